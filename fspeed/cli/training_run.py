"""One run of fspeed-train on this rank: the job (the corpus GPT or a user's model and data), the
parallel layout and the state (resumed, restarted or new), the steps with their logging,
evaluation, checkpoints and stop requests, and the summary at the end (`run_training`).

`fspeed.cli.train` is the command around it: the checks, `--launch`, the Hydra app.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

from .. import checkpoint, data
from ..checkpoint import CheckpointError
from ..config import ConfigError, Problem
from ..config.build import (
    apply_activation_checkpointing, build_device, build_model_config, build_optimizer, build_precision,
    build_zero_config,
)
from ..config.schema import Bf16Config, RunConfig
from ..config.targets import TargetConfig
from ..engine import fs_rules
from ..eval_step import make_eval_step
from ..remat_budget import remat_within_budget
from ..rematerialization import RematProfile
from ..loss_scale import LossScaleAtMinimumError
from ..micro_batches import split_micro_batches
from ..models import GPT_RULES, Model, count_params, gpt
from ..monitor import comm_scalars
from ..parallel import CommLog, Mesh, Plan, estimate_memory, init_distributed, profiled_partition, tensor_slicing, zero
from ..parallel.memory import state_bytes_per_parameter
from ..train_init import init_train_state
from ..train_state import TrainState
from ..timers import METRIC_KEYS, breakdown_summary
from ..train_step import NonFiniteError, make_train_step
from .observe import (DEVICE_PEAKS_DIR, FlopsWatch, check_monitor_packages, finish_lr_range_test, metrics_csv_path,
                      open_monitors, progress_line, record_device_peak, step_timers)
from .goodput import CLIENT_STATE_KEY as GOODPUT_KEY, COLUMNS as GOODPUT_COLUMNS, Goodput, GoodputLedger
from .restarts import (
    AttemptRecord, agent_failures, describe_failure, restarts_possible, step_error, world_change, world_size,
)
from .run_batches import LOADER_KEY, RunBatches
from .resume import nothing_to_resume_line, resumable_tag, saved_tokenizer
from .resumed_world import BATCH_KEY, batch_for_resume, batch_record
from .run_data import prepare_data
from .stop_requests import StopRequests, TrainingStopped
from .user_errors import record_for_the_launcher
from .user_job import build_user_data, build_user_model

log = logging.getLogger("fspeed")


def _parallel_setup(run: RunConfig, rules, model: Model, train_rows: Any, device: Optional[torch.device]):
    """(mesh, plan) for this run: None, None for a plain single process. `rules`: the model's
    tensor-slicing rules (used when parallel.tensor > 1); `model` and its first training micro-batch
    (from `train_rows`) for pipeline.partition=profile."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and run.zero.stage == 0 and run.parallel.tensor == 1 and run.parallel.pipe == 1:
        return None, None
    if world > 1:
        init_distributed(timeout_s=run.parallel.timeout_s)
    log_comms = CommLog(enabled=run.comms_logger.enabled, verbose=run.comms_logger.verbose)
    mesh = Mesh(data=run.parallel.data, model=run.parallel.tensor, pipe=run.parallel.pipe, log=log_comms)
    plan = zero(build_zero_config(run))  # stage, buckets, overlap, prefetch and the offload blocks
    if run.parallel.tensor > 1:
        plan = plan | tensor_slicing(rules)
    if run.parallel.pipe > 1:
        interval = run.pipeline.activation_checkpoint_interval
        remat = run.activation_checkpointing.to_library() if interval else None
        plan = plan | run.pipeline.to_library(run.batch.grad_accum, remat)
        first = torch.arange(min(run.batch.micro_batch_size, len(train_rows)))
        plan = profiled_partition(plan, model, lambda: train_rows.get(first), run.parallel.pipe, device)
    return mesh, plan


@dataclass
class _Job:
    """What a run trains: the model, the rows its batches are drawn from, what checkpoints carry."""

    model: Model
    train_rows: Any  # data.TokenWindows or data.DatasetRows
    val_rows: Any  # the same, or None: no validation
    client_state: dict[str, Any]
    summary: str  # for the opening log line
    tokens_per_row: Optional[int]  # for tok/s (None: the rows are samples of a user's dataset)
    rules: Any  # tensor-slicing rules for the model


def _corpus_job(run: RunConfig, ckpt_dir: Path, resume_tag: Optional[str]) -> _Job:
    """The built-in job: the reference GPT on the configured text corpus."""
    run_data = prepare_data(run, saved_tokenizer(ckpt_dir, resume_tag))
    tokenizer = run_data.tokenizer
    model_cfg = build_model_config(run, tokenizer.vocab_size)
    client_state = {"tokenizer": tokenizer.to_dict(), "model": asdict(model_cfg)}
    vocab = f"vocab {tokenizer.vocab_size} ({tokenizer.kind})"
    if model_cfg.vocab_size != tokenizer.vocab_size:  # padded: fspeed-export drops the extra rows again
        rows = ["wte"] if model_cfg.tie_embeddings else ["wte", "head"]
        client_state[checkpoint.VOCAB_KEY] = {"size": tokenizer.vocab_size, "padded_size": model_cfg.vocab_size,
                                              "tensors": rows}
        vocab = (f"vocab {tokenizer.vocab_size} ({tokenizer.kind}; the embedding has {model_cfg.vocab_size} rows, "
                 f"padded to a multiple of {8 * run.parallel.tensor})")
    return _Job(gpt(model_cfg), run_data.train, run_data.val, client_state,
                f"{vocab}, {run_data.num_tokens:,} tokens "
                f"({len(run_data.train)} train / {len(run_data.val)} val windows of {run.model.seq_len})",
                run.model.seq_len, GPT_RULES)


def _user_job(run: RunConfig, device: Optional[torch.device]) -> _Job:
    """A user's model and data (`model._target_`, `data._target_`; see `user_job`)."""
    train_rows, val_rows = build_user_data(run)
    rows = torch.arange(min(run.batch.micro_batch_size, len(train_rows)))
    model = build_user_model(run, device, example=train_rows.get(rows) if run.parallel.pipe > 1 else None)
    rules = fs_rules(model) if run.parallel.tensor > 1 else None
    val = f"{len(val_rows)} validation samples" if val_rows is not None else "no validation data"
    return _Job(model, train_rows, val_rows, {"model_target": str(run.model), "data_target": str(run.data)},
                f"model {run.model}, data {run.data}: {len(train_rows)} training samples, {val}", None, rules)


def run_training(run: RunConfig, out_dir: Path) -> dict[str, Any]:
    """Train the configured GPT; returns a summary (val loss at start and end, paths, timing).

    Under a launcher (WORLD_SIZE > 1) every rank runs this: each data rank trains on its share of
    every global batch; rank 0 alone logs, writes metrics and saves.
    """
    training = _TrainingRun(run, out_dir)
    training.train()
    return training.finish()


class _TrainingRun:
    """One run of `fspeed-train`: set up from the config (`__init__`: the job, the parallel layout, the
    state, resumed or initialized, the step), trained (`train`: the loop, its metrics, evaluation,
    saves and stop requests), then saved and summarized (`finish`)."""

    def __init__(self, run: RunConfig, out_dir: Path):
        rank = int(os.environ.get("RANK", "0"))
        self.ledger = GoodputLedger(out_dir, persist=rank == 0 and restarts_possible())
        self.record = AttemptRecord(out_dir, rank, enabled=restarts_possible())
        self.ckpt_dir = Path(run.checkpoint.dir)
        resume_tag = resumable_tag(run, out_dir, restarted=self.record.attempt > 0)
        run = batch_for_resume(run, self.ckpt_dir, resume_tag)  # the saved global batch on another world size
        self.run, self.out_dir = run, out_dir
        t, triad = run.train, run.batch
        check_monitor_packages(run)
        torch.manual_seed(t.seed)
        t0 = time.perf_counter()
        self.pending_save: Optional[checkpoint.AsyncSave] = None  # checkpoint.async_save's save in flight
        device = self.device = build_device(run)
        job = _user_job(run, device) if isinstance(run.model, TargetConfig) else \
            _corpus_job(run, self.ckpt_dir, resume_tag)
        self.job, self.client_state = job, {**job.client_state, BATCH_KEY: batch_record(run)}
        model, self.remat_profile = apply_activation_checkpointing(run, job.model)
        mesh, plan = self.mesh, self.plan = _parallel_setup(run, job.rules, model, job.train_rows, device)
        self.lead = mesh is None or mesh.rank == 0
        if not self.lead:
            log.setLevel(logging.WARNING)
            logging.getLogger("fspeed.config").setLevel(logging.ERROR)  # what the config implies: rank 0 says it
        dp, data_rank = (mesh.size("data"), mesh.coordinate("data")) if mesh else (1, 0)
        self.batches = RunBatches(run, job.train_rows, data_rank, dp, mesh, model)
        self.val_batches = [] if job.val_rows is None else data.Loader(
            job.val_rows, data.BatchSampler(len(job.val_rows), triad.micro_batch_size * dp, t.seed, rank=data_rank,
                                            world_size=dp)).eval_batches(t.eval_batches)
        optimizer = build_optimizer(run)
        precision = build_precision(run)
        params = model.init(torch.Generator().manual_seed(t.seed))
        model, activations = _within_remat_budget(run, model, params, job.train_rows, data_rank, dp)
        self.model = model
        state = init_train_state(params, optimizer, precision=precision, seed=t.seed, device=device, plan=plan,
                                 mesh=mesh, model=model)
        self.state = self._resumed_or_initialized(state, resume_tag)
        log.info(
            "%s: %s parameters, %s, batch %s, optimizer %s, precision %s, %s; data ready in %.1fs",
            model.name, f"{count_params(params):,}", ", ".join(filter(None, (job.summary, self.batches.summary()))),
            triad.derivation, optimizer, precision.name,
            f"{plan!r} on {mesh!r}" if plan else "one process", time.perf_counter() - t0,
        )
        log.info("%s", estimate_memory(params, plan or Plan(), mesh.sizes if mesh else {"data": 1}, precision,
                                       optimizer_state_bytes=state_bytes_per_parameter(optimizer),
                                       logical_axes=model.logical_axes, activations=activations,
                                       layers=model.layers))
        if self.state.layout.pipeline is not None:
            log.info("pipeline stages:\n%s", self.state.layout.pipeline.describe())
        self.timers = step_timers(run)
        stepped = model if self.state.layout.pipeline is not None else model.loss  # a pipeline runs the layers
        self.train_step = make_train_step(stepped, optimizer, grad_accum=triad.grad_accum, plan=plan, mesh=mesh,
                                          on_nonfinite=on_nonfinite_policy(run), timers=self.timers)
        self.eval_step = make_eval_step(stepped, plan=plan, mesh=mesh)

    def _resumed_or_initialized(self, state: TrainState, resume_tag: Optional[str]) -> TrainState:
        """`state` after the checks before the first step (can every rank save, with room for one
        checkpoint?), resumed from `resume_tag`, or with the weights of checkpoint.init_from."""
        run, mesh = self.run, self.mesh
        self.resumed = resume_tag is not None
        try:
            checkpoint.preflight(self.ckpt_dir, state, mesh=mesh)
        except CheckpointError as e:
            raise ConfigError([Problem("checkpoint.dir", str(e))]) from None
        if resume_tag is not None:
            state, saved_client_state = checkpoint.load_checkpoint(self.ckpt_dir, state, tag=resume_tag, mesh=mesh)
            self.batches.resume(saved_client_state, state.step)
            self.ledger.resumed(saved_client_state, state.step)
            log.info("resumed from %s at step %d", self.ckpt_dir / resume_tag, state.step)
        elif self.record.attempt > 0 and self.lead:
            log.warning("restarted before the first checkpoint (%s): training starts again from step 0",
                        self.ckpt_dir)
        elif run.checkpoint.resume and self.lead:
            log.warning("%s", nothing_to_resume_line(run, self.out_dir))
        if self.record.attempt > 0:
            self._restarted_after_failure(resume_tag, state.step)
        if resume_tag is None and run.checkpoint.init_from:  # fine-tuning: weights only, a fresh optimizer
            try:
                state = checkpoint.init_from_weights(state, run.checkpoint.init_from)
            except CheckpointError as e:
                raise ConfigError([Problem("checkpoint.init_from", str(e))]) from None
            log.info("weights from %s", run.checkpoint.init_from)
        return state

    def _restarted_after_failure(self, resume_tag: Optional[str], step: int) -> None:
        """A restarted attempt (`restarts`): record the restart and (rank 0) say what failed, where this
        attempt resumes and how many steps it redoes."""
        records = self.record.previous_attempt()
        failure = describe_failure(records, agent_failures(self.record.attempt - 1))
        last_step = max((r.step for r in records), default=step)
        restart = self.ledger.restarted(failure, step, last_step)
        if self.lead:
            limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            start = f"{self.ckpt_dir / resume_tag} (step {step})" if resume_tag else "step 0 (no checkpoint yet)"
            changed = world_change(records, world_size())
            log.warning("restart %d of %s: attempt %d failed: %s; %sresumed from %s, %d step%s lost (the failed "
                        "attempt had reached step %d)", self.record.attempt, limit, self.record.attempt - 1, failure,
                        f"{changed}; " if changed else "", start, restart["steps_redone"],
                        "" if restart["steps_redone"] == 1 else "s", last_step)
            if self.ledger.lost_start:
                log.warning("restarts/run.json is missing from %s: goodput counts from this attempt's start",
                            self.out_dir)

    def save(self, state: TrainState, background: bool = False) -> Optional[Path]:
        """A checkpoint of `state` with the run's client state (with the goodput count, for a restart);
        with a mesh, a collective: every rank writes its own shard. A save in flight is finished first
        (at most one); `background` starts the save in a thread and returns None (`poll_save` reports it)."""
        self.finish_save()
        loader_state = self.batches.state_dict()
        client = {**self.client_state, GOODPUT_KEY: self.ledger.client_state()}
        if loader_state is not None:
            client[LOADER_KEY] = loader_state
        saved = checkpoint.save_checkpoint(self.ckpt_dir, state, client_state=client, mesh=self.mesh,
                                           keep_last=self.run.checkpoint.keep_last, blocking=not background)
        if background:
            self.pending_save = saved
            return None
        return saved

    def finish_save(self) -> None:
        """Wait for the save in flight, if any; its CheckpointError is raised here."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            path = pending.wait()
            log.info("checkpoint %s written in the background in %.1fs", path, pending.seconds)

    def poll_save(self) -> None:
        """After a step: finish the save in flight once every rank's has finished (so that every rank
        reports a failure at the same step)."""
        pending = self.pending_save
        if pending is None:
            return
        done = float(pending.done())
        if self.mesh is not None:
            done = self.mesh.all_reduce_scalar(done, "min")
        if done:
            self.finish_save()

    def _settle_save(self) -> None:
        """On the way out of a failed run: wait for the save in flight and log (not raise) its failure."""
        try:
            self.finish_save()
        except CheckpointError as e:
            log.error("%s", e)

    def evaluate(self, state: TrainState) -> Optional[float]:
        """The mean validation loss, or None without validation data."""
        if not self.val_batches:
            return None
        return sum(self.eval_step(state, b) for b in self.val_batches) / len(self.val_batches)

    def train(self) -> None:
        """Steps until the configured count (module docstring: a stop request, a divergence or a
        failure saves the last good step first, where it can)."""
        run = self.run
        self.flops_watch = FlopsWatch(run, self.model, self.mesh, self.lead, run.batch.grad_accum)
        self.monitor = open_monitors(run, self.out_dir, self.batches.metric_names + GOODPUT_COLUMNS,
                                     self.state.step if self.resumed or self.record.attempt > 0 else None) \
            if self.lead else None
        self.breakdowns: list[dict[str, float]] = []
        self.remat_sums: dict[str, dict[str, float]] = {}  # activation_checkpointing.profile: ms per block
        self.first_step = self.state.step
        self.goodput: Optional[Goodput] = None
        self.lr_curve: list[tuple[float, float]] = []  # scheduler=lr_range_test: (lr, loss) of each applied step
        self.val_start = self.evaluate(self.state)
        if self.val_start is not None:
            log.info("step %d: val_loss %.4f", self.state.step, self.val_start)
            if self.monitor:
                self.monitor.write({"step": self.state.step, "samples": self.state.samples,
                                    "val_loss": self.val_start})
        self.bar = _progress_bar(run, self.state.step, self.batches.steps) if self.lead else None
        self.val_loss, self.metrics = self.val_start, {}
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.train_start = time.perf_counter()
        self.ledger.training_starts(self.state.step)
        stops = StopRequests() if run.checkpoint.save_on_failure else nullcontext()
        activity = f"step {self.state.step + 1}"
        with stops:
            try:
                while self.state.step < self.batches.steps:
                    activity = f"step {self.state.step + 1}"
                    self._step()
                    self.record.stepped(self.state.step)
                    last = self.state.step == self.batches.steps
                    activity = "the background save in flight"
                    self.poll_save()
                    if run.checkpoint.save_every and self.state.step % run.checkpoint.save_every == 0 and not last:
                        activity = f"the save of step {self.state.step}"
                        self.save(self.state, background=run.checkpoint.async_save)
                    signum = stops.agreed(self.mesh) if isinstance(stops, StopRequests) else None
                    if signum and not last:
                        raise TrainingStopped(signum, self.state.step)
            except BaseException as error:
                self._settle_save()
                if isinstance(error, Exception) and not isinstance(error, TrainingStopped):
                    text = step_error(error, activity)
                    if text == self.record.previous_error:  # said once, in full, by the attempt before
                        error.repeated_in_attempt = self.record.attempt - 1
                    self.record.stepped(self.state.step, text)
                    record_for_the_launcher(text)  # what the agent compares to see a failure repeat
                if run.checkpoint.save_on_failure:
                    _save_last_good_step(error, self.state, self.save, self.mesh, self.ckpt_dir)
                raise
            finally:
                if self.bar is not None:
                    self.bar.close()
                if self.monitor:
                    if self.mesh is not None:
                        self.monitor.write_scalars(comm_scalars(self.mesh.log), self.state.step)
                    self.monitor.close()

    def _step(self) -> None:
        """One training step, and its row of metrics: recorded, evaluated on schedule, written, shown."""
        t = self.run.train
        started = time.perf_counter()
        batch, batch_metrics = self.batches.batch(self.state.step)
        self.flops_watch.before_step(self.state, batch)
        self.state, self.metrics = self.train_step(self.state, batch)
        self.ledger.step_took(time.perf_counter() - started)
        state, metrics = self.state, self.metrics
        self.window_steps += 1
        samples_per_s = self.window_steps * self.run.batch.train_batch_size / (time.perf_counter() - self.window_start)
        row = {k: metrics[k] for k in ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped")}
        row.update(samples=state.samples, samples_per_s=samples_per_s,
                   elapsed_s=time.perf_counter() - self.train_start, **batch_metrics)
        if self.job.tokens_per_row:
            row["tokens_per_s"] = samples_per_s * batch_metrics.get("curriculum_seqlen", self.job.tokens_per_row)
        if self.run.scheduler.name == "lr_range_test" and not metrics["skipped"]:
            self.lr_curve.append((metrics["lr"], metrics["loss"]))
        if self.remat_profile is not None:
            sums = self.remat_profile.take()
            self.remat_profile.merge(self.remat_sums, sums)
            row.update(self.remat_profile.totals(sums))
        if self.timers is not None:
            self.breakdowns.append({k: metrics[k] for k in METRIC_KEYS})
            row.update(self.breakdowns[-1])
            self.flops_watch.after_step(state, metrics, row)
        last = state.step == self.batches.steps
        if self.val_batches and ((t.eval_every and state.step % t.eval_every == 0) or last):
            self.val_loss = self.evaluate(state)
            row["val_loss"] = self.val_loss
        if last:  # the run's goodput, at the end of its last step (before the final checkpoint)
            self.goodput = self.ledger.report()
            row.update(self.goodput.row())
        if self.monitor:
            self.monitor.write(row)
            if last:
                self.monitor.write_scalars(self.goodput.scalars(), state.step)
        if self.bar is not None:
            rate = {"tok_s": f"{row['tokens_per_s']:,.0f}"} if "tokens_per_s" in row \
                else {"samples_s": f"{samples_per_s:,.1f}"}
            val = {"val": f"{self.val_loss:.3f}"} if self.val_loss is not None else {}
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", **rate, **val,
                                 refresh=False)
            self.bar.update(1)
        if self.lead and (state.step % (t.steps_per_print or t.log_every) == 0 or last or "val_loss" in row):
            _log_line(row, self.bar)
            self.window_start, self.window_steps = time.perf_counter(), 0

    def finish(self) -> dict[str, Any]:
        """The final checkpoint and the run's summary; rank 0 prints it (with the communication,
        breakdown and remat tables the run collected)."""
        run, state, val_start, val_loss = self.run, self.state, self.val_start, self.val_loss
        path = self.save(state)
        train_time = time.perf_counter() - self.train_start
        drop = 1.0 - val_loss / val_start if val_start is not None else None
        goodput = self.goodput or self.ledger.report()  # the latter: no step left to train (resumed at the end)
        summary = {
            "val_loss_start": val_start, "val_loss_end": val_loss, "val_loss_drop": drop,
            "steps": state.step, "skipped_steps": state.skipped_steps, "train_seconds": train_time,
            "checkpoint": str(path), "metrics_csv": str(metrics_csv_path(run, self.out_dir) or "") or None,
            "goodput": goodput.value, "restarts": goodput.restarts, "steps_redone": goodput.steps_redone,
            "seconds_lost": goodput.seconds_lost,
        }
        if self.device is not None and self.device.type == "cuda":
            summary["device_peak_bytes"] = record_device_peak(self.device, self.out_dir)
        if not self.lead:
            return summary
        if self.mesh is not None and run.comms_logger.enabled:
            print("\ncommunication (rank 0):\n" + self.mesh.log.summary())
        if self.breakdowns:
            print("\n" + breakdown_summary(self.breakdowns))
        if self.remat_sums:
            per_step = {block: {p: ms / max(state.step - self.first_step, 1) for p, ms in row.items()}
                        for block, row in self.remat_sums.items()}
            print("\nactivation checkpointing, ms per step:\n" + RematProfile.table(per_step))
        if self.lr_curve:
            summary["lr_range_test_lr"] = finish_lr_range_test(self.lr_curve, self.out_dir)
        if val_start is not None:
            print(f"\nval loss {val_start:.4f} -> {val_loss:.4f} ({drop:.0%} lower) after {state.step} steps "
                  f"({state.skipped_steps} skipped) in {train_time:.0f}s")
        else:
            print(f"\ntraining loss {self.metrics.get('loss', float('nan')):.4f} after {state.step} steps "
                  f"({state.skipped_steps} skipped) in {train_time:.0f}s (no validation data)")
        print(goodput.line())
        if "device_peak_bytes" in summary:
            print(f"device memory: peak {summary['device_peak_bytes'] / 2**30:.2f} GiB reserved on rank 0 (every "
                  f"rank's: {self.out_dir / DEVICE_PEAKS_DIR})")
        if summary["metrics_csv"]:
            print(f"metrics:    {summary['metrics_csv']}")
        same = " and the same zero/parallel settings" if self.mesh is not None and self.mesh.world_size > 1 else ""
        print(f"checkpoint: {path}  (resume with checkpoint.resume=true checkpoint.dir={self.ckpt_dir}{same})")
        return summary


def _within_remat_budget(run: RunConfig, model: Model, params: Any, train_rows: Any, data_rank: int,
                         dp: int) -> tuple[Model, int]:
    """activation_checkpointing.budget_mib: (the model with the remat that fits it, the activation bytes
    it keeps), measured on a full-length micro-batch (the curriculum's longest); else (model, 0).
    Every rank measures the same, on its own."""
    if run.activation_checkpointing.budget_mib is None:
        return model, 0
    triad, seed = run.batch, run.train.seed
    sample = data.Loader(train_rows, data.BatchSampler(len(train_rows), triad.train_batch_size, seed,
                                                       rank=data_rank, world_size=dp)).batch(0)
    micro = split_micro_batches(sample, triad.grad_accum)[0]
    model, choice = remat_within_budget(model, params, micro, int(run.activation_checkpointing.budget_mib * 2**20))
    log.info("%s", choice)
    return model, choice.tried[-1][2]


def on_nonfinite_policy(run: RunConfig) -> Optional[str]:
    """`train.on_nonfinite` for make_train_step; None where bf16's check_grad_overflow=false turns checks off."""
    if isinstance(run.precision, Bf16Config) and not run.precision.check_grad_overflow:
        return None
    return run.train.on_nonfinite


_AGREED = (TrainingStopped, NonFiniteError, LossScaleAtMinimumError)  # every rank raises these at the same step


def _save_last_good_step(error: BaseException, state, save: Callable, mesh, ckpt_dir: Path) -> None:
    """checkpoint.save_on_failure: save `state` after `error` where that is possible and safe.

    It is safe after a signal stop or a divergence (raised before the step changed anything, at
    the same step on every rank) and, in a single process, after any other exception that left
    the state untouched. The saved path goes on the error as `final_checkpoint`; what could not
    be saved is logged with the reason.
    """
    if isinstance(error, CheckpointError) or not isinstance(error, Exception):
        return  # the save itself failed, or a second interrupt asks to leave now
    if not isinstance(error, _AGREED) and mesh is not None and mesh.world_size > 1:
        log.error("no final checkpoint: %s happened on this rank alone, and a multi-rank save needs every rank",
                  type(error).__name__)
        return
    if state.donated:
        log.error("no final checkpoint: the failing step had already started changing the state (%s)",
                  type(error).__name__)
        return
    try:
        path = save(state)
    except CheckpointError as e:
        log.error("could not save a final checkpoint: %s", e)
        return
    error.final_checkpoint = f"{path} (resume with checkpoint.resume=true checkpoint.dir={ckpt_dir})"
    if mesh is None or mesh.rank == 0:  # every rank saved its part of the one checkpoint
        log.warning("saved the last good step (%d) to %s before stopping", state.step, path)


def _progress_bar(run: RunConfig, start: int, total: int):
    """A one-line bar on a terminal; None (plain log lines every log_every / steps_per_print steps)
    when stderr is not a terminal (CI, a log file), where the bar's redraws would pile up."""
    if not run.monitor.progress_bar or not sys.stderr.isatty():
        return None
    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                mininterval=0.5, file=sys.stderr)


def _log_line(row: dict[str, Any], bar) -> None:
    line = progress_line(row)
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        log.info(line)
