"""Communication volume per step and rank under ZeRO 0-3, from the comm log, against theory.

The ZeRO paper counts an all-reduce of Psi elements as 2 Psi (a reduce-scatter plus an
all-gather), so stages 0-2 move 2 Psi per step and stage 3 moves 3 Psi (the parameters are
all-gathered in forward and again in backward, the gradients reduce-scattered once). Here every
collective fspeed issues is logged (op and message size); the volume counts an all-reduce of S
bytes as 2S, a reduce-scatter or all-gather as the full (world-size times the per-rank) buffer, and
a reduce onto one owner or a broadcast from one (ZeRO-1/2's partitions and their parameters, ZeRO-3's
persistent parameters) as its message S: what each rank sends or receives.

    python benchmarks/zero_comm.py [--ranks 4] [--layers 8] [--d-model 256]

Last line: zero3_comm_over_theory=<measured stage-3 elements per step / 3 Psi>.
"""

from __future__ import annotations

import argparse

import torch

import fspeed as fs
from fspeed.parallel.comm import CommLog
from fspeed.testing import GlooWorld


def measure(stage: int, layers: int, d_model: int) -> dict:
    """Comm volume of one training step (after a warmup step), by op, for this rank (fp32)."""
    log = CommLog(enabled=True)
    mesh = fs.Mesh(data=-1, log=log)
    cfg = fs.models.GPTConfig(vocab_size=256, seq_len=64, n_layer=layers, n_head=8, d_model=d_model)
    model = fs.models.gpt(cfg)
    opt = fs.optim.adamw(1e-4)
    plan = fs.zero(stage)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    tokens = torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(mesh.rank))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state, _ = step(state, batch)
    log.reset()
    state, _ = step(state, batch)
    n = mesh.size("data")
    volume = {}
    for op, sizes in log.records.items():
        total = sum(size * len(lat) for size, lat in sizes.items())
        volume[op] = total * {"all_reduce": 2, "reduce": 1, "broadcast": 1}.get(op, n) / 4  # elements (fp32)
    calls = {op: sum(len(lat) for lat in sizes.values()) for op, sizes in log.records.items()}
    return {"psi": state.layout.local.numel, "volume": volume, "calls": calls, "summary": log.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    results = {}
    with GlooWorld(args.ranks, timeout_s=600) as world:
        for stage in range(4):
            results[stage] = world.run(measure, stage, args.layers, args.d_model)[0]
            print(f"  stage {stage} measured", flush=True)
    psi = results[0]["psi"]
    print(f"\nGPT {psi / 1e6:.2f}M parameters (Psi), {args.ranks} gloo ranks, one fp32 step; elements per rank")
    print(f"{'stage':<6}{'all_reduce':>13}{'reduce':>13}{'broadcast':>13}{'reduce_scatter':>16}{'all_gather':>13}"
          f"{'total':>13}{'theory':>10}{'ratio':>8}  calls")
    ratio3 = None
    for stage, r in results.items():
        v = r["volume"]
        total = sum(v.values())
        theory = (3 if stage == 3 else 2) * psi
        ratio = total / theory
        ratio3 = ratio if stage == 3 else ratio3
        calls = ", ".join(f"{op} {c}" for op, c in sorted(r["calls"].items()))
        print(f"{stage:<6}{v.get('all_reduce', 0):>13,.0f}{v.get('reduce', 0):>13,.0f}{v.get('broadcast', 0):>13,.0f}"
              f"{v.get('reduce_scatter', 0):>16,.0f}{v.get('all_gather', 0):>13,.0f}{total:>13,.0f}"
              f"{f'{3 if stage == 3 else 2} Psi':>10}{ratio:>8.3f}  {calls}")
    print("\nstage 3, rank 0, DeepSpeed-style comm log of the measured step:")
    print(results[3]["summary"])
    print(f"zero3_comm_over_theory={ratio3:.3f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/zero_comm.json

    with recorded("zero_comm"):
        main()
