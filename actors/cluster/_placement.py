"""Where a cluster's agents go, and what moved: the placement policy of new agents, and the
records of migrations and of the cluster as a whole."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from ._host import HostInfo
from ._prefixes import HeldPrefixes

__all__ = (
    "CacheAware",
    "ClusterStats",
    "Migration",
    "MostFreeBudget",
    "PlacementPolicy",
    "PrefixPlacement",
    "RoundRobin",
)


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


@runtime_checkable
class PrefixPlacement(Protocol):
    """A placement policy that looks at the new agent's prompt: ``blocks`` are the hashes
    of its first prompt's whole blocks (``prefix_blocks``), ``held`` what each host holds."""

    def choose(self, agent: str, hosts: Sequence[HostInfo]) -> str: ...

    def choose_prefix(
        self, agent: str, hosts: Sequence[HostInfo], blocks: Sequence[int], held: HeldPrefixes
    ) -> str:
        """The name of one of ``hosts`` for ``agent``."""
        ...


def _load(h: HostInfo) -> int:
    """A host's agents, running or warm on its disk."""
    return len(set(h.agents) | set(h.warm_agents))


def _turns(h: HostInfo) -> int:
    """A host's turns under way: prefilling, decoding, or waiting for a batch slot."""
    return h.stats.prefilling + h.stats.decoding + h.stats.waiting


class MostFreeBudget:
    """The host with the most hot budget left (no budget: unbounded), then the one with the
    fewest agents, then the first by name."""

    def choose(self, agent: str, hosts: Sequence[HostInfo]) -> str:
        return min(hosts, key=lambda h: (-h.free_bytes, _load(h), h.name)).name


class RoundRobin:
    """Each new agent on the next host by name, in turn (what a balancer that knows
    nothing of caches does)."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, agent: str, hosts: Sequence[HostInfo]) -> str:
        names = sorted(h.name for h in hosts)
        return names[next(self._next) % len(names)]


class CacheAware:
    """The default on clusters: the host that holds the longest prefix of the new agent's
    prompt (a team's system prompt, a shared context, an earlier conversation; hot or warm),
    unless that host is past its share. A host is past it when it would hold more than
    ``1 + slack`` times an even share of the agents (this one counted) and more than
    ``allowance`` agents beyond the least loaded host (both, as SGLang's cache-aware router
    balances: a few agents of imbalance keep a team together), or when its turns under way
    (queued or running) are more than ``queue_allowance`` past the least busy host's (its
    cached prefix would save less than the wait costs); it is passed over while another is
    not. A prompt no host holds goes to the host holding the fewest distinct prompts (so
    that teams, not agents, are spread), then as :class:`MostFreeBudget` places it. A
    prompt shorter than a block, or none (``choose``): MostFreeBudget."""

    def __init__(self, slack: float = 0.3, allowance: int = 8, queue_allowance: int = 16) -> None:
        if slack < 0 or allowance < 0 or queue_allowance < 0:
            raise ValueError("slack, allowance and queue_allowance must be >= 0")
        self.slack = slack
        self.allowance = allowance
        self.queue_allowance = queue_allowance
        self._fallback = MostFreeBudget()

    def choose(self, agent: str, hosts: Sequence[HostInfo]) -> str:
        return self._fallback.choose(agent, hosts)

    def choose_prefix(
        self, agent: str, hosts: Sequence[HostInfo], blocks: Sequence[int], held: HeldPrefixes
    ) -> str:
        if not blocks:
            return self.choose(agent, hosts)
        loads = {h.name: _load(h) for h in hosts}
        share = (1 + self.slack) * (sum(loads.values()) + 1) / len(hosts)
        least = min(loads.values())
        idlest = min(_turns(h) for h in hosts)

        def past(h: HostInfo) -> bool:
            after = loads[h.name] + 1
            busy = _turns(h) - idlest > self.queue_allowance
            return busy or (after > share and after - least > self.allowance)

        room = [h for h in hosts if not past(h)] or list(hosts)
        return min(
            room,
            key=lambda h: (
                -held.overlap(h.name, blocks),
                held.prompts(h.name),
                -h.free_bytes,
                loads[h.name],
                h.name,
            ),
        ).name
