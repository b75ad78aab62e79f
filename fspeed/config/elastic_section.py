"""The `elasticity` config section (DeepSpeed's `elasticity` block): an elastic global batch.

With `elasticity.enabled`, the batch triad is not read from `train.*`: DeepSpeed's rules
(`fspeed.elasticity`) choose the global batch from `max_train_batch_size` and `micro_batch_sizes`
so that it stays valid over the data-parallel world sizes in [min_gpus, max_gpus], and the
micro-batch and gradient accumulation are computed for the data-parallel world the run starts
on. A world size outside the valid ones is a ConfigError listing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..batch_triad import BatchTriad
from ..elasticity import ElasticConfig, ElasticityError, elastic_batch
from .errors import ConfigError, Problem
from .fields import POSITIVE, ValidatedConfig, each, setting


@dataclass(frozen=True, kw_only=True)
class ElasticitySection(ValidatedConfig):
    """DeepSpeed's `elasticity` keys that decide the batch (its defaults; `fspeed.elasticity`)."""

    enabled: bool = False  # the global batch from the keys below instead of train.train_batch_size / grad_accum
    max_train_batch_size: int = setting(2000, POSITIVE)  # the largest global batch acceptable
    micro_batch_sizes: tuple[int, ...] = setting((2, 4, 6), each(POSITIVE))  # per-rank micro-batches allowed
    min_gpus: int = setting(1, POSITIVE)  # the smallest GPU count the batch must stay valid for
    max_gpus: int = setting(10000, POSITIVE)  # the largest
    prefer_larger_batch: bool = True  # between batches valid on as many GPU counts: the larger (else the smaller)
    model_parallel_size: int = setting(1, POSITIVE)  # version 0.2: GPUs per model replica (1 or tensor x pipe)
    num_gpus_per_node: int = setting(1, POSITIVE)  # version 0.2: the batch is computed per node
    version: Literal[0.1, 0.2] = 0.2  # DeepSpeed's elasticity version: 0.1 (per GPU) or 0.2 (per node)
    # with enabled: train.train_batch_size and train.grad_accum set are ignored (false: they are an error);
    # train.micro_batch_size is always replaced by the elastic micro-batch
    ignore_non_elastic_batch_info: bool = False

    def relation_problems(self) -> list[Problem]:
        if not self.enabled:
            return []
        if not self.micro_batch_sizes:
            return [Problem("micro_batch_sizes", "must list at least one micro-batch size", [])]
        try:
            self.to_library()
        except ElasticityError as err:
            return [Problem(err.key, str(err), getattr(self, err.key, None))]
        return []

    def to_library(self) -> ElasticConfig:
        """The library's `ElasticConfig` of these keys."""
        return ElasticConfig(max_train_batch_size=self.max_train_batch_size,
                             micro_batch_sizes=tuple(self.micro_batch_sizes), min_gpus=self.min_gpus,
                             max_gpus=self.max_gpus, prefer_larger_batch=self.prefer_larger_batch,
                             model_parallel_size=self.model_parallel_size, num_gpus_per_node=self.num_gpus_per_node,
                             version=self.version)


def elastic_triad(section: ElasticitySection, train_keys: dict[str, Optional[int]], dp_world_size: int,
                  model_parallel: int) -> BatchTriad:
    """The batch triad of an enabled `elasticity` section on `dp_world_size` data ranks; ConfigError
    naming the key when DeepSpeed's rules reject it, or when `train_keys` (train.train_batch_size and
    train.grad_accum as configured) are set without ignore_non_elastic_batch_info."""
    given = [f"train.{k}={v}" for k, v in train_keys.items() if v is not None]
    if given and not section.ignore_non_elastic_batch_info:
        raise ConfigError([Problem("elasticity.enabled", f"chooses the batch, and {' and '.join(given)} would not be "
                                   "used", True, hint="set them to null, or elasticity.ignore_non_elastic_batch_info="
                                   "true to ignore them (DeepSpeed's rule)")])
    if section.model_parallel_size not in (1, model_parallel):
        raise ConfigError([Problem("elasticity.model_parallel_size", f"is the GPUs per model replica, and this run's "
                                   f"parallel.tensor x parallel.pipe is {model_parallel}", section.model_parallel_size,
                                   f"{model_parallel} (or 1)")])
    try:
        batch = elastic_batch(section.to_library(), dp_world_size)
    except ElasticityError as err:
        if err.key == "world_size":
            raise ConfigError([Problem("parallel.data", f"the elastic batch (elasticity.enabled) does not fit: {err}",
                                       dp_world_size, hint="launch one of the valid data-parallel world sizes")]) \
                from None
        raise ConfigError([Problem(f"elasticity.{err.key}", str(err), getattr(section, err.key, None))]) from None
    derivation = (f"elasticity: train_batch_size {batch.train_batch_size} (valid on "
                  f"{len(batch.valid_world_sizes)} data-parallel world sizes); micro_batch_size = the largest of "
                  f"{list(section.micro_batch_sizes)} dividing {batch.train_batch_size} / {dp_world_size} = "
                  f"{batch.micro_batch_size}; grad_accum = {batch.grad_accum}")
    return BatchTriad(batch.train_batch_size, batch.micro_batch_size, batch.grad_accum, dp_world_size, derivation)


__all__ = ["ElasticitySection", "elastic_triad"]
