"""`fspeed`: DeepSpeed's launcher CLI on torchrun; `fspeed report` prints what this machine offers fspeed.

    fspeed --num_gpus 4 train.py --lr 3e-4                    # one node, 4 ranks (processes on CPU)
    fspeed --hostfile hosts --include "worker-0:0,1@worker-1" train.py
    fspeed --hostfile hosts --dry-run train.py                # print the per-node commands
    fspeed --hostfile hosts --node_rank 1 train.py            # start only node 1, here (no ssh)

Without a hostfile (`--hostfile`, default `/job/hostfile` when it exists) the job runs on this
machine: all visible GPUs, or on a CPU-only machine `--num_gpus` processes (default 1). Each rank
reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from its environment (set by
torchrun); `--local_rank` is only passed with `--append_local_rank`. A failure ends in one summary
(the failed rank, its exit code and its message); `--debug` shows torchrun's tracebacks instead.
`--max_restarts N` restarts the worker group after a failure instead, up to N times (see `agent.py`).
`--nnodes MIN:MAX` (with a hostfile) lets the run continue on the nodes that remain after a node is
lost, down to MIN (c10d rendezvous; see `fspeed.launcher.elastic`).
See `fspeed.launcher`.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Mapping, Optional

from fspeed.launcher import (
    LaunchConfigError, LaunchError, LaunchSpec, NodeCommand, NodeRange, RendezvousTimings, build_node_commands,
    exported_env, local_pool, parse_node_range, pool_from_slot_counts, rank_log_files, read_hostfile, run_node_commands,
    select_resources, user_env,
)
from fspeed.launcher.environment import DEBUG_ENV

DEFAULT_HOSTFILE = "/job/hostfile"


def report() -> str:
    """Versions and capabilities relevant to fspeed (Python, torch, threads, CUDA, Numba)."""
    import torch

    lines = [f"python      {platform.python_version()} ({sys.executable})"]
    for package in ("fspeed", "torch", "optree", "numba", "hydra-core", "safetensors"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        lines.append(f"{package:<11} {version}")
    lines.append(f"threads     {torch.get_num_threads()} (torch intra-op)")
    cuda = torch.cuda.is_available()
    lines.append(f"cuda        {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available'}")
    lines.append(f"bf16 on cpu {'yes' if torch.backends.mkldnn.is_available() else 'unknown'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's `deepspeed` flags (same names and meanings) plus fspeed's few additions."""
    parser = argparse.ArgumentParser(
        prog="fspeed", allow_abbrev=False,
        usage="fspeed [launcher options] script.py [script args...]\n       fspeed report",
        description="Launch a training script on one or more nodes through torchrun (one agent per node). "
                    "`fspeed report` prints versions and capabilities.")
    add = parser.add_argument
    add("-H", "--hostfile", default=None,
        help=f"'<host> slots=<n>' lines; default {DEFAULT_HOSTFILE} if it exists, else this machine only")
    add("-i", "--include", default="", help="HOST[:SLOT[,SLOT...]][@HOST...]: use only these hosts/slots")
    add("-e", "--exclude", default="", help="same format: use everything except these hosts/slots")
    add("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    add("--num_gpus", "--num_accelerators", type=int, default=None,
        help="use the first N slots of every host (on a CPU-only machine: N processes)")
    add("--master_addr", default=None, help="address of node 0 (default: the first host; 127.0.0.1 locally)")
    add("--master_port", type=int, default=None,
        help="rendezvous port on node 0 (default 29500; a free port for one local node)")
    add("--node_rank", type=int, default=None, help="start only this node's agent, here, without ssh")
    add("--no_ssh", action="store_true", help="DeepSpeed's flag for the same; requires --node_rank")
    add("--ssh_port", type=int, default=None, help="ssh port for remote nodes")
    add("--rdzv_backend", choices=("static", "c10d"), default=None,
        help="static (default): ranks node-major in hostfile order (DeepSpeed's); c10d: elastic-style "
             "rendezvous (implied by --nnodes)")
    add("--max_restarts", type=int, default=0,
        help="after a rank fails, restart the whole worker group up to N times (fspeed-train's ranks then "
             "resume from the newest checkpoint); default 0: the job fails")
    add("--nnodes", default=None, metavar="MIN:MAX",
        help="with a hostfile: start on up to MAX nodes (default: the hosts given) and, when a node is lost, "
             "continue on those that remain while at least MIN do (c10d rendezvous; needs --max_restarts >= 1)")
    timings = RendezvousTimings()
    add("--rdzv_last_call_s", type=int, default=None,
        help=f"c10d: once MIN nodes joined a rendezvous, wait this long for the others (default {timings.last_call_s})")
    add("--rdzv_node_timeout_s", type=int, default=None,
        help=f"c10d: a node silent this long counts as lost (default {timings.node_timeout_s})")
    add("--rdzv_join_timeout_s", type=int, default=None,
        help=f"c10d: a rendezvous that takes longer fails the run (default {timings.join_timeout_s})")
    add("--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_python", action="store_true", help="run the script as an executable, without python")
    add("--append_local_rank", action="store_true",
        help="append --local_rank=<n> to the script's arguments, as DeepSpeed does by default")
    add("--log-dir", "--log_dir", "--enable_each_rank_log", dest="log_dir", default=None,
        help="write each rank's stdout/stderr to files under DIR/node<k>/ (default: console only)")
    add("--log_files_only", action="store_true",
        help="with --log-dir: files only, not the console (DeepSpeed's --enable_each_rank_log behaviour)")
    add("--env", action="append", default=[], metavar="KEY=VALUE",
        help="set a variable on every node (repeatable; also read from .fspeed_env in ~ and .)")
    add("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print the per-node commands and exit")
    add("--debug", action="store_true",
        help="on a failure, show torchrun's tracebacks and log lines (default: one summary naming the failed rank)")
    add("user_script", help="the training script (or module with --module)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def plan_from_args(args: argparse.Namespace, *, environ: Mapping[str, str], cwd: Path, home: Optional[Path],
                   cuda_device_count: int, own_names: tuple[str, ...] = ()) -> list[NodeCommand]:
    """Parsed flags -> the node commands to run here (all nodes, or only `--node_rank`'s)."""
    hostfile = args.hostfile
    if hostfile is None and Path(DEFAULT_HOSTFILE).is_file():
        hostfile = DEFAULT_HOSTFILE
    if hostfile is not None:
        pool = pool_from_slot_counts(read_hostfile(hostfile))
    else:
        if args.num_nodes is not None and args.num_nodes > 1:
            raise LaunchConfigError(
                f"--num_nodes {args.num_nodes}: without a hostfile only this machine (1 node) is available; "
                "pass --hostfile with '<host> slots=<n>' lines")
        pool = local_pool(cuda_device_count, environ.get("CUDA_VISIBLE_DEVICES"), args.num_gpus)
    resources = select_resources(pool, include=args.include, exclude=args.exclude,
                                 num_nodes=args.num_nodes, num_gpus=args.num_gpus)
    if args.no_ssh and args.node_rank is None:
        raise LaunchConfigError("--no_ssh needs --node_rank: which node of the hostfile this machine is")
    if args.node_rank is not None and not 0 <= args.node_rank < len(resources):
        raise LaunchConfigError(
            f"--node_rank {args.node_rank}: must be between 0 and {len(resources) - 1} "
            f"(nodes: {', '.join(resources)})")
    nodes, backend, timings = _rendezvous_from_args(args, hostfile is not None, len(resources))
    spec = LaunchSpec(
        script=args.user_script, script_args=tuple(args.user_args), python=sys.executable, cwd=str(cwd),
        module=args.module, no_python=args.no_python, master_addr=args.master_addr, master_port=args.master_port,
        rdzv_backend=backend, log_dir=args.log_dir, log_tee=not args.log_files_only,
        append_local_rank=args.append_local_rank, max_restarts=args.max_restarts, ssh_port=args.ssh_port,
        nodes=nodes, rdzv_timings=timings)
    commands = build_node_commands(
        resources, spec, own_names=own_names, local_has_cuda=cuda_device_count > 0,
        extra_env={**user_env(cwd, home, environ, args.env), **({DEBUG_ENV: "1"} if args.debug else {})},
        remote_env=exported_env(environ, cwd),
        run_all_here=args.node_rank is not None)
    return commands if args.node_rank is None else [commands[args.node_rank]]


def _rendezvous_from_args(args: argparse.Namespace, has_hostfile: bool,
                          hosts: int) -> tuple[Optional[NodeRange], str, RendezvousTimings]:
    """(--nnodes's range or None, the rendezvous backend, the c10d timings), checked against each other."""
    nodes = None
    if args.nnodes is not None:
        if not has_hostfile:
            raise LaunchConfigError(f"--nnodes {args.nnodes}: a node range needs --hostfile with the nodes "
                                    "('<host> slots=<n>' lines); without one only this machine (1 node) is used")
        nodes = parse_node_range(args.nnodes, hosts)
        if args.rdzv_backend == "static":
            raise LaunchConfigError(f"--nnodes {args.nnodes} needs the c10d rendezvous (the static one has a fixed "
                                    "set of nodes): leave --rdzv_backend out, or pass --rdzv_backend c10d")
    backend = args.rdzv_backend or ("c10d" if nodes is not None else "static")
    given = {name: value for name, value in (("last_call_s", args.rdzv_last_call_s),
                                             ("node_timeout_s", args.rdzv_node_timeout_s),
                                             ("join_timeout_s", args.rdzv_join_timeout_s)) if value is not None}
    if given and backend != "c10d":
        flags = ", ".join(f"--rdzv_{name}" for name in given)
        raise LaunchConfigError(f"{flags}: timings of the c10d rendezvous, which this launch does not use "
                                "(it is used with --nnodes MIN:MAX or --rdzv_backend c10d)")
    return nodes, backend, RendezvousTimings(**given)


def _own_host_names() -> tuple[str, ...]:
    name = socket.gethostname()
    return (name, name.split(".")[0])


def _summary(commands: list[NodeCommand], what: str) -> str:
    first = commands[0]
    lines = [f"fspeed: world size {first.world_size}, rendezvous {first.rendezvous}; {what}:"]
    lines += [f"fspeed:   {command.describe()}" for command in commands]
    return "\n".join(lines)


def _log_locations(log_dir: str, commands: list[NodeCommand]) -> str:
    found = rank_log_files(log_dir, commands)
    lines = [f"fspeed: per-rank logs under {log_dir}:"]
    for command in commands:
        if command.remote:
            lines.append(f"fspeed:   {command.describe()}: on {command.host} under "
                         f"{log_dir}/node{command.node_rank}/<run>/attempt_<n>/<local rank>/")
            continue
        for rank in command.ranks:
            paths = ", ".join(str(p) for p in found.get(rank, [])) or "(none written)"
            lines.append(f"fspeed:   rank {rank}: {paths}")
    return "\n".join(lines)


def launch(argv: list[str]) -> int:
    """Parse launcher flags, then print (--dry-run) or run the node commands; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import torch

        commands = plan_from_args(
            args, environ=os.environ, cwd=Path.cwd(), home=Path.home(),
            cuda_device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            own_names=_own_host_names())
    except LaunchConfigError as error:
        parser.exit(2, f"fspeed: error: {error}\n")
    if args.dry_run:
        print("# " + _summary(commands, "the commands that start").splitlines()[0])
        for command in commands:
            print(f"# {command.describe()}\n{command.shell()}")
        return 0
    print(_summary(commands, "starting"), file=sys.stderr, flush=True)
    try:
        result = run_node_commands(commands, min_nodes=commands[0].min_nodes)
    except LaunchError as error:
        print(f"fspeed: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fspeed: interrupted; the node agents were stopped", file=sys.stderr)
        return 130
    if args.log_dir is not None:
        print(_log_locations(args.log_dir, commands), file=sys.stderr)
    if not result.ok:
        print("\n".join(f"fspeed: {line}" for line in result.summary().splitlines()), file=sys.stderr)
    elif result.lost:
        print("\n".join(f"fspeed: {line}" for line in result.lost_message().splitlines()), file=sys.stderr)
    return result.exit_code


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        print(report())
        return
    code = launch(argv)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
