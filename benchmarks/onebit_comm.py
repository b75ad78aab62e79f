"""Bytes communicated per step and rank after warmup: Adam vs 1-bit Adam vs 0/1 Adam, from the comm log.

    python benchmarks/onebit_comm.py [--ranks 2 4] [--layers 6] [--steps 6]

Each configuration trains a GPT of a few million parameters on 2 and 4 gloo ranks (ZeRO stage 0),
runs past the warmup, resets the mesh's CommLog, and counts the bytes of the next `--steps` steps.
Two countings:

    message   the size of each collective's message as DeepSpeed's comms logger records it (the
              buffer for all_reduce, the per-rank input for all_gather / all_to_all)
    wire      what a rank actually sends with ring algorithms: all_reduce 2(n-1)/n S, all_gather
              (n-1) S, all_to_all (n-1)/n S

0/1 Adam is measured in phase B with local_step_interval = `--local-interval` (what its schedule
reaches late in training: with DeepSpeed's defaults the interval doubles every 32678 steps up to 16),
so it communicates on one step in that many. The last line is Adam's message bytes over 1-bit
Adam's, at the largest world.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fspeed.testing import GlooWorld  # noqa: E402


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "all_gather":
        return (n - 1) * nbytes
    if op == "all_to_all":
        return (n - 1) / n * nbytes
    return float(nbytes)


def measure(kind: str, layers: int, steps: int, warmup: int, local_interval: int) -> dict:
    import fspeed as fs
    from fspeed.parallel.comm import CommLog

    log = CommLog(enabled=False)  # byte counts only
    mesh = fs.Mesh(data=-1, log=log)
    n, rank = mesh.size("data"), mesh.coordinate("data")
    cfg = fs.models.GPTConfig(vocab_size=512, seq_len=32, n_layer=layers, n_head=4, d_model=192)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    if kind == "adam":
        opt = fs.optim.adam(1e-3)
    elif kind == "onebit_adam":
        opt = fs.optim.onebit_adam(1e-3, freeze_step=warmup, world_size=n)
    else:  # phase B from step warmup + 2, intervals already at local_interval
        opt = fs.optim.zero_one_adam(1e-3, var_freeze_step=warmup, var_update_scaler=1, local_step_scaler=1,
                                     local_step_clipper=local_interval, world_size=n)
    plan = fs.zero(0)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    gen = torch.Generator().manual_seed(rank)
    rows = 2

    def batch():
        x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=gen)
        return {"inputs": x[:, :-1], "targets": x[:, 1:]}

    run_in = warmup + 2 + (local_interval.bit_length() if kind == "zero_one_adam" else 0)
    for _ in range(run_in):
        state, _ = step(state, batch())
    log.reset()
    for _ in range(steps):
        state, _ = step(state, batch())
    by_op = dict(log.bytes_by_op)
    numel = state.params.numel
    return {"n": n, "numel": numel, "by_op": by_op, "tensors": len(state.params.layout.paths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--local-interval", type=int, default=4)
    args = parser.parse_args()

    rows, reductions = [], {}
    for n in args.ranks:
        with GlooWorld(n, timeout_s=600) as world:
            per_kind = {}
            for kind in ("adam", "onebit_adam", "zero_one_adam"):
                res = world.run(measure, kind, args.layers, args.steps, args.warmup, args.local_interval)[0]
                message = sum(res["by_op"].values()) / args.steps
                wire = sum(wire_bytes(op, b, n) for op, b in res["by_op"].items()) / args.steps
                per_kind[kind] = (message, wire)
                ops = ", ".join(f"{op} {b / args.steps / 1e3:,.1f} kB" for op, b in sorted(res["by_op"].items()))
                rows.append((n, kind, res["numel"], res["tensors"], message, wire, ops))
            adam = per_kind["adam"]
            reductions[n] = {k: (adam[0] / v[0], adam[1] / v[1]) for k, v in per_kind.items() if k != "adam"}

    print(f"\n{'ranks':>5} {'optimizer':<14} {'params':>10} {'tensors':>7} {'message B/step':>15} "
          f"{'wire B/step':>13}  per op (message bytes per step)")
    for n, kind, numel, tensors, message, wire, ops in rows:
        print(f"{n:>5} {kind:<14} {numel:>10,} {tensors:>7} {message:>15,.0f} {wire:>13,.0f}  {ops}")
    print("\nreduction vs Adam (message bytes as DeepSpeed's comms logger counts them / wire bytes):")
    for n, red in reductions.items():
        for kind, (msg, wire) in red.items():
            print(f"  {n} ranks {kind:<14} {msg:6.1f}x message  {wire:6.1f}x wire")
    last = max(reductions)
    for n, red in reductions.items():
        print(f"onebit_comm_reduction_{n}ranks={red['onebit_adam'][0]:.2f}")
        print(f"onebit_comm_reduction_wire_{n}ranks={red['onebit_adam'][1]:.2f}")
        print(f"zero_one_comm_reduction_{n}ranks={red['zero_one_adam'][0]:.2f}")
    print(f"onebit_comm_reduction={reductions[last]['onebit_adam'][0]:.2f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/onebit_comm.json

    with recorded("onebit_comm"):
        main()
