"""The records the actors answer with and stream (turns, caches, models, statistics):
plain msgspec Structs."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from .enums import FinishReason, Match, Tier
from .options import Constraint

__all__ = (
    "AgentSnapshot",
    "AgentState",
    "CacheInfo",
    "Completion",
    "EngineBoard",
    "EngineStats",
    "Exported",
    "Finished",
    "ModelInfo",
    "ModelState",
    "Piece",
    "Timings",
    "TierMove",
    "TierMoves",
    "ToolCall",
    "ToolCallDelta",
    "ToolRequest",
)


class Exported(msgspec.Struct, frozen=True):
    export_id: int
    persisted: int  # tokens already safe on disk (the ranges start at or before this)
    tokens: list[int]  # every token the cache holds
    ranges: list[tuple[int, int, dict[str, Any]]]  # (start, stop, {name: numpy array})
    # Tokens [0, shared_upto) are agent shared_from's stored ranges, shared at a turn's
    # start, and nothing is on disk yet: the writer may link that agent's segment files.
    shared_from: str = ""
    shared_upto: int = 0


class Piece(msgspec.Struct, frozen=True, tag=True):
    """Newly generated text (may be empty while a UTF-8 character or stop string is pending)."""

    text: str
    token_id: int


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    # Parts of the above: reading the warm cache from disk for this turn (in queue_s) and
    # making the working copy from the stored cache (in prefill_s).
    load_s: float = 0.0
    dequantize_s: float = 0.0
    # A cache streamed in (a layer-streamed warm load: ``load_s`` then only opened its
    # files): the read's seconds, run beside the turn's first forward (in prefill_s), and
    # how long that forward waited for bytes; 0 for a cache read whole first.
    stream_s: float = 0.0
    stream_wait_s: float = 0.0
    # A float working copy filled beside the turn's first forward (``dequantize_s`` then
    # only made its arrays): the filling's seconds, and how long that forward waited for
    # it (both in prefill_s); 0 for a copy made first, a ready copy or none.
    copy_s: float = 0.0
    copy_wait_s: float = 0.0
    # Before all of the above (not in ttft_s): rendering the conversation, tokenizing it
    # and matching it against the agent's cache, on the agent's side.
    prompt_s: float = 0.0
    shared_tokens: int = 0  # of the reused tokens, those shared from another agent's cache
    # From the turn's last token to its Completion: storing its new tokens (quantized by
    # the engine at the turn's end, exported) and writing them to the warm tier before it
    # is reported; ``write_s`` the writing alone (the store's files and commit).
    save_s: float = 0.0
    write_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


class Finished(msgspec.Struct, frozen=True, tag=True):
    """The end of a generation: why it stopped, what it cost, what the cache now holds."""

    reason: FinishReason
    text: str
    token_ids: list[int]
    cache_tokens: list[int]  # exactly what the agent's cache now holds
    timings: Timings


class CacheInfo(msgspec.Struct, frozen=True):
    agent: str
    tokens: int
    nbytes: int
    busy: bool
    persisted: int
    tool_wait_s: float = 0.0  # seconds it is still kept hot for a tool call's result
    last_used: float = 0.0  # its last use, in time.monotonic() seconds (larger: later)
    # Recurrent layers: the checkpoints (states at the end of stored ranges) it keeps, the
    # token counts they are at, and their bytes (part of nbytes).
    checkpoints: int = 0
    checkpoint_tokens: list[int] = msgspec.field(default_factory=list)
    checkpoint_bytes: int = 0


class TierMove(msgspec.Struct, frozen=True):
    """One cache leaving or entering a model's hot tier, as the hot tier logged it:
    ``kind`` ``"demoted"`` (to ``tier`` ``"warm"`` or ``"cold"``, ``nbytes`` freed) or
    ``"installed"`` (a warm cache staged from disk, ``nbytes`` of it; ``source``
    ``"prefetch"`` or ``"turn"``). ``seq`` numbers the model's moves from 1, ``t`` is
    unix seconds."""

    seq: int
    t: float
    kind: str
    agent: str
    nbytes: int
    tier: str = ""  # a demotion's destination
    source: str = ""  # an install's cause


class TierMoves(msgspec.Struct, frozen=True):
    """A model's moves after a ``since`` (``TierEvents``), oldest first; ``last``: the
    seq of its latest move (ask after it next time); ``lost``: moves after ``since``
    that had left the log (it keeps the latest ones only)."""

    moves: list[TierMove]
    last: int
    lost: int = 0


class EngineBoard(msgspec.Struct, frozen=True):
    """The engine as a dashboard samples it, in one answer (``BoardQuery``): its stats,
    and by the engine's name of each model its hot caches, its moves after the seq asked
    and its state."""

    stats: EngineStats
    hot: dict[str, list[CacheInfo]]
    moves: dict[str, TierMoves]
    states: list[ModelState]


class ModelInfo(msgspec.Struct, frozen=True):
    name: str
    fingerprint: str
    context_length: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    codec: dict[str, Any]
    vocab_size: int = 0  # the engine takes token ids in [0, vocab_size); 0: unknown (old records)
    # Per layer [n_kv_heads, key_dim, value_dim, window (0: none)] (CacheGeometry.describe);
    # [] in old records: every layer n_kv_heads x head_dim.
    geometry: list[list[int]] = msgspec.field(default_factory=list)
    # Recurrent layers' states (CacheGeometry.describe_states); []: none.
    states: list[dict[str, Any]] = msgspec.field(default_factory=list)


class EngineStats(msgspec.Struct, frozen=True):
    agents_cached: int
    cache_bytes: int
    budget_bytes: int | None
    peak_bytes: int
    prefilling: int
    decoding: int
    waiting: int
    steps: int
    generated_tokens: int
    max_batch_seen: int
    demoted_warm: int
    demoted_cold: int
    installs: int  # warm caches staged from disk into the hot tier (not forks made in memory)
    warm_writes: int = 0  # turns whose new tokens were written to the warm tier
    warm_write_failures: int = 0  # turns whose warm write failed (Completion.save_error)
    # Under a write budget (write-back): caches handed to their agents to write as they left
    # the hot tier (or were told done), their stored bytes, the dirty caches that went cold
    # or stopped unwritten for want of budget, and the budget's window spent now.
    written_back: int = 0
    written_back_bytes: int = 0
    write_back_refused: int = 0
    write_budget_spent: int = 0
    ready_agents: int = 0  # hot agents keeping a ready (float) copy between turns
    ready_bytes: int = 0  # the bytes of those copies (part of cache_bytes)
    # Of ready_bytes: the float copies of prefixes several hot caches share (one each)
    shared_ready_bytes: int = 0
    working_bytes: int = 0  # running turns' working caches now (part of cache_bytes)
    dropped_ready: int = 0  # ready copies dropped for room (float -> quantized)
    ready_turns: int = 0  # turns that started from a ready copy (nothing dequantized)
    # Float turns whose first forward attended over the stored form (their float copy made
    # after their first token, or never for a turn of one token: kernels.stored_attend)
    stored_first_turns: int = 0
    # Stored tokens made into float copies: at a turn's start, and ready copies built ahead
    # (a layer built counts its share; a build given up counts what it did)
    dequantized_tokens: int = 0
    shared_turns: int = 0  # turns that reused another agent's stored ranges (share_prefixes)
    shared_tokens: int = 0  # the tokens those turns reused instead of prefilling them
    tool_waits: int = 0  # hot agents waiting on their tool calls' results now
    constrained_tokens: int = 0  # tokens picked under a grammar's mask (finished turns)
    mask_s: float = 0.0  # host seconds spent computing those masks
    # A session's memory limit (several models): None without one. ``memory_bytes``: what
    # counts against it now (weights, activations, hot tiers, MLX's kept buffers).
    memory_limit_bytes: int | None = None
    memory_bytes: int = 0
    memory_peak_bytes: int = 0
    mlx_peak_bytes: int = 0  # MLX's own peak active bytes plus what it keeps, sampled
    weights_bytes: int = 0  # of the models loaded now
    models_loaded: int = 0
    model_loads: int = 0  # loads that turns caused (after the session started)
    model_unloads: int = 0
    swap_s: float = 0.0  # median seconds of an unload and the load that followed
    # The warm tier on disk (``Session.stats`` adds them; None / 0 without a warm tier or
    # a disk limit): its bytes now, its limit, the bytes it wrote, the agents made cold.
    warm_bytes: int = 0
    warm_limit_bytes: int | None = None
    warm_written_bytes: int = 0
    warm_written_today_bytes: int = 0  # of those, on today's local date (with a disk limit)
    demoted_warm_to_cold: int = 0


class ToolCall(msgspec.Struct, frozen=True):
    """A call the model made: its id (for the result's ``tool_call_id``), the function's
    name and its arguments, parsed."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        """The arguments as JSON text (OpenAI's ``function.arguments``)."""
        return json.dumps(self.arguments, ensure_ascii=False)

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (OpenAI's shape)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of a tool call as it forms in a stream: ``index`` which call of the turn;
    the first piece of each call carries its ``id`` and ``name``, the rest pieces of its
    arguments' JSON text (OpenAI's ``delta.tool_calls[]``; Anthropic's ``tool_use``
    block start, then ``input_json_delta`` pieces). The arguments' pieces joined are
    the call's JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolRequest(msgspec.Struct, frozen=True):
    """What a turn offers the model and forces: ``tools`` (OpenAI's function tool
    definitions), ``choice`` ``"auto"`` / ``"none"`` / ``"required"`` / ``"function"``
    (then ``name`` is the one it must call), ``parallel`` (several calls in one turn), and
    ``response`` (a grammar its answer must follow when it does not call a tool: a JSON
    schema, or any JSON object)."""

    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True
    response: Constraint | None = None


class AgentState(msgspec.Struct, frozen=True):
    agent: str
    messages: list[dict[str, Any]]
    tokens: int
    persisted: int
    restored: bool
    turns: int


class AgentSnapshot(msgspec.Struct, frozen=True):
    """An agent between turns: the exact tokens its cache holds, the text they spell and
    its conversation (what it resumes from, on disk or as a fork's start)."""

    tokens: list[int]
    text: str
    messages: list[dict[str, Any]]
    # Where its cache's stored ranges end (ascending; empty: not known), and how many of
    # ``tokens`` are on disk (None: all; 0 for a cold cache, whose tokens are re-prefilled).
    bounds: list[int] = []
    on_disk: int | None = None
    # Where its answers began (each decoded one token a step: ``Generate.answers``).
    answers: list[int] = []


class Completion(msgspec.Struct, frozen=True):
    """One finished turn: the text, why it stopped, its timings, and how the cache was
    found: ``path`` the tier it came from (cold: nothing reused; warm: reloaded from disk
    for this turn; hot), ``match`` how the prompt compared with what it held.

    ``tool_calls``: the calls the model made (its finish_reason is then TOOL_CALLS; the
    calls' text is not in ``text``).

    ``saved``: the turn's cache is in the warm tier (always False without ``cache_dir``);
    ``save_error``: why it is not, when writing it failed (disk full, I/O error). The
    conversation goes on either way, and the next write that succeeds saves what this one
    missed."""

    text: str
    finish_reason: FinishReason
    token_ids: list[int]
    timings: Timings
    path: Tier
    match: Match
    saved: bool = False
    save_error: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ModelState(msgspec.Struct, frozen=True):
    """One model of a multi-model engine: loaded now or not, pinned, its weights' bytes
    (0 before its first load), how many times it was loaded, and seconds since last use."""

    name: str
    loaded: bool
    pinned: bool
    weights_bytes: int
    loads: int
    idle_s: float
