"""A user's own model and data as an fspeed-train job: `model._target_` and `data._target_`.

    fspeed-train model._target_=my_pkg.build_model data._target_=my_pkg.build_dataset zero.stage=3 --launch

The model target returns an `nn.Module` (its output's `.loss`, e.g. a Hugging Face model given
`labels`, or a scalar output, is the loss), a `(module, loss_fn(outputs, batch))` pair, or an
fspeed `Model`. A module is `functionalize`d: its repeated blocks are the units ZeRO-3 gathers,
and with `parallel.tensor > 1` its own tensor-parallel plan (a transformers model's) slices it.
With `parallel.pipe > 1` its forward is traced on the first training micro-batch and cut before
each repeated block instead (`fs.models.traced_layers`): the pipeline's layers; with
`parallel.tensor > 1` too, a Llama-family model's own layers and tp_plan (`fs.models.decoder_layers`).
The data target returns a map-style `Dataset`, a `(train, validation)` pair, or a mapping with
`train` and optionally `validation` and `collate_fn`. Batches are drawn as the corpus' windows
are: a pure function of seed and step (uniform with replacement), so resume is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..config import ConfigError, Problem
from ..config.schema import RunConfig
from ..data import DatasetRows
from ..models import Model, functionalize, traced_layers
from ..models.decoder_layers import sliceable_layers
from ..models.module import output_loss

_MODEL_RETURNS = "an nn.Module, a (module, loss_fn) pair, or an fspeed Model"
_DATA_RETURNS = "a map-style Dataset, a (train, validation) pair, or a mapping with train, validation, collate_fn"


def build_user_model(run: RunConfig, device: Optional[torch.device] = None, example: Any = None) -> Model:
    """The Model to train from `model._target_`: an nn.Module is moved to `device` with every buffer
    (None: left where it is) and functionalized, or, with `parallel.pipe > 1`, traced on `example` (a
    training micro-batch) into layers."""
    built = run.model.instantiate()
    loss_fn: Optional[Callable] = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module) and callable(built[1]):
        built, loss_fn = built
    if isinstance(built, Model):
        return built
    if not isinstance(built, nn.Module):
        raise ConfigError([Problem("model._target_", f"returned {type(built).__name__}; allowed: {_MODEL_RETURNS}",
                                   run.model.target)])
    if device is not None:
        built = built.to(device)
    try:
        if run.parallel.pipe > 1 and run.parallel.tensor > 1:  # its own layers and tp_plan (decoder_layers)
            return sliceable_layers(built, loss_fn)
        if run.parallel.pipe > 1:
            if example is None:
                raise ValueError("a pipeline traces the module's forward on a training micro-batch; none was given")
            return traced_layers(built, example, loss_fn or output_loss)
        model = functionalize(built, loss_fn or output_loss, tp_plan="auto" if run.parallel.tensor > 1 else None)
    except ValueError as err:
        key = "parallel.pipe" if run.parallel.pipe > 1 else "parallel.tensor" if run.parallel.tensor > 1 \
            else "model._target_"
        raise ConfigError([Problem(key, str(err))]) from None
    return model


def build_user_data(run: RunConfig) -> tuple[DatasetRows, Optional[DatasetRows]]:
    """(training rows, validation rows or None) from `data._target_`."""
    built = run.data.instantiate()
    collate = None
    if isinstance(built, Mapping):
        unknown = set(built) - {"train", "validation", "collate_fn"}
        if "train" not in built or unknown:
            raise ConfigError([Problem("data._target_", f"returned a mapping with keys {sorted(built)}; allowed: "
                                       "train (required), validation, collate_fn", run.data.target)])
        train, val, collate = built["train"], built.get("validation"), built.get("collate_fn")
    elif isinstance(built, tuple) and len(built) == 2:
        train, val = built
    else:
        train, val = built, None
    rows = []
    for name, dataset in (("train", train), ("validation", val)):
        if dataset is None:
            rows.append(None)
            continue
        try:
            rows.append(DatasetRows(dataset, collate))
        except (TypeError, ValueError) as err:
            raise ConfigError([Problem("data._target_", f"its {name} data: {err}; allowed: {_DATA_RETURNS}",
                                       run.data.target)]) from None
    return rows[0], rows[1]


__all__ = ["build_user_data", "build_user_model"]
