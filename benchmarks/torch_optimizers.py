"""What `from_torch` and parameter groups cost against fspeed's fused AdamW.

One AdamW step (lr 1e-3, wd 0.01) on the parameters of a ~10M-parameter reference GPT (vocab
8192, d_model 256, 10 layers: 124 tensors), fp32 on CPU, every variant on its own copy of the
same numbers:

    fspeed adamw                 fspeed.optim.adamw on the flat buffer (Numba kernel, one pass)
    fspeed adamw backend=torch   the same through torch._fused_adamw_ (one call on the buffer)
    from_torch AdamW fused       from_torch(torch.optim.AdamW, fused=True) on the flat buffer
    from_torch AdamW foreach     from_torch(torch.optim.AdamW, foreach=True) on the flat buffer
    torch loop AdamW fused       torch.optim.AdamW(fused=True) on the 124 separate tensors, as in
                                 an eager loop
    torch loop AdamW foreach     torch.optim.AdamW(foreach=True) likewise
    fspeed adamw + mask          adamw(mask=no_decay(...)): biases and norms exempt, one kernel call
                                 per run of segments with the same settings (42 runs)
    from_torch fused + mask      the same mask over from_torch's AdamW (one step() per setting, one
                                 fused launch over the list of its runs)

And the adapter's constant cost per step: from_torch(AdamW, fused) against fspeed's adamw
(backend="torch") on a 1,000-element buffer, where both launch the same kernel once.

Timing: warm-ups, then rounds of one step of every variant (round-robin, so a load spike hits all
alike); the median over --reps rounds. Ratios are time / fspeed adamw's time (> 1: slower). This
machine is shared: numbers move by +-30% between runs.

    python benchmarks/torch_optimizers.py [--reps 20]

Ends with name=value lines: from_torch_adamw_fused_vs_fused, from_torch_adamw_foreach_vs_fused,
torch_loop_adamw_fused_vs_fused, torch_loop_adamw_foreach_vs_fused, grouped_adamw_vs_fused,
grouped_from_torch_vs_from_torch, from_torch_step_overhead_us.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

import fspeed as fs
from fspeed.optim import GradientTransformation, adamw, from_torch, no_decay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_adam import interleaved_medians  # noqa: E402

HP = dict(lr=1e-3, weight_decay=0.01)
EXEMPT = no_decay("ln", "bqkv", "bo", "b_in", "b_out")  # the reference GPT's norms and biases


def gpt_params() -> dict:
    cfg = fs.models.GPTConfig(vocab_size=8192, seq_len=256, n_layer=10, n_head=4, d_model=256)
    return fs.models.gpt(cfg).init(torch.Generator().manual_seed(0))


def fspeed_step(opt: GradientTransformation, params: fs.Flat, grads: fs.Flat) -> Callable[[], None]:
    """One `apply` per call on a private copy of `params` (the state is carried between calls)."""
    box = {"p": params.clone()}
    box["s"] = opt.init(box["p"])

    def step() -> None:
        box["p"], box["s"] = opt.apply(grads, box["s"], box["p"])

    return step


def torch_loop_step(params: fs.Flat, grads: fs.Flat, **flags) -> Callable[[], None]:
    """An eager loop's optimizer step: one nn.Parameter per tensor, `.grad` set, `opt.step()`."""
    tensors = [torch.nn.Parameter(v.clone()) for _, v in params.items()]
    for t, (_, g) in zip(tensors, grads.items()):
        t.grad = g.clone()
    return torch.optim.AdamW(tensors, **HP, **flags).step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    params = fs.Flat.from_tree(gpt_params())
    grads = params.with_buffer(torch.randn(params.buffer.shape, generator=torch.Generator().manual_seed(1)) * 1e-2)
    variants = {
        "fspeed adamw": fspeed_step(adamw(**HP), params, grads),
        "fspeed adamw backend=torch": fspeed_step(adamw(**HP, backend="torch"), params, grads),
        "from_torch AdamW fused": fspeed_step(from_torch(torch.optim.AdamW, **HP, fused=True), params, grads),
        "from_torch AdamW foreach": fspeed_step(from_torch(torch.optim.AdamW, **HP, foreach=True), params, grads),
        "torch loop AdamW fused": torch_loop_step(params, grads, fused=True),
        "torch loop AdamW foreach": torch_loop_step(params, grads, foreach=True),
        "fspeed adamw + mask": fspeed_step(adamw(**HP, mask=EXEMPT), params, grads),
        "from_torch fused + mask": fspeed_step(from_torch(torch.optim.AdamW, **HP, fused=True, mask=EXEMPT),
                                               params, grads),
    }
    runs = sum(len(inner.mu) for inner in adamw(**HP, mask=EXEMPT).init(params).groups)
    times = interleaved_medians(variants, args.reps)

    tiny = fs.Flat.from_tree({"w": torch.randn(1000)})
    tiny_grads = tiny.with_buffer(torch.randn(1000))
    small = interleaved_medians({
        "fspeed adamw backend=torch": fspeed_step(adamw(**HP, backend="torch"), tiny, tiny_grads),
        "from_torch AdamW fused": fspeed_step(from_torch(torch.optim.AdamW, **HP, fused=True), tiny, tiny_grads),
    }, args.reps * 10, warmup=20)

    base = times["fspeed adamw"]
    print(f"AdamW step on {params.numel:,} fp32 parameters ({len(params.layout.paths)} tensors), "
          f"{torch.get_num_threads()} threads, median of {args.reps}; the mask makes {runs} runs")
    print(f"  {'variant':<28} {'ms':>8} {'vs fspeed':>10}")
    for name, seconds in times.items():
        print(f"  {name:<28} {seconds * 1e3:8.2f} {seconds / base:10.2f}")
    overhead = small["from_torch AdamW fused"] - small["fspeed adamw backend=torch"]
    print(f"  1,000 elements: fspeed backend=torch {small['fspeed adamw backend=torch'] * 1e6:.0f} us, "
          f"from_torch fused {small['from_torch AdamW fused'] * 1e6:.0f} us")
    print()
    print(f"from_torch_adamw_fused_vs_fused={times['from_torch AdamW fused'] / base:.3f}")
    print(f"from_torch_adamw_foreach_vs_fused={times['from_torch AdamW foreach'] / base:.3f}")
    print(f"torch_loop_adamw_fused_vs_fused={times['torch loop AdamW fused'] / base:.3f}")
    print(f"torch_loop_adamw_foreach_vs_fused={times['torch loop AdamW foreach'] / base:.3f}")
    print(f"grouped_adamw_vs_fused={times['fspeed adamw + mask'] / base:.3f}")
    print(f"grouped_from_torch_vs_from_torch={times['from_torch fused + mask'] / times['from_torch AdamW fused']:.3f}")
    print(f"from_torch_step_overhead_us={overhead * 1e6:.1f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/torch_optimizers.json

    with recorded("torch_optimizers"):
        main()
