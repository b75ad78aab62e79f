"""A Hugging Face GPT-2 (random init, no download) trained by fspeed and by the PyTorch alternatives.

Two gloo ranks (torchrun), the same model, data and AdamW, engines taking turns in the same two
processes, so the shared machine's load hits every engine alike: two consecutive steps each, the
second timed (a barrier before it, the slowest rank's time), so it overlaps what the first left in
flight (ZeRO-1/2's parameter all-gather) as consecutive training does; that of the timed step is
waited for before the next engine runs:

    fspeed ZeRO-3      fs.functionalize(model) under fs.zero(3) (layer-by-layer gathering)
    FSDP2              torch.distributed.fsdp.fully_shard on every block and the root, AdamW fused
    fspeed ZeRO-1      fs.zero(1)
    fspeed ZeRO-0      fs.zero(0) (all-reduce, as DDP)
    DDP                DistributedDataParallel, AdamW fused
    DeepSpeed ZeRO-3   deepspeed.initialize (the [bench] extra; skipped when not installed)
    fspeed ZeRO-3, module's ops / fspeed ZeRO-1, module's ops   the same with functionalize(fused_ops=False)

fspeed's engines run as users get them: GPT-2's Python tanh-GELU (`gelu_new`) computes as torch's
fused kernel (`fspeed.models.fused_ops`); the "module's ops" engines (and the `_same_ops` figures)
run the module's own ops, as the PyTorch engines do: those ratios are the runtimes' alone.

and, on one process first, fspeed without a plan against an eager loop with fused AdamW, with where
fspeed's step time goes: `grad_and_value` of the loss (forward + backward through
functional_call), the gradient delivery, the optimizer step; and fspeed with `fs.causal_lm_loss`
(the output head fused with the loss; the eager loop keeps Hugging Face's own loss); and both with
biases and norms exempt from weight decay (`adamw(mask=no_decay())` against two torch param groups).

    python benchmarks/your_model.py [--steps 12] [--warmup 2] [--layers 6] [--width 384] [--threads 1] [--system-malloc]

Every process raises glibc's malloc thresholds as fspeed-train does (`fs.retain_freed_host_memory`,
for every engine in it alike); --system-malloc keeps glibc's defaults.

Then, on one process, the module's own loss against `fs.causal_lm_loss` (its output head fused with the
loss) at this vocabulary and at GPT-2's 50257: bytes kept for backward and step time.

Last lines: hf_zero3_step_time_vs_fsdp2, hf_zero1_step_time_vs_ddp, hf_step_time_vs_deepspeed,
hf_step_time_vs_eager, their _same_ops twins (fspeed with the module's own ops: zero3, zero1, eager),
hf_fused_ops_kept_bytes_over_module_ops (activation memory, fused_ops on over off),
hf_step_time_vs_eager_with_no_decay_groups (biases and norms exempt from
weight decay on both sides), hf_dispatch_bound_step_time_vs_eager (a 12-layer GPT-2 of width 64 on one
row of 128 tokens, where per-op Python dispatch is the step, as on a launch-bound GPU) and its
_same_ops twin (each
fspeed's median step time over the other's; lower is better), then per vocabulary
hf_fused_head_kept_bytes_over_own_loss_vocabV and hf_fused_head_step_time_over_own_loss_vocabV.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB, SEQ, MICRO = 8192, 128, 4
SAME = ", module's ops"  # an fspeed engine with functionalize(fused_ops=False): the ops the others run
# the headline ratios: each the median over steps of the two engines' times in that step (the same round)
PAIRS = (("fspeed ZeRO-3", "FSDP2"), ("fspeed ZeRO-1", "DDP"), ("fspeed ZeRO-0", "DDP"), ("fspeed ZeRO-3", "DeepSpeed ZeRO-3"),
         ("fspeed ZeRO-3" + SAME, "FSDP2"), ("fspeed ZeRO-1" + SAME, "DDP"))


def build_gpt2(layers: int, width: int, vocab: int = VOCAB):
    import transformers

    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    for owner in (utils, import_utils):  # this repository's kernels/ folder is not Hugging Face's package
        owner.is_kernels_available = lambda *a, **k: False
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=vocab, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def lm_loss(outputs, batch):
    return outputs.loss


def batch_for(step: int, rows: int, rank: int = 0, vocab: int = VOCAB) -> dict:
    x = torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))
    return {"input_ids": x, "labels": x}


# ------------------------------------------------------------------------------ one process


def one_process(args, loss_fn=lm_loss, no_decay: bool = False, fused_ops: bool = True) -> dict:
    """fspeed (no plan) against an eager loop with fused AdamW, alternating; and fspeed's phases.
    `loss_fn`: fspeed's (the eager loop always takes the module's own loss). `no_decay`: biases and
    norms exempt from weight decay (0.1), as fine-tuning recipes do: `adamw(mask=fs.optim.no_decay())`
    against torch's AdamW with the same two param groups. `fused_ops`: functionalize's (False: the
    module's own ops, as the eager loop runs them)."""
    import fspeed as fs

    torch.set_num_threads(args.threads)
    if not args.system_malloc:
        fs.retain_freed_host_memory()  # for every engine of the process alike
    module = build_gpt2(args.layers, args.width)
    eager = copy.deepcopy(module)
    if no_decay:
        decays = fs.optim.no_decay()
        named = list(eager.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for n, p in named if decays(n)], "weight_decay": 0.1},
                                 {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}],
                                lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, fused=True)
    model = fs.functionalize(module, loss_fn, fused_ops=fused_ops)
    fs_opt = fs.optim.adamw(1e-4, weight_decay=0.1, mask=fs.optim.no_decay()) if no_decay else fs.optim.adamw(1e-4)
    state = fs.init_train_state(model.init(), fs_opt, model=model)
    step = fs.make_train_step(model.loss, fs_opt)
    phases = {"grad_and_value (forward + backward + delivery)": [], "boundary (AdamW, write-back, any norm left)": []}
    times = {"fspeed": [], "eager": []}
    for i in range(args.steps):
        batch = batch_for(i, MICRO)
        for name in (("fspeed", "eager") if i % 2 == 0 else ("eager", "fspeed")):
            t0 = time.perf_counter()
            if name == "eager":
                opt.zero_grad(set_to_none=True)
                eager(**batch).loss.backward()
                opt.step()
            else:
                s = step.begin(state)
                step.micro(s, state, batch)
                t1 = time.perf_counter()
                state, _ = step.boundary(s, state)
                if i >= args.warmup:
                    phases["grad_and_value (forward + backward + delivery)"].append(t1 - t0)
                    phases["boundary (AdamW, write-back, any norm left)"].append(time.perf_counter() - t1)
            times[name].append(time.perf_counter() - t0)
    eager_fwd_bwd = []
    for i in range(args.warmup, args.steps):
        t0 = time.perf_counter()
        eager(**batch_for(i, MICRO)).loss.backward()
        eager_fwd_bwd.append(time.perf_counter() - t0)
        eager.zero_grad(set_to_none=True)
    med = {k: statistics.median(v[args.warmup:]) for k, v in times.items()}
    paired = statistics.median(f / e for f, e in zip(times["fspeed"][args.warmup:], times["eager"][args.warmup:]))
    return {"times": med, "paired": paired, "phases": {k: statistics.median(v) for k, v in phases.items()},
            "eager_forward_backward": statistics.median(eager_fwd_bwd),
            "params": sum(p.numel() for p in module.parameters())}


def fused_head(args, vocabs=(VOCAB, 50257), steps: int = 6) -> dict:
    """fspeed on the same GPT-2 with the module's own loss (logits, then cross_entropy) and with
    `fs.causal_lm_loss` (the head fused with the loss), alternating: per vocabulary, the bytes the
    forward keeps for backward (malloc's, at backward start) and the step time."""
    import fspeed as fs
    from fspeed.remat_budget import bytes_kept_for_backward

    torch.set_num_threads(args.threads)
    fs.retain_freed_host_memory()
    out = {}
    for vocab in vocabs:
        module = build_gpt2(args.layers, args.width, vocab)
        runs = {}
        for name, loss_fn in (("own loss", lm_loss), ("causal_lm_loss", fs.causal_lm_loss)):
            model = fs.functionalize(module, loss_fn)
            opt = fs.optim.adamw(1e-4)
            holder = {"state": fs.init_train_state(model.init(), opt, model=model)}
            step = fs.make_train_step(model.loss, opt)

            def run(step=step, holder=holder, steps_taken=itertools.count()):
                holder["state"], _ = step(holder["state"], batch_for(next(steps_taken), MICRO, vocab=vocab))
            runs[name] = run
        figures = {name: [] for name in runs}
        for i in range(steps + 1):  # the first round warms up
            for name in (runs if i % 2 == 0 else reversed(list(runs))):
                kept, seconds = bytes_kept_for_backward(runs[name])
                if i:
                    figures[name].append((kept, seconds))
        out[vocab] = {name: (statistics.median(k for k, _ in v), statistics.median(t for _, t in v))
                      for name, v in figures.items()}
    return out


def fused_ops_kept(args) -> dict:
    """Bytes the forward keeps for backward (malloc's, at backward start), fspeed with fused_ops on and
    off (the Python GELU keeps its intermediates), one step each after one to warm up."""
    import fspeed as fs
    from fspeed.remat_budget import bytes_kept_for_backward

    torch.set_num_threads(args.threads)
    fs.retain_freed_host_memory()
    module = build_gpt2(args.layers, args.width)
    out = {}
    for fused_ops in (True, False):
        model = fs.functionalize(module, lm_loss, fused_ops=fused_ops)
        opt = fs.optim.adamw(1e-4)
        box = {"state": fs.init_train_state(model.init(), opt, model=model)}
        step = fs.make_train_step(model.loss, opt)

        def run(step=step, box=box):
            box["state"], _ = step(box["state"], batch_for(0, MICRO))
        run()
        out[fused_ops] = bytes_kept_for_backward(run)[0]
    return out


def gpu_one_process(layers: int = 12, width: int = 768, rows: int = 32, steps: int = 12,
                    device: str = "cuda", headline: str = "gpu_hf_step_time_vs_eager", fused_ops: bool = True) -> dict:
    """On one GPU (the device check, `sparse_attention_gpu.py`): the same comparison as `one_process`
    with the module and data on `device`, fp32 with TF32 matmuls; prints the ratio as `headline`.
    On the CPU with a tiny model it measures the per-step dispatch a launch-bound GPU step pays.
    `fused_ops`: functionalize's (False: the module's own ops, as the eager loop runs them)."""
    import fspeed as fs

    torch.backends.cuda.matmul.allow_tf32 = True
    module = build_gpt2(layers, width).to(device)
    eager = copy.deepcopy(module)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, fused=True)
    model = fs.functionalize(module, lm_loss, fused_ops=fused_ops)
    fs_opt = fs.optim.adamw(1e-4)
    state = {"s": fs.init_train_state(model.init(), fs_opt, model=model, device=device)}
    step = fs.make_train_step(model.loss, fs_opt)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run_eager(batch):
        opt.zero_grad(set_to_none=True)
        eager(**batch).loss.backward()
        opt.step()

    def run_fspeed(batch):
        state["s"], _ = step(state["s"], batch)
    times = {"fspeed": [], "eager": []}
    for i in range(steps + 2):  # two warm-up rounds
        batch = {k: v.to(device) for k, v in batch_for(i, rows).items()}
        for name, run in ((("fspeed", run_fspeed), ("eager", run_eager)) if i % 2 == 0
                          else (("eager", run_eager), ("fspeed", run_fspeed))):
            synchronize()
            t0 = time.perf_counter()
            run(batch)
            synchronize()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in module.parameters())
    print(f"Hugging Face GPT-2 ({params / 1e6:.0f}M parameters, {layers} layers, width {width}), {rows} x {SEQ} tokens "
          f"on {device}: fspeed{'' if fused_ops else ' (fused_ops=False)'} {med['fspeed'] * 1e3:.1f} ms, eager loop "
          f"with fused AdamW {med['eager'] * 1e3:.1f} ms")
    print(f"{headline}={med['fspeed'] / med['eager']:.3f}")
    return med


# ---------------------------------------------------------------------------------- 2 ranks


def worker(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import fspeed as fs

    torch.set_num_threads(args.threads)
    if not args.system_malloc:
        fs.retain_freed_host_memory()  # for every engine of the process alike
    fs.init_distributed(backend="gloo")
    rank = dist.get_rank()
    mesh = fs.Mesh(data=-1)
    base = build_gpt2(args.layers, args.width)
    engines = {}

    def fspeed_engine(stage, fused_ops=True):
        model = fs.functionalize(copy.deepcopy(base), lm_loss, fused_ops=fused_ops)
        opt = fs.optim.adamw(1e-4)
        plan = fs.zero(stage, param_persistence_threshold=0 if stage == 3 else 100_000,
                       reduce_bucket_size=2_000_000, allgather_bucket_size=2_000_000, overlap_comm=True)
        box = {"state": fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)}
        step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)

        def run(batch):
            box["state"], _ = step(box["state"], batch)
        run.settle = lambda: box["state"].params  # ZeRO-1/2's parameter all-gather, left in flight by a step
        return run

    def torch_engine(wrap):
        module = wrap(copy.deepcopy(base))
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)

        def run(batch):
            opt.zero_grad(set_to_none=True)
            module(**batch).loss.backward()
            opt.step()
        return run

    def fsdp2(module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in module.transformer.h:
            fully_shard(block, mesh=device_mesh)
        fully_shard(module, mesh=device_mesh)
        return module

    engines["fspeed ZeRO-3"] = fspeed_engine(3)
    engines["FSDP2"] = torch_engine(fsdp2)
    engines["fspeed ZeRO-1"] = fspeed_engine(1)
    engines["fspeed ZeRO-0"] = fspeed_engine(0)
    engines["DDP"] = torch_engine(lambda m: DistributedDataParallel(m))
    engines["fspeed ZeRO-3" + SAME] = fspeed_engine(3, fused_ops=False)
    engines["fspeed ZeRO-1" + SAME] = fspeed_engine(1, fused_ops=False)
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                           "overlap_comm": True, "reduce_bucket_size": 2_000_000}}
        ds_engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=ds_config)

        def deepspeed_run(batch):
            loss = ds_engine(**batch).loss
            ds_engine.backward(loss)
            ds_engine.step()
        engines["DeepSpeed ZeRO-3"] = deepspeed_run
    except ImportError:
        pass
    times = {name: [] for name in engines}
    names = list(engines)
    for i in range(args.steps):
        batch = batch_for(i, MICRO, rank)
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            # two consecutive steps, the second timed: it overlaps what the first left in flight (ZeRO-1/2's
            # parameter all-gather) as consecutive training does, no more; that of the second is then waited
            # for, untimed, so no engine's work runs during another's
            engines[name](batch_for(i + args.steps, MICRO, rank))
            dist.barrier()
            t0 = time.perf_counter()
            engines[name](batch)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
            getattr(engines[name], "settle", lambda: None)()
    if rank == 0:
        kept = {k: v[args.warmup:] for k, v in times.items()}
        pairs = {f"{a} / {b}": statistics.median(x / y for x, y in zip(kept[a], kept[b])) for a, b in PAIRS
                 if a in kept and b in kept}
        Path(args.result).write_text(json.dumps({"times": {k: statistics.median(v) for k, v in kept.items()},
                                                 "paired": pairs}))
    dist.barrier()
    dist.destroy_process_group()


def launch(args) -> dict:
    from fspeed.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={port}", __file__, "--worker", "--result", str(result), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--layers", str(args.layers), "--width", str(args.width),
               "--threads", str(args.threads)] + (["--system-malloc"] if args.system_malloc else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "NUMBA_NUM_THREADS": str(args.threads),
               "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            sys.stderr.write((proc.stdout + proc.stderr)[-8000:])
            raise SystemExit(f"the 2-rank launch failed (exit {proc.returncode})")
        return json.loads(result.read_text())


def main(args) -> None:
    torch.set_num_threads(args.threads)
    print("dispatch-bound (each op tiny, as on a GPU whose step is launch-bound):")
    dispatch = gpu_one_process(layers=12, width=64, rows=1, steps=30, device="cpu",
                               headline="hf_dispatch_bound_step_time_vs_eager")
    dispatch_same = gpu_one_process(layers=12, width=64, rows=1, steps=30, device="cpu",
                                    headline="hf_dispatch_bound_step_time_vs_eager_same_ops", fused_ops=False)
    import fspeed as fs

    single = one_process(args)
    single_same = one_process(args, fused_ops=False)
    single_fused = one_process(args, fs.causal_lm_loss)
    single_groups = one_process(args, no_decay=True)
    fused = fused_head(args)
    kept_ops = fused_ops_kept(args)
    launched = launch(args)
    ranks, paired = launched["times"], launched["paired"]
    ms = 1e3
    print(f"\nHugging Face GPT-2, {single['params'] / 1e6:.1f}M parameters ({args.layers} layers, width {args.width}), "
          f"seq {SEQ}, micro-batch {MICRO}, AdamW; median step time after {args.warmup} warmup steps")
    print("\none process, alternating:")
    print(f"  {'fspeed (functionalize, no plan)':<38}{single['times']['fspeed'] * ms:>9.1f} ms")
    print(f"  {'eager loop, AdamW fused':<38}{single['times']['eager'] * ms:>9.1f} ms")
    print(f"  then, alternating again: fspeed with the module's own ops (fused_ops=False: its Python GELU, as the "
          f"eager loop runs it) {single_same['times']['fspeed'] * ms:.1f} ms, eager {single_same['times']['eager'] * ms:.1f} ms")

    print(f"  then, alternating again: fspeed with fs.causal_lm_loss (head fused) "
          f"{single_fused['times']['fspeed'] * ms:.1f} ms, eager {single_fused['times']['eager'] * ms:.1f} ms")
    print(f"  and with biases and norms exempt from weight decay (fspeed: adamw(mask=no_decay()); eager: two param "
          f"groups): fspeed {single_groups['times']['fspeed'] * ms:.1f} ms, eager {single_groups['times']['eager'] * ms:.1f} ms")
    for phase, t in single["phases"].items():
        print(f"    fspeed {phase:<48}{t * ms:>9.1f} ms")
    print(f"    eager forward + backward alone{'':<26}{single['eager_forward_backward'] * ms:>9.1f} ms")
    print(f"\none process, kept for backward: fspeed {kept_ops[True] / 2**20:.1f} MiB, with the module's own ops "
          f"(fused_ops=False) {kept_ops[False] / 2**20:.1f} MiB")
    print("\none process, the module's own loss against fs.causal_lm_loss (head fused with the loss), alternating:")
    print(f"  {'vocabulary':>10}  {'loss':<16}{'kept for backward':>18}{'step':>10}")
    for vocab, rows in fused.items():
        for name, (kept, seconds) in rows.items():
            print(f"  {vocab:>10}  {name:<16}{kept / 2**20:>14.1f} MiB{seconds * ms:>8.0f} ms")
    print(f"\n2 gloo ranks x {args.threads} thread, engines alternating, slowest rank:")
    for name, t in ranks.items():
        print(f"  {name:<38}{t * ms:>9.1f} ms")
    print()
    print("(each ratio: the median over steps of the two engines' times in the same step; of the medians in #)")
    for name, (a, b) in zip(("hf_zero3_step_time_vs_fsdp2", "hf_zero1_step_time_vs_ddp", "hf_zero0_step_time_vs_ddp"),
                            PAIRS):
        print(f"{name}={paired[f'{a} / {b}']:.3f}  # {ranks[a] / ranks[b]:.3f}")
    for name, (a, b) in zip(("hf_zero3_step_time_vs_fsdp2_same_ops", "hf_zero1_step_time_vs_ddp_same_ops"), PAIRS[4:]):
        print(f"{name}={paired[f'{a} / {b}']:.3f}  # {ranks[a] / ranks[b]:.3f}; fspeed with fused_ops=False")
    if "DeepSpeed ZeRO-3" in ranks:
        print(f"hf_step_time_vs_deepspeed={paired['fspeed ZeRO-3 / DeepSpeed ZeRO-3']:.3f}  "
              f"# {ranks['fspeed ZeRO-3'] / ranks['DeepSpeed ZeRO-3']:.3f}")
    else:
        print("hf_step_time_vs_deepspeed=nan  (DeepSpeed not installed: pip install -e '.[bench]')")
    print(f"hf_step_time_vs_eager={single['paired']:.3f}  # {single['times']['fspeed'] / single['times']['eager']:.3f}")
    print(f"hf_step_time_vs_eager_same_ops={single_same['paired']:.3f}  "
          f"# {single_same['times']['fspeed'] / single_same['times']['eager']:.3f}; fspeed with fused_ops=False")
    print(f"hf_step_time_vs_eager_with_causal_lm_loss={single_fused['paired']:.3f}  "
          f"# {single_fused['times']['fspeed'] / single_fused['times']['eager']:.3f}; the head fused, eager's not")
    print(f"hf_step_time_vs_eager_with_no_decay_groups={single_groups['paired']:.3f}  "
          f"# {single_groups['times']['fspeed'] / single_groups['times']['eager']:.3f}")
    print(f"hf_dispatch_bound_step_time_vs_eager={dispatch['fspeed'] / dispatch['eager']:.3f}")
    print(f"hf_dispatch_bound_step_time_vs_eager_same_ops={dispatch_same['fspeed'] / dispatch_same['eager']:.3f}")
    print(f"hf_fused_ops_kept_bytes_over_module_ops={kept_ops[True] / kept_ops[False]:.3f}")
    for vocab, rows in fused.items():
        (own_kept, own_t), (fused_kept, fused_t) = rows["own loss"], rows["causal_lm_loss"]
        print(f"hf_fused_head_kept_bytes_over_own_loss_vocab{vocab}={fused_kept / own_kept:.3f}")
        print(f"hf_fused_head_step_time_over_own_loss_vocab{vocab}={fused_t / own_t:.3f}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's default malloc thresholds (fspeed-train raises them: fspeed/host_memory.py)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/your_model.json

        with recorded("your_model"):
            main(arguments)
