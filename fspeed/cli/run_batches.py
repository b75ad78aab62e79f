"""The training batches of an fspeed-train run, step by step: the loader, the curriculum's cut, and
progressive layer dropping's keep ratio; with their position for the checkpoint.

Without `data.epochs` the batch of step ``t`` is drawn with replacement (`data.Loader`, a pure
function of seed and step). With it, the corpus is cut into non-overlapping windows and read in
epochs (`data.loader`); the run ends after `data.epochs` epochs or `train.steps`, whichever comes
first, and the loader's `state_dict` rides in the checkpoint's client_state (`loader`). With
`curriculum.enabled` each batch is cut to the schedule's length of its step; with
`progressive_layer_drop.enabled` it carries the step's `LayerDrop` (keep ratio and draw seed).
With `curriculum.curriculum_type=vocab_rarity` (the data-efficiency curriculum) the batches are
drawn from the samples the schedule admits by a metric index, cached next to the corpus file
(`<corpus>.fspeed-index/`), in `curriculum.index_dir`, or under the checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .. import data
from ..config import ConfigError, Problem
from ..config.schema import RunConfig
from ..config.targets import TargetConfig
from ..data.curriculum import difficulty_at, truncate_to_seqlen
from ..models.layer_drop import PLD_BATCH_KEY, step_layer_drop, supports_layer_drop

LOADER_KEY = "loader"  # client_state key of the loader's position


class RunBatches:
    """This data rank's batch for each step of a run (module docstring)."""

    def __init__(self, run: RunConfig, train_rows: Any, data_rank: int, data_size: int, mesh: Any = None,
                 model: Any = None) -> None:
        t, triad = run.train, run.batch
        self.seed = t.seed
        epochs = None if isinstance(run.data, TargetConfig) else run.data.epochs
        self.curriculum = run.curriculum.to_schedule()
        self.pld = run.progressive_layer_drop if run.progressive_layer_drop.enabled else None
        self.by_metric = self.curriculum is not None and run.curriculum.curriculum_type != "seqlen"
        if self.curriculum is not None and not self.by_metric:
            self._check_curriculum(run)
        if self.pld is not None and model is not None and not supports_layer_drop(model):
            raise ConfigError([Problem("progressive_layer_drop.enabled", f"the model {model.name} does not read the "
                                       f"batch's {PLD_BATCH_KEY!r}, so no block would be dropped", True,
                                       "false, or the reference GPT, or a module whose forward takes layer_drop "
                                       "(fspeed.models.layer_drop.kept_blocks)")])
        self.loader: Any
        if self.by_metric and epochs is not None:
            raise ConfigError([Problem("data.epochs", f"does not apply with curriculum.curriculum_type="
                                       f"{run.curriculum.curriculum_type}: the curriculum chooses each step's samples",
                                       epochs, "null")])
        if self.by_metric:
            self.loader = self._metric_loader(run, train_rows, mesh, data_rank, data_size)
            self._iterator = iter(self.loader)
        elif epochs is None:
            self.loader = data.Loader(train_rows, data.BatchSampler(len(train_rows), triad.train_batch_size, t.seed,
                                                                    rank=data_rank, world_size=data_size))
        else:
            seq_len = run.model.seq_len
            windows = data.TokenWindows(train_rows.tokens, seq_len, stride=seq_len)
            try:
                self.loader = data.loader(windows, micro_batch_size=triad.micro_batch_size, grad_accum=triad.grad_accum,
                                          mesh=mesh, shuffle=run.data.shuffle, seed=t.seed,
                                          drop_last=run.data.drop_last, num_workers=run.data.num_workers,
                                          epochs=epochs)
            except ValueError as err:
                raise ConfigError([Problem("data.epochs", f"{err}", epochs)]) from None
            self._iterator = iter(self.loader)
        self.steps = t.steps if epochs is None or self.by_metric else min(t.steps, epochs * len(self.loader))

    def _metric_loader(self, run: RunConfig, rows: Any, mesh: Any, data_rank: int, data_size: int) -> Any:
        """The data-efficiency curriculum: batches from the samples the schedule admits by metric."""
        c, triad = run.curriculum, run.batch
        if isinstance(rows, data.TokenWindows):
            rows = data.TokenWindows(rows.tokens, rows.seq_len, stride=rows.seq_len)
            corpus = run.data.corpus
            default = f"{corpus}.fspeed-index/windows{rows.seq_len}" if corpus != "stdlib" else None
        else:
            default = None
        cache = c.index_dir or default or str(Path(run.checkpoint.dir) / "data_index")
        dataset = rows.dataset if isinstance(rows, data.DatasetRows) else rows
        try:
            values = data.metric_index(dataset, c.curriculum_type, cache)
            sampler = data.CurriculumSampler(values, self.curriculum, triad.train_batch_size, run.train.seed,
                                             difficulty_type=c.difficulty_type, rank=data_rank, world_size=data_size)
        except (TypeError, ValueError) as err:
            raise ConfigError([Problem("curriculum.curriculum_type", str(err), c.curriculum_type)]) from None
        self.index_path = Path(cache) / f"{c.curriculum_type}.pt"
        return data.loader(rows, micro_batch_size=triad.micro_batch_size, grad_accum=triad.grad_accum, mesh=mesh,
                           seed=run.train.seed, sampler=sampler)

    @staticmethod
    def _check_curriculum(run: RunConfig) -> None:
        schedule, seq_len = run.curriculum.to_schedule(), getattr(run.model, "seq_len", None)
        if seq_len is not None and schedule.max_difficulty > seq_len:
            raise ConfigError([Problem("curriculum.max_difficulty", f"exceeds model.seq_len={seq_len}, the length of "
                                       "the batches it cuts", schedule.max_difficulty, f"<= {seq_len}")])
        if schedule.lowest < 1:
            raise ConfigError([Problem("curriculum.min_difficulty", f"rounds down to a sequence length of "
                                       f"{schedule.lowest} with difficulty_step={schedule.difficulty_step} (DeepSpeed "
                                       "subtracts d % difficulty_step)", schedule.min_difficulty,
                                       f">= {schedule.difficulty_step}")])

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics `batch` adds to each step's row."""
        if self.by_metric:
            return ("curriculum_difficulty",) + (("pld_theta",) if self.pld is not None else ())
        return (("curriculum_seqlen",) if self.curriculum is not None else ()) + \
            (("pld_theta",) if self.pld is not None else ())

    def summary(self) -> str:
        parts = []
        if isinstance(self.loader, data.EpochLoader) and self.loader.epochs is not None:
            parts.append(f"{self.loader.epochs} epochs of {len(self.loader)} steps")
        if self.by_metric:
            c = self.curriculum
            parts.append(f"data-efficiency curriculum {c.schedule_type} by {self.loader.sampler.difficulty_type} "
                         f"{c.min_difficulty}->{c.max_difficulty} (index {self.index_path})")
        elif self.curriculum is not None:
            parts.append(f"curriculum {self.curriculum.schedule_type} seqlen {self.curriculum.min_difficulty}->"
                         f"{self.curriculum.max_difficulty}")
        if self.pld is not None:
            parts.append(f"progressive layer drop theta {self.pld.theta} gamma {self.pld.gamma}")
        return ", ".join(parts)

    def batch(self, step: int) -> tuple[Any, dict[str, float]]:
        """(the batch of ``step``, its metrics: curriculum_seqlen, pld_theta where enabled)."""
        if isinstance(self.loader, data.EpochLoader):
            if self.loader.step != step:
                raise RuntimeError(f"the loader is at step {self.loader.step}, the run at {step}")
            batch = next(self._iterator)
        else:
            batch = self.loader.batch(step)
        metrics: dict[str, float] = {}
        if self.by_metric:
            metrics["curriculum_difficulty"] = difficulty_at(self.curriculum, step)
        elif self.curriculum is not None:
            seqlen = difficulty_at(self.curriculum, step)
            batch = truncate_to_seqlen(batch, seqlen)
            metrics["curriculum_seqlen"] = seqlen
        if self.pld is not None:
            if not isinstance(batch, dict):
                raise ConfigError([Problem("progressive_layer_drop.enabled", f"needs dict batches (the model reads "
                                           f"the step's layer drop under {PLD_BATCH_KEY!r}), got "
                                           f"{type(batch).__name__}", True)])
            drop = step_layer_drop(step, self.seed, self.pld.theta, self.pld.gamma)
            batch = {**batch, PLD_BATCH_KEY: drop}
            metrics["pld_theta"] = drop.theta
        return batch, metrics

    def state_dict(self) -> Optional[dict]:
        return self.loader.state_dict() if isinstance(self.loader, data.EpochLoader) else None

    def resume(self, client_state: dict, step: int) -> None:
        """Continue at ``step`` from a checkpoint's client_state (its saved loader position)."""
        if not isinstance(self.loader, data.EpochLoader):
            return
        saved = client_state.get(LOADER_KEY)
        if saved is None:
            raise ConfigError([Problem("data.epochs", "the checkpoint being resumed has no loader position (it was "
                                       "trained without data.epochs)", self.loader.epochs)])
        try:
            self.loader.load_state_dict(saved)
        except ValueError as err:
            raise ConfigError([Problem("data", str(err))]) from None
        if self.loader.step != step:
            raise ConfigError([Problem("data", f"the checkpoint's loader is at step {self.loader.step} but its "
                                       f"state at step {step}")])
        self._iterator = iter(self.loader)


__all__ = ["LOADER_KEY", "RunBatches"]
