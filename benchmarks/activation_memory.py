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
plain PyTorch loop keeps the logits and their log-softmax). fspeed's GPT runs with
`fused_head=True` here: by default (`fused_head=None`) it fuses from 2^20 logits of a micro-batch
up, and 2048 positions x 256 words is below that, where the separate ops keep ln_f's input and
output and the log-probabilities (three tensors of a block input's size at this width) instead of
one gradient.

    python benchmarks/activation_memory.py [--layers 12] [--seq 512] [--batch 4] [--width 256] [--steps 10]

Then, on 2 gloo ranks with tensor slicing, one rank's kept bytes under full remat with and
without `partition_activations`.

Last lines: full_remat_saved_bytes_over_theory, full_remat_step_time_over_none,
remat_vs_torch_checkpoint_step_time, partitioned_saved_bytes_over_unpartitioned.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

import fspeed as fs
from fspeed.remat_budget import bytes_kept_for_backward
from fspeed.host_memory import live_host_bytes
from fspeed.models.gpt_module import GPTModule, load_params_into_module


def fspeed_variant(model, params, batch, device="cpu", out=None, opt=None):
    opt = opt if opt is not None else fs.optim.adamw(1e-4)
    state = {"s": fs.init_train_state(params, opt, device=device)}
    step = fs.make_train_step(model.loss, opt)

    def run():
        state["s"], _ = step(state["s"], batch)
        if out is not None:
            out[:] = [state["s"]]
    return run


def torch_variant(cfg, params, batch, use_checkpoint, device="cpu"):
    module = GPTModule(cfg)
    load_params_into_module(module, params)
    module.to(device)
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
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_head=width // 64, d_model=width,
                              fused_head=True)
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fs.retain_freed_host_memory()
    if live_host_bytes() is None:
        raise SystemExit("this benchmark counts malloc's bytes: it needs glibc")
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.width // 64,
                              d_model=args.width, fused_head=True)  # the theory's head (module docstring)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": x, "targets": x.roll(-1, 1)}
    variants = {
        # each compared pair back to back in every round
        "fspeed, save_matmuls": fspeed_variant(fs.remat(model, "save_matmuls"), params, batch),
        "fspeed, full every 2": fspeed_variant(fs.remat(model, "full", every=2), params, batch),
        "fspeed, no remat": fspeed_variant(model, params, batch),
        "torch, no checkpoint": torch_variant(cfg, params, batch, False),
        "fspeed, full": fspeed_variant(fs.remat(model, "full"), params, batch),
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
    # paired: each round's ratio of the two (run back to back in it), then the median over rounds
    paired = statistics.median(a / b for a, b in zip(times["fspeed, full"], times["torch.utils.checkpoint"]))
    print(f"remat_vs_torch_checkpoint_step_time={paired:.3f}  # the median of the per-round ratios; of the "
          f"medians: {med['fspeed, full'][1] / med['torch.utils.checkpoint'][1]:.3f}")
    from fspeed.testing import GlooWorld

    ratios = {}
    with GlooWorld(2, threads_per_rank=1) as world:
        for layers in dict.fromkeys((args.layers, 32)):
            sizes = (layers, args.seq, args.batch, args.width)
            whole = max(world.run(partitioned_kept, False, *sizes))
            parts = max(world.run(partitioned_kept, True, *sizes))
            ratios[layers] = parts / whole
            print(f"tensor slicing over 2 ranks, full remat, {layers} layers, kept per rank: whole inputs "
                  f"{whole / 2**20:.1f} MiB, partitioned {parts / 2**20:.1f} MiB ({ratios[layers]:.3f}; "
                  "the fused head's x gradient is partitioned too, its weight gradients are not)")
    print(f"partitioned_saved_bytes_over_unpartitioned={ratios[args.layers]:.3f}")
    print(f"partitioned_saved_bytes_over_unpartitioned_32_layers={ratios[32]:.3f}")


def gpu_check(layers: int = 24, width: int = 1024, seq: int = 1024, batch: int = 8, steps: int = 8,
              device: str = "cuda") -> list[str]:
    """On CUDA: remat (and cpu_checkpointing, whose copies run on a side stream and come back one block
    ahead) equal the run without remat; then kept bytes (CUDA's allocator at backward start) and step
    time per variant against plain PyTorch with and without torch.utils.checkpoint (fp32 with TF32
    matmuls on both sides). Returns the correctness failures; prints a table and name=value lines.
    `device="cpu"` runs the same code (inline copies) to keep it working without a GPU."""
    from fspeed.rematerialization import Remat, apply_remat
    from fspeed.host_copies import HostCopies
    from fspeed.pytree import tree_leaves

    device = torch.device(device)
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    failures = []

    def variants_of(model):
        return {
            "fspeed, no remat": model,
            "fspeed, full": fs.remat(model, "full"),
            "fspeed, save_matmuls": fs.remat(model, "save_matmuls"),
            "fspeed, full + cpu_ckpt": fs.remat(model, "full", offload=True),
            "fspeed, cpu_ckpt no prefetch": apply_remat(model, Remat(offload=True,
                                                                      host_copies=HostCopies(prefetch=False))),
        }

    # correctness: small, exact fp32 (no TF32), with dropout: three steps of each variant
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=4, d_model=256, dropout=0.1)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(1), device="cpu").to(device)
    small = {"inputs": x, "targets": x.roll(-1, 1)}
    finals = {}
    for name, variant in variants_of(model).items():
        out = []
        run = fspeed_variant(variant, params, small, device, out)
        try:
            for _ in range(3):
                run()
        except Exception as error:  # a CUDA-only failure is a finding, not a crash
            failures.append(f"remat on CUDA, {name}: {type(error).__name__}: {error}")
            continue
        finals[name] = out[0].params.tree()
    ref = finals.get("fspeed, no remat")
    for name, tree in finals.items():
        if ref is None or name == "fspeed, no remat":
            continue
        err = max(relative_error(a, b.double()) for a, b in zip(tree_leaves(tree), tree_leaves(ref)))
        print(f"remat on CUDA, {name:30s} params after 3 steps vs no remat: relative error {err:.1e}")
        if not err <= 1e-5:
            failures.append(f"remat on CUDA, {name}: params differ from no remat by {err:.1e} (tolerance 1e-5)")

    # memory and time at size
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_head=width // 64, d_model=width)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    big = {"inputs": x, "targets": x.roll(-1, 1)}
    runs = {name: fspeed_variant(variant, params, big, device) for name, variant in variants_of(model).items()}
    runs["torch, no checkpoint"] = torch_variant(cfg, params, big, False, device)
    runs["torch.utils.checkpoint"] = torch_variant(cfg, params, big, True, device)
    kept = {k: [] for k in runs}
    times = {k: [] for k in runs}
    for step in range(steps + 3):  # a warm-up round, two measuring kept bytes, then timed rounds
        for name in (list(runs) if step % 2 == 0 else list(reversed(runs))):
            synchronize()
            if 0 < step < 3:  # the measurement synchronizes when backward starts: not timed
                kept[name].append(bytes_kept_for_backward(runs[name], device)[0])
                continue
            start = time.perf_counter()
            runs[name]()
            synchronize()
            if step:
                times[name].append(time.perf_counter() - start)
    med = {k: (statistics.median(kept[k]), statistics.median(times[k])) for k in runs}
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\nGPT {layers} layers, width {width}, seq {seq}, batch {batch} on {where}; fp32 "
          f"with TF32 matmuls; median of {steps} steps")
    print(f"{'variant':<30} {'kept for backward':>18} {'step time':>10}")
    for name, (nbytes, seconds) in med.items():
        print(f"{name:<30} {nbytes / 2**20:15.1f} MiB {seconds * 1e3:8.1f} ms")
    block_input = batch * seq * width * 4
    print(f"one block input: {block_input / 2**20:.1f} MiB")
    t = {k: v[1] for k, v in med.items()}
    print(f"gpu_full_remat_step_time_over_none={t['fspeed, full'] / t['fspeed, no remat']:.3f}")
    print(f"gpu_remat_vs_torch_checkpoint_step_time={t['fspeed, full'] / t['torch.utils.checkpoint']:.3f}")
    print(f"gpu_step_time_vs_torch={t['fspeed, no remat'] / t['torch, no checkpoint']:.3f}")
    print(f"gpu_cpu_checkpointing_step_time_over_full={t['fspeed, full + cpu_ckpt'] / t['fspeed, full']:.3f}")
    print(f"gpu_cpu_checkpointing_no_prefetch_over_full={t['fspeed, cpu_ckpt no prefetch'] / t['fspeed, full']:.3f}")
    print(f"gpu_cpu_checkpointing_kept_over_full={med['fspeed, full + cpu_ckpt'][0] / med['fspeed, full'][0]:.3f}")
    return failures


def gpu_profile(out_dir: str, layers: int = 24, width: int = 1024, seq: int = 1024, batch: int = 8) -> None:
    """On CUDA: torch.profiler tables (by CUDA time, then by CPU time) of three steps of fspeed without
    remat (Adam on its numba kernel, then on torch ops), with cpu_checkpointing, and of the plain
    PyTorch loop, to `out_dir`; the top rows and each one's busy GPU time per step are printed."""
    from torch.profiler import ProfilerActivity, profile

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda")
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_head=width // 64, d_model=width)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    big = {"inputs": x, "targets": x.roll(-1, 1)}
    runs = {
        "fspeed_numba_adam": fspeed_variant(model, params, big, device),
        "fspeed_torch_adam": fspeed_variant(model, params, big, device, opt=fs.optim.adamw(1e-4, backend="torch")),
        "fspeed_cpu_ckpt": fspeed_variant(fs.remat(model, "full", offload=True), params, big, device),
        "torch_eager": torch_variant(cfg, params, big, False, device),
    }
    for name, run in runs.items():
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 3
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 3e3
        by_cuda = events.table(sort_by="self_cuda_time_total", row_limit=40)
        by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=40)
        with open(f"{out_dir}/profile_{name}.txt", "w") as f:
            f.write(f"{name}: wall {wall * 1e3:.1f} ms/step, GPU busy {busy:.1f} ms/step\n\n{by_cuda}\n\n{by_cpu}\n")
        print(f"{name}: wall {wall * 1e3:.1f} ms/step, kernels' summed time {busy:.1f} ms/step")
        print("\n".join(by_cuda.splitlines()[:18]))


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error of `got` against `ref`, relative to `ref`'s largest magnitude."""
    return float((got.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/activation_memory.json

    with recorded("activation_memory"):
        main()
