"""TrainState: everything a training run carries from step to step, as one pytree.

    params       Flat, compute dtype: what the model sees
    master       Flat fp32 master weights (None in fp32, where params are the master)
    opt_state    the optimizer's state (moments are Flats, so updates are one pass)
    loss_scale   the loss scaler's state (DeepSpeed's DynamicLossScaler fields)
    step         optimizer-step attempts, skipped ones included (DeepSpeed's global_steps)
    skipped_steps, samples
    rng_seed     dropout generators are derived from (rng_seed, step, micro-batch): exact resume
    buffers      module state the forward updates in place (BatchNorm running statistics), a
                 pytree ({} when the model has none)
    precision    the precision policy (static: pytree metadata, not a leaf)

`layout` (static metadata) is the resolved parallel plan the state was built with, None without
one; this module knows nothing of the parallel runtime. `init_train_state` (`fspeed.train_init`)
builds states. `train_step` donates its input state: the returned state reuses its buffers, and reading a field
of the donated state raises `DonatedStateError` instead of returning silently changed tensors.
"""

from __future__ import annotations

from typing import Any, Optional


from .flat import Flat
from .loss_scale import LossScaleState
from .optim.base import learning_rate
from .precision import Precision, fp32
from .pytree import register_node

_FIELDS = ("params", "master", "opt_state", "loss_scale", "step", "skipped_steps", "samples", "rng_seed", "buffers")
_FIELD_SET = frozenset(_FIELDS)


class DonatedStateError(RuntimeError):
    """A TrainState was used after it was donated to train_step."""


class TrainState:
    """The state of a training run (see the module docstring)."""

    __slots__ = _FIELDS + ("precision", "layout", "_donated_at", "_in_flight")

    def __init__(
        self,
        params: Flat,
        master: Optional[Flat],
        opt_state: Any,
        loss_scale: LossScaleState,
        step: int = 0,
        skipped_steps: int = 0,
        samples: int = 0,
        rng_seed: int = 0,
        buffers: Any = None,
        precision: Precision = fp32(),
        layout: Optional[Any] = None,
    ):
        buffers = {} if buffers is None else buffers
        for name, value in zip(_FIELDS, (params, master, opt_state, loss_scale, step, skipped_steps, samples, rng_seed,
                                         buffers)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_donated_at", None)
        object.__setattr__(self, "_in_flight", None)

    def __getattribute__(self, name: str):
        if name in _FIELD_SET:
            donated_at = object.__getattribute__(self, "_donated_at")
            if donated_at is not None:
                raise DonatedStateError(
                    f"this TrainState was donated to train_step at step {donated_at}; its buffers now "
                    "belong to the state that call returned. Use the returned state "
                    "(state, metrics = step(state, batch))."
                )
            if name == "params":
                in_flight = object.__getattribute__(self, "_in_flight")
                if in_flight is not None:  # ZeRO-1/2's parameter all-gather: complete before anyone reads
                    in_flight.wait()
                    object.__setattr__(self, "_in_flight", None)
        return object.__getattribute__(self, name)

    def params_gathering(self, gather: Any) -> Optional[Flat]:
        """The params without waiting, when `gather` is the all-gather still writing them (the step
        that started it waits for each unit as its forward reaches it); None otherwise."""
        in_flight = object.__getattribute__(self, "_in_flight")
        if in_flight is None or in_flight is not gather:
            return None
        self.step  # noqa: B018 (the donation check)
        return object.__getattribute__(self, "params")

    def with_params_in_flight(self, gather: Any) -> "TrainState":
        """This state, its params still being written by `gather` (train_step's ZeRO-1/2 all-gather)."""
        if gather is not None and not gather.done:
            object.__setattr__(self, "_in_flight", gather)
        return self

    def __setattr__(self, name, value):
        raise AttributeError("TrainState is immutable; use state.replace(field=value)")

    def replace(self, **changes: Any) -> "TrainState":
        unknown = set(changes) - _FIELD_SET
        if unknown:
            raise TypeError(f"TrainState has no field(s) {sorted(unknown)}; fields are {list(_FIELDS)}")
        values = {name: changes.get(name, getattr(self, name)) for name in _FIELDS}
        return TrainState(**values, precision=self.precision, layout=self.layout)

    def donate(self) -> None:
        """Mark this state as consumed (train_step calls this before reusing its buffers)."""
        step = self.step
        object.__setattr__(self, "_donated_at", step)

    @property
    def donated(self) -> bool:
        return object.__getattribute__(self, "_donated_at") is not None

    @property
    def master_params(self) -> Flat:
        """The fp32 weights the optimizer updates: the masters (a ZeRO slice or shard), or params in fp32."""
        return self.master if self.master is not None else self.params

    @property
    def lr(self) -> Optional[float]:
        """The learning rate the next optimizer step will use."""
        return learning_rate(self.opt_state)

    def __repr__(self) -> str:
        if self.donated:
            return f"TrainState(<donated at step {object.__getattribute__(self, '_donated_at')}>)"
        return (
            f"TrainState(step={self.step}, skipped_steps={self.skipped_steps}, samples={self.samples}, "
            f"params={self.params!r}, precision={self.precision.name}, loss_scale={self.loss_scale.scale:g})"
        )


register_node(
    TrainState,
    lambda s: (tuple(getattr(s, name) for name in _FIELDS), (s.precision, s.layout)),
    lambda aux, children: TrainState(*children, precision=aux[0], layout=aux[1]),
    child_names=lambda aux: _FIELDS,
)
