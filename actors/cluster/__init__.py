"""More than one machine: engine hosts as Ray actors, the cluster session that places agents
and moves them with their caches, and its calls to the hosts (Ray is imported only when a
cluster is opened)."""

from __future__ import annotations

from ._agent import ClusterAgent as ClusterAgent
from ._host import EngineHost as EngineHost
from ._host import HostInfo as HostInfo
from ._host import TurnEnd as TurnEnd
from ._placement import CacheAware as CacheAware
from ._placement import MostFreeBudget as MostFreeBudget
from ._placement import PlacementPolicy as PlacementPolicy
from ._placement import PrefixPlacement as PrefixPlacement
from ._placement import RoundRobin as RoundRobin
from ._prefixes import BLOCK as BLOCK
from ._prefixes import HeldPrefixes as HeldPrefixes
from ._prefixes import prefix_blocks as prefix_blocks
from ._served import ServedCluster as ServedCluster
from ._served import sum_structs as sum_structs
from ._session import CLUSTER_KEYS as CLUSTER_KEYS
from ._session import ClusterOptions as ClusterOptions
from ._session import ClusterSession as ClusterSession
from ._session import open_cluster as open_cluster

__all__ = (
    "EngineHost",
    "HostInfo",
    "ClusterAgent",
    "CLUSTER_KEYS",
    "ClusterOptions",
    "ClusterSession",
    "BLOCK",
    "CacheAware",
    "HeldPrefixes",
    "MostFreeBudget",
    "PlacementPolicy",
    "PrefixPlacement",
    "RoundRobin",
    "ServedCluster",
    "sum_structs",
    "TurnEnd",
    "prefix_blocks",
    "open_cluster",
)
