"""More than one machine: engine hosts as Ray actors, the cluster session that places agents
and moves them with their caches, and its calls to the hosts (Ray is imported only when a
cluster is opened)."""

from __future__ import annotations

from ._agent import ClusterAgent as ClusterAgent
from ._host import EngineHost as EngineHost
from ._host import HostInfo as HostInfo
from ._placement import MostFreeBudget as MostFreeBudget
from ._placement import PlacementPolicy as PlacementPolicy
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
    "MostFreeBudget",
    "PlacementPolicy",
    "open_cluster",
)
