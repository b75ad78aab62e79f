"""fspeed against DeepSpeed: ZeRO stages 0-3, same GPT, same ds_config.json, same data, 2 gloo ranks.

For each stage the script writes one ``ds_config.json`` and trains the same GPT from the same
initial weights on the same batches twice, in the same two rank processes:

 - DeepSpeed: ``deepspeed.initialize(model=GPTModule, config=ds_config.json)`` (CPU accelerator,
   gloo), then per micro-batch ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``;
 - fspeed: ``deepspeed_config=ds_config.json`` translated into Hydra overrides, composed with the
   packaged config (``fspeed.conf``) and validated, then ``fs.make_train_step`` with the ZeRO plan,
   the optimizer and the precision that config builds.

The two engines alternate step by step (the order flips every step), each step preceded by a
barrier and timed on every rank; a step's time is the slowest rank's. Interleaving in one
process pair is deliberate: this 2-core machine is shared, and drift between separate launches
(seconds apart) is larger than the difference being measured; alternating exposes both engines
to the same load. The engines never run at the same time, and fspeed's functional GPT shares no
module with DeepSpeed's (which hooks only its own `GPTModule`). Each stage gets a fresh launch,
since DeepSpeed's engines (ZeRO-3 above all) cannot be torn down inside a process.

Both engines reduce gradients with ``overlap_comm: true`` (DeepSpeed overlaps its bucket reductions
with backward on a side stream on GPUs; on this CPU its reductions run in the backward hooks; fspeed
launches each bucket's collective asynchronously during backward and waits at the boundary). The
table also says, from fspeed's comm log, what fraction of its gradient-reduction time backward hid:
1 - (time blocked waiting for the reduce collectives) / (their time from launch to completion).

The optimizer is AdamW with ``torch_adam: true`` (DeepSpeed uses torch.optim.AdamW; no op has to
JIT-compile), with WarmupLR and global-norm clipping; fp32 throughout, so the parameters of the
two engines must agree to fp32 rounding. After ``--compare_at`` steps both are gathered to full
fp32 parameters (fspeed: ``fs.gather_params``; DeepSpeed: ``safe_get_full_fp32_param``).

Both engines run with ``--threads`` torch threads per rank (1: two ranks on two cores). The
workers set NUMBA_NUM_THREADS to the same number: numba's OpenMP threading layer, when fspeed's
Adam kernel first launches it, resets the process's OpenMP thread count (torch's intra-op threads,
for both engines) to NUMBA_NUM_THREADS, all cores by default. Any change of the thread count
during the run is reset and reported. ``--breakdown`` also prints where each engine's step time
goes (fspeed's boundary phases and ZeRO-3 layer work are timed by wrapping them; see
``step_breakdown.py``); the wrappers cost microseconds, but the headline is best taken without it.

    python benchmarks/vs_deepspeed.py [--stages 1 2 3] [--steps 14] [--warmup 2] [--compare_at 10]

Needs DeepSpeed (benchmark extra): DS_BUILD_OPS=0 pip install deepspeed==0.19.8
The last lines: max_param_diff=<over stages>, zero_step_time_vs_deepspeed=<worst fspeed/DeepSpeed>.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fspeed.testing import free_port
from step_breakdown import Sections, wrap_fspeed_boundary, wrap_fspeed_zero3

INSTALL = "DS_BUILD_OPS=0 pip install deepspeed==0.19.8   (or: pip install -e .[bench])"
WORLD = 2
MODEL_OVERRIDES = ("model=gpt_10m", "model.seq_len=128")  # 6 layers, d_model 384: ~10.7M params
VOCAB = 256  # bytes of the Python standard library's sources
CORPUS_BYTES = 2_000_000
PARAM_TOLERANCE = 1e-5
"""Max |fspeed - DeepSpeed| allowed after `--compare_at` steps, fp32. The engines sum in different
orders, so gradients differ in the last bits; Adam turns that into ~1e-7 parameter differences,
except where a gradient is mathematically zero (the attention key bias: it shifts every score of a
query equally, which softmax ignores): there Adam normalizes rounding noise into lr-sized steps, and
the key biases show the largest differences (~1e-6 after 10 steps)."""


def ds_config(stage: int, micro_batch: int, grad_accum: int) -> dict:
    """The one config both engines read. fp32, AdamW through torch.optim (torch_adam), WarmupLR."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",  # DeepSpeed's "Adam" is AdamW too (adam_w_mode=True); say it explicitly
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 2_000_000},
    }


# ----------------------------------------------------------------------------------- launcher


def launch_stage(stage: int, config_path: Path, result_path: Path, args: argparse.Namespace) -> dict:
    """Run one stage on `WORLD` gloo ranks with torchrun; returns rank 0's result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, "--worker",
           "--stage", str(stage), "--ds_config", str(config_path), "--result", str(result_path),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--compare_at", str(args.compare_at),
           "--threads", str(args.threads), *(["--breakdown"] if args.breakdown else [])]
    # NUMBA_NUM_THREADS too: numba's OpenMP layer, on its first launch, resets the process's OpenMP
    # thread count (torch's intra-op threads) to NUMBA_NUM_THREADS, i.e. to all cores by default
    threads = str(args.threads)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads,
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not result_path.exists():
        output = proc.stdout + proc.stderr
        first_traceback = output.find("Traceback")
        sys.stderr.write(output[first_traceback:][:12000] if first_traceback >= 0 else output[-12000:])
        raise SystemExit(f"stage {stage}: the torchrun launch failed (exit {proc.returncode}); its output is above")
    result = json.loads(result_path.read_text())
    result["launch_s"] = time.perf_counter() - t0
    return result


def main(args: argparse.Namespace) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"  # as in the workers; also silences DeepSpeed's auto-detect warning
    try:
        import deepspeed  # noqa: F401  (the workers import it; fail here with the install command instead)
    except Exception as err:  # ImportError, or a broken install raising something else
        sys.exit(f"vs_deepspeed: DeepSpeed is not importable in this environment ({sys.executable}): "
                 f"{type(err).__name__}: {err}\nIt is a benchmark-only extra; install it with:\n    {INSTALL}")
    if not 0 < args.compare_at <= args.steps or not 0 <= args.warmup < args.steps:
        sys.exit(f"need 0 < --compare_at <= --steps and 0 <= --warmup < --steps; got compare_at={args.compare_at}, "
                 f"steps={args.steps}, warmup={args.warmup}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="vs_deepspeed_") as tmp:
        for stage in args.stages:
            config_path = Path(tmp) / f"ds_config_zero{stage}.json"
            config_path.write_text(json.dumps(ds_config(stage, args.micro_batch, args.grad_accum), indent=2))
            results[stage] = launch_stage(stage, config_path, Path(tmp) / f"result_{stage}.json", args)
            r = results[stage]
            print(f"  stage {stage}: DeepSpeed {r['ds_ms']:.1f} ms/step, fspeed {r['fs_ms']:.1f} ms/step, "
                  f"max |dparam| {r['max_param_diff']:.2e} (launch {r['launch_s']:.0f} s)", flush=True)
    print_table(results, args)


def print_table(results: dict, args: argparse.Namespace) -> None:
    first = next(iter(results.values()))
    print(f"\nGPT {first['n_params'] / 1e6:.1f}M params ({first['model']}), {WORLD} gloo ranks x {args.threads} "
          f"thread, micro-batch {args.micro_batch} x grad_accum {args.grad_accum} per rank; same ds_config.json "
          f"(AdamW torch_adam, WarmupLR, clipping 1.0, fp32); median of {args.steps - args.warmup} steps after "
          f"{args.warmup} warmup, slowest rank, engines alternating")
    config = ds_config(0, args.micro_batch, args.grad_accum)
    config["zero_optimization"]["stage"] = "0|1|2|3"
    print(f"ds_config.json: {json.dumps(config)}")
    print(f"\n{'ZeRO':>4} {'DeepSpeed ms':>13} {'fspeed ms':>10} {'fspeed/DS':>10} {'reduce hidden':>14} "
          f"{'max|dparam|':>12} {'max|param moved|':>17} {'loss DS -> fs (step 1, last)':>34}")
    for stage, r in results.items():
        print(f"{stage:>4} {r['ds_ms']:>13.1f} {r['fs_ms']:>10.1f} {r['fs_ms'] / r['ds_ms']:>9.3f}x "
              f"{r['reduce_hidden']:>13.0%} {r['max_param_diff']:>12.2e} {r['max_param_moved']:>17.2e} "
              f"{r['ds_loss'][0]:>8.4f} {r['fs_loss'][0]:>7.4f}, {r['ds_loss'][-1]:>7.4f} {r['fs_loss'][-1]:>7.4f}")
    print("reduce hidden: of fspeed's gradient-reduction collectives' time from launch to completion, the share "
          "this rank spent computing backward instead of waiting (comm log)")
    for stage, r in results.items():
        for change in r["thread_changes"]:
            print(f"warning: ZeRO-{stage}, rank 0, {change}")
    for stage, r in results.items():
        if r.get("breakdown"):
            print_breakdown(stage, r["breakdown"])
    worst = max(results.values(), key=lambda r: r["max_param_diff"])
    worst_diff = worst["max_param_diff"]
    worst_ratio = max(r["fs_ms"] / r["ds_ms"] for r in results.values())
    verdict = "within" if worst_diff <= PARAM_TOLERANCE else "OUTSIDE"
    print(f"\nparameters after {args.compare_at} steps: max |fspeed - DeepSpeed| = {worst_diff:.2e} at "
          f"{worst['worst_param']} (ZeRO-{worst['stage']}; that tensor's max |param| is "
          f"{worst['worst_param_abs_max']:.3g}), {verdict} the fp32 tolerance {PARAM_TOLERANCE:g}")
    print("(this machine is shared and noisy: step times vary +-30% between runs)")
    print(f"\nmax_param_diff={worst_diff:.3e}")
    for stage, r in results.items():
        print(f"zero{stage}_step_time_vs_deepspeed={r['fs_ms'] / r['ds_ms']:.3f}")
        print(f"zero{stage}_reduce_hidden_by_overlap={r['reduce_hidden']:.3f}")
    print(f"zero_step_time_vs_deepspeed={worst_ratio:.3f}")
    if worst_diff > PARAM_TOLERANCE:
        raise SystemExit(1)


def print_breakdown(stage: int, breakdown: dict) -> None:
    print(f"\nZeRO-{stage} step sections, rank 0, median ms per step (sections of different steps do not add up):")
    for name, title in (("ds", "DeepSpeed"), ("fs", "fspeed")):
        for label, ms in breakdown[name].items():
            print(f"  {title:<10} {label:<45} {ms:>9.1f}")
    comm = ", ".join(f"{op} {ms:.1f}" for op, ms in sorted(breakdown["fs_comm"].items()))
    print(f"  fspeed collectives, ms per step, launch to completion (prefetches overlap compute): {comm or 'none'}")
    if breakdown["not_timed"]:
        print(f"  (fspeed internals not found, not timed: {', '.join(breakdown['not_timed'])})")


# ------------------------------------------------------------------------------------- worker


def fspeed_run_config(config_path: Path, dp_world_size: int, steps: int):
    """fspeed's validated RunConfig for the ds_config at `config_path`, composed as fspeed-train does."""
    from fspeed.config.compose import compose_run_config

    return compose_run_config(config_path, [
        *MODEL_OVERRIDES, f"train.steps={steps}", f"checkpoint.dir={config_path.parent / 'checkpoints'}",
        "monitor.csv=false", "monitor.progress_bar=false",
    ], dp_world_size=dp_world_size)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import deepspeed
    import fspeed as fs
    from fspeed.config.build import build_model_config, build_optimizer, build_precision, build_zero_config
    from fspeed.models.gpt_module import GPTModule, load_params_into_module

    torch.set_num_threads(args.threads)
    fs.init_distributed(backend="gloo")
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the process group
    deepspeed.utils.logger.setLevel(logging.ERROR)
    mesh = fs.Mesh(data=-1, log=fs.CommLog())  # the timeline gives the share of reduction overlap hides
    quiet_mesh = fs.Mesh(data=-1)  # same ranks, separate log: gathering for the comparison is not logged
    rank = mesh.rank

    # ---- the shared config, as fspeed reads it
    config_path = Path(args.ds_config)
    run, translation = fspeed_run_config(config_path, mesh.size("data"), args.steps)
    if run.zero.stage != args.stage:
        raise RuntimeError(f"{config_path} asks for ZeRO stage {args.stage}, but fspeed's translation gave "
                           f"zero.stage={run.zero.stage} (overrides: {translation.overrides})")
    model_cfg = build_model_config(run, VOCAB)
    model = fs.models.gpt(model_cfg)
    z = run.zero
    plan = fs.zero(build_zero_config(run))  # every translated zero_optimization key, overlap_comm included
    optimizer = build_optimizer(run)
    triad = run.batch

    # ---- the same data and the same initial weights
    text = fs.data.stdlib_corpus(CORPUS_BYTES)
    tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    windows = fs.data.TokenWindows(tokens, model_cfg.seq_len)
    loader = fs.data.Loader(windows, fs.data.BatchSampler(len(windows), triad.train_batch_size, run.train.seed,
                                                          rank=mesh.coordinate("data"), world_size=mesh.size("data")))
    params = model.init(torch.Generator().manual_seed(run.train.seed))
    module = GPTModule(model_cfg)
    load_params_into_module(module, params)

    # ---- DeepSpeed
    ds_dict = json.loads(config_path.read_text())
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=ds_dict)

    ds_sections, fs_sections = Sections(), Sections()
    timed = ds_sections.section if args.breakdown else (lambda label: contextlib.nullcontext())

    def ds_step(batch: dict) -> float:
        losses = []
        micro = zip(batch["inputs"].split(triad.micro_batch_size), batch["targets"].split(triad.micro_batch_size))
        for i, (inputs, targets) in enumerate(micro):
            with timed("forward + loss"):
                logits = engine(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            with timed("backward (+ grad reduction hooks)"):
                engine.backward(loss)
            with timed("engine.step at the boundary" if i == triad.grad_accum - 1 else "engine.step (no boundary)"):
                engine.step()
            losses.append(loss.detach())
        return float(torch.stack(losses).mean())

    # ---- fspeed
    skipped_sections = []
    if args.breakdown:
        wrap_fspeed_boundary(fs_sections)
        if z.stage == 3:
            skipped_sections = wrap_fspeed_zero3(fs_sections)
    state = fs.init_train_state(params, optimizer, precision=build_precision(run), seed=run.train.seed, plan=plan,
                                mesh=mesh, logical_axes=model.logical_axes)
    train_step = fs.make_train_step(model.loss, optimizer, grad_accum=triad.grad_accum, plan=plan, mesh=mesh)

    def fs_step(batch: dict) -> float:
        nonlocal state
        state, metrics = train_step(state, batch)
        return metrics["loss"]

    engines = {"ds": ds_step, "fs": fs_step}
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    gathered, thread_changes = None, []
    for step in range(args.steps):
        batch = loader.batch(step)
        for name in (("ds", "fs") if step % 2 == 0 else ("fs", "ds")):
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(engines[name](batch))
            times[name].append(time.perf_counter() - t0)
            if torch.get_num_threads() != args.threads:  # keep both engines on the same thread budget
                thread_changes.append(f"{name} step {step + 1}: torch threads {torch.get_num_threads()}, reset to "
                                      f"{args.threads}")
                torch.set_num_threads(args.threads)
            if args.breakdown:
                sections = ds_sections if name == "ds" else fs_sections
                sections.end_step(times[name][-1], "other (Python, batching)" if name == "ds"
                                  else "forward + backward + accumulate (rest)")
        if step + 1 == args.warmup:
            mesh.log.reset()  # comm totals and the overlap share cover the timed steps only
        if step + 1 == args.compare_at:
            gathered = gather_both(engine, state, quiet_mesh, model_cfg)

    # slowest rank per step; DeepSpeed's losses are this rank's, averaged over ranks here
    slowest = {name: torch.tensor(t, dtype=torch.float64) for name, t in times.items()}
    ds_loss = torch.tensor(losses["ds"], dtype=torch.float64)
    for t in slowest.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(ds_loss)
    ds_loss /= mesh.size("data")

    if rank == 0:
        fs_tree, ds_tree = gathered
        paths, fs_leaves, _ = fs.tree_flatten_with_paths(fs_tree)
        diffs = [float((a - b).abs().max()) for a, b in zip(fs_leaves, fs.pytree.tree_leaves(ds_tree))]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        moved = max(float((a - b).abs().max()) for a, b in zip(fs_leaves, fs.pytree.tree_leaves(params)))
        after_warmup = slice(args.warmup, None)
        result = {
            "stage": z.stage,
            "model": f"{model_cfg.n_layer} layers, d_model {model_cfg.d_model}, seq {model_cfg.seq_len}",
            "n_params": fs.models.count_params(params),
            "ds_ms": statistics.median(slowest["ds"][after_warmup].tolist()) * 1e3,
            "fs_ms": statistics.median(slowest["fs"][after_warmup].tolist()) * 1e3,
            "ds_times": slowest["ds"].tolist(), "fs_times": slowest["fs"].tolist(),
            "ds_loss": ds_loss.tolist(), "fs_loss": losses["fs"],
            "max_param_diff": diffs[worst], "worst_param": paths[worst],
            "worst_param_abs_max": float(fs_leaves[worst].abs().max()), "max_param_moved": moved,
            "translation": list(translation.overrides) if translation else [],
            "thread_changes": thread_changes,
            "reduce_hidden": reduce_hidden(mesh.log),
            "breakdown": {"ds": ds_sections.medians_ms(args.warmup), "fs": fs_sections.medians_ms(args.warmup),
                          "fs_comm": comm_ms_per_step(mesh.log, args.steps - args.warmup),
                          "not_timed": skipped_sections} if args.breakdown else None,
        }
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def reduce_hidden(log) -> float:
    """The share of the gradient-reduction collectives' time (launch to completion) that this rank
    did not spend waiting for them (computing backward meanwhile), from the comm log's timeline.
    Scalars (the loss and grad-norm all-reduces) are left out."""
    events = [e for e in log.events if e.op in ("all_reduce", "reduce", "reduce_scatter") and e.nbytes > 64]
    span = sum(e.waited - e.issued for e in events)
    return 1.0 - sum(e.blocked for e in events) / span if span > 0 else 0.0


def comm_ms_per_step(log, steps: int) -> dict[str, float]:
    """fspeed's collectives from its CommLog: total ms per timed step, by op."""
    return {op: sum(sum(lat) for lat in by_size.values()) * 1e3 / steps for op, by_size in log.records.items()}


def gather_both(engine, state, mesh, model_cfg) -> tuple[dict, dict]:
    """(fspeed params, DeepSpeed params) as full fp32 trees of the same structure; a collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    import fspeed as fs
    from fspeed.models.gpt_module import GPTModule, params_from_module

    fs_tree = fs.gather_params(state, mesh)
    full = {}
    for name, p in engine.module.named_parameters():
        value = safe_get_full_fp32_param(p)  # stage 3: an all-gather, in the same order on every rank
        if value is None and engine.zero_optimization_stage() == 0:
            value = p  # fp32 without ZeRO: the parameters are the masters
        if value is None:
            raise RuntimeError(f"DeepSpeed returned no fp32 master for {name} (stage {engine.zero_optimization_stage()})")
        full[name] = value.detach().clone()
    twin = GPTModule(model_cfg)
    twin.load_state_dict(full, strict=True)
    return fs_tree, params_from_module(twin)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per engine per stage")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--compare_at", type=int, default=10, help="step after which parameters are compared")
    parser.add_argument("--micro_batch", type=int, default=2, help="train_micro_batch_size_per_gpu")
    parser.add_argument("--grad_accum", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks share 2 cores)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each engine's step sections (wraps fspeed's boundary phases)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ds_config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/vs_deepspeed.json

        with recorded("vs_deepspeed"):
            main(arguments)
