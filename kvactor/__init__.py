"""kvactor: many LLM agents on one machine, as actors with tiered KV caches."""

from __future__ import annotations

from .runtime import *  # noqa: F403
from .runtime import __all__ as _runtime_all

__all__ = (*_runtime_all,)
