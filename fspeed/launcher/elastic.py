"""A node range (`fspeed --nnodes MIN:MAX`): a run that continues on the nodes that remain.

`--nnodes MIN:MAX` (or `MIN`, `MIN:`: MAX is the number of hosts given) starts an agent on every
host and lets torchrun's c10d rendezvous form the world from MIN to MAX of them. When a node is
lost (its agent dies, or it fails for good), the agents that remain re-rendezvous and restart
their workers on the smaller world, as long as at least MIN nodes remain; below MIN the run stops.
A restart is what continues the run, so a node range with MIN < MAX needs `--max_restarts` of at
least 1 (each loss uses one restart).

The rendezvous timings (`RendezvousTimings`, torchrun's `--rdzv-conf`):

- `last_call_s`: once MIN nodes have joined a round, how long it waits for the others before it
  starts without them (torchrun's `last_call_timeout`); it applies to the first round too, so
  every node must join within it for the run to start on all of them.
- `node_timeout_s`: a node whose agent has not renewed its heartbeat for this long is counted as
  gone (torchrun's keep-alive interval times its 3 attempts); a round after a loss waits this long
  for the lost node to be dropped, then `last_call_s`.
- `join_timeout_s`: how long a round may take in all before the agents give up
  (torchrun's `join_timeout`).

Node 0 (the first host) holds the rendezvous store: losing node 0 ends the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hostfile import LaunchConfigError

__all__ = ["KEEP_ALIVE_ATTEMPTS", "NodeRange", "RendezvousTimings", "parse_node_range"]

KEEP_ALIVE_ATTEMPTS = 3  # heartbeats a node may miss before it counts as gone (torchrun's default)


@dataclass(frozen=True)
class NodeRange:
    """The nodes a run may have: it starts on up to `max_nodes`, continues while `min_nodes` remain."""

    min_nodes: int
    max_nodes: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    def torchrun(self) -> str:
        """torchrun's `--nnodes` value."""
        return f"{self.min_nodes}:{self.max_nodes}"

    def describe(self) -> str:
        return (f"nodes {self.torchrun()}: starts on up to {self.max_nodes}, continues while at least "
                f"{self.min_nodes} remain{'' if self.min_nodes > 1 else 's'}")


@dataclass(frozen=True)
class RendezvousTimings:
    """torchrun's c10d rendezvous timings, in seconds (module docstring)."""

    last_call_s: int = 30
    node_timeout_s: int = 15
    join_timeout_s: int = 600

    def __post_init__(self) -> None:
        for name, value, least in (("--rdzv_last_call_s", self.last_call_s, 1),
                                   ("--rdzv_node_timeout_s", self.node_timeout_s, KEEP_ALIVE_ATTEMPTS),
                                   ("--rdzv_join_timeout_s", self.join_timeout_s, 1)):
            if value < least:
                raise LaunchConfigError(f"{name} {value}: must be at least {least} (seconds)")
        if self.join_timeout_s <= self.last_call_s + self.node_timeout_s:
            raise LaunchConfigError(
                f"--rdzv_join_timeout_s {self.join_timeout_s}: must exceed --rdzv_last_call_s + "
                f"--rdzv_node_timeout_s ({self.last_call_s} + {self.node_timeout_s}), or a round after a lost "
                "node times out before it can complete")

    def rdzv_conf(self, *, is_host: bool) -> str:
        """torchrun's `--rdzv-conf` value for one node (`is_host`: this node serves the rendezvous store)."""
        interval = max(1, self.node_timeout_s // KEEP_ALIVE_ATTEMPTS)
        return (f"is_host={int(is_host)},join_timeout={self.join_timeout_s},last_call_timeout={self.last_call_s},"
                f"keep_alive_interval={interval},keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}")


def parse_node_range(text: str, hosts: int) -> NodeRange:
    """`MIN:MAX`, `MIN:` or `MIN` (MAX: `hosts`) -> NodeRange; LaunchConfigError naming what is allowed."""
    allowed = f"allowed: MIN:MAX with 1 <= MIN <= MAX <= {hosts} (the hosts given), or MIN alone for MIN:{hosts}"
    low, _, high = text.strip().partition(":")
    try:
        min_nodes = int(low)
        max_nodes = int(high) if high.strip() else hosts
    except ValueError:
        raise LaunchConfigError(f"--nnodes {text!r}: not a node range; {allowed}") from None
    if min_nodes < 1:
        raise LaunchConfigError(f"--nnodes {text}: MIN must be at least 1; {allowed}")
    if max_nodes < min_nodes:
        raise LaunchConfigError(f"--nnodes {text}: MAX {max_nodes} is below MIN {min_nodes}; {allowed}")
    if max_nodes > hosts:
        raise LaunchConfigError(f"--nnodes {text}: MAX {max_nodes} is more than the {hosts} host"
                                f"{'s' if hosts != 1 else ''} given; {allowed}")
    return NodeRange(min_nodes, max_nodes)
