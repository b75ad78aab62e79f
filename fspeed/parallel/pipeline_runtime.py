"""Running a pipeline schedule on one stage: forwards, backwards and weight passes, activations between stages.

A step on stage s executes `schedule.actions[s]` in order (`fspeed.parallel.schedules`):

    F(m, c)   the input of micro-batch m for chunk c (the batch for the first piece, else received from
              the previous piece's stage), through the chunk's layers; the output is sent on (a
              non-blocking send), or, on the last piece, the loss is taken
    B(m, c)   the gradient of the chunk's output (received from the next piece's stage, or the loss's
              own), back through the chunk: the input's gradient is sent back, the parameters'
              gradients are added into the stage's accumulator; where the schedule's B goes
              input gradient first (`schedules.early_input_grads`: the cooldown's), the
              linears' weight gradients are left to the end of the B, after the send, as W's are
    W(m, c)   zero-bubble schedules only: B left every linear layer's weight gradient for later
              (`deferred_weight_grads`: B computes the input's gradient, W the weight's, dW = dYᵀ X);
              after its first step, zero bubble re-plans where its W's go from the stages'
              measured F, B and W times (`_replan`, `schedules.zero_bubble_for_costs`)

Sends never block and receives do, so a schedule that is valid (every stage can run its list in
order) cannot deadlock. The first transfer over each edge in a step of a new batch shape carries the
activation's shape and dtype; later ones reuse it. Parameters used on several stages (a tied
embedding) get their gradients summed over those stages; then the stage's gradient goes, as one
micro-batch, through the ZeRO stage's gradient sink (reduction over `data`; with `overlap_comm`
each bucket starts as the sums in it become final, during the schedule: `step`'s `final`). Each layer draws its
dropout from its own generator, seeded by (run seed, step, micro-batch, layer) (`fspeed.rng`): the
masks do not depend on where the layer runs, and are a one-process run's.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..flat import Flat
from ..models.layers import with_state
from ..models.ops import DenseOps
from ..pytree import PyTree, subtree, tensor_leaves, tree_flatten_with_paths, tree_unflatten
from ..remat_blocks import Remat, checkpointed
from .comm import AxisComm, Pending
from .deferred_weight_grads import DeferringOps, DeferWeightGrads, add_weight_grad
from .layout import Layout
from .mesh import AXES, process_group
from .schedules import Action, Schedule, build_schedule, early_input_grads, zero_bubble_for_costs

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8)
_META = 10  # dtype, ndim, up to 8 dims
RECEIVES_AHEAD = 2  # transfers a stage keeps posted before the actions that take them (`_post_ahead`)


class PipelineExecutor:
    """One stage's part of every step of a pipeline layout (module docstring)."""

    def __init__(self, layout: Layout, mesh, layers: Any, grad_dtype: torch.dtype):
        plan = layout.pipeline
        pipe = layout.plan.find("pipeline")
        self.layout, self.plan, self.layers = layout, plan, layers
        self.comm: AxisComm = mesh.comm("pipe")
        self.stage, self.stages, self.pieces = plan.stage, plan.stages, plan.stages * plan.virtual_stages
        self.schedule: Schedule = build_schedule(pipe.schedule, plan.stages, pipe.micro_batches, plan.virtual_stages,
                                                 pipe.input_grad_first)
        self.micro_batches = pipe.micro_batches
        self.grad_dtype = grad_dtype
        self.mesh = mesh
        self.ops = self._wrapped(DenseOps())
        # per piece: whether every layer sends its linears through ops (zero bubble then defers them there)
        self.linear_via_ops = [all(layer.linear_via_ops for layer in layers.layers[plan.bounds[k]:plan.bounds[k + 1]])
                               for k in range(self.pieces)]
        self.shapes: dict = {}  # (batch signature, piece) -> (a tuple?, ((shape, dtype), ...)) of what enters it
        self.interval = pipe.activation_checkpoint_interval
        self.remat = pipe.remat if pipe.remat is not None else Remat()
        self.tie_groups: Optional[list] = None  # created by the first step (every rank), not by evaluation
        self.peak_in_flight = 0  # the most micro-batches whose forward graph this stage held at once
        self.deferred_linears = 0  # weight gradients the weight passes computed (zero bubble's W's and the
        # input-gradient-first B's), all steps
        self.posted: dict = {}  # receives posted ahead: (kind, micro, piece) -> (a tuple?, [(Pending, buffer)])
        self.timeline: Optional[list] = None  # a list: each step appends (action, start, end) of its compute,
        # receives excluded (time.perf_counter, one clock for all processes of a machine; benchmarks/pipeline.py);
        # a B that sends its input's gradient first as two: B until it is sent, then W (its weight pass)
        # zero bubble: the first step's F, B and W times re-plan where the W's go (`_replan`)
        self.replan = self.schedule.split_backward and self.stages > 1

    def _wrapped(self, ops: Any) -> Any:
        """`ops` (the dense ones) wrapped by the layout's transforms (tensor slicing)."""
        for transform in self.layout.plan.ordered():
            ops = transform.wrap_ops(ops, self.mesh, self.layout.tensor_axes)
        return ops

    # -- one step ---------------------------------------------------------------------------

    def step(self, params: Flat, micro_batches: Sequence[PyTree], multiplier: float,
             layer_rng: Callable[[int, int], Optional[torch.Generator]],
             into: Optional[torch.Tensor] = None,
             final: Optional[Callable[[Sequence[int]], None]] = None,
             buffers: Optional[PyTree] = None) -> tuple[list[torch.Tensor], Flat]:
        """Run the schedule: (the losses of the micro-batches on the last piece's stage, else empty;
        the stage's summed parameter gradients in the layout's local order, `grad_dtype`).
        `layer_rng(m, i)`: a generator of its own (or None) for layer i on micro-batch m (a
        checkpointed group keeps each layer's to replay it). `into`: the buffer to sum them in (the
        gradient sink's own, `ParallelRuntime.summed_grad_buffer`), zeroed before the first backward.
        `final(params)`: called with parameters (local indices) as their sums in `into` become final
        (`ParallelRuntime.begin_summed`: their reduction over `data` starts while the schedule goes
        on): during the first piece's last backward as autograd completes each, where backward sums
        in `into` itself (each parameter's .grad its view: the dtypes match), else after that
        backward's gradients are added; after a later piece's last backward, once the gradient the
        previous stage waits for is sent; after the last weight pass under zero bubble; never for a
        tied parameter (another stage's sum is added after the schedule). `buffers`: the model's state (every
        layer's; a stage's layers update theirs, then each stage sends them to the others,
        `_share_state`)."""
        if len(micro_batches) != self.micro_batches:
            raise ValueError(f"the pipeline runs {self.micro_batches} micro-batches per step, got {len(micro_batches)}")
        self.device = params.device
        self.buffers = buffers
        run = _StageStep(self, params, micro_batches, multiplier, layer_rng, into, final)
        spent = run.run()
        for pending in run.sends:
            pending.wait()
        self._sum_tied(run.acc, run.acc_views)
        self._share_state(buffers)
        if self.replan:
            self._replan(spent)
        return run.losses, Flat(run.acc, self.layout.local)

    def _weight_pass(self, store: list, acc_of: dict) -> None:
        """Add the weight gradients a backward deferred (`DeferredLinear`) into their sums."""
        self.deferred_linears += len(store)
        with torch.no_grad():
            for key, shape, a, b in store:
                add_weight_grad(acc_of[key].view(shape), a, b)
        store.clear()  # the graph's nodes still hold the list; its tensors go now

    def _share_state(self, buffers: Optional[PyTree]) -> None:
        """Each layer's state (BatchNorm statistics), updated by this step's forwards on the stage
        that holds the layer, sent to every other stage: every rank keeps the whole state, as a
        one-process run does (what checkpoints save and evaluation reads). One message per holding
        stage and dtype."""
        packs: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for i, layer in enumerate(self.layers.layers):
            for path in layer.state:
                for t in tensor_leaves(subtree(buffers, path)):
                    packs.setdefault((self.plan.stage_of_layer(i), t.dtype), []).append(t)
        for (holder, _), tensors in packs.items():
            _packed_in_place(tensors, lambda flat, holder=holder: self.comm.broadcast_(flat, holder))

    def _replan(self, spent: dict[str, list[float]]) -> None:
        """Zero bubble after its first step: the schedule whose W's best fill the waits for the
        stages' measured F, B and W times (`zero_bubble_for_costs`; ZB-H1 where none does better).
        Every rank takes the same times (each stage's medians, the largest over its data and model
        ranks), so every rank builds the same schedule: the collectives the stages' actions issue
        stay in one order."""
        costs = torch.zeros(self.stages, 3, dtype=torch.float64)
        costs[self.stage] = torch.tensor([statistics.median(spent[k]) for k in "FBW"], dtype=torch.float64)
        self.comm.all_reduce_(costs)  # each stage's row from that stage
        for axis in AXES:
            if axis != "pipe":
                self.mesh.comm(axis).all_reduce_(costs, "max")
        self.schedule = zero_bubble_for_costs(self.stages, self.micro_batches, *costs.t().tolist())
        self.replan = False

    def _forward(self, tree: PyTree, x: torch.Tensor, k: int, m: int, micro_batch: PyTree,
                 layer_rng: Callable[[int, int], Optional[torch.Generator]], ops: Any,
                 mode: Optional[Callable[[], Any]] = None) -> torch.Tensor:
        """Piece k's layers on micro-batch m (and the loss on the last piece), under `mode` (zero
        bubble's deferring torch-function mode, entered inside each checkpointed group so that
        its recompute in B defers the same weight gradients)."""
        seq = self.layers.layers
        lo, hi = self.plan.bounds[k], self.plan.bounds[k + 1]
        last = k == self.pieces - 1
        if last and self.layers.last_with_loss is not None:
            hi -= 1  # the last layer runs inside the tail, with the loss
        group = self.interval or max(hi - lo, 1)
        for start in range(lo, hi, group):
            members = range(start, min(start + group, hi))
            generators = [layer_rng(m, i) for i in members]
            if self.interval and torch.is_grad_enabled() and any(seq[i].uses for i in members):
                x = checkpointed(self.remat, self._run_layers, tree, x, *generators, members=members, ops=ops, mode=mode,
                                 label=f"{seq[members[0]].name}..{seq[members[-1]].name}")
            else:
                x = self._run_layers(tree, x, *generators, members=members, ops=ops, mode=mode)
        if last:
            with mode() if mode is not None else contextlib.nullcontext():
                loss = self.layers.tail(tree, x, micro_batch, ops=ops)
            if loss.dim() != 0:
                raise ValueError(f"the layer sequence's loss must be a scalar, got shape {list(loss.shape)}")
            return loss
        return x

    def _run_layers(self, tree: PyTree, x: torch.Tensor, *generators: Optional[torch.Generator],
                    members: range, ops: Any, mode: Optional[Callable[[], Any]] = None) -> torch.Tensor:
        if mode is not None:
            with mode():
                return self._run_layers(tree, x, *generators, members=members, ops=ops)
        seq = self.layers.layers
        for i, rng in zip(members, generators):
            x = seq[i].fn(tree, x, rng=rng, ops=ops, **with_state(seq[i], self.buffers))
            if not (isinstance(x, torch.Tensor) or
                    isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) for t in x)):
                raise TypeError(f"pipeline layer {seq[i].name!r} returned {type(x).__name__}; a layer's output must "
                                "be a tensor or a tuple of tensors (what crosses a stage boundary)")
        return x

    def _final_after(self, index_of: dict[int, int], chunk_leaves: list[list[torch.Tensor]],
                     actions: Sequence[Action]) -> dict[int, list[int]]:
        """Action index -> the parameters (local indices, by leaf id in `index_of`) no later action
        of this stage adds to: those of the chunks whose last backward (B or W) it is, and of no
        later chunk; tied parameters left out (`_sum_tied` adds another stage's sum after the schedule)."""
        last = {a.chunk: i for i, a in enumerate(actions) if a.kind in "BW"}
        tied = {path for path, _ in self.plan.tied}
        final_at: dict[int, int] = {}
        for c, leaves_c in enumerate(chunk_leaves):
            for leaf in leaves_c:
                p = index_of[id(leaf)]
                if c in last and self.layout.params[p].path not in tied:
                    final_at[p] = max(final_at.get(p, -1), last[c])
        out: dict[int, list[int]] = {}
        for p, i in final_at.items():
            out.setdefault(i, []).append(p)
        return out

    def _leaves_of_chunk(self, leaves: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
        """The parameter tensors the layers of `chunk` use (floating ones: the differentiable ones)."""
        seq = self.layers.layers
        uses = [u for i in self.plan.layers_of(self.stage, chunk) for u in seq[i].uses]
        return [leaf for info, leaf in zip(self.layout.params, leaves) if leaf.requires_grad and
                any(info.path == u or info.path.startswith(u + ".") for u in uses)]

    # -- transfers between pieces ----------------------------------------------------------------

    def _send(self, kind: str, m: int, to_piece: int, value: Any, signature, mailbox) -> list[Pending]:
        """Send `value` (an activation entering piece `to_piece`: a tensor or a tuple of them; or the
        list of gradients of its floating parts, leaving it backwards), one message per tensor."""
        peer = to_piece % self.stages
        parts = [t.detach().contiguous() for t in _parts(value)]
        if peer == self.stage:
            mailbox[(kind, m, to_piece)] = parts if kind == "grad" else _like(value, parts)
            return []
        out = []
        key = (signature, to_piece)
        if kind == "act" and key not in self.shapes:
            self.shapes[key] = (isinstance(value, tuple), _form(parts))
            out.append(self.comm.start_send(torch.tensor([int(isinstance(value, tuple)), len(parts)]), peer))
            out.append(self.comm.start_send(torch.cat([_encode(t) for t in parts]), peer))
        return out + [self.comm.start_send(t, peer) for t in parts]

    def _post_ahead(self, actions: Sequence[Action], i: int, scanned: int, signature) -> int:
        """Keep the receives of the next `RECEIVES_AHEAD` actions after `i` that take a transfer from
        another stage posted, where its shape is known: a transfer then lands while this stage
        computes, read by gloo's thread on whichever core is idle; posted only when the action was
        next, a transfer that arrived first was read from the socket by the posting call itself
        (1.2-3.9 ms before the last stage's first B, measured). Receives are posted in the order the
        schedule needs them (the scan stops at a shape not known yet), so they pair with the peer's
        sends as before. `scanned`: the last action the previous call posted or passed; returns this
        call's."""
        j = max(scanned, i)
        while len(self.posted) < RECEIVES_AHEAD and j + 1 < len(actions):
            action = actions[j + 1]
            k = self.plan.piece(self.stage, action.chunk)
            if action.kind == "F" and k > 0:
                kind, source, known = "act", k - 1, self.shapes.get((signature, k))
            elif action.kind == "B" and k < self.pieces - 1:
                kind, source, known = "grad", k + 1, self.shapes.get((signature, k + 1))
            else:
                j += 1
                continue
            peer = source % self.stages
            if peer != self.stage:  # else a transfer within this stage (the mailbox)
                if known is None:
                    break  # the first of a new batch shape: received when its action comes
                is_tuple, form = known
                if kind == "grad":
                    form = tuple((shape, dtype) for shape, dtype in form if dtype.is_floating_point)
                buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in form]
                self.posted[(kind, action.micro, k)] = (is_tuple, [(self.comm.start_recv(b, peer), b)
                                                                   for b in buffers])
            j += 1
        return j

    def _receive(self, kind: str, m: int, piece: int, signature, mailbox, form) -> Any:
        """The activation entering `piece` (kind "act": a tensor or a tuple, as sent), or the gradients
        of its output's floating parts ("grad": a list; `form`, their shapes and dtypes)."""
        source = piece + 1 if kind == "grad" else piece - 1
        if (kind, m, piece) in mailbox:
            return mailbox.pop((kind, m, piece))
        peer = source % self.stages
        what = (f"the {'activation' if kind == 'act' else 'gradient'} of micro-batch {m} "
                f"{'for' if kind == 'act' else 'from'} pipeline piece {piece if kind == 'act' else source} "
                f"from pipe stage {peer}")
        if (kind, m, piece) in self.posted:
            is_tuple, posted = self.posted.pop((kind, m, piece))
            parts = [self.comm.finish_recv(pending, buffer, what) for pending, buffer in posted]
        else:
            is_tuple = False
            if kind == "act":
                key = (signature, piece)
                if key not in self.shapes:
                    header = self.comm.recv_(torch.empty(2, dtype=torch.int64), peer, what + " (its form)")
                    metas = self.comm.recv_(torch.empty(int(header[1]) * _META, dtype=torch.int64), peer,
                                            what + " (its shapes)")
                    self.shapes[key] = (bool(header[0]), tuple(_decode(meta) for meta in metas.split(_META)))
                is_tuple, form = self.shapes[key]
            parts = [self.comm.recv_(torch.empty(shape, dtype=dtype, device=self.device), peer, what)
                     for shape, dtype in form]
        if kind == "grad":
            return parts
        return tuple(parts) if is_tuple else parts[0]

    def _sum_tied(self, acc: torch.Tensor, views: list[torch.Tensor]) -> None:
        """Sum the gradients of parameters held by several stages over those stages."""
        if self.tie_groups is None:
            self.tie_groups = _tie_groups(self.layout, self.mesh)
        index = {info.path: i for i, info in enumerate(self.layout.params)}
        for paths, comm in self.tie_groups:
            _packed_in_place([views[index[p]] for p in paths], comm.all_reduce_)

    # -- evaluation --------------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss(self, params: Flat, batch: PyTree, buffers: Optional[PyTree] = None) -> Optional[float]:
        """The loss of `batch` as one micro-batch through every piece in order (no gradients); the
        last piece's stage returns it, the others None."""
        tree = tree_unflatten(self.layout.local.treedef, [t for _, t in params.items()])
        self.device = params.device
        self.buffers = buffers
        signature = ("eval",) + tuple((tuple(t.shape), t.dtype) for t in tree_flatten_with_paths(batch)[1]
                                      if isinstance(t, torch.Tensor))
        mailbox: dict = {}
        sends: list[Pending] = []
        loss = None
        for c in range(self.plan.virtual_stages):
            k = self.plan.piece(self.stage, c)
            x = self.layers.inputs(batch) if k == 0 else self._receive("act", 0, k, signature, mailbox, None)
            y = self._forward(tree, x, k, 0, batch, lambda m, i: None, self.ops)
            if k == self.pieces - 1:
                loss = float(y)
            else:
                sends += self._send("act", 0, k + 1, y, signature, mailbox)
        for pending in sends:
            pending.wait()
        return loss


class _StageStep:
    """One step of this stage's actions (`PipelineExecutor.step`): the parameters as autograd leaves,
    the buffer their gradients are summed in, what each forward keeps for its backward (and the
    weight gradients it deferred), and the transfers in flight."""

    def __init__(self, executor: PipelineExecutor, params: Flat, micro_batches: Sequence[PyTree], multiplier: float,
                 layer_rng: Callable[[int, int], Optional[torch.Generator]], into: Optional[torch.Tensor],
                 final: Optional[Callable[[Sequence[int]], None]]):
        ex = self.ex = executor
        self.micro_batches, self.multiplier, self.layer_rng, self.final = micro_batches, multiplier, layer_rng, final
        local = ex.layout.local
        leaves = self.leaves = [t.detach().requires_grad_(t.is_floating_point()) for _, t in params.items()]
        self.tree = tree_unflatten(local.treedef, leaves)
        if into is None:
            into = torch.empty(local.numel, dtype=ex.grad_dtype, device=params.device)
        elif into.numel() != local.numel or into.dtype != ex.grad_dtype or into.device != params.device:
            raise ValueError(f"the pipeline sums its gradient in a buffer of {local.numel} {ex.grad_dtype} on "
                             f"{params.device}; got {into.numel()} {into.dtype} on {into.device}")
        self.acc, self.zeroed = into, False
        self.acc_views = local.segments(self.acc)
        self.acc_of = {id(leaf): view.view(leaf.shape) for leaf, view in zip(leaves, self.acc_views)}
        # where the dtypes allow, each parameter's .grad is its view of the buffer: backward adds every
        # gradient into it as it makes it (autograd's own accumulation, while the gradient is in cache)
        self.in_place = all(leaf.dtype == self.acc.dtype for leaf in leaves if leaf.requires_grad)
        if self.in_place:
            for leaf in leaves:
                if leaf.requires_grad:
                    leaf.grad = self.acc_of[id(leaf)]
        self.chunk_leaves = [ex._leaves_of_chunk(leaves, c) for c in range(ex.plan.virtual_stages)]
        self.chunk_weights = [{id(t) for t in leaves_c} for leaves_c in self.chunk_leaves]
        self.signature = tuple((tuple(t.shape), t.dtype) for t in tree_flatten_with_paths(micro_batches[0])[1]
                               if isinstance(t, torch.Tensor))
        self.split = ex.schedule.split_backward
        self.early = early_input_grads(ex.schedule, ex.stage)  # B's that send x's gradient, then run their W
        self.saved: dict[tuple[int, int], tuple] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.mailbox: dict[tuple[str, int, int], Any] = {}  # transfers within this stage
        self.sends: list[Pending] = []
        self.losses: list[torch.Tensor] = []
        self.actions = ex.schedule.actions[ex.stage]
        # the last action whose receive is posted or passed (`_post_ahead`)
        self.scanned = ex._post_ahead(self.actions, -1, -1, self.signature)
        # per action: the parameters whose sums are final after it (their reduction over data may start)
        index_of = {id(leaf): p for p, leaf in enumerate(leaves)}
        self.final_after = ex._final_after(index_of, self.chunk_leaves, self.actions) if final is not None else {}

    def run(self) -> dict[str, list[float]]:
        """Every action in order; the seconds of each action's compute, by kind (F, B, W)."""
        ex = self.ex
        spent: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        for i, action in enumerate(self.actions):
            m, c = action.micro, action.chunk
            k = ex.plan.piece(ex.stage, c)
            if not self.zeroed and (action.kind == "B" or k > 0):
                # the sums start from zero before the first backward: zeroed here, where the stage
                # would otherwise wait for its first transfer (not on the step's critical path)
                self.acc.zero_()
                self.zeroed = True
            sent = None  # when a B that sends its input's gradient first sent it (then ran its weight pass)
            if action.kind == "F":
                start = self.forward(i, m, c, k)
            elif action.kind == "B":
                start, sent = self.backward(i, m, c, k)
            else:  # "W": the deferred weight gradients
                self.scanned = ex._post_ahead(self.actions, i, self.scanned, self.signature)
                start = time.perf_counter()
                ex._weight_pass(self.deferred.pop((m, c)), self.acc_of)
            if i in self.final_after:  # (also those backward gave no gradient, and after a weight pass)
                self.final(self.final_after[i])
            end = time.perf_counter()
            spent[action.kind].append(end - start)
            if ex.timeline is not None:
                if sent is not None:  # its two parts, as zero bubble's
                    ex.timeline += [(action, start, sent), (Action("W", m, c), sent, end)]
                else:
                    ex.timeline.append((action, start, end))
        return spent

    def forward(self, i: int, m: int, c: int, k: int) -> float:
        """F(m, c): the chunk's layers on micro-batch m (the loss on the last piece), the output sent
        on; returns when its compute started."""
        ex = self.ex
        x = ex.layers.inputs(self.micro_batches[m]) if k == 0 else \
            ex._receive("act", m, k, self.signature, self.mailbox, None)
        if k > 0:
            for t in _parts(x):
                if t.is_floating_point():
                    t.requires_grad_(True)
        self.scanned = ex._post_ahead(self.actions, i, self.scanned, self.signature)
        start = time.perf_counter()
        store: list = []
        ops, mode = ex.ops, None
        defer = self.split or (m, c) in self.early
        if defer and ex.linear_via_ops[k]:
            ops = ex._wrapped(DeferringOps(self.chunk_weights[c], store))
        elif defer:
            mode = functools.partial(DeferWeightGrads, self.chunk_weights[c], store)
        with torch.enable_grad():
            y = ex._forward(self.tree, x, k, m, self.micro_batches[m], self.layer_rng, ops, mode)
        if k == ex.pieces - 1:
            self.losses.append(y.detach().float())
            y = y.float() * self.multiplier
        else:
            self.sends += ex._send("act", m, k + 1, y, self.signature, self.mailbox)
        self.saved[(m, c)] = (x, y)
        self.deferred[(m, c)] = store
        ex.peak_in_flight = max(ex.peak_in_flight, len(self.saved))
        return start

    def backward(self, i: int, m: int, c: int, k: int) -> tuple[float, Optional[float]]:
        """B(m, c): the output's gradient back through the chunk, the input's gradient sent back;
        returns when its compute started and, where it sent the input's gradient before its weight
        pass, when it sent it."""
        ex = self.ex
        x, y = self.saved.pop((m, c))
        if k == ex.pieces - 1:
            outputs, grad_y = [y], None
        else:  # the gradients of y's floating parts, for those that need one
            floats = [t for t in _parts(y) if t.is_floating_point()]
            grads_in = ex._receive("grad", m, k, self.signature, self.mailbox, _form(floats))
            pairs = [(t, g) for t, g in zip(floats, grads_in) if t.requires_grad]
            outputs, grad_y = [t for t, _ in pairs], [g for _, g in pairs]
        self.scanned = ex._post_ahead(self.actions, i, self.scanned, self.signature)
        start = time.perf_counter()
        xs = [t for t in _parts(x) if t.is_floating_point() and t.requires_grad] if k > 0 else []
        grads_x = self._gradients(i, c, k, outputs, grad_y, xs)
        if k > 0:  # a gradient for each floating part of x (zeros where x did not reach y)
            gx = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads_x, xs)]
            self.sends += ex._send("grad", m, k - 1, gx, self.signature, self.mailbox)
        sent = None
        if not self.split:
            store = self.deferred.pop((m, c))
            if (m, c) in self.early:  # its weight gradients, now that the input's is on its way
                sent = time.perf_counter()
                ex._weight_pass(store, self.acc_of)
        return start, sent

    def _gradients(self, i: int, c: int, k: int, outputs: list[torch.Tensor], grad_y: Optional[list[torch.Tensor]],
                   xs: list[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        """Backward from `outputs`: the chunk's parameter gradients added into their sums, the
        gradients of the input's parts `xs` returned."""
        inputs = xs + self.chunk_leaves[c]
        if self.in_place:  # the parameters' gradients go into their .grad views, x's into x.grad
            # the first piece's last backward: each parameter's sum is final as autograd adds to
            # it (a later piece's reduction starts after the action, once the input's gradient,
            # which the previous stage waits for, is on its way: measured 1% faster on PP2 x DP2
            # gloo, ZeRO-1, than starting in backward)
            done = self.final_after.get(i, ()) if k == 0 else ()
            hooks = [self.leaves[p].register_post_accumulate_grad_hook(lambda leaf, p=p: self.final([p]))
                     for p in done]
            if outputs and inputs:  # no `inputs=`: the graph's only leaves that take a gradient are
                # x and this chunk's parameters (1-2% of a B on 2 ranks went to autograd's walk for them)
                torch.autograd.backward(outputs, grad_y)
            for hook in hooks:
                hook.remove()
            return [t.grad for t in xs]
        grads = torch.autograd.grad(outputs, inputs, grad_y, allow_unused=True) if outputs else \
            (None,) * len(inputs)
        with torch.no_grad():
            for leaf, g in zip(self.chunk_leaves[c], grads[len(xs):]):
                if g is not None:
                    self.acc_of[id(leaf)].add_(g)
        return grads[:len(xs)]


def _packed_in_place(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """`collective` (in place) on the tensors as one flat message; each tensor gets its part back."""
    packed = collective(torch.cat([t.reshape(-1) for t in tensors]))
    at = 0
    for t in tensors:
        t.copy_(packed[at:at + t.numel()].view_as(t))
        at += t.numel()


def _parts(value: Any) -> list[torch.Tensor]:
    """The tensors of a stage boundary's value (a tensor, or a tuple or list of them)."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _like(value: Any, parts: list[torch.Tensor]) -> Any:
    return tuple(parts) if isinstance(value, tuple) else parts[0]


def _form(parts: Sequence[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in parts)


def _encode(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _META - 2 or t.dtype not in _DTYPES:
        raise ValueError(f"a pipeline activation's tensors must have at most {_META - 2} dims and a dtype of {_DTYPES}; "
                         f"got shape {list(t.shape)}, {t.dtype}")
    meta = torch.zeros(_META, dtype=torch.int64)
    meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
    meta[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


def _decode(meta: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    ndim = int(meta[1])
    return tuple(int(d) for d in meta[2:2 + ndim]), _DTYPES[int(meta[0])]


def _tie_groups(layout: Layout, mesh) -> list[tuple[list[str], AxisComm]]:
    """For each set of stages sharing parameters: (this stage's shared paths, the collectives of the
    ranks at those stages with this rank's data and model coordinates, logged as the `pipe` axis).
    Every rank creates every group, in the same order (torch requires it)."""
    plan = layout.pipeline
    by_stages: dict[tuple[int, ...], list[str]] = {}
    for path, stages in plan.tied:
        by_stages.setdefault(stages, []).append(path)
    out = []
    sizes = [mesh.sizes[a] for a in AXES]
    for stages, paths in sorted(by_stages.items()):
        for data in range(mesh.sizes["data"]):
            for model in range(mesh.sizes["model"]):
                ranks = [(s * sizes[1] + data) * sizes[2] + model for s in stages]
                group = process_group(ranks, mesh.timeout)
                if mesh.rank in ranks:
                    out.append((paths, AxisComm("pipe", group, ranks, mesh.log, mesh.rank)))
    return out


__all__ = ["PipelineExecutor"]
