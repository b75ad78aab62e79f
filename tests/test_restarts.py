"""Training that restarts itself: `fspeed-train --launch --max_restarts N` on 2 ranks, with faults
injected by `fspeed.fault_injection.healing_trial` (a rank killed, a rank stopped), a failure that
repeats at the same step (a model that raises), and the goodput every run ends with.

The model and data targets at the bottom are what the repeating-failure run trains (the workers
import them from this module).
"""

from __future__ import annotations

import csv
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from fspeed import fault_injection as fi
from fspeed.cli.goodput import Goodput, GoodputLedger
from fspeed.cli.restarts import AgentFailure, RankRecord, describe_failure

ROOT = Path(__file__).resolve().parents[1]
RESTARTABLE = fi.Job("zero3_restartable", fi.TINY_RUN + fi.ZERO3_TWO_RANKS + ("parallel.timeout_s=10",),
                     steps=30, launch=True)


def _with_repo_on_path() -> dict:
    """The workers import this module's targets (tests.test_restarts) from the repository root."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> tuple[Path, float]:
    """The uninterrupted run the faulted ones are compared with: (its checkpoints, its goodput)."""
    workdir = tmp_path_factory.mktemp("clean")
    checkpoints, _ = fi.reference_run(RESTARTABLE, workdir)
    goodput = fi.goodput_in((workdir / "log.txt").read_text())
    assert goodput is not None and 0 < goodput <= 1
    return checkpoints, goodput


def test_a_killed_rank_restarts_the_group_and_the_run_ends_bit_identical_with_its_goodput(tmp_path, clean_run):
    """kill -9 of a rank mid-run with --max_restarts 1: the group restarts from the newest checkpoint by
    itself, finishes, and its final state equals the uninterrupted run's bit for bit; the log says what
    failed; goodput is in the summary and in metrics.csv, with the restart's cost."""
    trial = fi.healing_trial(RESTARTABLE, tmp_path, clean_run[0], random.Random(7), window_s=0.5,
                             extra=("monitor.csv=true", "train.log_every=1"))
    assert trial.ok, trial.detail
    output = trial.numbers["output"]
    assert "was killed by SIGKILL" in output and "resumed from" in output and "lost (the failed attempt" in output
    faulted = trial.numbers["goodput"]
    assert faulted is not None and 0 < faulted <= 1
    with open(tmp_path / "run" / "metrics.csv") as f:
        every = list(csv.DictReader(f))
    trained = [int(r["step"]) for r in every if r["loss"]]
    assert trained == sorted(set(trained))  # one row a step: the lost attempt's went to metrics.redone.csv
    rows = [r for r in every if r["goodput"]]
    assert len(rows) == 1 and float(rows[0]["goodput"]) == pytest.approx(faulted, abs=1e-3)
    assert int(rows[0]["restarts"]) == 1 and int(rows[0]["steps_redone"]) == trial.numbers["steps_redone"]
    assert float(rows[0]["seconds_lost"]) > 0


def test_a_stopped_rank_times_out_the_group_restarts_and_goodput_is_lower(tmp_path, clean_run):
    """SIGSTOP of a rank: its peer's collective times out (parallel.timeout_s), the group is restarted
    (the stopped worker killed after the shutdown timeout), and the run finishes bit-identical to the
    clean one; the stall (the timeout, the restart) makes its goodput lower than the clean run's."""
    trial = fi.healing_trial(RESTARTABLE, tmp_path, clean_run[0], random.Random(3), fault=signal.SIGSTOP,
                             window_s=0.5)
    assert trial.ok, trial.detail
    assert "stopped responding (ignored SIGTERM, killed with SIGKILL)" in trial.numbers["output"]
    assert "CommError" in trial.numbers["output"]
    assert 0 < trial.numbers["goodput"] < clean_run[1]


def test_a_failure_that_repeats_at_the_same_step_stops_with_its_own_error(tmp_path):
    """A model that raises at step 3 fails again at step 3 after the restart: no further restart (of the
    2 allowed), a nonzero exit, and the launcher's summary quotes the original error."""
    command = fi.train_command(["--max_restarts", "2", "model._target_=tests.test_restarts.fails_at_step_3",
                                "data._target_=tests.test_restarts.rows", "parallel.data=2", "train.steps=6",
                                "train.micro_batch_size=2", "checkpoint.save_every=0", "monitor.progress_bar=false",
                                f"hydra.run.dir={tmp_path / 'run'}"], launch=True)
    process = fi.start(command, cwd=tmp_path, log=tmp_path / "log.txt",
                       env={**_with_repo_on_path(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"})
    try:
        code = process.wait(timeout=300)
    finally:
        fi.stop_session(process)
    output = (tmp_path / "log.txt").read_text(errors="replace")
    assert code != 0, output[-3000:]
    assert "restart 1 of 2: attempt 0 failed: rank" in output and "restart 2 of 2" not in output, output[-3000:]
    assert "failed again with the same error in attempt 1 as in attempt 0" in output, output[-3000:]
    summary = output[output.index("fspeed: the job failed"):]
    assert f"step 3: RuntimeError: {FAILURE}" in summary, summary


def test_what_failed_is_said_from_the_agents_view_and_the_ranks_records():
    records = [RankRecord(0, 0, 7, None), RankRecord(1, 0, 6, None)]
    killed = [AgentFailure(1, -9, "SIGKILL", None), AgentFailure(0, -15, "SIGTERM", None, stopped=True)]
    assert describe_failure(records, killed) == "rank 1 was killed by SIGKILL during step 7 (then rank 0)"
    raised = [RankRecord(0, 0, 2, "step 3: RuntimeError: boom"), RankRecord(1, 0, 2, None)]
    assert describe_failure(raised, []) == "rank 0 failed: step 3: RuntimeError: boom"
    assert describe_failure(raised, [AgentFailure(0, 1, None, "step 3: RuntimeError: boom")]) == \
        "rank 0 exited with code 1 (step 3: RuntimeError: boom)"
    assert describe_failure([], []) == "the workers failed before their first step"
    timed_out = [AgentFailure(1, 1, None, "step 4: CommError: timed out"), AgentFailure(0, -9, "SIGKILL", None, True)]
    assert describe_failure([RankRecord(0, 0, 3, None), RankRecord(1, 0, 3, "step 4: CommError: timed out")],
                            timed_out) == ("rank 0 stopped responding (ignored SIGTERM, killed with SIGKILL); rank 1 "
                                           "exited with code 1 (step 4: CommError: timed out)")


def test_goodput_counts_the_steps_a_checkpoint_kept_and_the_restarts_cost(tmp_path, monkeypatch):
    """The ledger against hand-computed sums: a first attempt's steps, a save, lost steps, a restart
    that continues from the checkpoint's count (not the failed attempt's)."""
    clock = iter([100.0, 110.0, 131.0, 150.0]).__next__
    monkeypatch.setattr("fspeed.cli.goodput.process_start_time", lambda: 100.0)
    first = GoodputLedger(tmp_path, persist=True, clock=clock)
    first.training_starts(0)  # t=100
    for seconds in (2.0, 3.0):
        first.step_took(seconds)
    saved = first.client_state()  # t=110: 5 s useful up to step 2
    first.step_took(4.0)  # step 3, lost with the failure
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = GoodputLedger(tmp_path, persist=True, clock=clock)
    second.resumed({"goodput": saved}, 2)
    second.restarted("rank 1 was killed by SIGKILL", resumed_step=2, last_step=3)
    second.training_starts(2)  # t=131: 21 s since the checkpoint's save
    second.step_took(6.0)
    report = second.report()  # t=150
    assert report == Goodput(wall_s=50.0, useful_s=11.0, restarts=1, steps_redone=1, seconds_lost=21.0)
    assert report.value == pytest.approx(11 / 50)
    assert "1 restart, 1 step redone, 21.0s" in report.line()


# ------------------------------------------------------------------------------ the repeating failure

FAILURE = "the model's forward failed at its third training step"


class _FailsAtStep3(nn.Module):
    """A linear regression whose third forward call raises: with no checkpoint before it (save_every=0)
    every attempt starts from step 0, so it fails at step 3 each time."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError(FAILURE)
        return ((x @ self.weight - y) ** 2).mean()


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=generator), torch.randn(32, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def fails_at_step_3() -> nn.Module:
    return _FailsAtStep3()


def rows() -> torch.utils.data.Dataset:
    return _Rows()


def test_the_targets_train_until_their_third_step():
    model, data = fails_at_step_3(), rows()
    batch = {"x": data.x[:2], "y": data.y[:2]}
    model(**batch), model(**batch)
    with pytest.raises(RuntimeError, match="third training step"):
        model(**batch)


def test_max_restarts_is_a_launch_flag_with_a_whole_number(monkeypatch, capsys):
    from fspeed.cli.train import _max_restarts_flag, main
    from fspeed.config import ConfigError

    assert _max_restarts_flag(["--max_restarts", "3", "train.steps=1"], launch=True) == (["train.steps=1"], 3)
    assert _max_restarts_flag(["--max_restarts=0"], launch=True) == ([], 0)
    assert _max_restarts_flag(["train.steps=1"], launch=False) == (["train.steps=1"], 0)
    with pytest.raises(ConfigError, match="must be a whole number"):
        _max_restarts_flag(["--max_restarts", "-1"], launch=True)
    with pytest.raises(ConfigError, match="this flag needs --launch"):
        _max_restarts_flag(["--max_restarts", "1"], launch=False)
    # under torchrun with restarts on, a run directory of its own per rank and attempt is refused
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.raises(SystemExit) as stop:
        main(["train.steps=1"])
    assert stop.value.code == 2 and "hydra.run.dir: a run torchrun may restart" in capsys.readouterr().err
