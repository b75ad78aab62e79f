"""Data-efficiency curriculum: samples ordered by a difficulty metric, admitted as the schedule grows.

DeepSpeed's Data Efficiency library (`data_efficiency.data_sampling.curriculum_learning`) analyses
a dataset offline into a per-sample metric index, then at each step samples only from the samples
whose difficulty is within the schedule's current value, with the same pacing functions as the
legacy curriculum (`CurriculumSchedule`). Here:

    values = metric_index(dataset, "vocab_rarity", cache="data/train.fspeed-index")   # built once, cached
    sampler = CurriculumSampler(values, schedule, global_batch_size=64, seed=0, rank=r, world_size=dp)
    loader = fs.data.loader(dataset, micro_batch_size=8, mesh=mesh, sampler=sampler)

Metrics (per sample; a sample's tokens are its ``inputs`` tensor, or the sample itself):

* ``seqlen``: the number of tokens that are not ``pad_id``;
* ``vocab_rarity``: ``-sum(log p(token))`` over those tokens, ``p`` the token's frequency in the
  whole dataset (DeepSpeed's Megatron example metric): rarer words make a harder sample.

``difficulty_type``: ``value`` admits samples whose metric is at most the difficulty;
``percentile`` admits the easiest ``difficulty`` percent (the schedule runs from min to max
percent). At step ``t`` the global batch is drawn without replacement (with replacement when
fewer samples are admitted than the batch holds) from the admitted ones, by a generator keyed by
(seed, step): a pure function of the step, so resume is exact, and the data ranks take contiguous
shares as in `EpochSampler`. The index is saved with the dataset's length, the metric and a
fingerprint of samples it read, and rebuilt when any of them differs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import torch

from fspeed.data.curriculum import CurriculumSchedule, difficulty_at
from fspeed.data.loader import _as_int, _generator

METRICS = ("seqlen", "vocab_rarity")
DIFFICULTY_TYPES = ("value", "percentile")


def _tokens(sample: Any) -> torch.Tensor:
    tokens = sample.get("inputs", sample.get("input_ids")) if isinstance(sample, dict) else sample
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point():
        raise TypeError(f"a difficulty metric reads a sample's integer tokens (a tensor, or a dict with 'inputs' or "
                        f"'input_ids'), got {type(tokens).__name__}")
    return tokens.reshape(-1).long()


def compute_metric(dataset: Any, metric: str, pad_id: Optional[int] = None) -> torch.Tensor:
    """The per-sample values of ``metric`` (float64, one per sample, in index order)."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}; allowed: {', '.join(METRICS)}")
    samples = [_tokens(dataset[i]) for i in range(len(dataset))]
    if pad_id is not None:
        samples = [s[s != pad_id] for s in samples]
    if metric == "seqlen":
        return torch.tensor([s.numel() for s in samples], dtype=torch.float64)
    counts = torch.bincount(torch.cat(samples)).double()
    log_p = torch.log(counts / counts.sum())
    return torch.stack([-log_p[s].sum() for s in samples])


def _fingerprint(dataset: Any, metric: str, pad_id: Optional[int]) -> str:
    n = len(dataset)
    probe = sorted({0, n // 3, n // 2, n - 1})
    digest = hashlib.blake2b(repr((n, metric, pad_id)).encode(), digest_size=16)
    for i in probe:
        digest.update(_tokens(dataset[i]).numpy().tobytes())
    return digest.hexdigest()


def metric_index(dataset: Any, metric: str, cache: Optional[str | os.PathLike] = None,
                 pad_id: Optional[int] = None) -> torch.Tensor:
    """`compute_metric`, loaded from ``cache/<metric>.pt`` when that was built for this dataset, else
    computed and saved there (atomically) for the next run."""
    if cache is None:
        return compute_metric(dataset, metric, pad_id)
    path = Path(cache) / f"{metric}.pt"
    key = _fingerprint(dataset, metric, pad_id)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved.get("fingerprint") == key and saved["values"].numel() == len(dataset):
            return saved["values"]
    values = compute_metric(dataset, metric, pad_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"fingerprint": key, "metric": metric, "values": values}, partial)
    os.replace(partial, path)
    return values


class CurriculumSampler:
    """The indices of every step under a data-efficiency curriculum (module docstring); usable as
    `fspeed.data.loader`'s ``sampler``."""

    def __init__(self, values: torch.Tensor, schedule: CurriculumSchedule, global_batch_size: int, seed: int = 0,
                 *, difficulty_type: str = "value", rank: int = 0, world_size: int = 1) -> None:
        if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() < 1:
            raise ValueError("values must be a non-empty 1-D tensor (one metric value per sample)")
        if difficulty_type not in DIFFICULTY_TYPES:
            raise ValueError(f"difficulty_type={difficulty_type!r}; allowed: {', '.join(DIFFICULTY_TYPES)}")
        if difficulty_type == "percentile" and not 0 < schedule.max_difficulty <= 100:
            raise ValueError(f"a percentile schedule runs within (0, 100], got max_difficulty="
                             f"{schedule.max_difficulty}")
        self.global_batch_size = _as_int("global_batch_size", global_batch_size, minimum=1)
        self.world_size = _as_int("world_size", world_size, minimum=1)
        self.rank = _as_int("rank", rank)
        if not 0 <= self.rank < self.world_size or self.global_batch_size % self.world_size:
            raise ValueError(f"rank {self.rank} of {self.world_size} data ranks with global_batch_size="
                             f"{self.global_batch_size}: the rank must be in range and the batch divisible")
        self.values, self.schedule, self.seed = values.double(), schedule, _as_int("seed", seed)
        self.difficulty_type, self.num_samples = difficulty_type, values.numel()
        self.order = torch.sort(self.values, stable=True).indices  # easiest first
        self.drop_last = True
        if self.admitted(0).numel() == 0:
            raise ValueError(f"no sample is admitted at the first difficulty {self.difficulty(0)} (the easiest has "
                             f"{float(self.values.min()):g}); lower min_difficulty")

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_samples // self.global_batch_size)

    def position(self, step: int) -> tuple[int, int]:
        return divmod(_as_int("step", step, minimum=0), self.steps_per_epoch)

    def difficulty(self, step: int) -> int:
        return difficulty_at(self.schedule, step)

    def admitted(self, step: int) -> torch.Tensor:
        """The sample indices the curriculum admits at ``step``, easiest first."""
        d = self.difficulty(step)
        if self.difficulty_type == "percentile":
            return self.order[:self.num_samples * d // 100]
        return self.order[:int(torch.searchsorted(self.values[self.order], float(d), right=True))]

    def global_indices(self, step: int) -> torch.Tensor:
        pool = self.admitted(step)
        generator = _generator("curriculum", self.seed, _as_int("step", step, minimum=0))
        if pool.numel() >= self.global_batch_size:
            return pool[torch.randperm(pool.numel(), generator=generator)[:self.global_batch_size]]
        return pool[torch.randint(0, pool.numel(), (self.global_batch_size,), generator=generator)]

    def indices(self, step: int) -> torch.Tensor:
        begin = self.rank * self.local_batch_size
        return self.global_indices(step)[begin:begin + self.local_batch_size].clone()


__all__ = ["DIFFICULTY_TYPES", "METRICS", "CurriculumSampler", "compute_metric", "metric_index"]
