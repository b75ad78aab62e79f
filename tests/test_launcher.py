"""The `fspeed` launcher: hostfile and filter grammars (property tests), per-node command building,
environment propagation, the runner's failure handling, and real torchrun runs on loopback."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fspeed.cli import launch as cli
from fspeed.launcher import (
    HostfileError, LaunchConfigError, LaunchSpec, NodeCommand, ResourceFilterError, build_node_commands,
    exported_env, filter_resources, local_pool, parse_env_file, parse_hostfile, parse_node_specs,
    pool_from_slot_counts, read_hostfile, run_node_commands, select_resources, user_env,
)
from fspeed.launcher.environment import REPORT_ENV
from fspeed.launcher.processes import alive, children, descendants
from fspeed.launcher.run import _stop
from fspeed.launcher import tether
from fspeed.testing import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "_launch_worker.py")

# ---------------------------------------------------------------------------------------------
# hostfile grammar

hostnames = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True)
noise_lines = st.sampled_from(["", "   ", "\t", "# comment", "  # indented comment", "#worker-9 slots=4"])


@st.composite
def hostfiles(draw):
    """(hostfile text, expected {host: slots}) with comments, blank lines and spacing variations."""
    hosts = draw(st.lists(hostnames, min_size=1, max_size=6, unique=True))
    expected = {host: draw(st.integers(1, 16)) for host in hosts}
    lines = []
    for host, slots in expected.items():
        lines += draw(st.lists(noise_lines, max_size=2))
        lead = draw(st.sampled_from(["", " ", "\t"]))
        sep = draw(st.sampled_from([" ", "\t", "   "]))
        trail = draw(st.sampled_from(["", " ", "  # 8x A100", "\t#x"]))
        lines.append(f"{lead}{host}{sep}slots={slots}{trail}")
    lines += draw(st.lists(noise_lines, max_size=2))
    return "\n".join(lines) + draw(st.sampled_from(["", "\n"])), expected


@given(hostfiles())
def test_valid_hostfiles_parse_to_their_pool_in_file_order(case):
    text, expected = case
    parsed = parse_hostfile(text, "hosts")
    assert list(parsed.items()) == list(expected.items())
    assert pool_from_slot_counts(parsed) == {host: tuple(range(n)) for host, n in expected.items()}


BAD_LINES = ["worker-x", "worker-x slots=", "worker-x slots=two", "worker-x slot=4", "worker-x slots=4 extra",
             "worker-x slots=-1", "slots=4", "worker-x slots=4gpus", "worker-x:0 slots=2", "a@b slots=1",
             "worker-x slots=0", "worker-x slots = 4"]


@given(hostfiles(), st.sampled_from(BAD_LINES), st.data())
def test_a_bad_line_is_an_error_naming_its_number_and_text(case, bad, data):
    text, _ = case
    lines = text.splitlines()
    at = data.draw(st.integers(0, len(lines)))
    lines.insert(at, bad)
    with pytest.raises(HostfileError) as error:
        parse_hostfile("\n".join(lines), "hosts")
    message = str(error.value)
    assert f"'hosts', line {at + 1}: {bad!r}" in message


@given(hostfiles(), st.data())
def test_a_duplicate_host_names_both_lines(case, data):
    text, expected = case
    host = data.draw(st.sampled_from(list(expected)))
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.split("#")[0].split() and line.split()[0] == host)
    lines.append(f"{host} slots=1")
    with pytest.raises(HostfileError, match=f"line {len(lines)}.*{host!r} is listed twice \\(first on line {first}\\)"):
        parse_hostfile("\n".join(lines), "hosts")


def test_an_empty_or_missing_hostfile_is_an_error(tmp_path):
    with pytest.raises(HostfileError, match="lists no hosts"):
        parse_hostfile("# only a comment\n\n", "hosts")
    with pytest.raises(HostfileError, match="does not exist"):
        read_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# --include / --exclude grammar


@st.composite
def pools(draw):
    hosts = draw(st.lists(hostnames, min_size=1, max_size=5, unique=True))
    return {host: tuple(range(draw(st.integers(1, 6)))) for host in hosts}


@st.composite
def filters(draw):
    """(pool, {host: None (whole) | slots}, filter string) naming hosts in random order."""
    pool = draw(pools())
    chosen = draw(st.permutations(list(pool)).map(lambda hosts: hosts[:draw(st.integers(1, len(hosts)))]))
    entries = {}
    for host in chosen:
        entries[host] = None if draw(st.booleans()) else tuple(
            draw(st.lists(st.sampled_from(pool[host]), min_size=1, unique=True)))
    spec = "@".join(host if slots is None else f"{host}:{','.join(map(str, slots))}" for host, slots in entries.items())
    return pool, entries, spec


@given(filters())
def test_include_keeps_exactly_what_it_names_in_pool_order(case):
    pool, entries, spec = case
    expected = {host: slots if entries[host] is None else tuple(sorted(entries[host]))
                for host, slots in pool.items() if host in entries}
    assert list(filter_resources(pool, include=spec).items()) == list(expected.items())


@given(filters())
def test_exclude_removes_what_it_names_and_drops_emptied_hosts(case):
    pool, entries, spec = case
    expected = {}
    for host, slots in pool.items():
        left = slots if host not in entries else () if entries[host] is None else tuple(
            s for s in slots if s not in entries[host])
        if left:
            expected[host] = left
    if not expected:
        with pytest.raises(ResourceFilterError, match="removes every slot"):
            filter_resources(pool, exclude=spec)
    else:
        assert list(filter_resources(pool, exclude=spec).items()) == list(expected.items())


@given(pools(), st.sampled_from(["--include", "--exclude"]))
def test_unknown_hosts_and_slots_are_errors_naming_them(pool, flag):
    kind = "include" if flag == "--include" else "exclude"
    with pytest.raises(ResourceFilterError, match=f"{flag}.*host 'no-such-host' is not in the resource pool"):
        filter_resources(pool, **{kind: "no-such-host"})
    host = next(iter(pool))
    missing = len(pool[host])
    with pytest.raises(ResourceFilterError, match=f"host {host!r} has no slot {missing} \\(its slots: 0"):
        filter_resources(pool, **{kind: f"{host}:0,{missing}"})


@pytest.mark.parametrize("spec", ["", "@", "a@", "@a", "a:", "a:1,", "a:x", ":1", "a:1:2", "a@@b", "a:-1"])
def test_malformed_filters_are_errors_showing_the_grammar(spec):
    with pytest.raises(ResourceFilterError, match="HOST\\[:SLOT"):
        parse_node_specs(spec, "--include")


def test_filter_details_union_and_mutual_exclusion():
    pool = {"w0": (0, 1, 2, 3), "w1": (0, 1)}
    assert parse_node_specs("w1:1@w0:3,0@w1:0") == {"w1": (0, 1), "w0": (0, 3)}
    assert filter_resources(pool, include="w0@w0:1") == {"w0": (0, 1, 2, 3)}       # union, not DeepSpeed's slot-wins
    with pytest.raises(ResourceFilterError, match="mutually exclusive"):
        filter_resources(pool, include="w0", exclude="w1")


@given(pools(), st.data())
def test_num_nodes_and_num_gpus_take_the_first_hosts_and_slots(pool, data):
    num_nodes = data.draw(st.none() | st.integers(1, len(pool)))
    hosts = list(pool)[: num_nodes or len(pool)]
    num_gpus = data.draw(st.none() | st.integers(1, min(len(pool[h]) for h in hosts)))
    selected = select_resources(pool, num_nodes=num_nodes, num_gpus=num_gpus)
    assert list(selected) == hosts
    assert all(selected[h] == pool[h][: num_gpus or len(pool[h])] for h in hosts)
    with pytest.raises(ResourceFilterError, match=f"--num_nodes {len(pool) + 1}: must be between 1 and"):
        select_resources(pool, num_nodes=len(pool) + 1)
    widest = max(len(slots) for slots in pool.values())
    with pytest.raises(ResourceFilterError, match=f"--num_gpus {widest + 1}.*has {widest}"):
        select_resources(pool, num_gpus=widest + 1)
    with pytest.raises(ResourceFilterError, match="cannot be combined"):
        select_resources(pool, include=hosts[0], num_gpus=1)


def test_local_pool_without_a_hostfile():
    assert local_pool(0, None, None) == {"localhost": (0,)}                # CPU: 1 process by default
    assert local_pool(0, "0,1", 4) == {"localhost": (0, 1, 2, 3)}          # CPU: --num_gpus processes
    assert local_pool(4, None, None) == {"localhost": (0, 1, 2, 3)}        # all GPUs
    assert local_pool(2, "2,3", None) == {"localhost": (2, 3)}             # CUDA_VISIBLE_DEVICES
    with pytest.raises(ResourceFilterError, match="--num_gpus 0"):
        local_pool(0, None, 0)


# ---------------------------------------------------------------------------------------------
# per-node commands


def _flag(argv, name):
    values = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def _agent_argv(command: NodeCommand) -> list[str]:
    """The agent invocation of a node, unwrapping `ssh host 'cd .. && env K=V .. python ..'`."""
    if not command.remote:
        return list(command.argv)
    inner = shlex.split(command.argv[-1])
    assert inner[:4] == ["cd", "/work/dir", "&&", "env"]
    start = next(i for i, arg in enumerate(inner) if arg == "/py")
    return inner[start:]


def _remote_env(command: NodeCommand) -> dict[str, str]:
    inner = shlex.split(command.argv[-1])
    start = next(i for i, arg in enumerate(inner) if arg == "/py")
    return dict(arg.split("=", 1) for arg in inner[4:start])


SPEC = LaunchSpec(script="train.py", script_args=("--lr", "1e-3", "a b"), python="/py", cwd="/work/dir")


def test_one_local_node():
    [node] = build_node_commands({"localhost": (0, 1)}, SPEC)
    argv = _agent_argv(node)
    assert not node.remote and argv[:4] == ["/py", "-u", "-m", "fspeed.launcher.agent"]
    assert _flag(argv, "--nnodes") == "1" and _flag(argv, "--nproc-per-node") == "2"
    assert not any(a.startswith("--master-port") for a in argv)           # torchrun picks a free port
    assert argv[-7:] == ["--module", "fspeed.launcher.tether", "script", "train.py", "--lr", "1e-3", "a b"]
    assert "CUDA_VISIBLE_DEVICES" not in node.env and list(node.ranks) == [0, 1]
    [gpu_node] = build_node_commands({"localhost": (2, 3)}, SPEC, local_has_cuda=True)
    assert gpu_node.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_two_remote_nodes_with_uneven_slots():
    resources = {"worker-0": (0, 1), "worker-1": (3,)}
    environ = {"NCCL_DEBUG": "INFO", "HOME": "/home/me", "PYTHONPATH": "/lib", "TORCHELASTIC_RUN_ID": "x",
               "CUDA_VISIBLE_DEVICES": "5"}
    commands = build_node_commands(resources, SPEC, extra_env={"MSG": "hello world"},
                                   remote_env=exported_env(environ, Path("/work/dir")))
    assert [c.node_rank for c in commands] == [0, 1] and [c.first_rank for c in commands] == [0, 2]
    for command, slots in zip(commands, resources.values()):
        assert command.remote and command.argv[0] == "ssh" and command.argv[-2] == command.host
        argv = _agent_argv(command)
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--node-rank") == str(command.node_rank)
        assert _flag(argv, "--nproc-per-node") == str(len(slots))
        assert _flag(argv, "--master-addr") == "worker-0" and _flag(argv, "--master-port") == "29500"
        env = _remote_env(command)
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, slots))
        assert env["MSG"] == "hello world" and env["NCCL_DEBUG"] == "INFO"
        assert env["PYTHONPATH"] == os.pathsep.join(["/work/dir", "/lib"])
        assert "HOME" not in env and "TORCHELASTIC_RUN_ID" not in env
        assert env["FSPEED_AGENT_TETHER"] == "stdin"  # the remote agent stops when ssh's channel closes
        assert argv[-7:] == ["--module", "fspeed.launcher.tether", "script", "train.py", "--lr", "1e-3", "a b"]
    assert commands[0].world_size == 3


def test_loopback_aliases_run_here_and_remote_nodes_need_a_reachable_master():
    commands = build_node_commands({"localhost": (0, 1), "127.0.0.1": (0, 1)}, SPEC)
    assert not any(c.remote for c in commands)
    assert {_flag(c.argv, "--master-addr") for c in commands} == {"127.0.0.1"}
    with pytest.raises(LaunchConfigError, match="loopback name.*--master_addr"):
        build_node_commands({"localhost": (0,), "worker-1": (0,)}, SPEC)
    here = build_node_commands({"worker-0": (0,), "worker-1": (0,)}, SPEC, run_all_here=True)
    assert not any(c.remote for c in here)                                 # --node_rank / --no_ssh


def test_rendezvous_logs_and_script_modes():
    spec = LaunchSpec(script="pkg.train", python="/py", module=True, rdzv_backend="c10d", master_port=1234,
                      log_dir="/logs", log_tee=False, append_local_rank=True)
    node0, node1 = build_node_commands({"localhost": (0,), "127.0.0.1": (0,)}, spec)
    assert _flag(node1.argv, "--rdzv-endpoint") == "127.0.0.1:1234" and _flag(node1.argv, "--rdzv-backend") == "c10d"
    assert _flag(node1.argv, "--log-dir") == "/logs/node1" and "--redirects=3" in node1.argv
    assert node1.argv[-5:] == ("--module", "fspeed.launcher.tether", "module", "pkg.train", "--local_rank=${local_rank}")
    with pytest.raises(LaunchConfigError, match="rdzv_backend 'etcd'"):
        LaunchSpec(script="x", rdzv_backend="etcd")


def test_the_tether_execs_torchruns_three_modes_and_runs_by_path():
    assert tether.worker_argv("script", "t.py", ["-a"], python="/py") == ["/py", "-u", "t.py", "-a"]
    assert tether.worker_argv("module", "pkg.t", [], python="/py") == ["/py", "-u", "-m", "pkg.t"]
    assert tether.worker_argv("exec", "/bin/t", ["x"]) == ["/bin/t", "x"]
    args = ["--nnodes=1", "--module", "fspeed.launcher.tether", "script", "t.py", "--module", "fspeed.launcher.tether"]
    assert tether.run_tether_by_path(args) == ["--nnodes=1", tether.__file__, *args[3:]]  # the first only


def test_a_worker_whose_agent_is_gone_does_not_start(tmp_path):
    marker = tmp_path / "ran"
    proc = subprocess.run([sys.executable, tether.__file__, "exec", "touch", str(marker)], capture_output=True,
                          text=True, env={**os.environ, tether.AGENT_PID_ENV: "1"}, timeout=60)
    assert proc.returncode == 1 and "its torchrun agent (pid 1) is gone" in proc.stderr and not marker.exists()
    proc = subprocess.run([sys.executable, tether.__file__, "exec", "touch", str(marker)], timeout=60)
    assert proc.returncode == 0 and marker.exists()  # no agent to check: it just execs


def test_a_worker_killed_by_a_signal_prints_its_python_stack():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    abort = [sys.executable, tether.__file__, "exec", sys.executable, "-c", "import os\ndef where(): os.abort()\nwhere()"]
    proc = subprocess.run(abort, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in proc.stderr and "in where" in proc.stderr
    proc = subprocess.run(abort, capture_output=True, text=True, env={**env, "PYTHONFAULTHANDLER": ""}, timeout=60)
    assert proc.returncode == -signal.SIGABRT and "Fatal Python error" not in proc.stderr  # the user's choice kept


# ---------------------------------------------------------------------------------------------
# environment files


def test_env_file_and_flags(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".fspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".fspeed_env").write_text("# comment\n\nexport B='from cwd'\nC=\"x=y\"\n")
    assert user_env(cwd, home, {}, ["C=flag"]) == {"A": "home", "B": "from cwd", "C": "flag"}
    with pytest.raises(LaunchConfigError, match="line 2: 'not an assignment'"):
        parse_env_file("A=1\nnot an assignment\n", "f")
    with pytest.raises(LaunchConfigError, match="--env '1X=2' is not KEY=VALUE"):
        user_env(cwd, home, {}, ["1X=2"])


# ---------------------------------------------------------------------------------------------
# the CLI: errors and dry runs (in process)


def _cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return exit_info.value.code, capsys.readouterr()


def test_bad_hostfile_is_a_clear_cli_error(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=four\n")
    code, out = _cli(["--hostfile", str(hosts), "train.py"], capsys)
    assert code == 2
    assert f"hostfile {str(hosts)!r}, line 2: 'worker-1 slots=four' is not a host entry" in out.err
    assert "'<hostname> slots=<n>'" in out.err


@pytest.mark.parametrize("argv, message", [
    (["--include", "w0", "--exclude", "w1"], "mutually exclusive"),
    (["--include", "w9"], "host 'w9' is not in the resource pool"),
    (["--no_ssh"], "--no_ssh needs --node_rank"),
    (["--node_rank", "2"], "--node_rank 2: must be between 0 and 1"),
])
def test_cli_flag_errors(tmp_path, capsys, argv, message):
    hosts = tmp_path / "hosts"
    hosts.write_text("w0 slots=2\nw1 slots=2\n")
    code, out = _cli(["--hostfile", str(hosts), *argv, "train.py"], capsys)
    assert code == 2 and message in out.err


def test_num_nodes_without_hostfile_is_an_error(capsys):
    code, out = _cli(["--num_nodes", "2", "train.py"], capsys)
    assert code == 2 and "without a hostfile only this machine" in out.err


def test_dry_run_of_one_node_is_that_node_of_the_full_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    cli.main(["--hostfile", "hosts", "--dry-run", "train.py", "--x", "1"])
    full = capsys.readouterr().out
    cli.main(["--hostfile", "hosts", "--node_rank", "1", "--dry-run", "train.py", "--x", "1"])
    one = capsys.readouterr().out
    assert "ssh" in full and "ssh" not in one                              # node 1 starts here
    args = cli.build_parser().parse_args(["--hostfile", "hosts", "train.py", "--x", "1"])
    plan = cli.plan_from_args(args, environ={}, cwd=tmp_path, home=None, cuda_device_count=0)
    assert _agent_argv_local(one) == _agent_argv_remote(plan[1])


def _agent_argv_local(dry_run_output: str) -> list[str]:
    [line] = [line for line in dry_run_output.splitlines() if not line.startswith("#")]
    argv = shlex.split(line)
    return argv[argv.index("-u") - 1:]


def _agent_argv_remote(command: NodeCommand) -> list[str]:
    inner = shlex.split(command.argv[-1])
    return inner[inner.index("-u") - 1:]


def test_report_subcommand_still_works(capsys):
    cli.main(["report"])
    assert "torch" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# the runner with stand-in agents (no torch: fast)


def _fake_node(rank: int, code: str) -> NodeCommand:
    return NodeCommand(rank, f"h{rank}", (0,), rank, 2, False, (sys.executable, "-c", code))


def test_a_failed_node_stops_the_others_and_its_root_cause_is_the_exit_code():
    report = ("import json, os, sys; json.dump({'failures': [{'rank': 1, 'local_rank': 0, 'exitcode': 7}], "
              f"'root_cause_rank': 1}}, open(os.environ[{REPORT_ENV!r}], 'w')); sys.exit(1)")
    result = run_node_commands([_fake_node(0, "import time; time.sleep(60)"), _fake_node(1, report)], grace_s=0.2)
    assert not result.ok and result.exit_code == 7 and result.failure_order == (1,)
    assert result.outcomes[0].stopped
    message = result.failure_message()
    assert "node 0 (h0, slots 0, rank 0, local) was stopped after another node failed" in message
    assert "node 1 (h1, slots 0, rank 1, local) failed with exit code 1 (the first node seen failing): " \
           "rank 1 (local rank 0) exited with code 7 (its first failure)" in message


def test_success_and_signal_exit_codes():
    assert run_node_commands([_fake_node(0, "pass"), _fake_node(1, "pass")]).exit_code == 0
    killed = run_node_commands([_fake_node(0, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")])
    assert killed.exit_code == 128 + 9 and "was killed by signal 9" in killed.failure_message()


def test_sigterm_to_the_launcher_stops_the_nodes(tmp_path):
    pid_file = tmp_path / "pid"                                           # the node signals its launcher
    code = (f"import os, signal, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)")
    with pytest.raises(KeyboardInterrupt):
        run_node_commands([_fake_node(0, code)])
    with pytest.raises(ProcessLookupError):                               # stopped and reaped
        os.kill(int(pid_file.read_text()), 0)


def test_children_are_seen():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pids = children(os.getpid())
        assert pids is None or child.pid in pids
    finally:
        child.kill()
        child.wait()


def _stand_in_agent(tmp_path, ignore_sigterm: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """A process standing in for a node agent, with one worker below it (sleeping): (it, the worker pids)."""
    ready = tmp_path / "ready"
    deaf = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_sigterm else ""
    code = (f"import signal, subprocess, sys, time; {deaf}"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(ready)!r}, 'w').close(); time.sleep(600)")
    agent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = descendants(agent.pid)
    assert workers, "the stand-in agent started no worker"
    return agent, workers


def _none_alive(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids) == []


def test_a_stop_with_the_waitpid_lock_taken_still_ends_and_kills_the_workers(tmp_path):
    """An interrupt inside Popen.poll can leave its waitpid lock taken; the stop must not wait on it
    forever (the launcher would hang after Ctrl-C)."""
    agent, workers = _stand_in_agent(tmp_path)
    assert agent._waitpid_lock.acquire(False)                            # as an interrupted poll leaves it
    try:
        started = time.monotonic()
        _stop([agent], kill_after_s=0.5, reap_s=0.5)
        assert time.monotonic() - started < 30
    finally:
        agent._waitpid_lock.release()
        agent.kill()
        agent.wait()
    assert _none_alive(workers)


def test_stopping_an_agent_that_ignores_sigterm_leaves_none_of_its_workers_running(tmp_path):
    """An agent deaf to SIGTERM is killed after the wait, and the worker it started goes with it
    (nothing that held the launch's output, or a GPU, outlives the launch)."""
    agent, workers = _stand_in_agent(tmp_path, ignore_sigterm=True)
    _stop([agent], kill_after_s=0.5)
    assert agent.returncode == -signal.SIGKILL
    assert _none_alive(workers)


# ---------------------------------------------------------------------------------------------
# real runs: torchrun agents, gloo workers


def _launch(args: list[str], capfd, monkeypatch) -> tuple[int, str]:
    """Run the `fspeed` CLI in this process (torch is already imported here); agents and workers are real."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(REPO)
    code = cli.launch(args)
    return code, capfd.readouterr().err


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def test_one_node_two_ranks_real_run(tmp_path, capfd, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    code, stderr = _launch(["--num_gpus", "2", "--log-dir", str(tmp_path / "logs"), "--env", "FSPEED_TEST_MARK=yes",
                            WORKER, str(out)], capfd, monkeypatch)
    assert code == 0, stderr
    records = _records(out)
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["world"] == 2 and r["all_reduce"] == 3.0
        assert r["env"]["LOCAL_RANK"] == str(r["rank"]) and r["env"]["RANK"] == str(r["rank"])
        assert r["env"]["WORLD_SIZE"] == "2" and r["env"]["MASTER_ADDR"] and r["env"]["MASTER_PORT"]
        assert r["env"]["FSPEED_TEST_MARK"] == "yes" and r["env"][REPORT_ENV] is None
        assert r["extra"] == []                                            # no --local_rank by default
    for rank in (0, 1):                                                    # per-rank logs, and where they are
        [stdout_log] = (tmp_path / "logs" / "node0").glob(f"*/attempt_0/{rank}/stdout.log")
        assert f"worker rank {rank} of 2 done" in stdout_log.read_text()
        assert f"rank {rank}: " in stderr and str(stdout_log) in stderr


def test_two_nodes_on_loopback_real_run(tmp_path, capfd, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("# two names for this machine: two nodes, two torchrun agents\nlocalhost slots=2\n"
                     "127.0.0.1 slots=2\n")
    code, stderr = _launch(["--hostfile", str(hosts), "--master_port", str(free_port()), "--append_local_rank",
                            WORKER, str(out)], capfd, monkeypatch)
    assert code == 0, stderr
    records = _records(out)
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["world"] == 4 and r["all_reduce"] == 1.0 + 2.0 + 3.0 + 4.0
        assert r["env"]["GROUP_RANK"] == str(r["rank"] // 2)                # node-major, hostfile order
        assert r["env"]["LOCAL_RANK"] == str(r["rank"] % 2) and r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["extra"] == [f"--local_rank={r['rank'] % 2}"]


FAILING_RANK = """
import json, os, sys
if os.environ["RANK"] == "1":
    print("fail.py: the clear line", file=sys.stderr)
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:  # where fspeed-train's ranks leave their message
        json.dump({"message": {"message": "the clear line", "extraInfo": {"timestamp": "0"}}}, f)
    sys.exit(3)
"""


def test_a_failing_rank_fails_the_launch_with_one_summary_naming_the_rank_its_code_and_message(tmp_path, capfd,
                                                                                                monkeypatch):
    script = tmp_path / "fail.py"                                          # no torch import: fast
    script.write_text(FAILING_RANK)
    code, stderr = _launch(["--num_gpus", "2", str(script)], capfd, monkeypatch)
    assert code == 3, stderr
    assert "fspeed: the job failed: rank 1 (local rank 1) exited with code 3: the clear line\n" in stderr
    assert "node 0 (localhost, slots 0-1, ranks 0-1, local) failed with exit code 1" in stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr and "exitcode" not in stderr, stderr
    code, stderr = _launch(["--num_gpus", "2", "--debug", str(script)], capfd, monkeypatch)
    assert code == 3 and "ChildFailedError" in stderr and "the job failed: rank 1" in stderr  # torchrun's own


def _process_states(pids: list[int]) -> str:
    """Each process's state, kernel wait channel and command line, for a failure message."""
    lines = []
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            status = (proc / "status").read_text().splitlines()
            state = " ".join(line for line in status if line.startswith(("State:", "SigPnd:", "ShdPnd:", "SigBlk:",
                                                                          "SigIgn:", "SigCgt:")))
            wchan = (proc / "wchan").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        lines.append(f"  {pid} {state} wchan={wchan} {cmdline[:160]}")
    return "\n".join(lines)


@pytest.mark.parametrize("how", ["ctrl-c", "kill -9 of the launcher"])
def test_stopping_a_launch_prints_no_agent_traceback(tmp_path, how):
    script = tmp_path / "sleeper.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').close()\n"
                      "time.sleep(600)\n")
    # as from a shell: SIGINT neither ignored nor blocked (a pytest worker's own state is inherited through exec)
    as_from_a_shell = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
                       "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")
    launcher = subprocess.Popen([sys.executable, "-c", as_from_a_shell, sys.executable, "-m", "fspeed.cli.launch",
                                 "--num_gpus", "2", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
        started = (tmp_path / "0").exists() and (tmp_path / "1").exists()
        if how == "ctrl-c":                                                # a terminal signals the whole group
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            launcher.kill()
        try:
            output, _ = launcher.communicate(timeout=120)                  # until the agents, too, are gone
        except subprocess.TimeoutExpired as stuck:
            pytest.fail(f"the launch did not end (workers had started: {started}); what was left:\n"
                        f"{_process_states([launcher.pid, *descendants(launcher.pid)])}\noutput: {stuck.output}")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert "Traceback" not in output and "SignalException" not in output, output
    assert launcher.returncode == (130 if how == "ctrl-c" else -signal.SIGKILL), output
    if how == "ctrl-c":
        assert "fspeed: interrupted; the node agents were stopped" in output
