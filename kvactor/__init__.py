"""kvactor: many LLM agents on one machine, as actors with tiered KV caches.

This module is the application API: ``open`` a session, spawn agents, and the values,
policies, codec and errors that come with them. The actor kernel lives in
``kvactor.runtime``; the engine, store and model loading in ``kvactor.actors``.

Importing kvactor first loads an optimized BLAS into the process when one is installed
(before MLX is imported), since MLX's Linux CPU wheel bundles a slow reference BLAS.
"""

from __future__ import annotations

from .kernels.blas import ensure_blas as _ensure_blas

BLAS = _ensure_blas()
"""Which BLAS MLX's CPU matmuls run on (a ``kvactor.kernels.BlasInfo``)."""

# ruff: noqa: E402  (MLX, imported by everything below, must come after the BLAS)
from .actors.cluster import CacheAware as CacheAware
from .actors.cluster import ClusterSession as ClusterSession
from .actors.cluster import MostFreeBudget as MostFreeBudget
from .actors.cluster import PlacementPolicy as PlacementPolicy
from .actors.cluster import RoundRobin as RoundRobin
from .actors.cluster import open_cluster as open_cluster
from .actors.engine import Attention as Attention
from .actors.enums import FinishReason as FinishReason
from .actors.enums import Match as Match
from .actors.enums import Tier as Tier
from .actors.errors import AgentBusy as AgentBusy
from .actors.errors import AgentExists as AgentExists
from .actors.errors import BudgetExceeded as BudgetExceeded
from .actors.errors import CacheDirLocked as CacheDirLocked
from .actors.errors import CacheMiss as CacheMiss
from .actors.errors import CacheRejected as CacheRejected
from .actors.errors import CacheTooLarge as CacheTooLarge
from .actors.errors import ContextOverflow as ContextOverflow
from .actors.errors import EngineStopped as EngineStopped
from .actors.errors import HostLost as HostLost
from .actors.errors import InvalidAgentId as InvalidAgentId
from .actors.errors import ModelLoadError as ModelLoadError
from .actors.errors import StoreWriteError as StoreWriteError
from .actors.errors import TurnEnded as TurnEnded
from .actors.errors import UnknownAgent as UnknownAgent
from .actors.errors import UnsafeCachePath as UnsafeCachePath
from .actors.hot import Candidate as Candidate
from .actors.hot import EvictionPolicy as EvictionPolicy
from .actors.hot import LRUPolicy as LRUPolicy
from .actors.hot import WorkflowPolicy as WorkflowPolicy
from .actors.opening import open as open
from .actors.options import Sampling as Sampling
from .actors.records import CacheInfo as CacheInfo
from .actors.records import Completion as Completion
from .actors.records import EngineStats as EngineStats
from .actors.records import ModelInfo as ModelInfo
from .actors.records import ModelState as ModelState
from .actors.records import Timings as Timings
from .actors.session import Agent as Agent
from .actors.session import AgentAPI as AgentAPI
from .actors.session import Session as Session
from .actors.session import SessionAPI as SessionAPI
from .actors.session import TextStream as TextStream
from .actors.session import TurnStream as TurnStream
from .actors.warm import Forgotten as Forgotten
from .actors.warm import SharedFile as SharedFile
from .actors.warm import WarmInfo as WarmInfo
from .actors.warm import default_cache_dir as default_cache_dir
from .kernels.qcodec import DEFAULT_CODEC as DEFAULT_CODEC
from .kernels.qcodec import KVCodec as KVCodec
from .runtime import ActorDeadError as ActorDeadError
from .runtime import AskTimeout as AskTimeout
from .runtime import KvactorError as KvactorError

__all__ = (
    "CacheAware",
    "BLAS",
    "DEFAULT_CODEC",
    "ActorDeadError",
    "Agent",
    "AgentAPI",
    "AgentBusy",
    "AgentExists",
    "AskTimeout",
    "Attention",
    "BudgetExceeded",
    "CacheDirLocked",
    "CacheInfo",
    "CacheMiss",
    "CacheRejected",
    "CacheTooLarge",
    "Candidate",
    "ClusterSession",
    "Completion",
    "ContextOverflow",
    "EngineStats",
    "EngineStopped",
    "EvictionPolicy",
    "FinishReason",
    "Forgotten",
    "HostLost",
    "InvalidAgentId",
    "KVCodec",
    "KvactorError",
    "LRUPolicy",
    "Match",
    "ModelInfo",
    "ModelLoadError",
    "ModelState",
    "MostFreeBudget",
    "PlacementPolicy",
    "RoundRobin",
    "Sampling",
    "Session",
    "SessionAPI",
    "SharedFile",
    "StoreWriteError",
    "TextStream",
    "Tier",
    "Timings",
    "TurnEnded",
    "TurnStream",
    "UnknownAgent",
    "UnsafeCachePath",
    "WarmInfo",
    "WorkflowPolicy",
    "default_cache_dir",
    "open",
    "open_cluster",
)
