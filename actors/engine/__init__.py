"""The engine: one actor on its own OS thread, the only owner of MLX, holding one runner per
model (its hot tier, decode batch and queues) under an optional memory limit; its
settings and the reference a model's agents send through."""

from __future__ import annotations

from ._config import Attention as Attention
from ._config import EngineConfig as EngineConfig
from ._config import ModelSpec as ModelSpec
from ._config import turn_reserve_bytes as turn_reserve_bytes
from ._engine import FAIR_WAIT_S as FAIR_WAIT_S
from ._engine import EngineActor as EngineActor
from ._memory import MEMORY_SHARE as MEMORY_SHARE
from ._memory import default_memory_limit as default_memory_limit
from ._memory import read_limit as read_limit
from ._memory import record_limit as record_limit
from ._model_ref import ModelRef as ModelRef
from ._runner import ModelRunner as ModelRunner

__all__ = (
    "FAIR_WAIT_S",
    "MEMORY_SHARE",
    "Attention",
    "EngineActor",
    "EngineConfig",
    "ModelRef",
    "ModelSpec",
    "ModelRunner",
    "default_memory_limit",
    "read_limit",
    "record_limit",
    "turn_reserve_bytes",
)
