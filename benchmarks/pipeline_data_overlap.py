"""PP2 x DP2 on 4 gloo ranks: the data-parallel gradient reduction started during the pipeline's last
backward (`overlap_comm=true`) against after the schedule (`overlap_comm=false`), alternating.

With `overlap_comm`, a stage's buckets are reduced over `data` as their parameters' sums become
final: the first stage's during its last backward, parameter by parameter as autograd completes
them; a later stage's once its last backward has sent the gradient the previous stage waits for;
a tied parameter's after the stages' sums are added. Without it the whole stage gradient is
reduced after the schedule. (ZeRO-2: each bucket reduced onto the rank that owns its partition,
in the buffer the stage summed in, as ZeRO-1's.) The model is benchmarks/pipeline.py's GPT (8
blocks, width 256, vocab 256, untied), 4 micro-batches of 4 x 128 tokens per data rank, AdamW,
ZeRO 0-2, 500K-element reduce buckets (the default, 5e8, makes a stage one bucket, reduced once
the stage is done).
Four ranks share this machine's two cores, so gloo's communication threads take CPU from the
stages' compute: a GPU's network engine would not.

    python benchmarks/pipeline_data_overlap.py [--steps 12] [--schedule 1f1b]

Per ZeRO stage: the median step time (slowest rank) of each mode, and the median time the first
stage's ranks waited for gradient reductions in a step. Last lines:
pipeline_data_overlap_step_time_vs_after_zero{0,1,2} (overlapped / after, median of paired steps)
and pipeline_data_overlap_first_stage_wait_vs_after_zero{0,1,2}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fspeed as fs
from fspeed.testing import GlooWorld

sys.path.insert(0, str(Path(__file__).parent))
from pipeline import make_batch, model_config  # noqa: E402 (the same model and data as pipeline.py)

MODES = ("overlapped", "after")


def measure(args: argparse.Namespace, stage: int) -> dict:
    """Per mode: this rank's step times and its blocked seconds in gradient reductions per step."""
    torch.set_num_threads(1)
    fs.retain_freed_host_memory()
    model = fs.models.gpt(model_config(args))
    runs = {}
    for mode in MODES:
        mesh = fs.Mesh(data=2, pipe=2, log=fs.CommLog())
        plan = fs.zero(stage, reduce_bucket_size=500_000, overlap_comm=mode == "overlapped") | \
            fs.pipeline(args.micro, schedule=args.schedule)
        opt = fs.optim.adamw(1e-4)
        state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh,
                                    model=model)
        runs[mode] = [mesh, state, fs.make_train_step(model, opt, plan=plan, mesh=mesh)]
    full = make_batch(args, args.micro * 2)
    data_rank = runs["after"][0].coordinate("data")
    batch = {k: v[data_rank::2] for k, v in full.items()}
    out: dict = {m: {"step": [], "wait": []} for m in MODES}
    for i in range(args.warmup + args.steps):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            mesh, state, step = runs[mode]
            mesh.log.reset()
            dist.barrier()
            t0 = time.perf_counter()
            runs[mode][1], _ = step(state, batch)
            dist.barrier()
            if i >= args.warmup:
                out[mode]["step"].append(time.perf_counter() - t0)
                out[mode]["wait"].append(sum(e.blocked for e in mesh.log.events
                                             if e.axis == "data" and e.op in ("all_reduce", "reduce")))
    return {"pipe": runs["after"][0].coordinate("pipe"), **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    args.layers, args.d_model, args.heads, args.seq, args.rows, args.micro = 8, 256, 8, 128, 4, 4
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab 256; PP2 x DP2 on 4 gloo ranks x "
          f"1 thread; {args.schedule}, {args.micro} micro-batches of {args.rows} rows per data rank", flush=True)
    results = {}
    with GlooWorld(4, timeout_s=1200) as world:
        for stage in (0, 1, 2):
            results[stage] = world.run(measure, args, stage)
            print(f"  measured ZeRO-{stage}", flush=True)
    print(f"\n{'ZeRO':>5}{'overlapped ms':>15}{'after ms':>10}{'ratio':>8}{'first-stage wait ms':>21}{'after':>8}")
    lines = []
    for stage, per_rank in results.items():
        steps = {m: [max(r[m]["step"][k] for r in per_rank) for k in range(args.steps)] for m in MODES}
        ratio = statistics.median(a / b for a, b in zip(steps["overlapped"], steps["after"]))
        first = [r for r in per_rank if r["pipe"] == 0]
        wait = {m: statistics.median(statistics.median(r[m]["wait"]) for r in first) for m in MODES}
        ms = {m: statistics.median(steps[m]) * 1e3 for m in MODES}
        print(f"{stage:>5}{ms['overlapped']:>15.1f}{ms['after']:>10.1f}{ratio:>8.3f}"
              f"{wait['overlapped'] * 1e3:>21.1f}{wait['after'] * 1e3:>8.1f}")
        lines.append(f"pipeline_data_overlap_step_time_vs_after_zero{stage}={ratio:.3f}")
        lines.append(f"pipeline_data_overlap_first_stage_wait_vs_after_zero{stage}="
                     f"{wait['overlapped'] / max(wait['after'], 1e-9):.3f}")
    print("(ratio: the median over steps of overlapped / after, steps in pairs; wait: the median time a first-stage "
          "rank blocked on gradient reductions in a step)")
    print("\n".join(lines))


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/pipeline_data_overlap.json

    with recorded("pipeline_data_overlap"):
        main()
