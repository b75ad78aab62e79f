"""The autotuner's one short profiling pass: what the model allows, and what its layouts cost to run.

    job = build_job(base_run)                        # the model and data fspeed-train would build
    profile = profile_job(job, base_run, micro_batches=(1, 8), remat=(("none", 1), ("full", 1)))
    profile.activation_bytes("full", 1, micro_batch=4)   # interpolated from the two measured sizes

On one process, before any trial: each remat choice's peak bytes and seconds of a micro-batch's
forward and backward through the real train step, at two micro-batch sizes (both are linear in
the micro-batch: a fixed part, the dispatch and the loss, and a per-sample part); each layer's
forward and backward seconds, bytes kept and output bytes (what a pipeline stage holds per
micro-batch in flight and sends to the next); the
optimizer's update seconds per element; and `ModelFacts` (can a pipeline cut it, has tensor
slicing rules for it, how many heads). Times are the fastest of a few runs after a warm-up: on a
machine shared with other work the fastest run is the one least disturbed by it.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..config.errors import ConfigError
from ..config.schema import RunConfig
from ..config.targets import TargetConfig
from ..host_memory import live_host_bytes
from ..models.layers import with_state
from ..models.model import Model
from ..pytree import PyTree, tree_leaves, tree_map
from ..rematerialization import remat as with_remat
from ..remat_budget import bytes_kept_for_backward, warmed_up_step
from ..parallel.memory import state_bytes_per_parameter
from .space import ModelFacts

RematKey = tuple[str, int]  # (policy, every)
CPU = torch.device("cpu")


@dataclass
class Job:
    """What a run trains, built as fspeed-train builds it: the model (None-remat), training rows, the
    tensor-slicing rules, tokens per sample (None for a user's data), and what the model allows."""

    model: Model
    train_rows: Any
    rules: Any
    tokens_per_sample: Optional[int]
    facts: ModelFacts
    pipeline_model: Optional[Model] = None  # the model as a pipeline runs it (a user module: traced layers)

    def data_bytes(self) -> int:
        """Bytes of the training rows every rank holds (the corpus' tokens; 0 when unknown)."""
        tokens = getattr(self.train_rows, "tokens", None)
        return tokens.numel() * tokens.element_size() if isinstance(tokens, torch.Tensor) else 0

    def micro_batch(self, size: int, device: Optional[torch.device] = None) -> Any:
        """The first `size` training rows as one micro-batch (on `device`, where given)."""
        rows = self.train_rows.get(torch.arange(min(size, len(self.train_rows))))
        return rows if device is None else tree_map(lambda t: t.to(device), rows)


def build_job(run: RunConfig, device: Optional[torch.device] = None) -> Job:
    """The model and data of `run` (fspeed-train's corpus GPT or a user's `model._target_` and
    `data._target_`), with the facts a search needs (`ModelFacts`); a user's module on `device`."""
    from ..cli.run_data import prepare_data  # noqa: PLC0415 (the entry point's own data preparation)
    from ..config.build import build_model_config  # noqa: PLC0415
    from ..models import GPT_RULES, gpt  # noqa: PLC0415

    if not isinstance(run.model, TargetConfig):
        data = prepare_data(run)
        model = gpt(build_model_config(run, data.tokenizer.vocab_size))
        facts = ModelFacts(layers=len(model.layers), tensor_rules=True, heads=run.model.n_head)
        return Job(model, data.train, GPT_RULES, run.model.seq_len, facts, model)
    return _user_job(run, device)


def _user_job(run: RunConfig, device: Optional[torch.device]) -> Job:
    from ..cli.user_job import build_user_data, build_user_model  # noqa: PLC0415
    from ..engine import fs_rules  # noqa: PLC0415

    train_rows, _ = build_user_data(run)
    example = train_rows.get(torch.arange(min(run.batch.micro_batch_size, len(train_rows))))
    model = build_user_model(dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, tensor=1, pipe=1)),
                             device)
    pipeline_model, layers, cut_reason = None, None, ""
    try:
        piped = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, tensor=1, pipe=2))
        pipeline_model = build_user_model(piped, device, example=example)
        layers = len(pipeline_model.layers)
    except (ConfigError, ValueError) as err:
        cut_reason = _one_line(err)
    rules, tensor_reason = None, ""
    try:
        sliced = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, tensor=2, pipe=1))
        rules = fs_rules(build_user_model(sliced))
    except (ConfigError, ValueError) as err:
        tensor_reason = _one_line(err)
    heads = _attention_heads(model)
    facts = ModelFacts(layers=layers, cut_reason=cut_reason or ModelFacts.cut_reason, tensor_rules=rules is not None,
                       tensor_reason=tensor_reason or ModelFacts.tensor_reason, heads=heads)
    return Job(model, train_rows, rules, None, facts, pipeline_model)


def _attention_heads(model: Model) -> Optional[int]:
    """A Hugging Face module's `config.num_attention_heads` (what tensor slicing splits), else None."""
    module = getattr(model.loss, "module", None)
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def _one_line(err: Exception) -> str:
    if isinstance(err, ConfigError):
        return "; ".join(p.reason for p in err.problems)
    return str(err).splitlines()[0]


@dataclass(frozen=True)
class LayerCost:
    """One layer on one micro-batch of `Profile.layer_micro_batch` rows: seconds of its forward and of
    its backward, bytes it keeps for backward, bytes of its output, its parameter count."""

    name: str
    forward_s: float
    backward_s: float
    kept_bytes: int
    output_bytes: int
    params: int


@dataclass
class Profile:
    """What the profiling pass measured (module docstring). `remat[(policy, every)]` holds
    (micro-batch, kept bytes, seconds) rows, one per measured size."""

    facts: ModelFacts
    params: PyTree
    logical_axes: Any
    rules: Any
    precision: Any
    optimizer_state_bytes: int
    optimizer_s_per_element: float
    host_copy_s_per_byte: float = 0.0  # copying host memory (ZeRO-Offload's downloads and uploads)
    remat: dict[RematKey, list[tuple[int, int, float]]] = field(default_factory=dict)
    layer_costs: tuple[LayerCost, ...] = ()
    layer_micro_batch: int = 1
    layers: Any = None  # the LayerSequence a pipeline cuts
    pipeline_params: Optional[PyTree] = None  # the pipeline model's parameters (None: no layers measured)
    pipeline_axes: Any = None  # and their logical axes
    tokens_per_sample: Optional[int] = None
    data_bytes: int = 0  # the training rows every rank holds

    @property
    def parameters(self) -> int:
        return sum(t.numel() for t in tree_leaves(self.params))

    def _fit(self, key: RematKey, column: int, micro_batch: int) -> float:
        rows = self.remat.get(key)
        if not rows:
            raise KeyError(f"remat {key[0]}:{key[1]} was not profiled; profiled: {sorted(self.remat)}")
        return linear_fit([(row[0], row[column]) for row in rows], micro_batch)

    def activation_bytes(self, policy: str, every: int, micro_batch: int) -> float:
        """Bytes one micro-batch of `micro_batch` rows keeps for backward under this remat."""
        return max(self._fit((policy, every), 1, micro_batch), 0.0)

    def micro_seconds(self, policy: str, every: int, micro_batch: int) -> float:
        """Seconds of one micro-batch's forward and backward on one process under this remat."""
        return max(self._fit((policy, every), 2, micro_batch), 0.0)


def linear_fit(points: Sequence[tuple[float, float]], x: float) -> float:
    """The line through the (x, y) points at `x`: least squares, kept non-decreasing and at least 0 at
    x = 0 (a cost grows with the micro-batch from a fixed part; noise must not make it shrink or go
    negative); one x measured: a line through the origin."""
    points = list(points)
    if len({p[0] for p in points}) == 1:
        x0, y0 = points[0][0], statistics.fmean(p[1] for p in points)
        return y0 * x / x0 if x0 else y0
    mx, my = statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)
    slope = sum((px - mx) * (py - my) for px, py in points) / sum((px - mx) ** 2 for px, _ in points)
    slope = max(slope, 0.0)
    intercept = my - slope * mx
    if intercept < 0:  # through the origin and the largest point instead
        top = max(points)
        slope, intercept = top[1] / top[0], 0.0
    return intercept + slope * x


def peak_live_bytes(run: Callable[[], Any], interval_s: float = 1e-4) -> tuple[int, float]:
    """(the most bytes malloc held while `run` ran over those before it, seconds `run` took): a thread
    reads glibc's live bytes every `interval_s` while autograd's threads work (a lower bound of the
    true peak, within one sampling interval's allocations). On CUDA use the allocator's peak instead."""
    gc.collect()
    before = live_host_bytes()
    if before is None:
        raise RuntimeError("measuring peak memory reads glibc's malloc counters; this C library has none")
    peak, running = [before], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], live_host_bytes())
            time.sleep(interval_s)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        run()
    finally:
        seconds = time.perf_counter() - start
        peak[0] = max(peak[0], live_host_bytes())
        running[0] = False
        watcher.join()
    return peak[0] - before, seconds


def measure_micro_batch(model: Model, params: PyTree, micro_batch: Any, repeats: int = 5,
                        device: torch.device = CPU) -> tuple[int, float]:
    """(the most bytes one micro-batch's forward and backward hold at once over those before it (what
    it keeps for backward and the gradients backward makes while it is still kept: the larger of the
    peak and the bytes held when backward starts); the fastest seconds of its forward and backward)
    through the real train step on one process, after a warm-up step. On the CPU the peak is
    sampled from malloc's counters, and the times are taken in runs of their own (reading the
    counters takes malloc's lock, which slows the run it watches); on CUDA it is the allocator's."""
    step, state = warmed_up_step(model, params, micro_batch)  # first-step allocations are not activations

    def micro() -> Callable[[], Any]:  # a micro-batch on a fresh accumulation, begun outside what is measured
        begun = step.begin(state)
        return lambda: step.micro(begun, state, micro_batch)

    sampled, _ = device_peak_bytes(micro(), device) if device.type == "cuda" else peak_live_bytes(micro())
    at_backward, _ = bytes_kept_for_backward(micro(), device)
    kept = max(sampled, at_backward)  # two lower bounds of the peak on the CPU: the sampler can miss a short one
    return kept, min(timed(micro(), device) for _ in range(repeats))


def timed(run: Callable[[], Any], device: torch.device = CPU) -> float:
    """Seconds `run` takes, its CUDA work included (synchronized before and after)."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_peak_bytes(run: Callable[[], Any], device: torch.device) -> tuple[int, float]:
    """(the CUDA allocator's peak bytes while `run` ran over those before it, seconds it took)."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(run, device)
    return torch.cuda.max_memory_allocated(device) - before, seconds


def measure_layers(model: Model, params: PyTree, micro_batch: Any, repeats: int = 5,
                   device: torch.device = CPU) -> tuple[LayerCost, ...]:
    """Each layer of `model.layers` on `micro_batch`: forward and backward seconds (the fastest after a
    warm-up), bytes kept for backward and output bytes (`LayerCost`)."""
    seq = model.layers
    leaves = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), params)
    buffers = model.init_buffers() if model.init_buffers is not None else None
    n, fused = len(seq), seq.last_with_loss is not None
    rows: list[list[tuple[float, float, int, int]]] = [[] for _ in range(n)]
    for run in range(repeats + 1):  # the first run warms up
        x = seq.inputs(micro_batch)
        for i, layer in enumerate(seq.layers):
            x = _detached(x)
            marks: dict[str, Any] = {}

            def forward_backward(i=i, layer=layer, x=x, marks=marks):
                synchronize(device)
                start = time.perf_counter()
                if fused and i == n - 1:
                    y = out = seq.last_with_loss(leaves, x, micro_batch)
                else:
                    y = layer.fn(leaves, x, rng=torch.Generator().manual_seed(i), **with_state(layer, buffers))
                    out = seq.loss(y, micro_batch) if i == n - 1 else sum(t.float().sum() for t in _floats(y))
                synchronize(device)
                marks["forward"], marks["y"] = time.perf_counter() - start, y
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.backward()
                else:  # nothing to differentiate: a layer without parameters or floating inputs
                    torch.zeros((), requires_grad=True).backward()
                synchronize(device)

            kept, seconds = bytes_kept_for_backward(forward_backward, device)
            if run:
                output = sum(t.numel() * t.element_size() for t in _floats(marks["y"]))
                rows[i].append((marks["forward"], seconds - marks["forward"], kept, output))
            x = marks["y"]
    counts = [sum(leaves_numel(leaves, path) for path in layer.uses) for layer in seq.layers]
    return tuple(LayerCost(layer.name, min(r[0] for r in row), min(r[1] for r in row),
                           int(statistics.median(r[2] for r in row)), row[0][3], count)
                 for layer, row, count in zip(seq.layers, rows, counts))


def leaves_numel(params: PyTree, path: str) -> int:
    """Elements of the parameter(s) at dotted `path` (a leaf or a subtree)."""
    node = params
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return sum(t.numel() for t in tree_leaves(node))


def optimizer_seconds_per_element(optimizer, elements: int = 1 << 20, repeats: int = 5,
                                  device: torch.device = CPU) -> float:
    """Seconds the optimizer's update takes per parameter element on `device` (the fastest of
    `repeats` after a warm-up)."""
    params = {"probe": torch.zeros(elements, device=device)}
    grads = {"probe": torch.full((elements,), 1e-3, device=device)}
    state = optimizer.init(params)
    times = []
    for run in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        _, state = optimizer.update(grads, state, params)
        synchronize(device)
        if run:
            times.append(time.perf_counter() - start)
    return min(times) / elements


def copy_seconds_per_byte(nbytes: int = 32 << 20, repeats: int = 5, device: torch.device = CPU) -> float:
    """Seconds per byte of ZeRO-Offload's copies (the fastest of `repeats` after a warm-up): from one
    host buffer into another on the CPU, from pinned host memory to the GPU and back on CUDA."""
    on_gpu = device.type == "cuda"
    source = torch.ones(nbytes // 4, pin_memory=on_gpu)
    target = torch.empty(nbytes // 4, device=device)

    def copies() -> None:
        target.copy_(source, non_blocking=on_gpu)
        if on_gpu:
            source.copy_(target, non_blocking=True)

    times = [timed(copies, device) / (2 if on_gpu else 1) for _ in range(repeats + 1)]
    return min(times[1:]) / nbytes


def profile_job(job: Job, run: RunConfig, micro_batches: Sequence[int], remat: Sequence[RematKey],
                with_layers: bool = False, repeats: int = 5, threads: Optional[int] = None) -> Profile:
    """The profiling pass over `job` (module docstring): every remat choice of `remat` at each of
    `micro_batches` (two sizes give the linear fit), and with `with_layers` each layer's costs at the
    smallest size; timed on `threads` intra-op threads (a trial's rank's: `trials.rank_threads`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _profile_job(job, run, micro_batches, remat, with_layers, repeats, run_device(run))
    finally:
        torch.set_num_threads(before)


def run_device(run: RunConfig) -> torch.device:
    """Where `run`'s ranks compute (`train.device`): this process's current GPU for cuda, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if run.train.device == "cuda" else CPU


def _profile_job(job: Job, run: RunConfig, micro_batches: Sequence[int], remat: Sequence[RematKey],
                 with_layers: bool, repeats: int, device: torch.device) -> Profile:
    from ..config.build import build_optimizer, build_precision  # noqa: PLC0415

    model = job.model
    params = model.init(torch.Generator().manual_seed(run.train.seed))
    optimizer = build_optimizer(run)
    profile = Profile(job.facts, params, model.logical_axes, job.rules, build_precision(run),
                      state_bytes_per_parameter(optimizer, next(iter(model.logical_axes), "probe")),
                      optimizer_seconds_per_element(optimizer, device=device), tokens_per_sample=job.tokens_per_sample,
                      data_bytes=job.data_bytes(), host_copy_s_per_byte=copy_seconds_per_byte(device=device))
    on_device = tree_map(lambda t: t.to(device), params)
    sizes = sorted(set(micro_batches))
    for policy, every in dict.fromkeys(remat):
        measured = model if policy == "none" else with_remat(model, policy, every)
        profile.remat[(policy, every)] = [
            (m, *measure_micro_batch(measured, on_device, job.micro_batch(m, device), repeats, device)) for m in sizes]
    piped = job.pipeline_model
    if with_layers and piped is not None and piped.layers is not None:
        piped_params = params if piped is model else piped.init(torch.Generator().manual_seed(run.train.seed))
        profile.layer_costs = measure_layers(piped, tree_map(lambda t: t.to(device), piped_params),
                                             job.micro_batch(sizes[0], device), repeats, device)
        profile.layer_micro_batch, profile.layers = sizes[0], piped.layers
        profile.pipeline_params, profile.pipeline_axes = piped_params, piped.logical_axes
    return profile


def _floats(x: Any) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _detached(x: Any) -> Any:
    def one(t: Any) -> Any:
        return t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
    return tuple(one(t) for t in x) if isinstance(x, tuple) else one(x)


__all__ = ["Job", "LayerCost", "Profile", "build_job", "copy_seconds_per_byte", "device_peak_bytes", "linear_fit",
           "measure_layers", "measure_micro_batch", "optimizer_seconds_per_element", "peak_live_bytes", "profile_job",
           "run_device", "timed"]
