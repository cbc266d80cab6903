"""One memory limit over everything a multi-model session holds for its models: loaded
weights, each model's activations, the hot tier (stored caches, working and ready copies,
checkpoints, stagings, exports being written) and the freed buffers MLX keeps for reuse.

The engine of a multi-model session (``actors.models_engine``) counts with these rules and
keeps the count within the limit; this module holds the rules, not the state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..models import LoadedModel
from ._config import EngineConfig, turn_reserve_bytes

__all__ = (
    "MEMORY_SHARE",
    "activation_bytes",
    "attention_heads",
    "attention_score_bytes",
    "MEMORY_FILE",
    "default_memory_limit",
    "kept_buffer_bytes",
    "mlx_memory",
    "one_turn_bytes",
    "physical_memory",
    "read_limit",
    "record_limit",
    "weights_bytes",
)

MEMORY_SHARE = 0.75
"""The default memory limit: this share of the machine's RAM (unified memory on a Mac)."""

# The freed buffers MLX may keep under a limit: this share of it, at most 1 GiB.
_KEPT_SHARE = 16


def physical_memory() -> int:
    """The machine's RAM in bytes (8 GiB when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_memory_limit() -> int:
    """``MEMORY_SHARE`` of the machine's RAM, in bytes."""
    return int(physical_memory() * MEMORY_SHARE)


def kept_buffer_bytes(limit: int) -> int:
    """What MLX may keep of freed buffers under ``limit``: a sixteenth of it, at most 1 GiB.
    The engine sets MLX's cache limit to it and counts it in full."""
    return min(limit // _KEPT_SHARE, 1 << 30)


def weights_bytes(lm: LoadedModel) -> int:
    """The bytes of ``lm``'s parameters as loaded (fp32 or packed)."""
    params: Any = tree_flatten(lm.model.parameters())
    return sum(int(a.nbytes) for _, a in params)


def _hidden_size(lm: LoadedModel) -> int:
    args = getattr(lm.model, "args", None)
    hidden = getattr(args, "hidden_size", None) or getattr(
        getattr(args, "text_config", None), "hidden_size", None
    )
    if isinstance(hidden, int):
        return hidden
    if isinstance(args, dict):  # text_config as a plain dict
        return int(args.get("hidden_size", 4096))
    return 4096


def activation_bytes(lm: LoadedModel, config: EngineConfig) -> int:
    """A bound on one forward's activations: a prefill chunk's fp32 logits over the
    vocabulary and a handful of hidden-state copies per token, for a whole batch's rows."""
    rows = max(config.prefill_chunk, config.max_batch)
    width = lm.tokenizer.vocab_size + 16 * _hidden_size(lm)
    return 4 * rows * width


def attention_heads(lm: LoadedModel) -> int:
    """``lm``'s query heads (read from its arguments; else 4 per KV head)."""
    args = getattr(lm.model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    return heads if isinstance(heads, int) and heads > 0 else 4 * max(lm.n_kv_heads, 8)


def attention_score_bytes(heads: int, queries: int, keys: int) -> int:
    """fp32 attention scores and their softmax of ``queries`` over ``keys`` in one layer."""
    return 8 * heads * queries * keys


def one_turn_bytes(lm: LoadedModel, config: EngineConfig) -> int:
    """What one turn of a modest size needs (a prefill chunk of prompt and 256 tokens of
    answer, from an empty cache): its reserve and its attention scores; what a model must
    fit besides its weights."""
    tokens = config.prefill_chunk + 256
    scores = attention_score_bytes(attention_heads(lm), config.prefill_chunk, tokens)
    return turn_reserve_bytes(lm.geometry, tokens) + scores


MEMORY_FILE = "memory.json"
"""In a cache directory: the memory limit and models of the session that last opened it."""


def record_limit(root: Path, limit: int, models: list[str]) -> None:
    """Write ``root``'s MEMORY_FILE (for ``kvactor inspect``); an OSError is ignored."""
    try:
        text = json.dumps({"memory_limit_bytes": limit, "models": models})
        (root / MEMORY_FILE).write_text(text + "\n", encoding="utf-8")
    except OSError:
        pass


def read_limit(root: Path) -> dict[str, Any] | None:
    """``root``'s MEMORY_FILE (None: none, or unreadable)."""
    try:
        data = json.loads((root / MEMORY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def mlx_memory() -> tuple[int, int, int]:
    """MLX's bytes now: (active, kept freed buffers, peak active since the last reset)."""
    return int(mx.get_active_memory()), int(mx.get_cache_memory()), int(mx.get_peak_memory())
