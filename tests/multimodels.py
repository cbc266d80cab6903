"""Two tiny random models of different configurations for the multi-model tests, and the
memory limit that holds either of them with one turn but never both."""

from __future__ import annotations

import functools
from typing import Any

from kvactor.actors.engine import EngineConfig
from kvactor.actors.engine._memory import (
    activation_bytes,
    kept_buffer_bytes,
    one_turn_bytes,
    weights_bytes,
)
from kvactor.actors.models import make_tiny_model

# The same cache geometry per token (2 layers, 2 KV heads of 64), so one turn reserves the
# same in both; weights large enough that the two never fit with a turn's needs.
A = functools.partial(make_tiny_model, 0, head_dim=64, hidden_size=192, intermediate_size=768)
B = functools.partial(
    make_tiny_model, 1, head_dim=64, hidden_size=256, intermediate_size=1024, num_attention_heads=4
)
MODELS: dict[str, Any] = {"router": A, "coder": B}


def need(spec: Any, config: EngineConfig | None = None) -> tuple[int, int]:
    """(weights + activations, one turn) of a model, as the engine counts them."""
    config = config or EngineConfig()
    lm = spec()
    return weights_bytes(lm) + activation_bytes(lm, config), one_turn_bytes(lm, config)


def swap_limit() -> int:
    """Room for the larger model (B), one turn and an eighth of one for caches, and for
    MLX's kept buffers: never for both models at once with a turn of short prompts."""
    (fixed_a, turn), (fixed_b, _) = need(A), need(B)
    room = fixed_b + turn + turn // 8
    limit = room * 16 // 15 + 16
    assert room <= limit - kept_buffer_bytes(limit)
    assert fixed_a + fixed_b + turn // 4 > limit - kept_buffer_bytes(limit)
    return limit


def hot_pool(kv: Any, model: str | None = None) -> Any:
    """Looking inside: the hot tier (``CachePool``) of ``model`` (None: the session's
    first) in ``kv``'s engine actor (its slot's runner)."""
    actor: Any = kv.engine._cell._actor
    slots = actor._slots
    name = model if model is not None else next(iter(slots))
    return slots[name].runner.pool
