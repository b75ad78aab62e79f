"""Pipeline parallelism on 2 gloo ranks (one thread each, one stage each): the bubble each schedule
leaves, measured against its theory, and fspeed's step time against torch.distributed.pipelining's
Schedule1F1B (and DeepSpeed's PipelineEngine when it runs) on the same model, stages and data.

The model is the reference GPT (untied embeddings, so every engine can hold it as two stages),
cut uniformly: stage 0 = embed + blocks 0..L/2-1, stage 1 = the rest + head. Bubble: every stage
records the start and end of each schedule action's compute (receives excluded); over a step,
bubble = 1 - busy / (stages * span), span = first start to last end over both stages (one clock:
perf_counter is the machine's monotonic clock). The theory (`bubble_fraction`) takes F = B = W and
free communication. 1F1B runs twice: as fspeed runs it by default (`input_grad_first`: the B's the
previous stage waits for, those after a stage's last forward, send the input's gradient before
computing the weights') and with each backward whole (`input_grad_first=False`), as DeepSpeed and
torch run it. Step time: a whole `train_step` (schedule, gradient delivery, AdamW) against torch's
`schedule.step` + `torch.optim.AdamW(foreach=True)`, in turn step by step in one run.

    python benchmarks/pipeline.py [--layers 8] [--d-model 256] [--seq 128] [--rows 8] [--steps 8] [--bubble-steps 16]

A micro-batch of 8 x 128 tokens by default (about 5 minutes with DeepSpeed): at 4 x 64 the
per-operation Python cost of zero bubble's split backward is a visible share of these small layers.

Last lines (1F1B, 8 micro-batches unless said): pipeline_bubble_over_theory (1F1B with each backward
whole, the classic 1F1B, against its theory), pipeline_bubble_over_sim (the same over the bubble the stages'
measured, unequal costs leave), ..._input_grad_first (the same two for fspeed's default 1F1B),
pipeline_transfer_lag_ms (1F1B with each backward whole: how long after its input was produced and
its stage free an action that takes a transfer starts, the part of the bubble the transfers make),
pipeline_step_time_vs_torch (fspeed's default / torch, median of steps in turn), ..._whole_backward
(fspeed with each backward whole / torch), zero_bubble_over_1f1b (4 micro-batches, step span, against
1F1B with each backward whole, theory 0.867), zero_bubble_over_1f1b_input_grad_first
(against fspeed's 1F1B, theory 0.929), pipeline_step_time_vs_deepspeed (or the reason it did not run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fspeed as fs
from fspeed.parallel.pipeline_runtime import PipelineExecutor
from fspeed.parallel.schedules import bubble_fraction, build_schedule, simulate
from fspeed.train_step import gc_paused, split_micro_batches
from fspeed.testing import GlooWorld

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_deepspeed import LayersModule  # noqa: E402 (the same layers-as-module for every engine)

# (schedule, micro-batches, virtual stages, input_grad_first): fspeed's default sends the cooldown's input
# gradients first; "1f1b" with False runs each backward whole, as DeepSpeed and torch do (the classic 1F1B)
SCHEDULE_RUNS = tuple((name, m, v, first) for m in (4, 8) for name, v, first in (
    ("gpipe", 1, True), ("1f1b", 1, True), ("1f1b", 1, False), ("zero_bubble", 1, True), ("interleaved_1f1b", 2, True)))


def label(name: str, first: bool) -> str:
    return name if first else f"{name} whole B"


def model_config(args: argparse.Namespace) -> fs.models.GPTConfig:
    return fs.models.GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                               d_model=args.d_model, tie_embeddings=False)


def make_batch(args: argparse.Namespace, micro_batches: int) -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (micro_batches * args.rows, args.seq + 1), generator=g)
    return {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}


def fspeed_setup(args: argparse.Namespace, schedule: str, micro_batches: int, virtual: int, first: bool = True):
    model = fs.models.gpt(model_config(args))
    mesh = fs.Mesh(data=1, pipe=2)
    plan = fs.pipeline(micro_batches, schedule=schedule, partition="uniform", virtual_stages=virtual,
                       input_grad_first=first)
    opt = fs.optim.adamw(1e-4)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh, model=model)
    return model, mesh, state, fs.make_train_step(model, opt, plan=plan, mesh=mesh)


def measure_bubbles(args: argparse.Namespace, micro_batches: int) -> dict:
    """Every schedule's steps at `micro_batches`, alternating step by step (the machine's noise falls
    on all alike): per schedule and step, this stage's busy seconds per action kind, first start and
    last end (rank-local results)."""
    fs.retain_freed_host_memory()
    runs = {}
    for name, m, v, first in SCHEDULE_RUNS:
        if m == micro_batches:
            model, mesh, state, _ = fspeed_setup(args, name, m, v, first)
            runs[(name, m, v, first)] = (PipelineExecutor(state.layout, mesh, model.layers, torch.float32),
                                         state.params)
    micro = split_micro_batches(make_batch(args, micro_batches), micro_batches)
    steps: dict = {key: [] for key in runs}
    for i in range(args.warmup + args.bubble_steps):
        for key, (executor, params) in runs.items():
            executor.timeline = []
            dist.barrier()
            with gc_paused():  # as make_train_step runs it
                executor.step(params, micro, 1.0 / micro_batches, lambda m, layer: None)
            t = executor.timeline
            if i >= args.warmup:
                steps[key].append({"busy": {k: sum(e - s for a, s, e in t if a.kind == k) for k in "FBW"},
                                   "count": {k: sum(a.kind == k for a, _, _ in t) for k in "FBW"},
                                   "start": t[0][1], "end": t[-1][2], "schedule": executor.schedule,
                                   "actions": [(a.kind, a.micro, a.chunk, s, e) for a, s, e in t]})
    return steps


def torch_setup(args: argparse.Namespace, micro_batches: int, bounds: list[int]):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: PLC0415

    model = fs.models.gpt(model_config(args))
    stage = dist.get_rank()
    module = LayersModule(model.layers, model.init(torch.Generator().manual_seed(0)),
                          range(bounds[stage], bounds[stage + 1]))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    pipe_stage = PipelineStage(module, stage, 2, torch.device("cpu"))
    schedule = Schedule1F1B(pipe_stage, micro_batches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    return schedule, opt


def torch_pipeline_step(schedule, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor):
    """One step of torch.distributed.pipelining (`schedule` on this rank's stage) and the optimizer:
    the mean loss of the micro-batches on the last stage, None on the others."""
    out: list = []
    if dist.get_rank() == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=out)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(torch.stack(out).detach().mean()) if out else None


def compare_step_time(args: argparse.Namespace, micro_batches: int) -> dict:
    """fspeed's train_step (its default 1F1B, and with each backward whole) and torch's 1F1B step +
    AdamW, in turn; seconds per step on this rank."""
    fs.retain_freed_host_memory()
    _, mesh, state, step = fspeed_setup(args, "1f1b", micro_batches, 1)
    _, _, whole_state, whole_step = fspeed_setup(args, "1f1b", micro_batches, 1, first=False)
    bounds = list(state.layout.pipeline.bounds)
    schedule, opt = torch_setup(args, micro_batches, bounds)
    batch = make_batch(args, micro_batches)
    times: dict = {"fspeed": [], "fspeed_whole": [], "torch": []}
    losses = {}
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        dist.barrier()
        t1 = time.perf_counter()
        torch_loss = torch_pipeline_step(schedule, opt, batch["inputs"], batch["targets"])
        dist.barrier()
        t2 = time.perf_counter()
        whole_state, _ = whole_step(whole_state, batch)
        dist.barrier()
        t3 = time.perf_counter()
        if i == 0:
            losses = {"fspeed": float(metrics["loss"]), "torch": torch_loss}
        if i >= args.warmup:
            times["fspeed"].append(t1 - t0)
            times["torch"].append(t2 - t1)
            times["fspeed_whole"].append(t3 - t2)
    return {"times": times, "losses": losses, "bounds": bounds}


def transfer_lag(stages: list[dict]) -> float:
    """Of one step on 2 stages, one chunk each: the mean over the actions that take another stage's
    output (stage 1's F's, stage 0's B's) of how long after it was both produced and wanted (the
    producer's action ended, this stage's previous action ended) the action started: the transfer
    and what surrounds it, which the theory and the simulation take as free."""
    ends = {(r, kind, m): e for r, st in enumerate(stages) for kind, m, _, _, e in st["actions"]}
    lags = []
    for r, st in enumerate(stages):
        previous = st["start"]
        for kind, m, _, start, end in st["actions"]:
            producer = (0, "F", m) if (r, kind) == (1, "F") else (1, "B", m) if (r, kind) == (0, "B") else None
            if producer is not None:
                lags.append(start - max(previous, ends[producer]))
            previous = end
    return statistics.fmean(lags) if lags else float("nan")


def bubble_rows(results: dict) -> list[dict]:
    rows = []
    for (name, m, v, first), per_rank in results.items():
        fractions, spans, lags = [], [], []
        for k in range(len(per_rank[0])):
            stages = [r[k] for r in per_rank]
            span = max(s["end"] for s in stages) - min(s["start"] for s in stages)
            if v == 1:
                lags.append(transfer_lag(stages))
            fractions.append(1 - sum(sum(s["busy"].values()) for s in stages) / (len(stages) * span))
            spans.append(span)
        theory = bubble_fraction(name, 2, m, v, first)
        kinds = {k: statistics.median(st[n]["busy"][k] for st in per_rank for n in range(len(st))) for k in "FBW"}
        # one chunk of one micro-batch on each stage (rank r is stage r): the stages' own costs
        per_stage = {k: [statistics.median(step["busy"][k] for step in st) / (m * v) for st in per_rank] for k in "FBW"}
        ran = per_rank[0][-1]["schedule"]  # zero bubble's, re-planned after its first step
        if not ran.split_backward:  # a backward costs B + W; those that send the input's gradient first
            # (the timeline's W's) send it after their B part: W is their weight pass, B the rest
            for r, st in enumerate(per_rank):
                whole = per_stage["B"][r] + per_stage["W"][r]
                w = statistics.median(step["busy"]["W"] / max(1, step["count"]["W"]) for step in st)
                per_stage["W"][r], per_stage["B"][r] = w, whole - w
        simulated = simulate(ran, per_stage["F"], per_stage["B"], per_stage["W"])
        stage_busy = [sum(per_stage[k][r] for k in "FBW") * m * v for r in range(len(per_rank))]
        rows.append({"schedule": name, "first": first, "label": label(name, first), "micro": m, "virtual": v,
                     "measured": statistics.median(fractions),
                     "quartiles": statistics.quantiles(fractions, n=4)[::2] if len(fractions) > 1 else fractions * 2,
                     "theory": theory, "simulated": simulated.bubble_fraction, "span": statistics.median(spans),
                     "lag": statistics.median(lags) if lags else float("nan"),
                     "kinds": kinds, "imbalance": max(stage_busy) / min(stage_busy) - 1, "ran": ran,
                     "busier": stage_busy.index(max(stage_busy)), "per_stage": per_stage})
    return rows


def print_bubbles(rows: list[dict]) -> None:
    print("\nBubble per schedule (2 stages; busy = compute of the stage's actions, receives excluded)")
    print("(whole B: each backward whole, as DeepSpeed and torch run 1F1B; fspeed's default sends the input's gradient\n"
          " before computing the weights' in the B's the previous stage waits for, those after the stage's last F)")
    print("(theory: equal stages, F = B = W, free communication; sim: the schedule simulated with each stage's\n"
          " measured F, B, W costs, free communication: what the stages' unequal work alone leaves; imb: the\n"
          " busier stage's work over the other's, - 1; step ms: median first start to last end over both\n"
          " stages; F/B/W ms: a stage's total per step; lag ms: how long after its input was produced and\n"
          " the stage was free an action that takes a transfer started, mean per action, median over steps)")
    print(f"{'schedule':<18}{'micro':>6}{'v':>3}{'measured':>10}{'theory':>9}{'ratio':>7}{'sim':>7}{'/sim':>6}"
          f"{'imb':>6}{'step ms':>9}{'F ms':>8}{'B ms':>8}{'W ms':>8}{'lag ms':>8}")
    for r in rows:
        k = r["kinds"]
        print(f"{r['label']:<18}{r['micro']:>6}{r['virtual']:>3}{r['measured']:>10.3f}{r['theory']:>9.3f}"
              f"{r['measured'] / r['theory']:>7.2f}{r['simulated']:>7.3f}{r['measured'] / r['simulated']:>6.2f}"
              f"{r['imbalance']:>6.1%}{r['span'] * 1e3:>9.1f}{k['F'] * 1e3:>8.1f}{k['B'] * 1e3:>8.1f}{k['W'] * 1e3:>8.1f}"
              f"{r['lag'] * 1e3:>8.2f}")


def deepspeed_times(args: argparse.Namespace, micro_batches: int) -> tuple[list[float] | None, str]:
    try:
        from pipeline_deepspeed import DeepSpeedUnavailable, measure_deepspeed_pipeline  # noqa: PLC0415
    except ImportError as err:
        return None, f"benchmarks/pipeline_deepspeed.py not importable ({err})"
    try:
        result = measure_deepspeed_pipeline(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                            seq_len=args.seq, vocab=256, micro_rows=args.rows,
                                            micro_batches=micro_batches, steps=args.steps, warmup=args.warmup)
    except DeepSpeedUnavailable as err:
        return None, str(err)
    return result["step_s"], f"first loss {result['first_loss']:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per step-time measurement")
    parser.add_argument("--bubble-steps", type=int, default=16,
                        help="timed steps per schedule for the bubbles (a median over steps: noise comes in stretches)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab 256, untied; "
          f"{args.rows} rows per micro-batch; 2 gloo ranks x 1 thread", flush=True)
    bubbles = {}
    with GlooWorld(2, timeout_s=1200) as world:
        for m in sorted({run[1] for run in SCHEDULE_RUNS}):
            per_rank = world.run(measure_bubbles, args, m)
            bubbles.update({key: [r[key] for r in per_rank] for key in per_rank[0]})
            print(f"  measured every schedule with {m} micro-batches", flush=True)
        compare = {m: world.run(compare_step_time, args, m) for m in (4, 8)}
        print("  measured fspeed against torch.distributed.pipelining", flush=True)
    rows = bubble_rows(bubbles)
    print_bubbles(rows)

    ds = {} if args.no_deepspeed else {m: deepspeed_times(args, m) for m in (4, 8)}
    print("\nStep time, 1F1B (rank 0, medians; fspeed/torch: the median of the ratios of steps run in turn;"
          " whole B: fspeed\nwith input_grad_first=False; DeepSpeed runs afterwards in its own launch; the same init,"
          " data and stages)")
    print(f"{'micro':>6}{'fspeed ms':>11}{'whole B ms':>12}{'torch ms':>10}{'fspeed/torch':>14}{'whole B/torch':>15}"
          f"{'DeepSpeed ms':>14}{'fspeed/DS':>11}   first loss fspeed / torch")
    ratios = {}
    for m, per_rank in compare.items():
        t = per_rank[0]["times"]
        ours, theirs = statistics.median(t["fspeed"]), statistics.median(t["torch"])
        pair_ratio = statistics.median(a / b for a, b in zip(t["fspeed"], t["torch"]))  # steps ran in turn
        whole_ratio = statistics.median(a / b for a, b in zip(t["fspeed_whole"], t["torch"]))
        ds_t, ds_note = ds.get(m, (None, "not run (--no-deepspeed)"))
        ds_ms = f"{statistics.median(ds_t) * 1e3:>14.1f}{ours / statistics.median(ds_t):>11.2f}" if ds_t else \
            f"{'-':>14}{'-':>11}"
        losses = per_rank[1]["losses"]
        print(f"{m:>6}{ours * 1e3:>11.1f}{statistics.median(t['fspeed_whole']) * 1e3:>12.1f}{theirs * 1e3:>10.1f}"
              f"{pair_ratio:>14.3f}{whole_ratio:>15.3f}{ds_ms}   {losses['fspeed']:.4f} / {losses['torch']:.4f}")
        ratios[m] = (pair_ratio, ours / statistics.median(ds_t) if ds_t else None, ds_note, whole_ratio)
    for m, (_, _, note, _) in ratios.items():
        print(f"  DeepSpeed PipelineEngine, {m} micro-batches: {note}")

    by = {(r["schedule"], r["micro"], r["first"]): r for r in rows}
    one_f, whole = by[("1f1b", 8, True)], by[("1f1b", 8, False)]
    for row, what in ((whole, "each backward whole (the classic 1F1B, as DeepSpeed and torch run it)"),
                      (one_f, "fspeed's default, the cooldown's input gradients first")):
        holds = "the embedding and blocks" if row["busier"] == 0 else "blocks, the head and the loss"
        print(f"\n  1F1B, 8 micro-batches, {what}: theory {row['theory']:.3f}, measured {row['measured']:.3f} "
              f"({row['measured'] / row['theory']:.3f}x; the steps' quartiles {row['quartiles'][0] / row['theory']:.3f}"
              f" and {row['quartiles'][1] / row['theory']:.3f}). The stages' work differs by {row['imbalance']:.1%} "
              f"(stage {row['busier']}, {holds}, is the busier); with their measured F, B, W the schedule simulates "
              f"{row['simulated']:.3f}: measured over that {row['measured'] / row['simulated']:.3f}; an action that "
              f"takes a transfer starts {row['lag'] * 1e3:.2f} ms after its input was produced and the stage was "
              f"free ({2 * row['micro']} such actions a step)")
    w_over_f = one_f["per_stage"]["W"][1] / one_f["per_stage"]["F"][1]
    print(f"  (the theory of the input gradient first takes W = F; here the last stage's weight pass is {w_over_f:.2f} of"
          " its forward, so it saves less than the theory says)")
    print(f"pipeline_bubble_over_theory={whole['measured'] / whole['theory']:.3f}")
    print(f"pipeline_bubble_over_sim={whole['measured'] / whole['simulated']:.3f}")
    print(f"pipeline_bubble_over_theory_input_grad_first={one_f['measured'] / one_f['theory']:.3f}")
    print(f"pipeline_bubble_over_sim_input_grad_first={one_f['measured'] / one_f['simulated']:.3f}")
    print(f"pipeline_transfer_lag_ms={whole['lag'] * 1e3:.2f}")
    print(f"pipeline_step_time_vs_torch={ratios[8][0]:.3f}")
    print(f"pipeline_step_time_vs_torch_whole_backward={ratios[8][3]:.3f}")
    zb, whole4, first4 = by[("zero_bubble", 4, True)], by[("1f1b", 4, False)], by[("1f1b", 4, True)]
    costs = [zb["per_stage"][k] for k in "FBW"]
    one = simulate(build_schedule("1f1b", 2, 4, input_grad_first=False), *costs).makespan
    sim = simulate(zb["ran"], *costs).makespan / one
    h1 = simulate(build_schedule("zero_bubble", 2, 4), *costs).makespan / one
    print("  zero bubble, 4 micro-batches, as re-planned after its first step from the stages' measured times:")
    for stage, row in enumerate(zb["ran"].actions):
        print(f"    stage {stage} | " + " ".join(f"{a.kind}{a.micro}" for a in row))
    print(f"  zero bubble over 1F1B (each backward whole) simulated with zero bubble's measured F, B, W costs: {sim:.3f} "
          f"as run, {h1:.3f} as ZB-H1 (theory 0.867 takes F = B = W); over fspeed's default 1F1B (theory 0.929): "
          f"{zb['span'] / first4['span']:.3f} measured")
    print(f"zero_bubble_over_1f1b={zb['span'] / whole4['span']:.3f}")
    print(f"zero_bubble_over_1f1b_input_grad_first={zb['span'] / first4['span']:.3f}")
    ds8 = ratios[8][1]
    print(f"pipeline_step_time_vs_deepspeed={ds8:.3f}" if ds8 is not None else
          "pipeline_step_time_vs_deepspeed=nan")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/pipeline.json

    with recorded("pipeline"):
        main()
