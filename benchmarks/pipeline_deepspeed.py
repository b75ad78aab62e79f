"""DeepSpeed's PipelineEngine on this CPU: 2 stages on 2 gloo ranks, one thread each, fspeed's GPT math.

Measures the training step time of DeepSpeed 0.19.8's pipeline (``deepspeed.pipe.PipelineModule``,
``deepspeed.initialize``, ``engine.train_batch``) on the reference GPT of ``fspeed.models.gpt``, for
side-by-side comparison with fspeed's pipeline. Each of fspeed's pipeline layers (``embed``,
``blocks.0`` .. ``blocks.{n-1}``, ``head``) is wrapped as an ``nn.Module`` holding the parameters the
layer uses and calling the layer's own function, so both engines run the same math from the same
initial weights (``gpt(cfg).init(Generator().manual_seed(0))``) on the same fixed random tokens
(``Generator().manual_seed(1)``: ``micro_batches * micro_rows`` rows of ``seq_len + 1`` tokens,
inputs and targets shifted by one, cut into micro-batches in order; the same batch every step, as
``benchmarks/pipeline.py``). The stages split the layers as fspeed's uniform partition does
(``partition_method="uniform"``, checked against ``PipelineModule.parts``). fp32, AdamW
(torch_adam) lr 1e-4 weight decay 0.01, ZeRO stage 0, one pipeline, no data parallelism.

A step is one ``train_batch`` (``micro_batches`` micro-batches of ``micro_rows`` rows), timed on
rank 0 after a barrier; ``warmup`` untimed steps come first.

    python benchmarks/pipeline_deepspeed.py          # defaults: L=8 D=256 H=8 S=64 V=256, 4 x 4 rows
    FSPEED_DEEPSPEED_PYTHON=/path/to/python ...      # the interpreter with deepspeed (and torch)

DeepSpeed may live in another venv than fspeed; the worker imports fspeed from this repository
through PYTHONPATH, so that venv needs fspeed's dependencies (torch, einops, optree, ...) too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from fspeed.parallel.pipeline_transform import _params_used
from fspeed.pytree import tree_flatten_with_paths, tree_unflatten
from fspeed.testing import free_port

REPO = Path(__file__).resolve().parent.parent
WORLD = 2


class LayersModule(nn.Module):
    """Layers `layer_range` of an fspeed `LayerSequence` as one nn.Module for another engine (DeepSpeed's
    PipelineModule, torch's pipelining): the parameters those layers use, cloned from `params`, and the
    layers' own functions on the tree rebuilt from them, so every engine runs the same math."""

    def __init__(self, seq: Any, params: Any, layer_range: range):
        super().__init__()
        self.seq, self.layer_range = seq, layer_range
        paths, leaves, self.treedef = tree_flatten_with_paths(params)
        used = {p for i in layer_range for p in _params_used(seq.layers[i], paths)}
        self.keep = [p in used for p in paths]
        self.weights = nn.ParameterList([nn.Parameter(leaf.clone()) for leaf, k in zip(leaves, self.keep) if k])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = iter(self.weights)
        tree = tree_unflatten(self.treedef, [next(held) if k else None for k in self.keep])
        for i in self.layer_range:
            x = self.seq.layers[i].fn(tree, x)
        return x


class DeepSpeedUnavailable(RuntimeError):
    """DeepSpeed's pipeline cannot be run here; the message says why in one line."""


@functools.lru_cache(maxsize=None)
def _has_deepspeed(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return probe.returncode == 0


def _default_python() -> str:
    if os.environ.get("FSPEED_DEEPSPEED_PYTHON"):
        return os.environ["FSPEED_DEEPSPEED_PYTHON"]
    if _has_deepspeed(sys.executable):
        return sys.executable
    raise DeepSpeedUnavailable(f"deepspeed is not importable in {sys.executable}: pip install -e '.[bench]', or set "
                               "FSPEED_DEEPSPEED_PYTHON to an interpreter that has it")


def _first_error(output: str) -> str:
    """The first exception line of the workers' output; a peer's lost connection or torchrun's summary only
    when nothing else failed."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in output.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    root = [line for line in errors if "Connection closed" not in line and "ChildFailedError" not in line]
    picked = root or errors
    return (picked[0] if picked else lines[-1] if lines else "no output")[:300]


def measure_deepspeed_pipeline(*, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab: int,
                               micro_rows: int, micro_batches: int, steps: int, warmup: int,
                               python: Optional[str] = None) -> dict:
    """Launch this file's worker on 2 gloo ranks; returns {"step_s": [...], "first_loss": float, "threads": 1}."""
    python = python or _default_python()
    if not _has_deepspeed(python):
        raise DeepSpeedUnavailable(f"deepspeed is not importable in {python}")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pipeline_deepspeed_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
               f"--master_port={port}", __file__, "--worker", "--result", str(result)]
        sizes = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab=vocab,
                     micro_rows=micro_rows, micro_batches=micro_batches, steps=steps, warmup=warmup)
        cmd += [arg for key, value in sizes.items() for arg in (f"--{key}", str(value))]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "PYTHONWARNINGS": "ignore::FutureWarning"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            raise DeepSpeedUnavailable(f"the 2-rank DeepSpeed pipeline launch failed (exit {proc.returncode}): "
                                       f"{_first_error(proc.stdout + proc.stderr)}")
        return json.loads(result.read_text())


# ------------------------------------------------------------------------------------- worker


def _worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.pipe import PipelineModule

    from fspeed.models.gpt import GPTConfig, gpt, gpt_layers
    from fspeed.parallel.pipeline_transform import uniform_bounds

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                    d_model=args.d_model, tie_embeddings=False, dropout=0.0)
    params = gpt(cfg).init(torch.Generator().manual_seed(0))
    seq = gpt_layers(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    layers = [LayersModule(seq, params, range(i, i + 1)) for i in range(len(seq.layers))]
    module = PipelineModule(layers=layers, num_stages=WORLD, loss_fn=loss_fn, partition_method="uniform")
    expected = uniform_bounds(len(layers), WORLD)
    if module.parts != expected:
        raise RuntimeError(f"DeepSpeed's partition {module.parts} differs from fspeed's {expected}")
    config = {
        "train_micro_batch_size_per_gpu": args.micro_rows,
        "gradient_accumulation_steps": args.micro_batches,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    rows = args.micro_rows
    tokens = torch.randint(0, args.vocab, (args.micro_batches * rows, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:  # every step: the same micro-batches, in order
            for m in range(args.micro_batches):
                micro = tokens[m * rows:(m + 1) * rows]
                yield micro[:, :-1].contiguous(), micro[:, 1:].contiguous()  # (first stage's, last's)

    data_iter = batches()
    step_s, losses = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=data_iter)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if torch.get_num_threads() != 1:
            raise RuntimeError(f"torch threads changed to {torch.get_num_threads()} during the run")
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"step_s": step_s, "first_loss": losses[0], "threads": 1,
                                                 "parts": module.parts, "losses": losses}))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--result", default="")
    for key, default in dict(n_layer=8, d_model=256, n_head=8, seq_len=64, vocab=256, micro_rows=4,
                             micro_batches=4, steps=5, warmup=2).items():
        parser.add_argument(f"--{key}", type=int, default=default)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    sizes = {k: v for k, v in vars(args).items() if k not in ("worker", "result")}
    result = measure_deepspeed_pipeline(**sizes)
    step_s = sorted(result["step_s"])
    print(json.dumps(result))
    print(f"DeepSpeed pipeline, 2 stages x 1 thread, {sizes}: median step {step_s[len(step_s) // 2]:.4f} s, "
          f"first loss {result['first_loss']:.6f}")


if __name__ == "__main__":
    main()
