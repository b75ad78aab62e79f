"""Per-rank model-state memory under ZeRO 0-3, measured, beside the ZeRO paper's formula.

A GPT of ~50M parameters trains one step on 4 gloo ranks for each stage (bf16 parameters and
gradients, fp32 masters and AdamW moments: the paper's mixed-precision Adam, K = 12). The bytes
are read off the state's actual buffers: parameters, the gradient buffers kept between steps,
fp32 masters and optimizer moments. Stage 3 also holds gathered layers while computing: the
current unit and the prefetched next one, counted from the layout.

    python benchmarks/zero_memory.py [--ranks 4] [--layers 16] [--d-model 512]

Last line: zero3_bytes_per_rank_over_formula=<measured stage-3 bytes / (16 Psi / N + largest layer)>.
"""

from __future__ import annotations

import argparse

import torch

import fspeed as fs
from fspeed.testing import GlooWorld


def measure(stage: int, layers: int, d_model: int) -> dict:
    """Build and step a state for one stage on this rank; bytes of every model-state buffer."""
    mesh = fs.Mesh(data=-1)
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=64, n_layer=layers, n_head=8, d_model=d_model)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    opt = fs.optim.adamw(1e-4)
    plan = fs.zero(stage)
    precision = fs.precision.bf16(grad_accum_dtype="bf16")
    state = fs.init_train_state(params, opt, precision=precision, plan=plan, mesh=mesh)
    del params
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    tokens = torch.randint(0, 256, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(mesh.rank))
    state, _ = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    layout = state.layout
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    largest = max((u.numel for u in layout.units if u.sharded), default=0)
    return {
        "psi": layout.local.numel,
        "params": nbytes(state.params.buffer),
        "grads": step.persistent_grad_bytes(),
        "master": nbytes(state.master.buffer),
        "optimizer": nbytes(state.opt_state.mu.buffer) + nbytes(state.opt_state.nu.buffer),
        "gathered": largest * 2 * (2 if layout.zero.prefetch else 1),
        "largest_layer_bytes": largest * 2,
    }


def paper_formula(stage: int, psi: int, n: int) -> float:
    """ZeRO paper, mixed-precision Adam (2 + 2 + K bytes per parameter, K = 12)."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=512)
    args = parser.parse_args()
    mb = 1 / 2**20
    rows = []
    with GlooWorld(args.ranks, timeout_s=600) as world:
        for stage in range(4):
            per_rank = world.run(measure, stage, args.layers, args.d_model)
            worst = max(per_rank, key=lambda r: r["params"] + r["grads"] + r["master"] + r["optimizer"])
            rows.append((stage, worst))
            print(f"  stage {stage} measured", flush=True)
    psi, n = rows[0][1]["psi"], args.ranks
    print(f"\nGPT {psi / 1e6:.1f}M parameters on {n} gloo ranks, bf16 params/grads + fp32 AdamW (MB per rank, "
          "the largest rank)")
    header = f"{'stage':<6}{'params':>9}{'grads':>9}{'master':>9}{'optim':>9}{'gathered':>10}{'total':>10}" \
             f"{'formula':>10}{'ratio':>8}"
    print(header)
    ratio3 = None
    for stage, r in rows:
        total = r["params"] + r["grads"] + r["master"] + r["optimizer"] + r["gathered"]
        formula = paper_formula(stage, psi, n) + (r["largest_layer_bytes"] if stage == 3 else 0)
        ratio = total / formula
        if stage == 3:
            ratio3 = ratio
        print(f"{stage:<6}{r['params'] * mb:>9.1f}{r['grads'] * mb:>9.1f}{r['master'] * mb:>9.1f}"
              f"{r['optimizer'] * mb:>9.1f}{r['gathered'] * mb:>10.1f}{total * mb:>10.1f}{formula * mb:>10.1f}"
              f"{ratio:>8.3f}")
    print("\nformula: 16Psi (stage 0), 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N + largest layer (stage 3);"
          " stage 3 'gathered' counts the computing layer and the prefetched next one")
    print(f"zero3_bytes_per_rank_over_formula={ratio3:.3f}")


if __name__ == "__main__":
    main()
