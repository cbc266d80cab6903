"""Where a cluster's agents go, and what moved: the placement policy of new agents, and the
records of migrations and of the cluster as a whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from ._host import HostInfo

__all__ = ("ClusterStats", "Migration", "MostFreeBudget", "PlacementPolicy")


class Migration(msgspec.Struct, frozen=True):
    """An agent moved between hosts with its warm cache."""

    agent: str
    source: str
    target: str
    nbytes: int  # the files shipped
    seconds: float


class ClusterStats(msgspec.Struct, frozen=True):
    """Every live host (its node, budget, agents, replicas, engine stats), the migrations
    so far, the hosts gone for good, and the replica updates that failed."""

    hosts: list[HostInfo]
    migrations: list[Migration]
    lost_hosts: list[str] = []
    replication_failures: int = 0


class PlacementPolicy(Protocol):
    """Picks the host of a new agent."""

    def choose(self, agent: str, hosts: Sequence[HostInfo]) -> str:
        """The name of one of ``hosts`` (never empty) for ``agent``."""
        ...


class MostFreeBudget:
    """The host with the most hot budget left (no budget: unbounded), then the one with the
    fewest agents, then the first by name."""

    def choose(self, agent: str, hosts: Sequence[HostInfo]) -> str:
        def load(h: HostInfo) -> int:
            return len(set(h.agents) | set(h.warm_agents))

        return min(hosts, key=lambda h: (-h.free_bytes, load(h), h.name)).name
