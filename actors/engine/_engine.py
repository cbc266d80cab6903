"""The engine actor: one actor, one OS thread, the only owner of MLX, holding one model or
several, under a memory limit or none.

Each model has a *slot* holding its :class:`~kvactor.actors.engine.ModelRunner` (its hot
tier, decode batch and queues, so a batch never mixes models). Messages reach a model
wrapped in :class:`ForModel` (what a :class:`ModelRef` sends); the work loop steps every
loaded model in turn. One model is the same engine with one slot.

With a memory limit (``_memory.py``), it covers every loaded model's weights and
activations, every hot tier and MLX's kept buffers: each model's hot tier gets what the
others leave, a turn that needs more first demotes other models' idle caches, then unloads
an idle model (least recently used, never a pinned one; its caches are warm already), and
a model that is not loaded is loaded for the turn that needs it. Without one (one model
only) the hot tier is bounded by its budget alone and the model is never unloaded.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx
import msgspec

from ...kernels.memory import release_thread
from ...runtime import Reply, ThreadActor
from ..enums import Room
from ..errors import BudgetExceeded, ModelLoadError, TurnEnded, UnknownAgent
from ..hot import WriteBudget, unloaded_victims
from ..messages import (
    BoardQuery,
    CacheQuery,
    DropCache,
    EndTurns,
    Export,
    Fork,
    ForModel,
    Generate,
    GetModelInfo,
    HotQuery,
    Install,
    InstallStreamed,
    ModelsQuery,
    Release,
    Reserve,
    StatsQuery,
    TierEvents,
    ToolWait,
    WarmVictims,
    Written,
)
from ..records import EngineBoard, EngineStats, Exported, ModelInfo, ModelState
from ._config import EngineConfig, ModelSpec
from ._memory import (
    MEMORY_SHARE,
    activation_bytes,
    kept_buffer_bytes,
    mlx_memory,
    one_turn_bytes,
    weights_bytes,
)
from ._model_ref import sum_stats
from ._runner import DETACHED, ModelRunner, settle_random_state

__all__ = ("FAIR_WAIT_S", "EngineActor")


#: Seconds a model waits to load before the turns of loaded models wait behind it (a
#: loaded model's turns run at least this long before it may be unloaded for another's).
FAIR_WAIT_S = 2.0

# Messages that need their model loaded; the others are answered without it.
_NEEDS_MODEL = (Generate, Install, InstallStreamed)


class _Waiting(NamedTuple):
    """A message waiting for its model: its reply (detached) and since when it waits."""

    message: Any
    reply: Reply
    since: float


@dataclass(eq=False)
class _Slot:
    """One model of the engine: its runner and what the engine knows of it (its sizes,
    measured at its first load, its record and the messages waiting for it)."""

    name: str
    runner: ModelRunner
    pinned: bool
    fixed: int = 0  # weights + activations, measured at the first load
    weights: int = 0
    turn: int = 0  # one modest turn's reserve
    load_extra: int = 0  # what loading it held beyond its weights at the peak (measured)
    info: ModelInfo | None = None
    tokenizer: Any = None
    loads: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # Messages waiting for it to load, or (loaded) turns waiting behind another model's,
    # each with when it came.
    pending: deque[_Waiting] = field(default_factory=deque)
    carried: EngineStats | None = None  # the counters of its loads before this one

    @property
    def loaded(self) -> bool:
        return self.runner.loaded

    @property
    def need(self) -> int:
        """What it needs of the limit: weights and activations, and the larger of one turn
        and loading's transient (a file's tensors beside their dequantized copies)."""
        return self.fixed + max(self.turn, self.load_extra)

    def busy(self) -> bool:
        """Loaded with work under way (turns queued or running, writes, stagings)."""
        return self.loaded and not self.runner.settled()


def _poster(
    write_back: Callable[[str, str, Exported], None] | None, model: str
) -> Callable[[str, Exported], None] | None:
    """What model ``model``'s hot tier calls to send a write-back to its agent."""
    if write_back is None:
        return None
    return lambda agent, exported: write_back(model, agent, exported)


class EngineActor(ThreadActor):
    """The engine over one model or several (see the module doc): ``models`` by name.
    ``limit``: the memory limit in bytes (None: none, for one model only: its hot tier is
    bounded by ``config.budget_bytes`` alone); ``pins``: models never unloaded;
    ``model_ttl_s``: an idle model unused that long is unloaded even without pressure
    (None: only under pressure); ``write_back(model, agent, export)``: under a write budget,
    hands a cache leaving a hot tier to its agent to write (thread-safe, never waits);
    ``write_spent``: bytes of the budget's window spent before this session (a restart).
    Raises ValueError for pins of unknown models, or several
    models without a limit."""

    def __init__(
        self,
        models: dict[str, ModelSpec],
        config: EngineConfig,
        limit: int | None,
        pins: frozenset[str] = frozenset(),
        model_ttl_s: float | None = None,
        write_back: Callable[[str, str, Exported], None] | None = None,
        write_spent: int = 0,
    ) -> None:
        unknown = sorted(pins - set(models))
        if unknown:
            raise ValueError(f"pinned models {unknown} are not among {sorted(models)}")
        if not models or (limit is None and len(models) > 1):
            raise ValueError("the engine needs one model, or several and a memory limit")
        self.config = config
        self.limit = limit
        self._kept = 0 if limit is None else kept_buffer_bytes(limit)
        self._ttl = model_ttl_s
        if model_ttl_s is not None:  # a model idle past its TTL is unloaded with no message
            self.idle_wake_s = max(model_ttl_s / 2, 0.05)
        # One SSD write budget for every model (write-back), as one disk takes their writes.
        budget = (
            WriteBudget(config.write_budget, config.write_window_s, spent=write_spent)
            if config.write_back and config.write_budget is not None
            else None
        )
        self._slots = {
            name: _Slot(
                name, ModelRunner(spec, config, _poster(write_back, name), budget), name in pins
            )
            for name, spec in models.items()
        }
        self._write_budget = budget
        self.loads = 0
        self.unloads = 0
        self.swap_s: list[float] = []  # seconds of each unload and the load that followed
        self._unload_s: float | None = None  # the last unload's, until a load follows
        self.peak = 0  # the count's peak
        self.mlx_peak = 0  # MLX's peak active bytes plus what it keeps, sampled
        self.started = False  # on_start ended: the open's loads are behind
        self._ending = False  # EndTurns came: no turn starts now

    # -- lifecycle --------------------------------------------------------------------
    def on_start(self) -> None:
        """Load each model once: what it is (ModelInfo), what it needs, and whether it fits
        the limit with one turn of its own (ModelLoadError says what it needs when not).
        Models stay loaded while they all fit; the rest load when a turn needs them."""
        try:
            self._load_all()
        except BaseException:
            self.on_stop()  # no array may outlive this thread
            raise
        self.loads = self.unloads = 0  # counted from here: what turns caused
        self.swap_s.clear()
        self._unload_s = None
        mx.reset_peak_memory()
        self.started = True

    def _load_all(self) -> None:
        if self.limit is None:
            for slot in self._slots.values():
                self._load(slot)
            return
        for slot in self._slots.values():
            # Its size is known once loaded: make room as if it were the largest so far.
            loaded = self._loaded()
            guess = max((s.need for s in loaded), default=0)
            for other in loaded:
                if self.count() + guess > self.limit:
                    self._unload(other)
            self._load(slot)
            need = self._kept + slot.need
            if need > self.limit:
                raise ModelLoadError(
                    f"model {slot.name!r} needs {need} bytes with one turn of its own "
                    f"(weights {slot.weights}, activations {slot.fixed - slot.weights}, "
                    f"the larger of one turn {slot.turn} and loading's transient "
                    f"{slot.load_extra}, MLX's kept buffers {self._kept}); the memory "
                    f"limit is {self.limit} bytes (memory_limit= sets it; by default "
                    f"{MEMORY_SHARE:.0%} of RAM)"
                )
        for other in sorted(self._loaded(), key=lambda s: s.last_used):
            if self.count() + max(s.turn for s in self._loaded()) <= self.limit:
                break
            self._unload(other)

    def on_stop(self) -> None:
        for slot in self._slots.values():
            for _, reply, _ in slot.pending:
                reply.fail(ModelLoadError(f"the engine stopped before {slot.name!r} loaded"))
            slot.pending.clear()
            slot.runner.unload()
        gc.collect()
        settle_random_state()
        release_thread()  # this thread's streams go with it, not at the process's exit

    def _load(self, slot: _Slot) -> None:
        started = time.perf_counter()
        if self.started:
            self._sample()  # MLX's peak so far is kept before the load's own is measured
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        slot.runner.load()
        if self.limit is not None:  # the runner asked for more; the limit counts this
            mx.set_cache_limit(self._kept)
        lm = slot.runner.lm
        slot.weights = weights_bytes(lm)
        peak = mx.get_peak_memory()
        slot.load_extra = max(slot.load_extra, peak - before - slot.weights)
        if self.started:
            self._sample()  # the load's peak counts once the session is open
        slot.fixed = slot.weights + activation_bytes(lm, self.config)
        slot.turn = one_turn_bytes(lm, self.config)
        if slot.info is None:
            slot.info, slot.tokenizer = slot.runner.info()
        slot.loads += 1
        self.loads += 1
        slot.last_used = time.monotonic()
        if self._unload_s is not None:
            self.swap_s.append(self._unload_s + time.perf_counter() - started)
            self._unload_s = None

    def _unload(self, slot: _Slot) -> None:
        started = time.perf_counter()
        stats = slot.runner.stats()
        slot.carried = stats if slot.carried is None else sum_stats([slot.carried, stats])
        slot.runner.unload()
        # Turns that waited behind another model wait for this one now: from now on.
        now = time.monotonic()
        slot.pending = deque(w._replace(since=now) for w in slot.pending)
        gc.collect()
        mx.clear_cache()
        self.unloads += 1
        self._unload_s = time.perf_counter() - started

    # -- the count --------------------------------------------------------------------
    def _loaded(self) -> list[_Slot]:
        return [s for s in self._slots.values() if s.loaded]

    def count(self) -> int:
        """Bytes counted against the limit now: MLX's kept buffers, and each loaded model's
        weights, activations and hot tier (running turns at their reserve); without a
        limit, the same (nothing is kept against one)."""
        used = self._kept + sum(self._holds(s) for s in self._loaded())
        self.peak = max(self.peak, used)
        return used

    @staticmethod
    def _holds(slot: _Slot) -> int:
        """A loaded model's part of the count: weights, activations, attention, hot tier."""
        runner = slot.runner
        return slot.fixed + runner.attention_bytes() + runner.pool.committed()

    def _fits(self, slot: _Slot) -> bool:
        """Whether ``slot`` (not loaded, at its measured size) fits now with one turn."""
        if self.limit is None:
            return True
        others = sum(self._holds(s) for s in self._loaded() if s is not slot)
        return self._kept + others + slot.need <= self.limit

    def _fit(self, slot: _Slot) -> None:
        """Bound ``slot``'s hot tier by what the rest of the count leaves of the limit
        (without a limit: its budget)."""
        cap = self.config.budget_bytes
        if self.limit is None:
            return  # the pool's bound is its budget, as it was made
        others = sum(self._holds(s) for s in self._loaded() if s is not slot)
        own = slot.fixed + slot.runner.attention_bytes()
        room = max(self.limit - self._kept - own - others, 0)
        slot.runner.pool.limit = room if cap is None else min(room, cap)

    def _free_for(self, slot: _Slot, need: int) -> None:
        """Make room for ``need`` more bytes (beyond the count now) for ``slot`` by the
        cost order: other models' idle caches to warm first, then idle models unloaded,
        least recently used first (without a limit: nothing to do)."""
        if self.limit is None:
            return
        others = sorted(
            (s for s in self._loaded() if s is not slot), key=lambda s: (s.pinned, s.last_used)
        )
        for other in others:
            missing = self.count() + need - self.limit
            if missing <= 0:
                return
            pool = other.runner.pool
            pool.limit = max(pool.committed() - missing, 0)
            pool.make_room(0)
        if not others:
            return  # no model to unload: its turn's start demotes its own idle caches
        # Its own idle caches go before any model does (its turn's start demotes them).
        enough = self.count() + need - self.limit
        own = slot.runner.pool.idle_bytes(enough) if slot.loaded else 0
        for other in others:
            if self.count() + need - own <= self.limit:
                return
            if not other.pinned and not other.busy():
                self._unload(other)

    # -- messages ---------------------------------------------------------------------
    def receive(self, message: Any) -> Any:
        match message:
            case ForModel(model, inner):
                slot = self._slots.get(model)
                if slot is None:
                    raise ValueError(f"no model {model!r}: the models are {sorted(self._slots)}")
                return self._for(slot, inner)
            case ModelsQuery():
                return self._states()
            case StatsQuery():
                return self.stats()
            case BoardQuery(since):
                states = self._states()
                return EngineBoard(
                    stats=self.stats(),
                    hot={
                        n: s.runner.pool.infos() if s.loaded else [] for n, s in self._slots.items()
                    },
                    moves={
                        n: s.runner.moves.after(since.get(n, 0)) for n, s in self._slots.items()
                    },
                    states=states,
                )
            case EndTurns():  # every model's; a turn waiting for its model to load fails
                self._ending = True
                ended = sum(
                    isinstance(w.message, Generate) for s in self._slots.values() for w in s.pending
                )
                for slot in self._slots.values():
                    self._fail_pending(slot, TurnEnded("the session ended its turns"))
                return ended + sum(s.runner.end_turns() for s in self._loaded())
        raise TypeError(f"the engine does not handle {type(message).__name__}")

    def _states(self) -> list[ModelState]:
        self._expire()  # what is due goes before the answer says what is loaded
        now = time.monotonic()
        return [
            ModelState(s.name, s.loaded, s.pinned, s.weights, s.loads, now - s.last_used)
            for s in self._slots.values()
        ]

    def _for(self, slot: _Slot, message: Any) -> Any:
        if self._ending and isinstance(message, Generate):
            raise TurnEnded("the session ended its turns: no turn starts now")
        if self._behind(slot, message):
            # A model waiting to load for FAIR_WAIT_S goes first: this turn waits behind
            # it, so that a model busy all the time never keeps another out for long.
            assert self.reply is not None
            slot.pending.append(_Waiting(message, self.reply.detach(), time.monotonic()))
            return None
        if slot.loaded:
            slot.last_used = time.monotonic()
            self._fit(slot)
            if isinstance(message, Reserve) and message.wait:  # staging for a turn
                pool = slot.runner.pool
                if self.limit is not None and message.nbytes > (pool.limit or 0) - pool.committed():
                    self._free_for(slot, message.nbytes)
                    self._fit(slot)
            result = slot.runner.receive(message, self.reply)
            return None if result is DETACHED else result
        if isinstance(message, _NEEDS_MODEL) or (isinstance(message, Reserve) and message.wait):
            assert self.reply is not None
            slot.pending.append(_Waiting(message, self.reply.detach(), time.monotonic()))
            self._load_pending()
            return None
        return self._unloaded(slot, message)

    def _unloaded(self, slot: _Slot, message: Any) -> Any:
        """The answer of a model that is not loaded (it holds no hot cache)."""
        match message:
            case GetModelInfo():
                return slot.info, slot.tokenizer
            case StatsQuery():
                return slot.carried  # set when it was unloaded
            case Reserve():
                return Room.NO_ROOM  # a hint: not worth loading a model for
            case Fork():
                return False  # nothing hot to fork from: it stages from disk
            case DropCache() | Release() | Written() | ToolWait():
                return None if not isinstance(message, DropCache) else False
            case WarmVictims(agents, need, beyond):  # no hints while unloaded: the policy
                return unloaded_victims(self.config.policy, agents, need, beyond)
            case CacheQuery(agent) | Export(agent):
                raise UnknownAgent(f"agent {agent!r} has no hot cache (its model is unloaded)")
            case HotQuery():
                return []
            case TierEvents(since):  # its log outlives its loads
                return slot.runner.moves.after(since)
        raise TypeError(f"the engine does not handle {type(message).__name__}")

    def _behind(self, slot: _Slot, message: Any) -> bool:
        """Whether turn ``message`` of loaded ``slot`` waits behind another model's. A
        turn whose cache was staged for it never does: unloading the model under it
        would only make it stage again."""
        if not (slot.loaded and isinstance(message, Generate) and self._others_wait(slot)):
            return False
        entry = slot.runner.pool.get(message.agent)
        return entry is None or not entry.staged

    def _others_wait(self, slot: _Slot) -> bool:
        """Whether another model that is not loaded has had a message waiting for it for
        FAIR_WAIT_S."""
        since = time.monotonic() - FAIR_WAIT_S
        return any(
            s.pending and not s.loaded and s.pending[0].since < since
            for s in self._slots.values()
            if s is not slot
        )

    def _load_pending(self) -> bool:
        """Load a model that turns wait for, if it fits once other models' idle caches and
        idle models are gone, and hand it what waited; hand a loaded model the turns that
        waited behind another's once none waits. True when something was handed over."""
        progressed = False
        for slot in self._slots.values():
            for gone in [w for w in slot.pending if w.reply.cancelled]:
                slot.pending.remove(gone)
            if not slot.pending:
                continue
            if slot.loaded:
                if not self._others_wait(slot):
                    self._fit(slot)
                    self._run_pending(slot)
                    progressed = True
                continue
            if not self._fits(slot):
                self._free_for(slot, slot.need)
            if not self._fits(slot):
                if not any(s.busy() for s in self._loaded()):
                    self._refuse(slot)
                continue
            try:
                self._load(slot)
            except Exception as exc:  # it loaded at start: a file gone or changed since
                self._fail_pending(slot, exc)
                continue
            self._fit(slot)
            self._run_pending(slot)
            return True
        return progressed

    def _run_pending(self, slot: _Slot) -> None:
        """Hand loaded ``slot`` the messages that waited, answering them here unless its
        runner takes the reply over (a turn streams from there)."""
        slot.last_used = time.monotonic()
        while slot.pending:
            message, reply, _ = slot.pending.popleft()
            try:
                result = slot.runner.receive(message, reply)
            except Exception as exc:
                reply.fail(exc)
            else:
                if result is not DETACHED:
                    reply.resolve(result)

    def _refuse(self, slot: _Slot) -> None:
        pinned = [s.name for s in self._loaded() if s.pinned]
        error = BudgetExceeded(
            f"model {slot.name!r} needs {slot.need} bytes to load and run a "
            f"turn; the memory limit is {self.limit} bytes and pinned models {pinned} hold "
            f"{self.count() - self._kept} bytes"
        )
        self._fail_pending(slot, error)

    @staticmethod
    def _fail_pending(slot: _Slot, error: Exception) -> None:
        while slot.pending:
            _, reply, _ = slot.pending.popleft()
            reply.fail(error)

    # -- the work loop ----------------------------------------------------------------
    def on_idle(self) -> bool:
        more = self._load_pending()
        for slot in self._loaded():
            if not slot.loaded:
                continue  # unloaded just now, for another model's turn
            if self.limit is not None:
                self._fit(slot)
                short = slot.runner.queued_need()
                if short is not None:
                    slot.last_used = time.monotonic()
                    if short > 0:  # what it needs: its shortfall plus the room left now
                        self._free_for(slot, short + self.limit - self.count())
                        self._fit(slot)
            more = slot.runner.step() or more
        self._sample()
        self._expire()
        return more or (any(s.pending for s in self._slots.values()) and self._can_progress())

    def _can_progress(self) -> bool:
        return any(s.busy() for s in self._loaded())

    def _sample(self) -> None:
        """MLX's own memory (its peak kept); under a limit, the count's too."""
        active, kept, peak = mlx_memory()
        self.mlx_peak = max(self.mlx_peak, peak + kept, active + kept)
        if self.limit is not None:
            self.count()

    def _expire(self) -> None:
        if self._ttl is None:
            return
        now = time.monotonic()
        for slot in self._loaded():
            idle = not (slot.pinned or slot.busy() or slot.pending)
            if idle and now - slot.last_used > self._ttl:
                self._unload(slot)

    # -- stats ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Every model's stats summed, with the memory limit's figures (None and 0 without
        a limit; ``mlx_peak_bytes`` either way)."""
        parts = [s.carried for s in self._slots.values() if s.carried is not None]
        for slot in self._loaded():
            parts.append(slot.runner.stats())
        total = sum_stats(parts)  # every model was loaded once: at start
        self._sample()
        loaded = self._loaded()
        swaps = sorted(self.swap_s)
        return msgspec.structs.replace(
            total,
            budget_bytes=self.config.budget_bytes,
            cache_bytes=sum(s.runner.pool.used for s in loaded),
            peak_bytes=max((s.runner.pool.peak for s in loaded), default=0),
            agents_cached=sum(len(s.runner.pool) for s in loaded),
            memory_limit_bytes=self.limit,
            memory_bytes=self.count(),
            memory_peak_bytes=self.peak,
            mlx_peak_bytes=self.mlx_peak,
            weights_bytes=sum(s.weights for s in loaded),
            models_loaded=len(loaded),
            model_loads=self.loads,
            model_unloads=self.unloads,
            swap_s=swaps[len(swaps) // 2] if swaps else 0.0,
            write_budget_spent=(
                0 if self._write_budget is None else self._write_budget.spent(time.monotonic())
            ),
        )
