"""`fspeed-train`: the Hydra app that trains the reference GPT from config.

    fspeed-train                                        # the default job (char GPT on the stdlib)
    fspeed-train optimizer=lamb precision=bf16 scheduler=one_cycle train.steps=500 train.grad_accum=4
    fspeed-train deepspeed_config=ds_config.json        # a DeepSpeed config, translated
    fspeed-train --cfg job                              # print the composed config

    fspeed-train --debug ...                            # tracebacks instead of one-line errors
    fspeed-train --help                                 # these flags, then Hydra's help (groups, keys)

Overrides are checked against fspeed's schema before Hydra composes them, and the composed
config is validated again (types, ranges, unknown keys, the batch triad) before any work starts;
so are the corpus (`run_data`) and the checkpoint directory (writable, with room for one
checkpoint). A user's error is one message and exit code 2 (`user_errors`); with `--launch`
these checks run once, before the ranks start. Nothing is lost once training runs: SIGTERM or
SIGINT stop after the current step (`stop_requests`), a divergence stops before the bad step is
applied, and with `checkpoint.save_on_failure` (the default) the last good step is saved first.
With `--launch --max_restarts N` a failed rank restarts the group, which resumes from the newest
checkpoint by itself (`restarts`); every run ends with its goodput (`goodput`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
import torch
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from .. import checkpoint, data
from ..checkpoint import CheckpointError
from ..config import ConfigError, Problem, prepare_overrides, to_run_config
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
from ..host_memory import retain_freed_host_memory
from ..loss_scale import LossScaleAtMinimumError
from ..micro_batches import split_micro_batches
from ..models import GPT_RULES, Model, count_params, gpt
from ..monitor import comm_scalars
from ..parallel import (CommLog, Mesh, Plan, estimate_memory, init_distributed, profiled_partition,
                        shutdown_distributed, tensor_slicing, zero)
from ..parallel.memory import state_bytes_per_parameter
from ..train_init import init_train_state
from ..train_state import TrainState
from ..timers import METRIC_KEYS, breakdown_summary
from ..train_step import NonFiniteError, make_train_step
from .observe import (DEVICE_PEAKS_DIR, FlopsWatch, check_monitor_packages, finish_lr_range_test, metrics_csv_path,
                      open_monitors, progress_line, record_device_peak, step_timers)
from .goodput import CLIENT_STATE_KEY as GOODPUT_KEY, COLUMNS as GOODPUT_COLUMNS, Goodput, GoodputLedger
from .restarts import (
    AttemptRecord, agent_failures, describe_failure, restart_count, restarts_possible, step_error, world_change,
    world_size,
)
from .run_batches import LOADER_KEY, RunBatches
from .resume import nothing_to_resume_line, resumable_tag, saved_tokenizer
from .resumed_world import BATCH_KEY, batch_for_resume, batch_record
from .run_data import prepare_data
from .stop_requests import StopRequests, TrainingStopped
from .user_errors import (DEBUG_ENV, USER_ERRORS, debug_requested, exit_with_user_error, raised_on_every_rank,
                          record_for_the_launcher)
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


_LAUNCH_HINT = "start the ranks with fspeed-train --launch (or fspeed --num_gpus N, or torchrun)"
_RESTARTED_HINT = ("a restart came back with another world (fspeed --nnodes); parallel.data=-1 continues on the ranks "
                   "that remain")


def data_parallel_size(cfg: DictConfig) -> int:
    """The data-parallel degree of a launch: from WORLD_SIZE and parallel.tensor x parallel.pipe / parallel.data."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tensor, pipe, data_size = int(cfg.parallel.tensor), int(cfg.parallel.get("pipe", 1)), int(cfg.parallel.data)
    model = tensor * pipe
    names = [f"parallel.{k}={v}" for k, v in (("tensor", tensor), ("pipe", pipe)) if v > 1]
    key = "parallel.pipe" if pipe > 1 and tensor == 1 else "parallel.tensor"
    if data_size == -1:
        if world % model:
            both = f" ({' x '.join(names)})" if len(names) > 1 else ""
            raise ConfigError([Problem(key, f"needs {model} ranks per model replica{both}, and the world size {world} "
                                       f"is not a multiple of {model}", pipe if key == "parallel.pipe" else tensor,
                                       hint=_LAUNCH_HINT if world == 1 else f"launch a multiple of {model} ranks")])
        return world // model
    if data_size * model != world:
        product = " x ".join([f"parallel.data={data_size}", *names])
        raise ConfigError([Problem("parallel.data", f"{product} = {data_size * model} ranks, but the world size is "
                                   f"{world}", data_size, f"{world // model} or -1" if world % model == 0 else None,
                                   _RESTARTED_HINT if restart_count() > 0 else _LAUNCH_HINT if world == 1 else None)])
    return data_size


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


@hydra.main(config_path="pkg://fspeed.conf", config_name="train", version_base=None)
def _hydra_app(cfg: DictConfig) -> Optional[float]:
    rank = int(os.environ.get("RANK", "0"))
    run: Optional[RunConfig] = None
    try:
        run = to_run_config(cfg, dp_world_size=data_parallel_size(cfg))
        summary = run_training(run, Path(HydraConfig.get().runtime.output_dir))
    except TrainingStopped as stop:
        _leave_together()
        if rank == 0:
            saved = getattr(stop, "final_checkpoint", None)
            print(f"fspeed-train: {stop}" + (f"; saved {saved}" if saved else ""), file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)
    except USER_ERRORS as err:
        if debug_requested():
            raise
        if raised_on_every_rank(err):
            _leave_together()
        exit_with_user_error(err, rank, run.train.gradient_clipping if run is not None else None)
    except Exception as err:
        before = getattr(err, "repeated_in_attempt", None)
        if before is None or debug_requested():
            raise
        print(f"fspeed-train (rank {rank}): {type(err).__name__}: {err} (again: attempt {before} failed the same "
              "way at the same step; its traceback is above)", file=sys.stderr, flush=True)
        sys.exit(1)
    shutdown_distributed()
    return summary["val_loss_end"]


def _leave_together() -> None:
    """Tear the process group down after an error every rank raised alike (a no-op without one)."""
    try:
        shutdown_distributed()
    except Exception:  # a peer already gone: nothing more to do together
        pass


USAGE = """\
usage: fspeed-train [--launch] [--debug] [Hydra flags] [key=value ...]

Train the reference GPT (or model._target_ / data._target_: your own) from fspeed's config; every
key can be set on the command line. The config, the corpus and the checkpoint directory are
checked before any work starts: a mistake is one message naming the key, and exit code 2.

fspeed-train's flags:
  --launch       run parallel.data x parallel.tensor x parallel.pipe ranks of this command on this
                 machine (the fspeed launcher, torchrun underneath), after checking everything once
  --max_restarts N
                 with --launch: after a failure (a rank dies, fails, or stops responding) restart
                 every rank from the newest checkpoint, up to N times (default 0: the run ends)
  --debug        tracebacks (the ranks' and torchrun's) instead of one-line errors and summaries

Hydra's flags (--hydra-help lists them all):
  --cfg job      print the composed config and exit
  --hydra-help   Hydra's own help

examples:
  fspeed-train train.steps=200 optimizer=lamb precision=bf16
  fspeed-train --launch parallel.data=2 zero.stage=3
  fspeed-train --launch --max_restarts 3 parallel.data=2 checkpoint.save_every=100
  fspeed-train deepspeed_config=ds_config.json
  fspeed-train checkpoint.dir=outputs/run1/checkpoints checkpoint.resume=required
  fspeed-export outputs/run1/checkpoints model.safetensors     # the trained weights

The config groups and every key with its default follow (Hydra's help).
"""


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: check (and expand DeepSpeed-config) overrides, then run the Hydra app.

    `--launch` starts parallel.data x parallel.tensor ranks of this same command through the
    `fspeed` launcher (torchrun underneath) instead of training in this process, after checking
    the config, the corpus and the checkpoint directory once. `--debug` shows tracebacks.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # model._target_ / data._target_ import from here, as with python -m
    launch = "--launch" in argv
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # Hydra's own switch; the ranks of --launch inherit it
    argv = [a for a in argv if a not in ("--launch", "--debug")]
    try:
        argv, max_restarts = _max_restarts_flag(argv, launch)
    except ConfigError as err:
        exit_with_user_error(err)
    args = get_args_parser().parse_args(argv)
    if args.help:  # fspeed-train's own flags first; Hydra's help (groups, the composed config) follows
        print(USAGE, flush=True)
        argv.append("hydra.help.app_name=fspeed-train")
        args.overrides.append(argv[-1])
    own_config_dir = args.config_dir is not None or args.config_path is not None
    _autotune_if_asked(args.overrides, launch)
    try:
        overrides, translation = prepare_overrides(args.overrides, check_group_options=not own_config_dir)
        if launch:
            sys.exit(_launch(overrides, [a for a in argv if a not in args.overrides], max_restarts))
        if restarts_possible() and not own_config_dir and not any(o.startswith("hydra.run.dir=") for o in overrides):
            raise ConfigError([Problem("hydra.run.dir", "a run torchrun may restart (its --max-restarts is above 0) "
                                       "needs one run directory for every rank and attempt, to resume from and "
                                       "to keep its restart records in", hint="set hydra.run.dir=<directory> "
                                       "(fspeed-train --launch sets it)")])
    except USER_ERRORS as err:
        if debug_requested():
            raise
        exit_with_user_error(err, int(os.environ.get("RANK", "0")))
    if translation is not None and int(os.environ.get("RANK", "0")) == 0:
        print(translation.summary(), file=sys.stderr)
    flags = [a for a in argv if a not in args.overrides]
    if int(os.environ.get("RANK", "0")) > 0:
        overrides = [*overrides, "hydra.output_subdir=null"]  # rank 0 alone records the config
    sys.argv = [sys.argv[0], *flags, *overrides]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    retain_freed_host_memory()  # host_memory's docstring: ~5% of a CPU step otherwise goes to page faults
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        _hydra_app()
        return
    try:
        _hydra_app()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    _end_rank(code)


def _autotune_if_asked(overrides: list[str], launch: bool) -> None:
    """A deepspeed_config with an enabled autotuning block runs fspeed-autotune (as DeepSpeed's
    `--autotuning tune`) on the world --launch would start, then exits with the tuner's code."""
    if not any(o.startswith("deepspeed_config=") for o in overrides):
        return
    from ..autotune.command import main as autotune_main  # noqa: PLC0415
    from ..autotune.deepspeed_block import tuner_argv  # noqa: PLC0415

    try:
        argv = tuner_argv(overrides, launch)
    except ValueError as err:
        exit_with_user_error(ConfigError([Problem("autotuning", str(err))]))
    if argv is not None:
        autotune_main(argv)
        sys.exit(0)


def _end_rank(code: int) -> None:
    """End a rank of a distributed run once its work is done and written: the exit handlers run (the
    monitors', fspeed's wait for what is in flight and the process group's teardown), then the
    process exits without the interpreter's teardown. There, a gloo thread that drops the last
    reference to a finished collective frees its tensors while the interpreter is finalizing, which
    ends the process in std::terminate (a SIGABRT after a complete run, rare: seen in 2-rank test
    runs after the final checkpoint was saved)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _max_restarts_flag(argv: list[str], launch: bool) -> tuple[list[str], int]:
    """(argv without `--max_restarts N` / `--max_restarts=N`, N; 0 without the flag). N must be an
    integer >= 0, and the flag needs --launch (under torchrun, its own flag sets the limit)."""
    rest, value = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--max_restarts":
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
            continue
        if arg.startswith("--max_restarts="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return rest, 0
    if not value.isdigit():
        raise ConfigError([Problem("--max_restarts", "must be a whole number of restarts", value, "0, 1, 2, ...")])
    if not launch:
        raise ConfigError([Problem("--max_restarts", "restarts are torchrun's: this flag needs --launch", int(value),
                                   hint="fspeed-train --launch --max_restarts N ..., or fspeed --max_restarts N")])
    return rest, int(value)


def _launch(overrides: list[str], flags: list[str], max_restarts: int = 0) -> int:
    """Run this command on parallel.data x parallel.tensor local ranks through the fspeed launcher
    (torchrun restarting the group up to `max_restarts` times after a failure), once the config, the
    corpus and the checkpoint directory pass the checks the ranks would make."""
    from .launch import launch

    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        # one run directory for every rank (each rank's Hydra would otherwise pick its own timestamp)
        run_dir = Path("outputs").resolve() / time.strftime("%Y-%m-%d/%H-%M-%S")
        overrides = [*overrides, f"hydra.run.dir={run_dir}"]
    cfg = _compose_as_the_ranks_will(overrides)
    data_size, tensor = int(cfg.parallel.data), int(cfg.parallel.tensor) * int(cfg.parallel.get("pipe", 1))
    if data_size == -1 and tensor > 1:
        data_size = 1  # parallel.tensor x parallel.pipe ranks, one model replica
    if data_size == -1:
        raise ConfigError([Problem("parallel.data", "--launch needs the number of data-parallel ranks", -1,
                                   "a positive integer, e.g. parallel.data=2")])
    run = to_run_config(cfg, dp_world_size=data_size)
    ckpt_dir = Path(run.checkpoint.dir)
    resume_tag = resumable_tag(run, Path(cfg.hydra.runtime.output_dir))
    if not isinstance(run.data, TargetConfig):  # a user's data target runs the user's code: the ranks build it
        prepare_data(run, saved_tokenizer(ckpt_dir, resume_tag))
    try:
        checkpoint.probe_directory(ckpt_dir)
    except CheckpointError as e:
        raise ConfigError([Problem("checkpoint.dir", str(e))]) from None
    debug = ["--debug"] if debug_requested() else []
    return launch(["--num_gpus", str(data_size * tensor), "--max_restarts", str(max_restarts), *debug, "--module",
                   "fspeed.cli.train", *flags, *overrides])


def _compose_as_the_ranks_will(overrides: list[str]) -> DictConfig:
    """The composed config with `${hydra:runtime.output_dir}` resolving to the run directory."""
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    with initialize_config_module("fspeed.conf", version_base=None):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(Path(cfg.hydra.run.dir).resolve())
    HydraConfig.instance().set_config(cfg)
    return cfg


if __name__ == "__main__":
    main()
