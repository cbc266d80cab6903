"""The LLM layer: engine, agent, store and prefetch actors, the hot tier (pool), model
loading and the session API. ``kvactor`` re-exports the application's part of it."""

from __future__ import annotations

if __name__ != "kvactor.actors":  # one import name per file: see docs/layout.md
    raise ImportError(f"import kvactor.actors, not {__name__}: each file has one import name")

from ..runtime import KvactorError as KvactorError
from .engine import Attention as Attention
from .engine import EngineActor as EngineActor
from .engine import EngineConfig as EngineConfig
from .enums import FinishReason as FinishReason
from .enums import Match as Match
from .enums import Room as Room
from .enums import StageOutcome as StageOutcome
from .enums import Tier as Tier
from .enums import TurnPath as TurnPath
from .errors import AgentBusy as AgentBusy
from .errors import BudgetExceeded as BudgetExceeded
from .errors import CacheDirLocked as CacheDirLocked
from .errors import CacheMiss as CacheMiss
from .errors import CacheRejected as CacheRejected
from .errors import ContextOverflow as ContextOverflow
from .errors import EngineStopped as EngineStopped
from .errors import InvalidAgentId as InvalidAgentId
from .errors import ModelExportError as ModelExportError
from .errors import ModelLoadError as ModelLoadError
from .errors import StoreWriteError as StoreWriteError
from .errors import TurnEnded as TurnEnded
from .errors import UnknownAgent as UnknownAgent
from .errors import UnsafeCachePath as UnsafeCachePath
from .hot import CachePool as CachePool
from .hot import Candidate as Candidate
from .hot import EvictionPolicy as EvictionPolicy
from .hot import LRUPolicy as LRUPolicy
from .models import Detokenizer as Detokenizer
from .models import LoadedModel as LoadedModel
from .models import Tokenizer as Tokenizer
from .models import default_model_path as default_model_path
from .models import fetch_default_model as fetch_default_model
from .models import load_model as load_model
from .models import make_tiny_model as make_tiny_model
from .opening import open as open
from .options import Sampling as Sampling
from .records import CacheInfo as CacheInfo
from .records import Completion as Completion
from .records import EngineStats as EngineStats
from .records import ModelInfo as ModelInfo
from .records import Timings as Timings
from .session import Agent as Agent
from .session import Session as Session
from .session import TextStream as TextStream
from .warm import WarmInfo as WarmInfo
from .warm import default_cache_dir as default_cache_dir

__all__ = (
    "Agent",
    "AgentBusy",
    "Attention",
    "BudgetExceeded",
    "CacheDirLocked",
    "CacheInfo",
    "CacheMiss",
    "CachePool",
    "CacheRejected",
    "Candidate",
    "Completion",
    "ContextOverflow",
    "Detokenizer",
    "EngineActor",
    "EngineConfig",
    "EngineStats",
    "EngineStopped",
    "EvictionPolicy",
    "FinishReason",
    "InvalidAgentId",
    "KvactorError",
    "LRUPolicy",
    "LoadedModel",
    "Match",
    "ModelInfo",
    "ModelExportError",
    "ModelLoadError",
    "Room",
    "Sampling",
    "Session",
    "StageOutcome",
    "StoreWriteError",
    "TextStream",
    "Tier",
    "Timings",
    "TurnEnded",
    "TurnPath",
    "Tokenizer",
    "UnknownAgent",
    "UnsafeCachePath",
    "WarmInfo",
    "default_cache_dir",
    "default_model_path",
    "fetch_default_model",
    "load_model",
    "make_tiny_model",
    "open",
)
