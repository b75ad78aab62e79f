"""DeepSpeed's checkpoint files read without DeepSpeed: what both layouts (data-parallel and pipeline) share.

The files are pickles holding a few DeepSpeed objects (its loss scaler, `ZeroStageEnum`,
`fragment_address`): `read_deepspeed_file` reads them with a restricted unpickler that admits
torch's weights-only globals and turns DeepSpeed's classes into inert records, and refuses anything
else, naming it. `DeepSpeedState` is a checkpoint read into full tensors by parameter name; the
helpers take its counters, Adam's hyperparameters and moments, and ZeRO-1/2's flat partitions
apart (`deepspeed_import`, `deepspeed_pipeline`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from .errors import CheckpointError

_DEEPSPEED_MODULES = ("deepspeed.",)


class DeepSpeedRecord:
    """An inert stand-in for a DeepSpeed object in a checkpoint pickle: its constructor arguments
    and its state, nothing executed."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}{self.args}"


def _allowed_globals() -> dict[str, Any]:
    from torch._weights_only_unpickler import _get_allowed_globals

    return _get_allowed_globals()


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DEEPSPEED_MODULES) or module == "deepspeed":
            return type(name, (DeepSpeedRecord,), {"__module__": __name__})
        allowed = _allowed_globals().get(f"{module}.{name}")
        if allowed is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed (only torch's weights-only globals "
                                         "and DeepSpeed's own classes, as inert records)")
        return allowed


class _RestrictedPickle:
    """A `pickle_module` for torch.load whose Unpickler is restricted (module docstring)."""

    Unpickler = _RestrictedUnpickler
    load = staticmethod(lambda f, **kw: _RestrictedUnpickler(f, **kw).load())
    __name__ = "fspeed_restricted_pickle"


def read_deepspeed_file(path: Path) -> Any:
    """One DeepSpeed .pt file, read with the restricted unpickler; CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", pickle_module=_RestrictedPickle, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # torch's zip reader and pickle raise many types
        raise CheckpointError(f"{path} cannot be read as a DeepSpeed checkpoint file ({type(e).__name__}: {e})") \
            from None


# what DeepSpeed's engine writes into a model-states file itself; a user's `client_state` is the rest
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version",
})


class DeepSpeedState:
    """Full tensors by parameter name (`weights`, `exp_avg`, `exp_avg_sq`) and the counters, read
    from the tag directory `where` (set by `read_deepspeed`). `client_state`: the entries a DeepSpeed
    user saved with `save_checkpoint(client_state=...)`, those of the first model-states file that
    DeepSpeed's engine does not write itself (its load returns them)."""

    def __init__(self, stage: int, weights: dict, exp_avg: dict, exp_avg_sq: dict, buffers: dict, counters: dict,
                 hparams: dict, config: dict, client_state: dict):
        self.stage, self.weights, self.exp_avg, self.exp_avg_sq = stage, weights, exp_avg, exp_avg_sq
        self.buffers, self.counters, self.hparams, self.config = buffers, counters, hparams, config
        self.client_state = client_state
        self.where: Optional[Path] = None


def client_state_of(model_states: dict) -> dict:
    """What a model-states file holds beside DeepSpeed's own entries (`DeepSpeedState.client_state`)."""
    return {k: v for k, v in model_states.items() if k not in _DEEPSPEED_KEYS}


def counters_of(model_states: dict) -> dict:
    """The run's counters as a model-states file records them."""
    return {"step": int(model_states.get("global_steps", 0)), "samples": int(model_states.get("global_samples", 0)),
            "skipped_steps": int(model_states.get("skipped_steps", 0))}


def zero_optimizer_states(files: list[Path]) -> tuple[list[dict], int]:
    """The ZeRO optimizer states of `files` (one per data rank, in rank order) and their ZeRO stage."""
    states = [r.get("optimizer_state_dict") if isinstance(r, dict) else None for r in map(read_deepspeed_file, files)]
    if any(not isinstance(s, dict) for s in states):
        raise CheckpointError(f"{files[0]} is not a DeepSpeed ZeRO optimizer-states file")
    value = states[0].get("zero_stage")
    return states, int(value.args[0]) if isinstance(value, DeepSpeedRecord) else int(value)


def adam_hparams(optimizer_state: dict, where: Path) -> dict:
    """Adam's hyperparameters (lr, betas, eps, weight decay, decoupled or not) from a torch optimizer state."""
    try:
        group = optimizer_state["param_groups"][0]
        return {"lr": float(group["lr"]), "betas": tuple(group["betas"]), "eps": float(group["eps"]),
                "weight_decay": float(group.get("weight_decay", 0.0)),
                "decoupled": bool(group.get("decoupled_weight_decay", group.get("adam_w_mode", True)))}
    except (KeyError, IndexError, TypeError) as e:
        raise CheckpointError(f"{where}: the optimizer state has no Adam param group ({e}); only Adam/AdamW "
                              "checkpoints are imported") from None


def adam_step(optimizer_state: dict, where: Path) -> int:
    """Adam's step count, one for every parameter of a torch optimizer state."""
    steps = {int(s["step"]) for s in optimizer_state.get("state", {}).values() if "step" in s}
    if len(steps) != 1:
        raise CheckpointError(f"{where}: expected one Adam step count over the parameters, found {sorted(steps)}; "
                              "only Adam/AdamW checkpoints are imported")
    return steps.pop()


def adam_moments(state: dict, index: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's two moments, in fp32, of the parameter at `index` of a torch optimizer state."""
    entry = state.get("state", {}).get(index)
    if not entry or "exp_avg" not in entry or "exp_avg_sq" not in entry:
        raise CheckpointError(f"{where}: no Adam moments (exp_avg, exp_avg_sq) for {index!r}; only Adam/AdamW "
                              "checkpoints are imported")
    return entry["exp_avg"].float(), entry["exp_avg_sq"].float()


def zero12_tensors(states: list[dict], param_shapes: list, where: Path):
    """(weights, exp_avg, exp_avg_sq by parameter name, the base optimizer state) from ZeRO-1/2's
    per-rank partitions of each group's flat fp32 buffer (`states`, in data-rank order)."""
    weights, avg, avg_sq = {}, {}, {}
    for g, group in enumerate(param_shapes):
        flat = torch.cat([s["single_partition_of_fp32_groups"][g].float() for s in states])
        moments = [adam_moments(s["base_optimizer_state"], g, str(where)) for s in states]
        flat_avg = torch.cat([m[0] for m in moments])
        flat_sq = torch.cat([m[1] for m in moments])
        if any(any(p for p in paddings) for s in states for paddings in s.get("param_alignment_paddings") or []):
            raise CheckpointError(f"{where}: parameters padded inside a ZeRO group (param_alignment_paddings) are "
                                  "not supported")
        offset = 0
        for name, shape in group.items():
            n = int(torch.Size(shape).numel())
            if offset + n > flat.numel():
                raise CheckpointError(f"{where}: group {g} holds {flat.numel()} elements, fewer than its parameters")
            weights[name] = flat[offset:offset + n].view(shape).clone()
            avg[name] = flat_avg[offset:offset + n].view(shape).clone()
            avg_sq[name] = flat_sq[offset:offset + n].view(shape).clone()
            offset += n
    return weights, avg, avg_sq, states[0]["base_optimizer_state"]
