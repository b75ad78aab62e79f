"""The `fspeed` launcher: DeepSpeed's CLI surface (hostfile, --include/--exclude, --num_nodes,
--num_gpus) on top of torchrun's elastic agent, one agent per node.

    pool = pool_from_slot_counts(read_hostfile("hosts"))
    resources = select_resources(pool, include="worker-0:0,1@worker-1")
    commands = build_node_commands(resources, LaunchSpec(script="train.py"))
    result = run_node_commands(commands)

Modules: `hostfile` (hostfile grammar), `resources` (pools and filters), `environment` (what
reaches remote nodes), `commands` (per-node torchrun invocations), `elastic` (a node range:
`--nnodes MIN:MAX`), `agent` (torchrun plus a failure report), `tether` (workers die with their
agent, agents with the launcher: no orphans), `run` (running them, exit codes, per-rank logs). The CLI is `fspeed.cli.launch`.
"""

from .commands import LaunchSpec, NodeCommand, build_node_commands, resolve_master_addr
from .elastic import NodeRange, RendezvousTimings, parse_node_range
from .environment import exported_env, parse_env_assignments, parse_env_file, user_env
from .hostfile import HostfileError, LaunchConfigError, parse_hostfile, read_hostfile
from .resources import (
    ResourceFilterError, filter_resources, local_pool, parse_node_specs, pool_from_slot_counts, select_resources,
)
from .run import LaunchError, LaunchResult, NodeOutcome, RankFailure, rank_log_files, run_node_commands

__all__ = [
    "HostfileError", "LaunchConfigError", "LaunchError", "LaunchResult", "LaunchSpec", "NodeCommand", "NodeOutcome",
    "NodeRange", "RankFailure", "RendezvousTimings", "parse_node_range", "ResourceFilterError", "build_node_commands",
    "exported_env", "filter_resources", "local_pool",
    "parse_env_assignments", "parse_env_file", "parse_hostfile", "parse_node_specs", "pool_from_slot_counts",
    "rank_log_files", "read_hostfile", "resolve_master_addr", "run_node_commands", "select_resources", "user_env",
]
