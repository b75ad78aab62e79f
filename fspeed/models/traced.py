"""A module's forward, traced and cut into pipeline layers: any `nn.Module` pipelines without a hand-written
layer list (DeepSpeed's `PipelineModule` needs one; torch's `pipelining` traces, as here).

    model = fs.models.traced_layers(hf_model, example_micro_batch)     # cut before each repeated block
    plan = fs.zero(1) | fs.pipeline(micro_batches=8, schedule="1f1b")

`torch.export` captures the forward on an example micro-batch and `torch.distributed.pipelining`'s
splitter cuts its graph before each submodule named by `split_before` (fnmatch patterns over
submodule paths; "auto": every repeated block, `transformer.h.*` / `model.layers.*`). Layer 0 is what
runs before the first cut (embeddings), layer i the graph from cut i to cut i + 1; the last one holds
the rest (final norm, head, and the module's own loss when the batch carries labels).

With `loss_fn=fs.causal_lm_loss` the graph is also cut before the output head, traced without the
labels, and the last layer (the head, which must be a plain linear whose logits are the output) runs
with the loss as `ops.head_loss`: the logits are never materialized whole (`fspeed.models.causal_lm`).

What crosses a cut is every value a later layer or the output still needs: hidden states, and also
a mask computed in layer 0 or the labels the last layer's loss reads, as a tuple (integer parts
carry no gradient). Parameters keep the module's names; a tied one used before and after a cut
(GPT-2's embedding and head) is one path that the pipeline keeps equal on its stages.

Graphs are traced for training and for evaluation (dropout differs: a layer given a generator runs
the training graph, one given none the evaluation graph), and for each parameter dtype a run uses
(an exported graph asserts the dtypes it was traced with), each when first needed.

Limits, each a clear error: the batch dimension is dynamic but the other dimensions and the
constants are the example's (every micro-batch has its sequence length), and so is the device (a
graph makes its own position and mask tensors there: trace where it trains); the module must export as
one graph (no data-dependent control flow), hold no state buffers (BatchNorm statistics) and not
have Hugging Face's gradient checkpointing on (the pipeline's `activation_checkpoint_interval`
recomputes layers instead).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from ..pytree import PyTree, subtree
from ..rng import layer_generators
from .fused_ops import fused_forwards
from .layers import Layer, LayerSequence
from .module_calls import computing, seed_of, seeded
from .model import Model
from .causal_lm import fused_tail, output_head
from .module import _match, nested, output_loss, repeated_blocks
from .ops import DENSE


def traced_layers(module: nn.Module, example: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *,
                  split_before: Union[str, Sequence[str]] = "auto", call_kwargs: Optional[dict] = None,
                  name: Optional[str] = None, fused_ops: bool = True) -> Model:
    """A `Model` with a layer sequence from `module`'s traced forward (module docstring).

    `example`: one micro-batch as training feeds it (a dict is passed as keyword arguments minus
    its "targets" key; otherwise `example[0]` positionally, as `functionalize` does). `loss_fn(outputs,
    batch)`: default the module's own loss (`outputs.loss`). `call_kwargs`: constants added to every
    call (default for Hugging Face models: `use_cache=False`, whose cache export cannot return).
    `fused_ops`: Hugging Face's Python tanh-GELUs are traced as torch's fused kernel
    (`fspeed.models.fused_ops`), as `functionalize` computes them."""
    name = name or type(module).__name__
    persistent = [n for n in module.state_dict() if n not in dict(module.named_parameters(remove_duplicate=False))]
    if persistent:
        raise ValueError(f"traced_layers: {name} has persistent buffers (module state such as BatchNorm statistics: "
                         f"{persistent[:3]}), which a traced graph's layers do not carry; list its layers with "
                         "fs.models.sequential([...], loss_fn=...), whose layers carry their statistics, or use "
                         "fs.functionalize without a pipeline")
    if any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules()):  # HF's per-layer flag
        raise ValueError(f"traced_layers: {name} has Hugging Face's gradient checkpointing on, which a traced graph "
                         "does not keep; call module.gradient_checkpointing_disable() and recompute pipeline layers "
                         "with fs.pipeline(..., activation_checkpoint_interval=1) "
                         "(pipeline.activation_checkpoint_interval=1)")
    points = _split_points(module, split_before, name)
    fused = getattr(loss_fn, "fuses_head", False)  # causal_lm_loss: the last layer is the head, run as head_loss
    if fused:
        head = output_head(module, name)
        head_path = next(p for p, m in module.named_modules() if m is head)
        if any(head_path.startswith(p + ".") for p in points):
            raise ValueError(f"traced_layers: {name}'s output head {head_path!r} lies inside a split point")
        points = [*points, head_path]
    constants = dict(call_kwargs if call_kwargs is not None else _default_call_kwargs(module))
    kwargs = _call_kwargs(module, example, constants)
    if fused:
        kwargs.pop("labels", None)  # the fused loss reads them from the micro-batch; the graph ends at the logits
    device = next(module.parameters()).device
    seen: set[int] = set()
    for key, value in kwargs.items():  # on the module's device; one tensor given twice (labels = input_ids)
        if isinstance(value, torch.Tensor):  # is traced as two inputs
            kwargs[key] = value.to(device, copy=id(value) in seen)
            seen.add(id(value))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        _, out_spec = torch_pytree.tree_flatten(module(**kwargs))
    tracer = _Tracer(module, kwargs, points, name, out_spec.num_leaves, fused_forwards(module) if fused_ops else {})
    base = next(module.parameters()).dtype
    reference = tracer.graph(True, base)  # evaluation's graph and other dtypes' are traced when first run
    names = ["input", *points]
    kinds = ["input", *(type(module.get_submodule(p)).__name__ for p in points)]
    layers = [Layer(names[i], _stage_fn(tracer, i), tuple(dict.fromkeys(tracer.names(reference, i).values())),
                    kinds[i]) for i in range(len(points) + 1)]
    loss_fn = loss_fn or output_loss
    tail = _fused_head_tail(tracer, reference, layers[-1], name) if fused else None

    def inputs(micro_batch: Any) -> tuple:
        return reference.flow.first_inputs(_call_kwargs(module, micro_batch, constants), name)

    def loss(y: Any, micro_batch: Any, *, ops: Any = DENSE) -> torch.Tensor:
        return loss_fn(torch_pytree.tree_unflatten(list(y), out_spec), micro_batch)

    seq = LayerSequence(tuple(layers), inputs, loss, tail)

    def init(generator: Optional[torch.Generator] = None) -> dict:
        return nested({n: p.detach().clone() for n, p in module.named_parameters()})

    def model_loss(params: PyTree, batch: Any, *, rng: Optional[torch.Generator] = None) -> torch.Tensor:
        return seq.run(params, batch, rng=rng)

    def apply(params: PyTree, micro_batch: Any, *, rng: Optional[torch.Generator] = None) -> Any:
        x = inputs(micro_batch)
        for layer, rng_i in zip(layers, layer_generators(rng, len(layers))):
            x = layer.fn(params, x, rng=rng_i)
        return torch_pytree.tree_unflatten(list(x), out_spec)

    units: dict[str, str] = {}
    for layer in layers:
        for path in layer.uses:
            units.setdefault(path, layer.name)
    return Model(init, apply, model_loss, {}, name=f"{name} (traced, {len(layers)} layers)", units=units, layers=seq)


class _Graph(NamedTuple):
    stages: list  # the stage GraphModules, in order
    flow: "_Flow"


class _Tracer:
    """The module's graphs by (training, parameter dtype), each traced when first asked for: dropout
    differs between training and evaluation, and an exported graph asserts the dtypes it was traced
    with (a bf16 run needs a bf16 graph)."""

    def __init__(self, module: nn.Module, kwargs: dict, points: list[str], name: str, outputs: int, fused: dict):
        self.module, self.kwargs, self.points, self.name, self.outputs = module, kwargs, points, name, outputs
        self.fused = fused  # submodules traced as their fused forwards (`fused_ops`)
        self.canonical = _canonical_names(module)
        self.device = next(module.parameters()).device  # a graph makes its own tensors (positions, masks) here
        self.graphs: dict[tuple[bool, torch.dtype], _Graph] = {}
        self.inputs: Optional[list[str]] = None
        self._names: dict[tuple[int, int], dict[str, str]] = {}

    def graph(self, train: bool, dtype: torch.dtype) -> _Graph:
        key = (train, dtype)
        if key not in self.graphs:
            with computing((), self.fused, DENSE):
                graph = _trace(self.module, self.kwargs, self.points, train, self.name, dtype)
            if dtype != next(self.module.parameters()).dtype:  # which crossing values are sizes: as traced first
                reference = next(iter(self.graphs.values())).flow
                for ours, theirs in zip(graph.flow.carried, reference.carried):
                    if len(ours) != len(theirs):
                        raise ValueError(f"traced_layers: {self.name}'s {dtype} graph passes other values across its "
                                         "cuts than its first one")
                    graph.flow.ints.update(v for v, w in zip(ours, theirs) if w in reference.ints)
            if len(graph.flow.outputs) != self.outputs:
                raise ValueError(f"traced_layers: {self.name}'s traced graph returns {len(graph.flow.outputs)} values, "
                                 f"its forward {self.outputs}")
            inputs = [v.name for v in graph.flow.carried[0]]
            if self.inputs is not None and inputs != self.inputs:
                raise ValueError(f"traced_layers: {self.name} reads {inputs} in one mode and {self.inputs} in another")
            self.inputs = inputs
            self.graphs[key] = graph
        return self.graphs[key]

    def names(self, graph: _Graph, i: int) -> dict[str, str]:
        """Stage i's parameter names in `graph` -> the module's names for them (looked up once)."""
        key = (id(graph.stages[i]), i)
        if key not in self._names:
            self._names[key] = {n: self.canonical[n] for n, _ in graph.stages[i].named_parameters(remove_duplicate=False)}
        return self._names[key]


def _trace(module: nn.Module, kwargs: dict, points: list[str], train: bool, name: str, dtype: torch.dtype) -> _Graph:
    """The module's forward in train or eval mode with `dtype` parameters, exported with a dynamic
    batch dimension and cut before each split point (torch.distributed.pipelining's splitter; its
    tracing entry point has no dynamic shapes, so this calls the export and the split it wraps)."""
    from torch.distributed.pipelining._IR import (  # noqa: PLC0415 (pulls in torch.distributed)
        MultiUseParameterConfig, Pipe, SplitPoint, annotate_split_points)

    was = module.training
    module.train(train)
    annotate_split_points(module, {p: SplitPoint.BEGINNING for p in points})
    swapped = [(p, p.data, p.grad) for p in module.parameters() if p.is_floating_point() and p.dtype != dtype]
    for p, data, _ in swapped:  # placeholders of the run's dtype (export reads only their metadata)
        p.grad = None
        p.data = torch.empty_like(data, dtype=dtype)
    kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    dynamic = _dynamic_batch(module, kwargs)
    try:
        program = torch.export.export(module, (), kwargs, dynamic_shapes=dynamic)
        pipe = Pipe._from_traced(module, program, MultiUseParameterConfig.REPLICATE)
    except Exception as err:
        raise ValueError(f"traced_layers: {name}'s forward does not export as one graph ({type(err).__name__}: "
                         f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); write its layer list with "
                         "fs.models.sequential instead") from err
    finally:
        for p, data, grad in swapped:
            p.data, p.grad = data, grad
        _unannotate(module, points)
        module.train(was)
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    if len(stages) != len(points) + 1:
        raise ValueError(f"traced_layers: {name} was cut into {len(stages)} pieces, not {len(points) + 1}: a split "
                         f"point ({points[:3]}...) is not called exactly once per forward")
    flow = _Flow(pipe.split_gm.graph, len(stages), _static_dims(program, kwargs))
    if not swapped:  # the example's pass needs the module's own parameters (the run's dtype: the tracer maps)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            flow.learn_types(stages, kwargs, name)
    return _Graph(stages, flow)


def _dynamic_batch(module: nn.Module, kwargs: dict) -> dict:
    """`torch.export`'s dynamic_shapes for a keyword call: dimension 0 of every tensor may vary, keyed
    as the forward's signature names them (arguments it takes through **kwargs under that name)."""
    params = inspect.signature(module.forward).parameters
    spec = {k: ({0: torch.export.Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim() else None)
            for k, v in kwargs.items()}
    named = {k: v for k, v in spec.items() if k in params and params[k].kind != inspect.Parameter.VAR_KEYWORD}
    rest = {k: v for k, v in spec.items() if k not in named}
    var_keyword = next((p.name for p in params.values() if p.kind == inspect.Parameter.VAR_KEYWORD), None)
    if rest and var_keyword is not None:
        named[var_keyword] = rest
    return named


def _static_dims(program: Any, kwargs: dict) -> dict[str, tuple]:
    """Each traced tensor input's shape, None where the graph takes any size (a dynamic dimension)."""
    out = {}
    for node in program.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if node.name in kwargs and isinstance(val, torch.Tensor):
            out[node.name] = tuple(d if isinstance(d, int) else None for d in val.shape)
    return out


def _split_points(module: nn.Module, split_before: Union[str, Sequence[str]], name: str) -> list[str]:
    paths = [p for p, _ in module.named_modules() if p]
    if split_before == "auto":
        points = repeated_blocks(module)
        if not points:
            raise ValueError(f"traced_layers: {name} has no repeated blocks to cut before; pass split_before= "
                             "(submodule path patterns, e.g. 'encoder.layer.*')")
        return points
    points, unmatched = _match(paths, [split_before] if isinstance(split_before, str) else list(split_before))
    if unmatched:
        raise ValueError(f"traced_layers: split_before {unmatched} matches no submodule of {name}; its submodules "
                         f"include {paths[:8]}")
    nested_points = [p for p in points if any(p.startswith(q + ".") for q in points)]
    if nested_points:
        raise ValueError(f"traced_layers: split_before matches {nested_points[:3]} inside other matches; cut "
                         "before blocks, not before their parts")
    return points


def _default_call_kwargs(module: nn.Module) -> dict:
    config = getattr(module, "config", None)
    takes = "use_cache" in inspect.signature(module.forward).parameters
    return {"use_cache": False} if takes and getattr(config, "use_cache", None) is not None else {}


def _call_kwargs(module: nn.Module, batch: Any, constants: dict) -> dict:
    """The module's call on `batch` as keyword arguments (functionalize's convention)."""
    if isinstance(batch, dict):
        return {**{k: v for k, v in batch.items() if k != "targets"}, **constants}
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params:
        raise ValueError(f"traced_layers: {type(module).__name__}.forward takes no positional input for the batch")
    return {params[0].name: first, **constants}


def _unannotate(module: nn.Module, points: Sequence[str]) -> None:
    """Undo the splitter's in-place wrapping of each split point's forward."""
    for p in points:
        sub = module.get_submodule(p)
        sub.__dict__.pop("forward", None)
        sub.__dict__.pop("_orig_forward", None)


def _canonical_names(module: nn.Module) -> dict[str, str]:
    """Every name of every parameter (tied aliases too) -> the name `named_parameters()` gives it."""
    first = {id(p): n for n, p in module.named_parameters()}
    return {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}


class _Flow:
    """Which values cross each cut, from the split graph: placeholders (the call's keyword arguments)
    and stage outputs, each kept while a later stage or the graph's output reads it. A Python int
    (a dynamic size one stage computes and a later one reads) crosses as a 0-d tensor."""

    def __init__(self, graph: torch.fx.Graph, n_stages: int, shapes: dict[str, tuple]):
        self.shapes = shapes
        self.stage_nodes: list[torch.fx.Node] = [n for n in graph.nodes if n.op == "call_module"]
        if len(self.stage_nodes) != n_stages:
            raise ValueError(f"traced_layers: the split graph calls {len(self.stage_nodes)} stages, "
                             f"expected {n_stages}")
        index = {n: i for i, n in enumerate(self.stage_nodes)}
        self.stage_args = [[_node(a) for a in n.args] for n in self.stage_nodes]
        if any(n.kwargs for n in self.stage_nodes):
            raise ValueError("traced_layers: a traced stage takes keyword arguments, which the cuts cannot carry")
        output = next(n for n in graph.nodes if n.op == "output")
        flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        self.outputs = [_node(a) for a in flat]
        producer: dict[torch.fx.Node, int] = {}
        for n in graph.nodes:
            if n.op == "placeholder":
                producer[n] = -1
            elif n.op == "call_module":
                producer[n] = index[n]
            elif n.op == "call_function" and n.target is operator.getitem:
                producer[n] = index[n.args[0]]
        last_use: dict[torch.fx.Node, int] = {}
        for i, args in enumerate(self.stage_args):
            for a in args:
                last_use[a] = i
        for a in self.outputs:
            last_use[a] = n_stages
        order = list(dict.fromkeys([a for args in self.stage_args for a in args] + self.outputs))
        # carried[i]: what enters stage i (made before it, read by it or later); carried[n]: the outputs
        self.carried = [[v for v in order if producer[v] < i <= last_use[v]] for i in range(n_stages)]
        self.carried[0].sort(key=lambda v: v.name)  # the call's arguments by name: the same in either mode's graph
        self.carried.append(self.outputs)
        self.results = [{u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}
                        for node in self.stage_nodes]
        self.ints: set[torch.fx.Node] = set()

    def first_inputs(self, given: dict, name: str) -> tuple:
        out = []
        for node in self.carried[0]:
            if node.name not in given:
                raise ValueError(f"traced_layers: the micro-batch lacks {node.name!r}, which {name} was traced with")
            value = given[node.name]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"traced_layers: {node.name!r} is {type(value).__name__}; only tensors cross stages")
            want = self.shapes.get(node.name)
            if want is not None and (len(want) != value.dim() or
                                     any(w is not None and w != d for w, d in zip(want, value.shape))):
                shown = ["any" if w is None else w for w in want]
                raise ValueError(f"traced_layers: {node.name!r} has shape {list(value.shape)}, but {name}'s graph "
                                 f"takes {shown} (specialised to the traced example; trace with a micro-batch of the "
                                 "training shape)")
            out.append(value)
        return tuple(out)

    def run_stage(self, i: int, stage: nn.Module, x: Any, call: Callable, name: str = "") -> tuple:
        """Stage i on what enters it (`x`, as the previous stage left it): what leaves it. With
        `name` (the first pass, over the example), learn which crossing values are ints."""
        parts = x if isinstance(x, tuple) else (x,)
        env = {v: (int(p) if v in self.ints else p) for v, p in zip(self.carried[i], parts)}
        out = call(stage, [env[a] for a in self.stage_args[i]])
        if self.results[i]:
            for k, node in self.results[i].items():
                env[node] = out[k]
        else:
            env[self.stage_nodes[i]] = out
        device = next(p.device for p in parts if isinstance(p, torch.Tensor))  # where a size crosses with the rest
        if name:
            for v in self.carried[i + 1]:
                if isinstance(env[v], int) and not isinstance(env[v], bool):
                    self.ints.add(v)
                elif not isinstance(env[v], torch.Tensor):
                    raise ValueError(f"traced_layers: {name} passes {type(env[v]).__name__} {v.name!r} across a cut; "
                                     "only tensors and sizes can cross stages")
        return tuple(torch.tensor(env[v], device=device) if v in self.ints else env[v] for v in self.carried[i + 1])

    def learn_types(self, stages: list, kwargs: dict, name: str) -> None:
        x = tuple(kwargs[n.name] for n in self.carried[0])
        for i, stage in enumerate(stages):
            x = self.run_stage(i, stage, x, lambda module, args: module(*args), name)


def _fused_head_tail(tracer: _Tracer, reference: _Graph, head: Layer, name: str) -> Callable:
    """The last layer (the output head, a plain `linear` of the hidden state) and causal_lm_loss as one
    `ops.head_loss` call (`fspeed.models.causal_lm`): the logits are never materialized whole."""
    last = len(reference.stages) - 1
    found = _plain_linear(reference.stages[last])
    if found is not True:
        raise ValueError(f"causal_lm_loss: {name} changes its logits after the output head (a scale, soft-capping) or "
                         f"returns more than them ({found}), so the head cannot be fused with the loss; pass "
                         "lambda outputs, batch: fs.causal_lm_loss(outputs, batch) (unfused)")
    (weight_path,) = head.uses
    entering, hidden_node = reference.flow.carried[last], reference.flow.stage_args[last][0]
    position = entering.index(hidden_node)

    def tail(params: PyTree, x: Any, micro_batch: Any, *, ops: Any = DENSE) -> torch.Tensor:
        return fused_tail((x if isinstance(x, tuple) else (x,))[position], subtree(params, weight_path), micro_batch, ops)
    return tail


_PASS_THROUGH = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.alias.default)


def _plain_linear(module: nn.Module) -> Any:
    """True when `module`'s graph computes one `linear` (through nested submodule calls) and returns only
    its result; else what it computes instead (for the error)."""
    graph = module.graph
    computed = [n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")
                and n.target not in _PASS_THROUGH]
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    results = [r.args[0] if isinstance(r, torch.fx.Node) and r.target in _PASS_THROUGH else r for r in results]
    if len(computed) != 1 or results != computed:
        return [str(n.target) for n in computed][:4]
    (node,) = computed
    if node.op == "call_module":
        return _plain_linear(module.get_submodule(node.target))
    return True if node.target is torch.ops.aten.linear.default else [str(node.target)]


def _node(a: Any) -> torch.fx.Node:
    if not isinstance(a, torch.fx.Node):
        raise ValueError(f"traced_layers: a cut carries the constant {a!r}; only tensors cross stages")
    return a


def _stage_fn(tracer: _Tracer, i: int) -> Callable:
    """Stage i as a pipeline layer (the training graph when given a generator, else the evaluation
    one; of the parameters' dtype): what enters its cut in, what leaves the next cut out (the
    module's flat outputs at the end)."""
    paths = sorted(set(tracer.names(next(iter(tracer.graphs.values())), i).values()))

    def fn(params: PyTree, x: Any, *, rng: Optional[torch.Generator] = None, ops: Any = DENSE) -> Any:
        by_path = {path: subtree(params, path) for path in paths}
        some = next(iter(by_path.values()), None)
        if some is not None and some.device != tracer.device:
            raise ValueError(f"traced_layers: {tracer.name} was traced on {tracer.device} and runs on {some.device}; "
                             "its graph makes tensors on the traced device: trace the module where it trains "
                             "(module.to(device) before traced_layers)")
        dtype = next((t.dtype for t in by_path.values() if t.is_floating_point()), None)
        graph = tracer.graph(rng is not None, dtype or next(tracer.module.parameters()).dtype)
        tensors = {stage_name: by_path[path] for stage_name, path in tracer.names(graph, i).items()}

        def call(stage: nn.Module, args: list) -> Any:
            if dtype is not None:
                args = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype
                        else a for a in args]
            with seeded(seed_of(rng)):
                return torch.func.functional_call(stage, tensors, tuple(args), strict=False, tie_weights=False)
        return graph.flow.run_stage(i, graph.stages[i], x, call)
    return fn


__all__ = ["traced_layers"]
