"""Build one torchrun invocation per node from a resource pool (what `fspeed --dry-run` prints).

Node k of the pool runs `python -u -m fspeed.launcher.agent` (torchrun's elastic agent, see
`agent.py`) with `--nnodes=<nodes> --nproc-per-node=<its slots> --node-rank=k`. The default
rendezvous is torchrun's static one at `master_addr:master_port`: global ranks are node-major in
hostfile order (node 0 gets ranks 0..n0-1, and so on, uneven slot counts included), exactly
DeepSpeed's assignment. `rdzv_backend='c10d'` uses c10d rendezvous instead (elastic-friendly, but
node order is then decided by the rendezvous): node 0 serves its store (`is_host`), every node
names itself by its host (`--local-addr`), and `nodes` (a `NodeRange`, `elastic.py`) gives
torchrun's `--nnodes=MIN:MAX`, with the rendezvous timings of `rdzv_timings`. A single local node
without an explicit port lets torchrun pick a free one.

Every worker starts through `fspeed.launcher.tether` (torchrun's `--module` mode), which ties it
to its agent and then execs the script (`script` mode: `python -u script`; `module`: `python -u
-m module`; `exec`: the executable itself, torchrun's `--no-python`). Remote agents get
`FSPEED_AGENT_TETHER=stdin`: they stop when their ssh connection to the launcher closes.

torchrun gives every worker RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (node
rank), MASTER_ADDR and MASTER_PORT. DeepSpeed also appends `--local_rank=<n>` to the script's
arguments; that is off here (read LOCAL_RANK) unless `append_local_rank=True`, which passes
`--local_rank=${local_rank}` for torchrun to substitute per worker.

Restricted slots become `CUDA_VISIBLE_DEVICES` on the node: always for remote nodes (harmless on
CPU nodes, where only the count matters) and for the local node when it has CUDA. Hosts that are
this machine (`localhost`, `127.x.x.x`, `::1`, its host name) run directly; others are started
with `ssh host 'cd <cwd> && env K=V ... python ...'`.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .elastic import NodeRange, RendezvousTimings
from .hostfile import LaunchConfigError
from .resources import format_slots
from .tether import AGENT_TETHER_ENV, TETHER_MODULE

__all__ = [
    "AGENT_MODULE", "TETHER_MODULE", "DEFAULT_MASTER_PORT", "LaunchSpec", "NodeCommand", "is_loopback", "resolve_master_addr",
    "build_node_commands", "node_log_dir",
]

AGENT_MODULE = "fspeed.launcher.agent"
DEFAULT_MASTER_PORT = 29500
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", "::1"})


@dataclass(frozen=True)
class LaunchSpec:
    """What to run and how, independent of the resource pool."""

    script: str
    script_args: tuple[str, ...] = ()
    python: str = "python3"
    cwd: str = "."
    module: bool = False                  # `python -m script`
    no_python: bool = False               # run `script` as an executable
    master_addr: Optional[str] = None     # default: derived from the first host
    master_port: Optional[int] = None     # default: torchrun's free port (one local node) or 29500
    rdzv_backend: str = "static"          # 'static' (DeepSpeed's rank order) or 'c10d'
    rdzv_id: str = "fspeed"
    log_dir: Optional[str] = None         # per-rank files under <log_dir>/node<k>/
    log_tee: bool = True                  # True: files and console; False: files only (DeepSpeed)
    append_local_rank: bool = False
    max_restarts: int = 0
    ssh_port: Optional[int] = None
    nodes: Optional[NodeRange] = None     # --nnodes MIN:MAX (c10d only)
    rdzv_timings: RendezvousTimings = field(default_factory=RendezvousTimings)  # c10d only

    def __post_init__(self) -> None:
        if self.rdzv_backend not in ("static", "c10d"):
            raise LaunchConfigError(f"rdzv_backend {self.rdzv_backend!r}: allowed are 'static' and 'c10d'")
        if self.module and self.no_python:
            raise LaunchConfigError("--module and --no_python are mutually exclusive")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchConfigError(f"--master_port {self.master_port}: must be between 1 and 65535")
        if self.max_restarts < 0:
            raise LaunchConfigError(f"max_restarts {self.max_restarts}: must be >= 0")
        if self.nodes is not None and self.rdzv_backend != "c10d":
            raise LaunchConfigError(f"--nnodes {self.nodes.torchrun()} needs the c10d rendezvous; "
                                    f"--rdzv_backend {self.rdzv_backend} has a fixed set of nodes")
        if self.nodes is not None and self.nodes.elastic and self.max_restarts < 1:
            raise LaunchConfigError(
                f"--nnodes {self.nodes.torchrun()}: the nodes that remain after a loss continue by restarting "
                f"their workers, so pass --max_restarts N with N >= 1 (each lost node uses one restart)")


@dataclass(frozen=True)
class NodeCommand:
    """One node's torchrun agent: what to execute on this machine, with which extra environment."""

    node_rank: int
    host: str
    slots: tuple[int, ...]
    first_rank: int                       # global rank of this node's local rank 0
    world_size: int
    remote: bool                          # started through ssh
    argv: tuple[str, ...]                 # executed here (`ssh ...` for remote nodes)
    env: Mapping[str, str] = field(default_factory=dict)   # set on top of this process's environment
    rendezvous: str = ""                  # e.g. 'static at 127.0.0.1:29500'
    min_nodes: Optional[int] = None       # with a node range: the nodes the run needs to go on

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + len(self.slots))

    def describe(self) -> str:
        last = self.first_rank + len(self.slots) - 1
        ranks = f"rank {self.first_rank}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"
        how = "ssh" if self.remote else "local"
        return f"node {self.node_rank} ({self.host}, slots {format_slots(self.slots)}, {ranks}, {how})"

    def shell(self) -> str:
        """A copy-pasteable shell line equivalent to running this command."""
        assignments = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        return " ".join((["env"] + assignments if assignments else []) + [shlex.quote(a) for a in self.argv])


def is_loopback(host: str) -> bool:
    """localhost, ::1 and 127.0.0.0/8 names."""
    if host in LOOPBACK_NAMES:
        return True
    parts = host.split(".")
    return len(parts) == 4 and parts[0] == "127" and all(p.isdigit() and int(p) < 256 for p in parts)


def _is_this_machine(host: str, own_names: Collection[str]) -> bool:
    return is_loopback(host) or host in own_names or host.split(".")[0] in own_names


def resolve_master_addr(hosts: Sequence[str], given: Optional[str], remote_hosts: Collection[str]) -> str:
    """`--master_addr`, else the first host's name; a loopback first host is 127.0.0.1 if all nodes are local."""
    if given:
        return given
    first = hosts[0]
    if not is_loopback(first):
        return first
    if remote_hosts:
        raise LaunchConfigError(
            f"the first host {first!r} is a loopback name, which remote nodes ({', '.join(remote_hosts)}) "
            "cannot reach; pass --master_addr with an address of this machine they can reach"
        )
    return "127.0.0.1"


def node_log_dir(log_dir: str, node_rank: int) -> str:
    """Where node k's torchrun keeps its per-rank logs: `<log_dir>/node<k>`."""
    return str(Path(log_dir) / f"node{node_rank}")


def _torchrun_args(spec: LaunchSpec, *, host: str, nnodes: int, nproc: int, node_rank: int, master_addr: str,
                   master_port: Optional[int]) -> list[str]:
    count = spec.nodes.torchrun() if spec.nodes is not None else str(nnodes)
    args = [f"--nnodes={count}", f"--nproc-per-node={nproc}", f"--max-restarts={spec.max_restarts}"]
    if spec.rdzv_backend == "c10d":
        port = master_port if master_port is not None else DEFAULT_MASTER_PORT
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{port}", f"--rdzv-id={spec.rdzv_id}",
                 f"--rdzv-conf={spec.rdzv_timings.rdzv_conf(is_host=node_rank == 0)}",
                 f"--local-addr={'127.0.0.1' if is_loopback(host) else host}"]
    else:
        args += [f"--node-rank={node_rank}", f"--master-addr={master_addr}"]
        if master_port is not None:
            args.append(f"--master-port={master_port}")
    if spec.log_dir is not None:
        args += [f"--log-dir={node_log_dir(spec.log_dir, node_rank)}", "--tee=3" if spec.log_tee else "--redirects=3"]
    mode = "module" if spec.module else "exec" if spec.no_python else "script"
    script_args = list(spec.script_args)
    if spec.append_local_rank:
        script_args.append("--local_rank=${local_rank}")
    return args + ["--module", TETHER_MODULE, mode, spec.script] + script_args


def build_node_commands(resources: Mapping[str, Sequence[int]], spec: LaunchSpec, *,
                        own_names: Collection[str] = (), local_has_cuda: bool = False,
                        extra_env: Optional[Mapping[str, str]] = None,
                        remote_env: Optional[Mapping[str, str]] = None,
                        run_all_here: bool = False) -> list[NodeCommand]:
    """One `NodeCommand` per host of `resources`, in rank order.

    `own_names`: this machine's host names (hosts that run without ssh, besides loopback names).
    `extra_env`: the user's `.fspeed_env`/`--env` variables, set on every node.
    `remote_env`: the exported variables (`environment.exported_env`) for ssh nodes.
    `run_all_here`: treat every host as this machine (DeepSpeed's `--no_ssh`, with `--node_rank`).
    """
    if not resources:
        raise LaunchConfigError("the resource pool is empty; there is nothing to launch")
    hosts = list(resources)
    remote_hosts = [] if run_all_here else [h for h in hosts if not _is_this_machine(h, own_names)]
    master_addr = resolve_master_addr(hosts, spec.master_addr, remote_hosts)
    master_port = spec.master_port
    if master_port is None and len(hosts) > 1:
        master_port = DEFAULT_MASTER_PORT
    world_size = sum(len(slots) for slots in resources.values())
    rendezvous = f"{spec.rdzv_backend} at {master_addr}:" + (
        str(master_port) if master_port is not None
        else str(DEFAULT_MASTER_PORT) if spec.rdzv_backend == "c10d" else "<free port>")
    if spec.nodes is not None:
        rendezvous += f", {spec.nodes.describe()}"
    extra_env = dict(extra_env or {})
    min_nodes = spec.nodes.min_nodes if spec.nodes is not None else None
    commands: list[NodeCommand] = []
    first_rank = 0
    for node_rank, (host, slots) in enumerate(resources.items()):
        slots = tuple(slots)
        remote = host in remote_hosts
        env = dict(extra_env)
        if remote or local_has_cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        agent = [spec.python, "-u", "-m", AGENT_MODULE] + _torchrun_args(
            spec, host=host, nnodes=len(hosts), nproc=len(slots), node_rank=node_rank,
            master_addr=master_addr, master_port=master_port)
        if remote:
            remote_vars = {**(remote_env or {}), **env, AGENT_TETHER_ENV: "stdin"}
            exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in remote_vars.items())
            line = f"cd {shlex.quote(spec.cwd)} && env {exports} " + " ".join(shlex.quote(a) for a in agent)
            ssh = ["ssh", "-o", "BatchMode=yes"] + (["-p", str(spec.ssh_port)] if spec.ssh_port else [])
            commands.append(NodeCommand(node_rank, host, slots, first_rank, world_size, True,
                                        tuple(ssh + [host, line]), {}, rendezvous, min_nodes))
        else:
            commands.append(NodeCommand(node_rank, host, slots, first_rank, world_size, False, tuple(agent), env,
                                        rendezvous, min_nodes))
        first_rank += len(slots)
    return commands
