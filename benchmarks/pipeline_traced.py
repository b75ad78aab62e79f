"""A Hugging Face GPT-2 pipelined with no hand-written layer list: fspeed's `traced_layers` against torch's
own tracing frontend (`torch.distributed.pipelining.pipeline` + `Schedule1F1B`), same model and stages.

Both trace the module's forward with `torch.export` and cut it into 2 stages at the same block, on 2
gloo ranks of one thread each; 1F1B over 8 micro-batches; the same weights, data and loss (the
logits' shifted cross-entropy, as Hugging Face's own loss); AdamW (fspeed's fused, torch's foreach).
Steps alternate between the engines in the same processes (a barrier before each), so the shared
machine's load falls on both alike. The first step's losses are printed side by side (equal math:
fspeed traces with `fused_ops=False`, so both run GPT-2's own Python GELU and the ratio is the
runtimes'; by default fspeed traces it as torch's fused kernel, `fspeed.models.fused_ops`).

    python benchmarks/pipeline_traced.py [--layers 8] [--width 256] [--rows 8] [--micro 8] [--steps 8]

Then, in one process, what the last pipeline layer keeps for backward at GPT-2's vocabulary (50257)
with the module's own loss and with `fs.causal_lm_loss`, which cuts before the head and fuses it
with the loss.

Then 2 stages of the same GPT-2 at vocabulary 50257, whose last layer (head and loss) outweighs many
blocks, cut by DeepSpeed's `uniform` and `parameters` partitions and by `fs.parallel.balanced_partition`
(measured layer times), alternating steps.

Last lines: pipeline_traced_hf_step_time_vs_torch (fspeed over torch, median of paired steps),
pipeline_balanced_partition_step_time_over_uniform and _over_parameters,
pipeline_traced_fused_head_kept_bytes_over_own_loss, pipeline_traced_hf_trace_seconds (fspeed's
traced_layers: the training graph's export).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fspeed as fs
from fspeed.testing import GlooWorld

sys.path.insert(0, str(Path(__file__).parent))
from pipeline import torch_pipeline_step  # noqa: E402 (torch's side of the step, as in pipeline.py)
from your_model import SEQ, build_gpt2  # noqa: E402 (the same GPT-2 builder as the module benchmark)

VOCAB = 8192


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position t predicts token t + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def batch_of(args: argparse.Namespace) -> dict:
    ids = torch.randint(0, VOCAB, (args.rows * args.micro, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def measure(args: argparse.Namespace) -> dict:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline  # noqa: PLC0415

    torch.set_num_threads(1)
    fs.retain_freed_host_memory()
    rank = dist.get_rank()
    base = build_gpt2(args.layers, args.width, VOCAB)
    base.config.use_cache = False
    batch = batch_of(args)
    example = {"input_ids": batch["input_ids"][:args.rows]}

    t0 = time.perf_counter()
    model = fs.models.traced_layers(copy.deepcopy(base), example,  # the module's own ops, as torch traces them
                                    lambda out, b: shifted_loss(out.logits, b["labels"]), fused_ops=False)
    trace_s = time.perf_counter() - t0
    mesh, plan = fs.Mesh(pipe=2), fs.pipeline(args.micro, "1f1b")
    opt = fs.optim.adamw(1e-4)
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    cut = model.layers.layers[state.layout.pipeline.bounds[1]].name  # the block stage 1 starts at

    module = copy.deepcopy(base)
    pipe = pipeline(module, mb_args=(example["input_ids"],), split_spec={cut: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.micro, loss_fn=lambda logits, labels: shifted_loss(logits, labels))
    torch_opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

    times: dict = {"fspeed": [], "torch": []}
    first = {}
    for i in range(args.warmup + args.steps):
        for name in (("fspeed", "torch") if i % 2 == 0 else ("torch", "fspeed")):
            dist.barrier()
            t = time.perf_counter()
            if name == "fspeed":
                state, metrics = step(state, batch)
                loss = metrics["loss"]
            else:
                loss = torch_pipeline_step(schedule, torch_opt, batch["input_ids"], batch["labels"])
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
            if i == 0:
                first[name] = loss
    return {"times": times, "first": first, "trace_s": trace_s, "cut": cut,
            "layers": len(model.layers), "params": sum(p.numel() for p in base.parameters())}


def last_stage_kept_bytes(args: argparse.Namespace, vocab: int = 50257, rows: int = 4) -> dict:
    """One process: what the traced GPT-2's last pipeline layer keeps for backward (the part of its
    forward a 1F1B last stage holds per micro-batch), with the module's own loss and with
    `fs.causal_lm_loss` (the head fused with the loss), at GPT-2's vocabulary."""
    from fspeed.remat_budget import bytes_kept_for_backward  # noqa: PLC0415

    torch.set_num_threads(1)
    module = build_gpt2(2, args.width, vocab)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids}
    out = {}
    for name, loss_fn in (("own loss", None), ("causal_lm_loss", fs.causal_lm_loss)):
        model = fs.models.traced_layers(module, batch, loss_fn)
        seq, params = model.layers, model.init()
        fused = seq.last_with_loss is not None  # then the head is a layer of its own, run by the tail
        first = len(seq) - 1 - fused  # the last block: where the measured part starts
        rng = torch.Generator().manual_seed(0)
        x = seq.inputs(batch)
        with torch.no_grad():  # the layers before: the stage's input (the training graph's)
            for layer in seq.layers[:first]:
                x = layer.fn(params, x, rng=rng)
        tree = fs.tree_map(lambda t: t.detach().requires_grad_(), params)
        x = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in x)

        def run(seq=seq, tree=tree, x=x, first=first, fused=fused):
            y = x
            for layer in seq.layers[first:len(seq) - fused]:
                y = layer.fn(tree, y, rng=torch.Generator().manual_seed(0))
            seq.tail(tree, y, batch).backward()
        kept = [bytes_kept_for_backward(run) for _ in range(3)]
        out[name] = (statistics.median(k for k, _ in kept), statistics.median(t for _, t in kept))
    return out


def compare_partitions(args: argparse.Namespace, vocab: int = 50257, rows: int = 4, micro: int = 4,
                       steps: int = 6) -> dict:
    """2 stages of the traced GPT-2 at GPT-2's vocabulary (its last layer, the head and the loss, costs
    as much as many blocks): partitions `uniform` and `parameters` (DeepSpeed's) against
    `fs.parallel.balanced_partition` (measured layer times), 1F1B, steps alternating; seconds per step."""
    torch.set_num_threads(1)
    module = build_gpt2(args.layers, args.width, vocab)
    module.config.use_cache = False
    ids = torch.randint(0, vocab, (rows * micro, SEQ), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    example = {"input_ids": ids[:rows], "labels": ids[:rows]}
    model = fs.models.traced_layers(module, example)
    balanced = fs.parallel.balanced_partition(model, example, 2)
    mesh, opt = fs.Mesh(pipe=2), fs.optim.adamw(1e-4)
    runs = {}
    for name, partition in (("uniform", "uniform"), ("parameters", "parameters"), (f"balanced {balanced}", balanced)):
        plan = fs.pipeline(micro, "1f1b", partition=partition)
        state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
        bounds = list(state.layout.pipeline.bounds)
        same = next((other for other, run in runs.items() if run[3] == bounds), None)
        if same is not None:  # the same cut: the same run (timing it twice would only measure noise)
            runs[name] = runs[same]
            continue
        runs[name] = [state, fs.make_train_step(model, opt, plan=plan, mesh=mesh), [], bounds]
    distinct = list({id(run): (name, run) for name, run in runs.items()}.values())
    for i in range(steps + 1):
        for name, run in (distinct if i % 2 == 0 else distinct[::-1]):
            dist.barrier()
            t = time.perf_counter()
            run[0], _ = run[1](run[0], batch)
            dist.barrier()
            if i:
                run[2].append(time.perf_counter() - t)
    return {name: (statistics.median(run[2]), run[3]) for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with GlooWorld(2, timeout_s=1200) as world:
        results = world.run(measure, args)
        partitions = world.run(compare_partitions, args)[0]
    r0 = results[0]
    t = r0["times"]
    ours, theirs = statistics.median(t["fspeed"]), statistics.median(t["torch"])
    paired = statistics.median(a / b for a, b in zip(t["fspeed"], t["torch"]))
    print(f"Hugging Face GPT-2, {r0['params'] / 1e6:.1f}M parameters ({args.layers} layers, width {args.width}, "
          f"vocab {VOCAB}), {args.micro} micro-batches of {args.rows} x {SEQ} tokens, 2 stages cut before "
          f"{r0['cut']}, 1F1B, 2 gloo ranks x 1 thread; fspeed traced it into {r0['layers']} layers in "
          f"{r0['trace_s']:.1f} s")
    print(f"{'engine':<48}{'step ms':>10}   first loss")
    print(f"{'fspeed traced_layers + train_step':<48}{ours * 1e3:>10.1f}   {results[1]['first']['fspeed']:.4f}")
    print(f"{'torch.distributed.pipelining pipeline()':<48}{theirs * 1e3:>10.1f}   {results[1]['first']['torch']:.4f}")
    kept = last_stage_kept_bytes(args)
    print(f"\nthe last layer (final block, norm, head, loss) of the traced GPT-2 at vocabulary 50257, {4} x {SEQ} "
          "tokens, one process:")
    for name, (nbytes, seconds) in kept.items():
        print(f"  {name:<16} kept for backward {nbytes / 2**20:8.1f} MiB   {seconds * 1e3:7.1f} ms")
    print(f"\n2 stages of the traced GPT-2 at vocabulary 50257 ({args.layers} blocks), 1F1B, 4 micro-batches of "
          f"4 x {SEQ} tokens, by partition:")
    for name, (seconds, bounds) in partitions.items():
        print(f"  {name:<24} layer bounds {bounds}   {seconds * 1e3:8.0f} ms per step")
    balanced_s = next(v[0] for k, v in partitions.items() if k.startswith("balanced"))
    print(f"pipeline_traced_hf_step_time_vs_torch={paired:.3f}")
    print(f"pipeline_balanced_partition_step_time_over_uniform={balanced_s / partitions['uniform'][0]:.3f}")
    print(f"pipeline_balanced_partition_step_time_over_parameters={balanced_s / partitions['parameters'][0]:.3f}")
    print(f"pipeline_traced_fused_head_kept_bytes_over_own_loss={kept['causal_lm_loss'][0] / kept['own loss'][0]:.3f}")
    print(f"pipeline_traced_hf_trace_seconds={r0['trace_s']:.2f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/pipeline_traced.json

    with recorded("pipeline_traced"):
        main()
