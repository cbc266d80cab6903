"""What the dashboard reads of a session, sampled cheaply: the engine's figures, every hot
cache (one question per model), the models' states and the warm tier's agents; and each
model's hot-tier moves since the last sample (one question per model), which it hands to
the activity log: the timeline shows every demotion and reload, not what two samples tell.

However many pages poll, the session is asked at most every ``FRESH_S`` (pages asking
meanwhile share the last sample), and the warm tier's list (a read of every agent's
manifest: costly with thousands) at most every ``WARM_EVERY_S``, or ten times as long as
its last read took. While the engine is mid-step a sample waits ``WAIT_S`` at most, then
the last one is shown (its ``t`` says how old). A board of ``kvactor run`` outlives its
session: :meth:`Board.freeze` keeps the last sample, shown as the run's final state."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field

import anyio

from ..actors.errors import UnknownAgent
from ..actors.records import CacheInfo, EngineStats, ModelInfo, ModelState
from ..actors.warm import WarmInfo
from ._activity import Activity
from ._served import Served

__all__ = ("Board", "Sample")

FRESH_S = 0.25  # a sample this young is shared by every page asking
WARM_EVERY_S = 1.0  # the warm list is read at most this often...
WARM_COST_FACTOR = 10  # ... and at most once per ten times its last read's seconds
WAIT_S = 0.5  # how long a page waits for an engine mid-step (then: the last sample)
CHEAP_WARM_S = 0.05  # a warm list read this fast is read again at once when it may be stale
FIRST_WAIT_S = 10.0  # the first sample waits longer: there is nothing to show before it


@dataclass(frozen=True)
class Sample:
    """The session at time ``t`` (unix seconds): its figures, its hot caches, its warm
    agents, its models, and the model each running agent runs."""

    t: float
    stats: EngineStats
    hot: list[CacheInfo]
    warm: list[WarmInfo]
    states: list[ModelState]
    models: dict[str, ModelInfo]
    running: dict[str, str]  # agent -> its model's name


@dataclass
class Board:
    """The sampler of one app (see the module doc); ``session`` None: not started yet."""

    session: Served | None
    activity: Activity
    # A new id per board: a page that sees it change knows the server restarted.
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    final: bool = False  # frozen: the run is over, the last sample is its final state
    # Invariant: only sample() writes these (attach() starts the moves' count anew).
    _last: Sample | None = None
    _warm: list[WarmInfo] = field(default_factory=list)
    _warm_at: float = float("-inf")
    _warm_cost_s: float = 0.0
    _moves_since: dict[str, int] = field(default_factory=dict)  # model -> last move read
    _cold_since: dict[str, int] = field(default_factory=dict)  # the same, of the warm tiers
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    def attach(self, session: Served) -> None:
        """Sample ``session`` from now on (``kvactor run``: once it is open)."""
        self.session = session
        self.final = False
        self._moves_since = {}  # a new session's logs number their moves from 1
        self._cold_since = {}

    async def freeze(self) -> None:
        """Take a last sample and keep it (the session is about to close)."""
        async with self._lock:
            if self.session is not None:
                self._last = await self._read(self.session, warm=True)
            self.session = None
            self.final = True

    async def sample(self) -> Sample | None:
        """The session now, or as last sampled (see the module doc); None before any
        sample could be taken."""
        async with self._lock:
            session, last = self.session, self._last
            if session is None or (last is not None and time.time() - last.t < FRESH_S):
                return last
            with anyio.move_on_after(WAIT_S if last is not None else FIRST_WAIT_S):
                warm = anyio.current_time() - self._warm_at >= max(
                    WARM_EVERY_S, WARM_COST_FACTOR * self._warm_cost_s
                )
                self._last = await self._read(session, warm=warm)
            return self._last

    async def _read(self, session: Served, *, warm: bool) -> Sample:
        board = await session.board(self._moves_since)  # one question to the engine
        stats, moves, states = board.stats, board.moves, board.states
        hot = [c for caches in board.hot.values() for c in caches]
        hot_now = {c.agent for c in hot}
        # Read and recorded with no wait between: a sample cancelled earlier reads them again.
        self._moves_since = {model: part.last for model, part in moves.items()}
        self.activity.moved(moves)
        cold = await session.warm_moves(self._cold_since)  # the stores': no engine wait
        self._cold_since = {model: part.last for model, part in cold.items()}
        self.activity.moved(cold)
        left = {m.agent for part in moves.values() for m in part.moves if m.tier == "warm"}
        running = {}
        for name in list(session.agents):
            with contextlib.suppress(UnknownAgent):  # forgotten meanwhile
                running[name] = session.model_of(name)
        usable = {w.agent for w in self._warm if w.rejected is None}
        # An agent neither hot nor in the list read last may have been written since (its
        # first warm write): read the list again now when that is cheap.
        unknown = (set(running) | left) - hot_now - usable
        if warm or (unknown and self._warm_cost_s < CHEAP_WARM_S):
            started = anyio.current_time()
            self._warm = await session.warm_agents()
            self._warm_at = anyio.current_time()
            self._warm_cost_s = self._warm_at - started
            usable = {w.agent for w in self._warm if w.rejected is None}
        return Sample(
            t=time.time(),
            stats=stats,
            hot=hot,
            warm=list(self._warm),
            states=states,
            models=dict(session.models),
            running=running,
        )
