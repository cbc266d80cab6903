"""Messages between the actors (sessions, agents, the engine): plain msgspec Structs,
tagged unions. The records they answer with are in ``records``."""

from __future__ import annotations

from typing import Any

import msgspec

from .options import Constraint, Sampling
from .records import ToolRequest

__all__ = (
    "BoardQuery",
    "WarmAgent",
    "WarmVictims",
    "AskWith",
    "MakeContext",
    "SpawnAgent",
    "AgentMessage",
    "CacheQuery",
    "DropCache",
    "EndTurns",
    "EngineMessage",
    "Export",
    "Flush",
    "ForModel",
    "Fork",
    "Generate",
    "GetModelInfo",
    "GetState",
    "Hint",
    "Install",
    "InstallStreamed",
    "ModelsQuery",
    "Release",
    "Reserve",
    "Snapshot",
    "StatsQuery",
    "ToolWait",
    "Turn",
    "WriteBack",
    "Written",
)


class Generate(msgspec.Struct, frozen=True, tag=True):
    """Continue ``agent``'s cache so that it holds ``tokens``, then generate.

    The engine reuses the longest common prefix of ``tokens`` and what the agent's cache
    holds, trims the rest, and prefills only the difference. The reply is a stream of
    Piece items ending with one Finished.

    ``cuts``: token counts, increasing, inside ``tokens``, where the prefill stores what it
    holds as a range of its own before it goes on (the end of a system prompt): another
    cache may share up to there, and the tokens after a cut are computed from the stored
    values before it, whether this cache prefilled them or shared them.

    ``answers``: token counts, increasing, each below a cut, where an answer began that
    was decoded one token a step up to that cut. The prefill ends a chunk there, so that
    the prompt before is chunked as its turn was, and with ``deterministic`` it feeds
    those positions as they were decoded (each attending as its decode step did): a
    cache re-prefilled after it was dropped then holds the same bits as the one dropped.

    ``constraint``: a grammar the generated tokens must follow (compiled at admission: a
    bad one fails the request with ValueError at once); the turn ends when it is complete.
    """

    agent: str
    tokens: list[int]
    sampling: Sampling
    sent_at: float
    warm: bool = False  # the agent has a warm copy: fail with CacheMiss instead of starting cold
    cuts: tuple[int, ...] = ()
    answers: tuple[int, ...] = ()
    # Its cache shares stored ranges only with caches of agents of the same scope (a
    # tenant of a server): what one scope caches is never visible to another.
    scope: str = ""
    constraint: Constraint | None = None


class Export(msgspec.Struct, frozen=True, tag=True):
    """Host views of an idle agent's stored ranges not yet known to be in the warm tier.
    ``admit``: under a write budget, its agent stops: answers None (nothing pinned) when the
    budget has no room for them."""

    agent: str
    admit: bool = False


class Written(msgspec.Struct, frozen=True, tag=True):
    """The store has made an export durable up to ``upto`` tokens (releases its pin);
    ``failed``: writing the rest failed (disk full, I/O error), so the agent's next export
    starts at ``upto`` again."""

    agent: str
    export_id: int
    upto: int
    failed: bool = False


class Reserve(msgspec.Struct, frozen=True, tag=True):
    """Ask for hot-tier room for a warm cache about to be staged. Answers a Room; with
    ``wait``, instead of NO_ROOM it answers once running turns have made room."""

    agent: str
    nbytes: int
    wait: bool = False


class Install(msgspec.Struct, frozen=True, tag=True):
    """A staged warm cache (host arrays) to make hot. ``pin`` keeps it from being demoted
    until the agent's next turn starts (an on-demand load for a turn that is waiting);
    without it, it was a prefetch hint. ``read_s``: how long reading it took (the pool's
    reload estimates learn the disk's rate from it). Answers whether it was installed."""

    agent: str
    tokens: list[int]
    ranges: list[tuple[int, int, dict[str, Any]]]
    pin: bool = False
    read_s: float = 0.0


class InstallStreamed(msgspec.Struct, frozen=True, tag=True):
    """A warm cache to make hot while it streams in (a layer-streamed load): ``read``, the
    store's StreamedRead, writes its bytes into the arrays the engine allocates for it, and
    the agent's first forward runs as they land (``kernels.agent_cache.Landing``). ``pin``
    as Install. Answers whether it was installed (then the read has started)."""

    agent: str
    tokens: list[int]
    read: Any
    pin: bool = False


class Release(msgspec.Struct, frozen=True, tag=True):
    """Give back a reservation whose staging failed."""

    agent: str


class DropCache(msgspec.Struct, frozen=True, tag=True):
    agent: str


class CacheQuery(msgspec.Struct, frozen=True, tag=True):
    agent: str


class HotQuery(msgspec.Struct, frozen=True, tag=True):
    """Answers a CacheInfo for every hot cache of the model (none while it is unloaded):
    one message for a dashboard's table, however many agents are hot."""


class TierEvents(msgspec.Struct, frozen=True, tag=True):
    """Answers the model's hot-tier moves (demotions, installs from the warm tier) after
    seq ``since`` as a TierMoves, loaded or not: one message for a dashboard's timeline,
    however many moves came since it last asked."""

    since: int = 0


class BoardQuery(msgspec.Struct, frozen=True, tag=True):
    """Answers an EngineBoard: what ``StatsQuery``, each model's ``HotQuery`` and
    ``TierEvents`` (after ``since[model]``, 0 for a model not named) and ``ModelsQuery``
    answer, at one moment and in one message (a dashboard's sample waits for one
    decode step, not four)."""

    since: dict[str, int] = msgspec.field(default_factory=dict)


class Fork(msgspec.Struct, frozen=True, tag=True):
    """Make ``new``'s hot cache the ``source``'s, sharing its stored arrays (they are never
    written in place), if the source is hot, idle and holds exactly ``tokens``: answers
    whether it did."""

    source: str
    new: str
    tokens: list[int]


class ToolWait(msgspec.Struct, frozen=True, tag=True):
    """``agent``'s turn ended in tool calls: its next turn brings their results, so its
    cache is kept hot ahead of idle agents' for ``ttl_s`` seconds (None: the engine's
    ``tool_wait_s``), or until that turn comes."""

    agent: str
    ttl_s: float | None = None


class Hint(msgspec.Struct, frozen=True, tag=True):
    """The application's advice for the hot tier (answers None; ``kvactor.actors.hints``).
    ``next``: agents that run next, soonest first; ``expect_in_s``: (agent, seconds until
    its next turn); ``priority``: (agent, priority), higher stays hot longer; ``done``:
    agents done for now (their caches go first)."""

    next: tuple[str, ...] = ()
    expect_in_s: tuple[tuple[str, float], ...] = ()
    priority: tuple[tuple[str, int], ...] = ()
    done: tuple[str, ...] = ()


class GetModelInfo(msgspec.Struct, frozen=True, tag=True):
    """Answers ``(ModelInfo, Tokenizer)``. The tokenizer is a live object, not data: agents
    render prompts and match prefixes on the event loop without a round trip per call, and
    it holds no MLX arrays, so sharing it with the engine's thread is safe."""


class StatsQuery(msgspec.Struct, frozen=True, tag=True):
    pass


class EndTurns(msgspec.Struct, frozen=True, tag=True):
    """The session is about to close (answers how many turns it ended): a decoding turn
    ends at its next step (``FinishReason.ENDED``; its agent saves it as any turn), one
    not decoding yet, and every later one, fails with TurnEnded."""


# -- the warm tier's limit: which warm agents go cold first (the engine's policy says) --


class WarmAgent(msgspec.Struct, frozen=True):
    """A warm agent that could go cold: the bytes only it holds on disk, its cached tokens,
    and when its warm cache was last written (unix time)."""

    agent: str
    nbytes: int
    tokens: int
    updated: float


class WarmVictims(msgspec.Struct, frozen=True, tag=True):
    """Which of ``agents`` go cold first to free ``need`` bytes of the warm tier, in the
    eviction policy's order with the application's hints (done first, hinted to run soon
    last): answers their names (fewer when all of them free less). An agent whose cache is
    hot, staged, or with a turn queued or running is never named.

    ``beyond``: ``agents`` are only the least recently written of the warm agents (and
    those an ``AskWith`` named), every other one written at ``beyond`` (unix time) or
    later. The answer is then the names the policy would give were every warm agent asked;
    an ``AskWith`` when the hints rank agents left out first (done, or of a lower
    priority): ask again with those too; or None when it cannot be told from these (a
    policy of unknown order, or a pick that reaches ``beyond``): ask again with all.
    ``checked``: the names an ``AskWith`` gave, those not among ``agents`` being no
    candidates (not warm, or spared by the store) unless ``held_back``: left out of what
    may rank first. ``held_back``: those still warm but not among ``agents``, each written
    at ``held_beyond`` (unix time) or later (the store sends the least recently written of
    them; the answer must stop short of the rest as of the others left out)."""

    agents: list[WarmAgent]
    need: int
    beyond: float | None = None
    checked: tuple[str, ...] = ()
    held_back: tuple[str, ...] = ()
    held_beyond: float = 0.0


class AskWith(msgspec.Struct, frozen=True):
    """A ``WarmVictims``'s answer: ask again with these agents too (those of them still
    warm), the same ``beyond``; the hints rank them before any other agent left out."""

    agents: tuple[str, ...]


EngineMessage = (
    Generate
    | Export
    | Written
    | Reserve
    | Install
    | InstallStreamed
    | Release
    | DropCache
    | CacheQuery
    | HotQuery
    | TierEvents
    | Fork
    | ToolWait
    | Hint
    | GetModelInfo
    | StatsQuery
    | EndTurns
    | WarmVictims
)


class Turn(msgspec.Struct, frozen=True, tag=True):
    """A user message (``raw=False``) or a whole raw prompt (``raw=True``); or, with
    ``history``, the whole conversation as the caller keeps it (an HTTP client resending
    every message: ``text`` is unused), which replaces the agent's. ``prime``: no message;
    the cache is filled with the conversation as it is (its system prompt: a shared
    context), one token sampled and dropped. The reply streams text pieces, then one
    Completion."""

    text: str
    sampling: Sampling
    raw: bool = False
    history: list[dict[str, Any]] | None = None
    prime: bool = False  # fill the cache with the conversation so far (a shared context)
    tools: ToolRequest | None = None  # tools offered, tool choice, response format


class GetState(msgspec.Struct, frozen=True, tag=True):
    """Answers an AgentState."""


class Snapshot(msgspec.Struct, frozen=True, tag=True):
    """Answers the agent's AgentSnapshot between turns (what a fork starts from)."""


class WriteBack(msgspec.Struct, frozen=True, tag=True):
    """Under a write budget: the engine's hot tier sent the agent's cache out (it left the
    tier, or was told done): write ``exported`` to the warm tier and answer the engine with
    Written. An export older than the agent's cache (a turn ran since) is not written."""

    exported: Any  # records.Exported


class Flush(msgspec.Struct, frozen=True, tag=True):
    """Under a write budget: write what the warm tier lacks of the agent's hot cache now,
    whatever the budget says (an export or a hand-over needs it on disk); answers None."""


AgentMessage = Turn | GetState | Snapshot | WriteBack | Flush


class ForModel(msgspec.Struct, frozen=True, tag=True):
    """An engine message for the model called ``model``."""

    model: str
    message: Any


class ModelsQuery(msgspec.Struct, frozen=True, tag=True):
    """Ask the engine for every model's :class:`ModelState`."""


# -- a session's requests, as the session API checked them (to a host of a cluster too) --


class SpawnAgent(msgspec.Struct, frozen=True, kw_only=True):
    """A new agent (``SessionAPI.spawn_agent``, checked there): ``name``, and at most one
    of ``system``, ``fork_of`` and ``context``; ``scope`` None: its source's or ``""``."""

    name: str
    system: str | None = None
    fork_of: str | None = None
    context: str | None = None
    scope: str | None = None
    tool_wait_s: float | None = None
    model: str | None = None
    host: str | None = None


class MakeContext(msgspec.Struct, frozen=True, kw_only=True):
    """A shared context (``SessionAPI.context``, checked there)."""

    name: str
    text: str
    scope: str = ""
    model: str | None = None
    host: str | None = None
