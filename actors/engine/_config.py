"""The engine's settings, and the one rule for what a turn reserves in the hot budget."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import mlx.core as mx

from ...kernels.agent_cache import DEFAULT_CHECKPOINTS
from ...kernels.geometry import CacheGeometry
from ...kernels.qcodec import KVCodec
from ...kernels.turn_cache import FloatTurnCache, QuantizedTurnCache
from ..hot import EvictionPolicy, WorkflowPolicy, make_policy
from ..models import LoadedModel

__all__ = ("Attention", "EngineConfig", "ModelSpec", "turn_reserve_bytes")

Attention = Literal["auto", "quantized", "dequantized"]
ModelSpec = str | os.PathLike[str] | None | Callable[[], LoadedModel]


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch``: agents decoding in one forward. ``prefill_chunk``: prompt tokens per
    prefill step (decode steps of other agents run between chunks). ``weights``: see
    ``load_model``. ``codec``: how stored caches are quantized (None: ``DEFAULT_CODEC``).
    ``budget_bytes``: the hot tier's byte budget (None: unbounded). ``persistent``: a warm
    tier exists, so only caches safe on disk may be demoted; without one, demotion drops a
    cache to cold (text only). ``policy``: whom to demote.
    ``attention``: how turns read an agent's stored cache. ``"quantized"``: attention runs
    over the quantized parts as stored (``mx.quantized_matmul``), batches are
    QuantizedBatchCaches, and only the running turn's tokens are float. ``"dequantized"``:
    each turn dequantizes the agent's cache into a float copy once, and batches are
    mlx-lm BatchKVCaches of those. ``"auto"``: quantized on a GPU; dequantized on the CPU,
    where MLX's quantized matmul is slower than float attention (bench/decode_batch.py).
    The stored bytes, and so hot/warm equality, are the same either way.
    ``ready_copies``: with dequantized attention, keep each hot agent's float working copy
    between turns (its new tokens replaced by their stored values, so nothing changes an
    answer), within the budget: the next turn starts without dequantizing. Room is made
    by dropping ready copies first (least recently used), then by demoting caches.
    ``share_prefixes``: a turn that finds nothing of its own agent's cache to reuse reuses
    the longest run of stored ranges of another hot cache (a shared context, an agent with
    the same system prompt) that its prompt begins with, token for token: those arrays are
    shared, not copied or prefilled (``AgentKV.share_into``), and on disk its first write
    links that agent's segment files instead of writing them again. Its answer is what
    the same prompt gives from a reloaded cache of those tokens (stored values); a turn
    that prefilled them itself attended over their float values, so it may differ.
    ``tool_wait_s``: how long a turn that ended in tool calls keeps its agent's cache hot
    ahead of idle agents' (``ToolWait``), waiting for the turn that brings the results
    (an agent may set its own: ``spawn_agent(tool_wait_s=)``).

    ``deterministic``: a row's logits are the same bits whatever else is batched with it
    (its batch's attention runs row by row over each row's own keys, and a decode step's
    projections of few rows are computed as a batch's: ``kernels.rowwise``), so greedy
    answers never depend on concurrency; it costs ~10% of decode throughput at batch 1 and
    8 on this CPU (``bench/invariance.py``), so it is off by default. Without it a batch
    changes a row's last bits, and a greedy pick at a near-tie of two tokens may differ.
    With it a cache prefilled again after it was dropped (a cold agent) is the same bits
    as the one dropped: its answers' positions are fed as they were decoded
    (``Generate.answers``): up to ``max_batch`` a forward, each attending as its decode
    step did (1.23x a plain re-prefill's TTFT on the default model), or one a step where
    the working cache cannot (1.82x).
    ``checkpoints``: with recurrent layers (state-space, linear attention), how many of an
    agent's stored ranges keep the states at their end (a turn stores its prompt and its
    answer as ranges of their own): a turn resumes at the last one at or before where its
    prompt diverges, and from nothing below them. Their bytes count in the budget, and on
    disk as many are kept. At least 1 (the latest state).

    ``write_budget``: with a warm tier, bytes the hot tier may send to disk per
    ``write_window_s`` seconds (default a day), and write-back instead of write-through: a
    turn's end writes only its conversation (a small manifest); a cache is written as it
    leaves the hot tier, when it is hinted done and when its agent stops, if the budget has
    room (:class:`~kvactor.actors.hot.WriteBack`), else it goes cold. None: write-through.

    Raises ValueError for a value out of range.
    """

    max_batch: int = 8
    prefill_chunk: int = 256
    weights: str = "auto"
    codec: KVCodec | None = None
    budget_bytes: int | None = None
    persistent: bool = False
    policy: EvictionPolicy = field(default_factory=WorkflowPolicy)
    attention: Attention = "auto"
    ready_copies: bool = True
    share_prefixes: bool = True
    deterministic: bool = False
    tool_wait_s: float = 30.0
    checkpoints: int = DEFAULT_CHECKPOINTS
    write_budget: int | None = None
    write_window_s: float = 86_400.0

    def __post_init__(self) -> None:
        # A name ("lru", "workflow") picks a policy; anything else without victims() is
        # refused here, not at the first demotion (where it would stop the engine).
        object.__setattr__(self, "policy", make_policy(self.policy))
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        if not 0 <= self.tool_wait_s <= 86_400:
            raise ValueError(f"tool_wait_s must be in [0, 86400], got {self.tool_wait_s}")
        if self.checkpoints < 1:
            raise ValueError("checkpoints must be >= 1 (the latest state is always kept)")
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ValueError("budget_bytes must be positive (or None for no budget)")
        budget = self.write_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ValueError(f"write_budget must be an int of bytes or None, not {budget!r}")
        if budget is not None and budget < 0:
            raise ValueError(f"write_budget must be >= 0 bytes, not {budget}")
        if not 0 < self.write_window_s <= 366 * 86_400:
            raise ValueError(f"write_window_s must be in (0, 1 year], not {self.write_window_s}")
        if self.attention not in get_args(Attention):
            raise ValueError(
                f"attention must be one of {get_args(Attention)}, not {self.attention!r}"
            )

    @property
    def write_back(self) -> bool:
        """Caches are written back (a write budget over a warm tier), not through."""
        return self.persistent and self.write_budget is not None

    def turn_cache(self) -> type[FloatTurnCache] | type[QuantizedTurnCache]:
        """The working-cache class of the attention mode (``"auto"`` resolved for the device
        MLX runs on now)."""
        if self.attention == "auto":
            quantized = mx.default_device() != mx.cpu
        else:
            quantized = self.attention == "quantized"
        return QuantizedTurnCache if quantized else FloatTurnCache


def turn_reserve_bytes(
    geometry: CacheGeometry, tokens: int, *, stored_bytes: int | None = None, checkpoints: int = 1
) -> int:
    """What a turn reserves in the hot budget for its working cache, twice (the batch pads
    rows and merging copies them). With dequantized attention (``stored_bytes`` None) that
    is fp32 K and V of all ``tokens`` (prompt + max_tokens); with quantized attention, fp32
    K and V of the ``tokens`` the turn adds, plus a copy of the agent's ``stored_bytes``
    with scales widened to fp32 (at most 1.5x). Tokens count in steps of 256. Recurrent
    layers add their states: during the turn three (the working one, the one from before
    the last step, ``TurnCache.before_step``, and the next one being computed); at its end
    the ``checkpoints`` it stores, twice (stored, and exported until written)."""
    fp = (-(-tokens // 256) * 256) * geometry.fp32_bytes_per_token()
    states = max(3, 2 * checkpoints) * geometry.state_bytes
    if stored_bytes is None:
        return 2 * fp + states
    return 2 * (fp + stored_bytes * 3 // 2) + states
