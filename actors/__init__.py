"""Actors (engine, agent, store, prefetch), the hot-tier budget, model loading, session API."""

from __future__ import annotations

from ._tokenizer import Detokenizer as Detokenizer
from ._tokenizer import Tokenizer as Tokenizer
from .engine import EngineActor as EngineActor
from .engine import EngineConfig as EngineConfig
from .errors import AgentBusy as AgentBusy
from .errors import BudgetExceeded as BudgetExceeded
from .errors import CacheMiss as CacheMiss
from .errors import CacheRejected as CacheRejected
from .errors import ContextOverflow as ContextOverflow
from .errors import EngineStopped as EngineStopped
from .errors import InvalidAgentId as InvalidAgentId
from .errors import KvactorError as KvactorError
from .errors import StoreWriteError as StoreWriteError
from .errors import UnknownAgent as UnknownAgent
from .model import LoadedModel as LoadedModel
from .model import ModelLoadError as ModelLoadError
from .model import default_model_path as default_model_path
from .model import fetch_default_model as fetch_default_model
from .model import load_model as load_model
from .model import make_tiny_model as make_tiny_model
from .protocol import CacheInfo as CacheInfo
from .protocol import EngineStats as EngineStats
from .protocol import ModelInfo as ModelInfo
from .protocol import Sampling as Sampling
from .protocol import Timings as Timings
from .session import Agent as Agent
from .session import Completion as Completion
from .session import Session as Session
from .session import TextStream as TextStream
from .session import open as open
from .store import WarmInfo as WarmInfo
from .store import default_cache_dir as default_cache_dir

__all__ = (
    "Agent",
    "AgentBusy",
    "BudgetExceeded",
    "CacheMiss",
    "CacheRejected",
    "CacheInfo",
    "Completion",
    "ContextOverflow",
    "EngineStopped",
    "Detokenizer",
    "EngineActor",
    "EngineConfig",
    "EngineStats",
    "InvalidAgentId",
    "KvactorError",
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "Sampling",
    "Session",
    "StoreWriteError",
    "TextStream",
    "Timings",
    "Tokenizer",
    "UnknownAgent",
    "WarmInfo",
    "default_cache_dir",
    "default_model_path",
    "fetch_default_model",
    "load_model",
    "make_tiny_model",
    "open",
)
