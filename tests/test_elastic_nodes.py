"""A node range (`fspeed --hostfile hosts --nnodes MIN:MAX`): the flag's checks, the plan it prints,
the launcher going on without a lost node, and a real run on two nodes of this machine (`localhost`
and `127.0.0.1`) whose second node is killed: it finishes on one node with the same global batch,
every sample of the epoch used once, equal to the uninterrupted two-rank run up to reduction order."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fspeed import checkpoint
from fspeed.checkpoint import CheckpointError
from fspeed.cli import launch as cli
from fspeed.cli.restarts import RankRecord, world_change
from fspeed.cli.resumed_world import batch_record, keep_global_batch
from fspeed.cli.run_batches import LOADER_KEY
from fspeed.cli.run_data import prepare_data
from fspeed.fault_injection import TINY_RUN, _cmdline, descendants, stop_session, train_command, wait_until
from fspeed.fault_injection import run as run_command
from fspeed.launcher import LaunchConfigError, NodeCommand, NodeRange, RendezvousTimings, parse_node_range
from fspeed.launcher import run_node_commands
from fspeed.testing import free_port
from tests.test_resumed_world import SMALL, _params, _ranks, _run

ROOT = Path(__file__).resolve().parents[1]
TWO_NODES = "localhost slots=1\n127.0.0.1 slots=1\n"  # two names for this machine: two nodes, two agents

# ---------------------------------------------------------------------------------------------
# --nnodes: parsing and checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, hosts, expected", [
    ("1:2", 2, (1, 2)), ("2:4", 4, (2, 4)), ("3:3", 4, (3, 3)), ("1", 3, (1, 3)), ("2:", 3, (2, 3)),
    (" 1 : 2 ", 2, (1, 2)),
])
def test_a_node_range_is_min_and_max_with_max_defaulting_to_the_hosts(text, hosts, expected):
    nodes = parse_node_range(text, hosts)
    assert (nodes.min_nodes, nodes.max_nodes) == expected
    assert nodes.torchrun() == f"{expected[0]}:{expected[1]}" and nodes.elastic == (expected[0] < expected[1])


@pytest.mark.parametrize("text, hosts, says", [
    ("0:2", 2, "MIN must be at least 1"), ("-1:2", 2, "MIN must be at least 1"),
    ("3:2", 4, "MAX 2 is below MIN 3"), ("1:3", 2, "MAX 3 is more than the 2 hosts given"),
    ("x", 2, "not a node range"), ("1:y", 2, "not a node range"), ("", 2, "not a node range"),
])
def test_a_bad_node_range_is_one_error_naming_what_is_allowed(text, hosts, says):
    with pytest.raises(LaunchConfigError) as error:
        parse_node_range(text, hosts)
    message = str(error.value)
    assert says in message and f"1 <= MIN <= MAX <= {hosts}" in message and "\n" not in message


def test_rendezvous_timings_are_checked_and_become_torchruns_rdzv_conf():
    conf = RendezvousTimings(last_call_s=4, node_timeout_s=6, join_timeout_s=60).rdzv_conf(is_host=True)
    assert conf == ("is_host=1,join_timeout=60,last_call_timeout=4,keep_alive_interval=2,keep_alive_max_attempt=3")
    with pytest.raises(LaunchConfigError, match="--rdzv_last_call_s 0: must be at least 1"):
        RendezvousTimings(last_call_s=0)
    with pytest.raises(LaunchConfigError, match="--rdzv_node_timeout_s 2: must be at least 3"):
        RendezvousTimings(node_timeout_s=2)
    with pytest.raises(LaunchConfigError, match="--rdzv_join_timeout_s 20: must exceed"):
        RendezvousTimings(last_call_s=10, node_timeout_s=10, join_timeout_s=20)


def _plan(tmp_path, *flags: str) -> list[NodeCommand]:
    hosts = tmp_path / "hosts"
    hosts.write_text(TWO_NODES)
    args = cli.build_parser().parse_args(["--hostfile", str(hosts), *flags, "train.py", "--lr", "1"])
    return cli.plan_from_args(args, environ={}, cwd=tmp_path, home=None, cuda_device_count=0)


def _flag(argv, name):
    values = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def test_a_node_range_plans_a_c10d_rendezvous_served_by_node_0(tmp_path):
    commands = _plan(tmp_path, "--nnodes", "1:2", "--max_restarts", "2", "--rdzv_last_call_s", "5",
                     "--rdzv_node_timeout_s", "3", "--master_port", "1234")
    assert [c.min_nodes for c in commands] == [1, 1]
    for command in commands:
        argv = command.argv
        assert _flag(argv, "--nnodes") == "1:2" and _flag(argv, "--rdzv-backend") == "c10d"
        assert _flag(argv, "--max-restarts") == "2" and _flag(argv, "--rdzv-endpoint") == "127.0.0.1:1234"
        assert _flag(argv, "--local-addr") == "127.0.0.1" and not any(a.startswith("--node-rank") for a in argv)
        conf = dict(item.split("=") for item in _flag(argv, "--rdzv-conf").split(","))
        assert conf == {"is_host": str(int(command.node_rank == 0)), "join_timeout": "600", "last_call_timeout": "5",
                        "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
    assert commands[0].rendezvous == ("c10d at 127.0.0.1:1234, nodes 1:2: starts on up to 2, continues while "
                                      "at least 1 remains")


def test_the_dry_run_says_the_node_range_and_its_rendezvous(tmp_path, capsys, monkeypatch):
    (tmp_path / "hosts").write_text(TWO_NODES)
    monkeypatch.chdir(tmp_path)
    assert cli.launch(["--hostfile", "hosts", "--nnodes", "1", "--max_restarts", "1", "--dry-run", "t.py"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("# fspeed: world size 2, rendezvous c10d at 127.0.0.1:29500, nodes 1:2: starts on up to 2, "
                      "continues while at least 1 remains; the commands that start:")
    assert out[1].startswith("# node 0 (localhost") and "--nnodes=1:2" in out[2] and "is_host=1" in out[2]
    assert out[3].startswith("# node 1 (127.0.0.1") and "is_host=0" in out[4]


@pytest.mark.parametrize("flags, says", [
    (["--nnodes", "1:2"], "pass --max_restarts N with N >= 1"),
    (["--nnodes", "1:2", "--max_restarts", "1", "--rdzv_backend", "static"], "needs the c10d rendezvous"),
    (["--rdzv_last_call_s", "5"], "--rdzv_last_call_s: timings of the c10d rendezvous, which this launch does not"),
    (["--nnodes", "1:3", "--max_restarts", "1"], "MAX 3 is more than the 2 hosts given"),
    (["--nnodes", "1:2", "--max_restarts", "1", "--rdzv_node_timeout_s", "1"], "--rdzv_node_timeout_s 1"),
])
def test_launcher_flags_that_do_not_fit_a_node_range_are_errors(tmp_path, flags, says):
    with pytest.raises(LaunchConfigError, match=says.replace("(", r"\(")):
        _plan(tmp_path, *flags)


def test_a_node_range_needs_a_hostfile(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "DEFAULT_HOSTFILE", str(tmp_path / "none"))
    args = cli.build_parser().parse_args(["--nnodes", "1:2", "--max_restarts", "1", "t.py"])
    with pytest.raises(LaunchConfigError, match="a node range needs --hostfile"):
        cli.plan_from_args(args, environ={}, cwd=tmp_path, home=None, cuda_device_count=0)


def test_a_fixed_range_and_plain_c10d_need_no_restarts(tmp_path):
    assert _flag(_plan(tmp_path, "--nnodes", "2:2")[0].argv, "--nnodes") == "2:2"
    plain = _plan(tmp_path, "--rdzv_backend", "c10d", "--rdzv_last_call_s", "7")
    assert _flag(plain[0].argv, "--nnodes") == "2" and "last_call_timeout=7" in _flag(plain[0].argv, "--rdzv-conf")
    assert plain[0].min_nodes is None


# ---------------------------------------------------------------------------------------------
# the launcher: a lost node is not the end while enough remain
# ---------------------------------------------------------------------------------------------


def _fake_node(rank: int, code: str) -> NodeCommand:
    return NodeCommand(rank, f"h{rank}", (0,), rank, 3, False, (sys.executable, "-c", code))


def test_a_lost_node_leaves_the_others_running_while_min_nodes_remain(tmp_path):
    done = tmp_path / "done"
    finisher = f"import time; time.sleep(1.5); open({str(done)!r}, 'w').close()"
    result = run_node_commands([_fake_node(0, finisher), _fake_node(1, "import sys; sys.exit(5)"),
                                _fake_node(2, finisher)], grace_s=0.1, min_nodes=2)
    assert done.exists() and result.ok and result.exit_code == 0
    assert [o.command.node_rank for o in result.lost] == [1] and not any(o.stopped for o in result.outcomes)
    assert result.lost_message() == ("node 1 (h1, slots 0, rank 1, local) was lost (failed with exit code 5); "
                                     "the run went on without it")


def test_fewer_than_min_nodes_stop_the_others_with_one_summary():
    result = run_node_commands([_fake_node(0, "import time; time.sleep(60)"), _fake_node(1, "import sys; sys.exit(5)"),
                                _fake_node(2, "import time; time.sleep(0.5); raise SystemExit(6)")],
                               grace_s=0.1, min_nodes=2)
    assert not result.ok and result.exit_code == 6          # the failure the run could not go on after
    assert [o.command.node_rank for o in result.lost] == [1] and result.outcomes[0].stopped
    summary = result.summary()
    assert summary.splitlines()[:2] == [
        "the job failed (exit code 6)",
        "fewer than the 2 nodes the run needs (--nnodes) remained after 2 failed: the others were stopped"]
    assert "node 1 (h1, slots 0, rank 1, local) was lost (failed with exit code 5)" in summary
    assert "node 0 (h0, slots 0, rank 0, local) was stopped after another node failed" in summary


def test_without_a_node_range_a_failed_node_still_stops_the_others():
    result = run_node_commands([_fake_node(0, "import time; time.sleep(60)"), _fake_node(1, "import sys; sys.exit(5)")],
                               grace_s=0.1)
    assert not result.ok and result.outcomes[0].stopped and not result.lost and result.exit_code == 5


def test_the_restart_line_says_the_world_changed():
    before = [RankRecord(0, 0, 4, None, 2), RankRecord(1, 0, 4, None, 2)]
    assert world_change(before, 1) == "the world shrank from 2 to 1 rank (a node was lost)"
    assert world_change(before, 4) == "the world grew from 2 to 4 ranks"
    assert world_change(before, 2) is None and world_change([RankRecord(0, 0, 4, None)], 1) is None


# ---------------------------------------------------------------------------------------------
# a real run: two nodes on this machine, node 1 killed after a checkpoint
# ---------------------------------------------------------------------------------------------

TRAIN = (*TINY_RUN, *SMALL, "train.eval_every=0", "train.grad_accum=1", "checkpoint.save_every=2")


def _latest(directory: Path):
    try:
        return checkpoint.latest_tag(directory)
    except CheckpointError:  # between the write and the rename
        return None


def _kill_node_1(launcher: subprocess.Popen) -> None:
    """SIGKILL node 1's torchrun agent and its worker (the agent that does not serve the rendezvous)."""
    agents = [pid for pid in descendants(launcher.pid)
              if "fspeed.launcher.agent" in _cmdline(pid) and "is_host=0" in _cmdline(pid)]
    assert len(agents) == 1, agents
    for pid in [agents[0], *descendants(agents[0])]:
        os.kill(pid, signal.SIGKILL)


def _elastic_run(tmp_path: Path, name: str, *extra: str) -> tuple[int, str, Path]:
    """`fspeed --nnodes 1:2` of fspeed-train on two local nodes, node 1 killed once a checkpoint exists:
    (exit code, output, checkpoint directory)."""
    (tmp_path / "hosts").write_text(TWO_NODES)
    checkpoints, log = tmp_path / f"{name}_checkpoints", tmp_path / f"{name}.log"
    command = [sys.executable, "-m", "fspeed.cli.launch", "--hostfile", "hosts", "--nnodes", "1:2", "--max_restarts",
               "1", "--rdzv_last_call_s", "10", "--rdzv_node_timeout_s", "3", "--master_port", str(free_port()),
               "--module", "fspeed.cli.train", *TRAIN, *extra, f"checkpoint.dir={checkpoints}",
               f"hydra.run.dir={tmp_path / name}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        launcher = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
    try:
        assert wait_until(lambda: _latest(checkpoints) is not None or launcher.poll() is not None, 120, 0.01)
        assert launcher.poll() is None, log.read_text()[-3000:]
        _kill_node_1(launcher)
        code = launcher.wait(timeout=150)
    finally:
        stop_session(launcher)
    return code, log.read_text(errors="replace"), checkpoints


def test_a_run_continues_on_the_node_that_remains_with_its_batch_and_samples(tmp_path):
    code, out, checkpoints = _elastic_run(tmp_path, "elastic", "parallel.data=-1")
    assert code == 0, out[-4000:]
    assert "the world shrank from 2 to 1 rank (a node was lost)" in out, out[-4000:]
    assert "global batch 8 kept, micro_batch_size 4 x grad_accum 2 x 1 data ranks" in out
    assert "fspeed: node 1 (127.0.0.1, slots 0, rank 1, local) was lost (was killed by signal 9); the run went on " \
           "without it" in out
    assert checkpoint.latest_tag(checkpoints) == "global_step10"          # the epoch's 10 steps, continued
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", out).group(1))
    assert 2 <= resumed_at < 10

    # every sample of the epoch once across the change: 2 data ranks up to the checkpoint the restart
    # resumed from, then 1 data rank from the loader position that checkpoint saved
    first = _run(2, "train.grad_accum=1")
    rows = prepare_data(first).train
    ranks, used = _ranks(first, rows)
    for step in range(resumed_at):
        for batches in ranks:
            batches.batch(step)
    saved = checkpoint.read_meta(checkpoints, f"global_step{resumed_at}")["client_state"]
    assert saved["batch"] == batch_record(first)
    resumed, _ = keep_global_batch(_run(1), saved["batch"])
    (later,), (used_later,) = _ranks(resumed, rows)
    later.resume({LOADER_KEY: saved[LOADER_KEY]}, resumed_at)
    for step in range(resumed_at, later.steps):
        later.batch(step)
    per_step = [sum((u[i] for u in used), []) for i in range(resumed_at)] + used_later
    everything = sum(per_step, [])
    assert len(per_step) == 10 and all(len(s) == 8 for s in per_step)
    assert len(everything) == len(set(everything)) == 80                  # each window of the epoch once

    # equal to the uninterrupted two-rank run up to the reduction order
    full = tmp_path / "full"
    code, clean = run_command(train_command([*TRAIN, "parallel.data=2", f"hydra.run.dir={full}"], launch=True),
                              cwd=tmp_path, log=tmp_path / "full.log", timeout_s=300)
    assert code == 0, clean[-3000:]
    expected, got = _params(full / "checkpoints"), _params(checkpoints)
    assert expected.keys() == got.keys() and expected
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


def test_a_fixed_data_size_that_no_longer_fits_stops_naming_why(tmp_path):
    code, out, _ = _elastic_run(tmp_path, "fixed", "parallel.data=2")
    assert code == 2, out[-4000:]
    summary = out[out.index("fspeed: the job failed"):].splitlines()
    assert summary[0] == "fspeed: the job failed: rank 0 (local rank 0) exited with code 2:", out[-4000:]
    why = [line for line in summary if "parallel.data=2 = 2 ranks, but the world size is 1" in line]
    assert len(why) == 1 and "parallel.data=-1 continues on the ranks that remain" in why[0], summary
    assert any("node 1 (127.0.0.1, slots 0, rank 1, local) was lost" in line for line in summary)
