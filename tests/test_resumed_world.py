"""Resuming on another number of data ranks: the global batch kept, every sample of the epoch used once
across the change, and the run equal to the uninterrupted one up to the reduction order."""

import shutil
from pathlib import Path

import pytest
import torch

from fspeed.cli.resumed_world import batch_record, keep_global_batch
from fspeed.cli.run_batches import LOADER_KEY, RunBatches
from fspeed.cli.run_data import prepare_data
from fspeed.config import ConfigError
from fspeed.config.compose import compose_run_config
from fspeed.fault_injection import TINY_RUN, checkpoint_tensors, run as run_command, train_command

SMALL = ("model.seq_len=64", "data.max_bytes=6000", "data.epochs=1", "train.steps=100")  # 80 windows: 10 steps of 8


def _run(dp, *overrides):
    return compose_run_config({}, ["checkpoint.dir=unused", *TINY_RUN, *SMALL, *overrides], dp_world_size=dp)[0]


def _saved(train_batch_size, micro, accum, dp):
    return {"train_batch_size": train_batch_size, "micro_batch_size": micro, "grad_accum": accum, "data_parallel": dp}


@pytest.mark.parametrize("before, after, overrides, expected", [
    ((8, 4, 1, 2), 1, (), (8, 4, 2)),                               # 2 x 4 x 1 -> 1 x 4 x 2
    ((8, 4, 2, 1), 2, ("train.grad_accum=2",), (8, 4, 1)),          # the given accumulation is recomputed
    ((24, 4, 3, 2), 4, (), (24, 3, 2)),                             # 4 does not divide the share 6: micro 3
    ((8, 4, 1, 2), 2, ("train.micro_batch_size=2",), (4, 2, 1)),    # same world: the config as given
    ((8, 4, 1, 2), 1, ("train.train_batch_size=12",), (12, 4, 3)),  # an explicit new global batch wins
])
def test_the_saved_global_batch_is_kept_on_another_world(before, after, overrides, expected):
    run, line = keep_global_batch(_run(after, *overrides), _saved(*before))
    assert (run.batch.train_batch_size, run.batch.micro_batch_size, run.batch.grad_accum) == expected
    assert run.batch.dp_world_size == after
    assert (line is None) == (after == before[3])


def test_a_global_batch_that_does_not_divide_stops_naming_why():
    with pytest.raises(ConfigError) as err:
        keep_global_batch(_run(3), _saved(8, 4, 1, 2))
    text = str(err.value)
    assert "parallel.data = 3" in text and "global batch 8" in text and "does not divide over 3" in text


class _DataAxis:
    """The data coordinates of a rank, as a Mesh reports them (what the loader reads)."""

    def __init__(self, rank, size):
        self.rank, self.data_size = rank, size

    def size(self, axis):
        return self.data_size

    def coordinate(self, axis):
        return self.rank


def _ranks(run, rows):
    """Every data rank's RunBatches, each recording the sample indices it reads."""
    dp, used = run.batch.dp_world_size, []
    ranks = []
    for r in range(dp):
        batches = RunBatches(run, rows, r, dp, _DataAxis(r, dp) if dp > 1 else None)
        sampler, seen = batches.loader.sampler, []
        original = sampler.indices

        def recorded(step, original=original, seen=seen):
            out = original(step)
            seen.append(out.tolist())
            return out
        sampler.indices = recorded
        ranks.append(batches)
        used.append(seen)
    return ranks, used


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
@pytest.mark.parametrize("stop", [3, 7])
def test_every_sample_is_used_once_across_the_change(before, after, stop):
    first = _run(before, "train.grad_accum=1" if before == 2 else "train.grad_accum=2")
    rows = prepare_data(first).train
    ranks, used = _ranks(first, rows)
    for step in range(stop):
        for batches in ranks:
            batches.batch(step)
    client_state = {LOADER_KEY: ranks[0].state_dict()}
    resumed, _ = keep_global_batch(_run(after), batch_record(first))
    assert resumed.batch.train_batch_size == first.batch.train_batch_size == 8
    later, used_later = _ranks(resumed, rows)
    for batches in later:
        batches.resume(client_state, stop)
    for step in range(stop, later[0].steps):
        for batches in later:
            batches.batch(step)
    per_step = [sum((u[i] for u in used), []) for i in range(stop)] + \
        [sum((u[i] for u in used_later), []) for i in range(later[0].steps - stop)]
    everything = sum(per_step, [])
    assert len(per_step) == 10 and all(len(s) == 8 for s in per_step)
    assert sorted(everything) == sorted(set(everything)) and len(everything) == 80  # each window once
    reference, _ = _ranks(_run(1, "train.grad_accum=2"), rows)  # the uninterrupted order, one rank
    assert per_step == [reference[0].loader.sampler.global_indices(i).tolist() for i in range(10)]


def _train(tmp_path, name, dp, *extra):
    directory = tmp_path / name
    code, out = run_command(train_command([*TINY_RUN, *SMALL, "train.eval_every=0", "checkpoint.save_every=5",
                                           f"hydra.run.dir={directory}", *extra], launch=dp > 1),
                            cwd=tmp_path, log=tmp_path / f"{name}.log", timeout_s=300)
    assert code == 0, out[-3000:]
    return directory, out


def _params(directory):
    tensors = checkpoint_tensors(directory)
    return {k.split(":", 1)[1].split("@")[0]: v for k, v in tensors.items() if ":params/" in k}


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_run_resumed_on_another_world_equals_the_uninterrupted_run(tmp_path, before, after):
    accum = ("train.grad_accum=1",) if before == 2 else ("train.grad_accum=2",)
    full, _ = _train(tmp_path, "full", before, f"parallel.data={before}", *accum)
    checkpoints = tmp_path / "resumed_checkpoints"
    shutil.copytree(full / "checkpoints" / "global_step5", checkpoints / "global_step5")
    (checkpoints / "latest").write_text("global_step5")
    _, out = _train(tmp_path, "resumed", after, f"parallel.data={after}", "checkpoint.resume=required",
                    f"checkpoint.dir={checkpoints}", *accum)
    micro_accum = "micro_batch_size 4 x grad_accum 2 x 1" if after == 1 else "micro_batch_size 4 x grad_accum 1 x 2"
    assert f"global batch 8 kept, {micro_accum} data ranks" in out
    assert (checkpoints / "latest").read_text() == "global_step10"  # the epoch's 10 steps, continued at 6
    expected, got = _params(full / "checkpoints"), _params(checkpoints)
    assert expected.keys() == got.keys() and expected
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)
