"""What does fspeed's functional train_step cost over a hand-written PyTorch loop?

One process, same data, same initial weights: the reference GPT (~10.8M params, seq 256)
 - through fspeed: `make_train_step` (torch.func.grad over a flat buffer, fused flat AdamW), and
 - as an nn.Module (`GPTModule`, same math) in a plain loop with `torch.optim.AdamW` (foreach,
   PyTorch's default) and, for reference, `fused=True`.
Steps are interleaved (A, B, C, A, B, C, ...) so machine noise hits every variant alike.
A second table times the optimizer alone on the same 10.8M parameters.

    python benchmarks/train_step_overhead.py [--steps 8] [--batch 8] [--threads 2]

Last line: overhead_ratio=<fspeed step time / plain PyTorch (foreach AdamW) step time>.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fspeed as fs
from fspeed.models.gpt_module import GPTModule, params_from_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=256, n_layer=6, n_head=6, d_model=384)
    model = fs.models.gpt(cfg)
    module = GPTModule(cfg)
    params = params_from_module(module)
    n_params = fs.models.count_params(params)
    hp = dict(lr=3e-4, weight_decay=0.1)

    data = torch.randint(0, 256, (args.batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": data[:, :-1], "targets": data[:, 1:]}

    opt = fs.optim.adamw(hp["lr"], weight_decay=hp["weight_decay"])
    state = fs.init_train_state(params, opt)
    fspeed_step = fs.make_train_step(model.loss, opt)

    modules = {"foreach": module, "fused": GPTModule(cfg)}
    modules["fused"].load_state_dict(module.state_dict())
    torch_opts = {
        "foreach": torch.optim.AdamW(modules["foreach"].parameters(), foreach=True, **hp),
        "fused": torch.optim.AdamW(modules["fused"].parameters(), fused=True, **hp),
    }

    def torch_step(kind: str) -> float:
        torch_opts[kind].zero_grad(set_to_none=True)
        loss = modules[kind].loss(batch)
        loss.backward()
        torch_opts[kind].step()
        return loss.item()

    def run_fspeed() -> float:
        nonlocal state
        state, metrics = fspeed_step(state, batch)
        return metrics["loss"]

    variants = {
        "fspeed train_step (flat fused AdamW)": run_fspeed,
        "PyTorch loop, AdamW foreach (default)": lambda: torch_step("foreach"),
        "PyTorch loop, AdamW fused=True": lambda: torch_step("fused"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    print(f"GPT {n_params / 1e6:.1f}M params, batch {args.batch} x seq {cfg.seq_len}, "
          f"{args.threads} threads, {args.warmup} warmup + {args.steps} timed steps each")
    for i in range(args.warmup + args.steps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            losses[name].append(fn())
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    first = {name: values[0] for name, values in losses.items()}
    spread = max(first.values()) - min(first.values())
    tokens = args.batch * cfg.seq_len
    base = statistics.median(times["PyTorch loop, AdamW foreach (default)"])
    print(f"\nfirst-step loss agrees across variants: max difference {spread:.2e}")
    print(f"\n{'variant':<40} {'ms/step':>9} {'tokens/s':>10} {'vs PyTorch':>11}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<40} {median * 1e3:>9.1f} {tokens / median:>10.0f} {median / base:>10.3f}x")

    optimizer_table(params, hp, args.threads)
    ratio = statistics.median(times["fspeed train_step (flat fused AdamW)"]) / base
    print(f"\nfirst_step_loss_spread={spread:.3e}")
    print(f"overhead_ratio={ratio:.3f}")


def optimizer_table(params: dict, hp: dict, threads: int, repeats: int = 7) -> None:
    """The optimizer step alone on the same parameters: fspeed's flat fused apply vs torch.optim."""
    flat = fs.Flat.from_tree(params)
    grads = fs.tree_map(torch.randn_like, flat)
    opt = fs.optim.adamw(**hp)
    opt_state = opt.init(flat)
    leaves = [p.clone().requires_grad_() for p in flat.segments()]
    for p, g in zip(leaves, grads.segments()):
        p.grad = g.clone()
    torch_opts = {
        "torch.optim.AdamW foreach": torch.optim.AdamW(leaves, foreach=True, **hp),
        "torch.optim.AdamW fused": torch.optim.AdamW(leaves, fused=True, **hp),
    }

    def fspeed_apply():
        nonlocal flat, opt_state
        flat, opt_state = opt.apply(grads, opt_state, flat)

    variants = {"fspeed adamw apply (one flat buffer)": fspeed_apply}
    variants.update({name: o.step for name, o in torch_opts.items()})
    times = {name: [] for name in variants}
    for i in range(repeats + 2):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    print(f"\noptimizer step alone ({flat.numel / 1e6:.1f}M params, {len(leaves)} tensors, {threads} threads)")
    print(f"{'variant':<40} {'ms':>8} {'Gparam/s':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<40} {median * 1e3:>8.2f} {flat.numel / median / 1e9:>9.2f}")


if __name__ == "__main__":
    main()
