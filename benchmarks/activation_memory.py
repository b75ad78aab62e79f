"""Activation memory and step time per remat policy, against torch.utils.checkpoint in a plain loop.

The reference GPT (12 layers, sequence 512 by default) trained one step at a time:

    fspeed, no remat           make_train_step on the model
    fspeed, full               fs.remat(model, "full")         (keeps each block's input)
    fspeed, save_matmuls       fs.remat(model, "save_matmuls") (keeps matmul outputs too)
    fspeed, full every 2       fs.remat(model, "full", every=2)
    torch, no checkpoint       GPTModule (same math) in a plain AdamW loop
    torch.utils.checkpoint     the same loop, each block under checkpoint(use_reentrant=False)

Saved bytes: malloc's in-use bytes (glibc `mallinfo2`) when backward starts, over those before the
forward: what the forward keeps for backward. Theory for full remat: one block input per block
plus the head's (the fused ln_f, head and loss keep only the gradients they took in forward; the
plain PyTorch loop keeps the logits and their log-softmax).

    python benchmarks/activation_memory.py [--layers 12] [--seq 512] [--batch 4] [--width 256] [--steps 6]

Then, on 2 gloo ranks with tensor slicing, one rank's kept bytes under full remat with and
without `partition_activations`.

Last lines: full_remat_saved_bytes_over_theory, full_remat_step_time_over_none,
remat_vs_torch_checkpoint_step_time, partitioned_saved_bytes_over_unpartitioned.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils.checkpoint import checkpoint

import fspeed as fs
from fspeed.activation_budget import bytes_kept_for_backward
from fspeed.host_memory import live_host_bytes
from fspeed.models.gpt_module import GPTModule, load_params_into_module


def fspeed_variant(model, params, batch):
    opt = fs.optim.adamw(1e-4)
    state = {"s": fs.init_train_state(params, opt)}
    step = fs.make_train_step(model.loss, opt)

    def run():
        state["s"], _ = step(state["s"], batch)
    return run


def torch_variant(cfg, params, batch, use_checkpoint):
    module = GPTModule(cfg)
    load_params_into_module(module, params)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    if use_checkpoint:
        for i, block in enumerate(module.blocks):
            module.blocks[i] = _Checkpointed(block)

    def run():
        logits = module(batch["inputs"])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), batch["targets"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # here, so the next forward's measurement does not count the free
    return run


class _Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def partitioned_kept(partition: bool, layers: int, seq: int, batch: int, width: int) -> int:
    """One tensor-slicing rank's kept bytes for a fully rematerialized GPT (runs in a GlooWorld)."""
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_head=width // 64, d_model=width)
    model = fs.remat(fs.models.gpt(cfg), "full", partition=partition)
    mesh = fs.Mesh(data=1, model=2)
    plan = fs.tensor_slicing(fs.models.gpt_rules)
    opt = fs.optim.sgd(0.0)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
    micro = {"inputs": x, "targets": x.roll(-1, 1)}
    state, _ = step(state, micro)
    kept = []
    for _ in range(3):  # malloc's count moves by a few hundred KiB from step to step: the median
        s = step.begin(state)
        kept.append(bytes_kept_for_backward(lambda: step.micro(s, state, micro))[0])
        state, _ = step.boundary(s, state)
    return statistics.median(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fs.retain_freed_host_memory()
    if live_host_bytes() is None:
        raise SystemExit("this benchmark counts malloc's bytes: it needs glibc")
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.width // 64,
                              d_model=args.width)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": x, "targets": x.roll(-1, 1)}
    variants = {
        "fspeed, no remat": fspeed_variant(model, params, batch),
        "fspeed, full": fspeed_variant(fs.remat(model, "full"), params, batch),
        "fspeed, save_matmuls": fspeed_variant(fs.remat(model, "save_matmuls"), params, batch),
        "fspeed, full every 2": fspeed_variant(fs.remat(model, "full", every=2), params, batch),
        "torch, no checkpoint": torch_variant(cfg, params, batch, False),
        "torch.utils.checkpoint": torch_variant(cfg, params, batch, True),
    }
    kept = {k: [] for k in variants}
    times = {k: [] for k in variants}
    for step in range(args.steps + 1):  # the first round warms up
        names = list(variants) if step % 2 == 0 else list(reversed(variants))
        for name in names:
            nbytes, seconds = bytes_kept_for_backward(variants[name])
            if step:
                kept[name].append(nbytes)
                times[name].append(seconds)
    print(f"GPT {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}; fp32, {args.threads} "
          f"threads; median of {args.steps} steps")
    print(f"{'variant':<26} {'kept for backward':>18} {'step time':>10}")
    med = {k: (statistics.median(kept[k]), statistics.median(times[k])) for k in variants}
    for name, (nbytes, seconds) in med.items():
        print(f"{name:<26} {nbytes / 2**20:15.1f} MiB {seconds * 1e3:8.0f} ms")
    block_input = args.batch * args.seq * args.width * 4
    # the fused head and loss (ops.head_loss) keep the gradients it took in forward: of the last
    # block's output, of the (tied) head weight and of ln_f's weight and bias (fp32)
    head = block_input + (cfg.vocab_size + 2) * args.width * 4
    theory = args.layers * block_input + head
    print(f"theory for full remat, kept when backward starts: {args.layers} block inputs ({block_input / 2**20:.2f} "
          f"MiB each) + the head's {head / 2**20:.1f} MiB = {theory / 2**20:.1f} MiB (the recompute adds one block's "
          "activations at a time during backward)")
    print(f"full_remat_saved_bytes_over_theory={med['fspeed, full'][0] / theory:.3f}")
    print(f"full_remat_saved_bytes_over_none={med['fspeed, full'][0] / med['fspeed, no remat'][0]:.3f}")
    print(f"save_matmuls_saved_bytes_over_none={med['fspeed, save_matmuls'][0] / med['fspeed, no remat'][0]:.3f}")
    print(f"full_remat_step_time_over_none={med['fspeed, full'][1] / med['fspeed, no remat'][1]:.3f}")
    print(f"remat_vs_torch_checkpoint_step_time={med['fspeed, full'][1] / med['torch.utils.checkpoint'][1]:.3f}")
    from fspeed.testing import GlooWorld

    ratios = {}
    with GlooWorld(2, threads_per_rank=1) as world:
        for layers in dict.fromkeys((args.layers, 32)):
            sizes = (layers, args.seq, args.batch, args.width)
            whole = max(world.run(partitioned_kept, False, *sizes))
            parts = max(world.run(partitioned_kept, True, *sizes))
            ratios[layers] = parts / whole
            print(f"tensor=2, full remat, {layers} layers, kept per rank: whole inputs {whole / 2**20:.1f} MiB, "
                  f"partitioned {parts / 2**20:.1f} MiB ({ratios[layers]:.3f}; the head's tensors are not partitioned, "
                  "as in DeepSpeed)")
    print(f"partitioned_saved_bytes_over_unpartitioned={ratios[args.layers]:.3f}")
    print(f"partitioned_saved_bytes_over_unpartitioned_32_layers={ratios[32]:.3f}")


if __name__ == "__main__":
    main()
