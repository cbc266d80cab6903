"""The engine actor: the only owner of MLX. Message dispatch and scheduling: chunked
prefill and continuous batched decode. The hot tier's accounting is the CachePool's."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any, cast

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import KVCache

from ..kernels.agent_cache import AgentKV, StoredRange, segment_layout
from ..kernels.memory import keep_freed_buffers
from ..kernels.qcodec import DEFAULT_CODEC
from ..kernels.sampling import sample_rows
from ..kernels.turn_cache import READY_SLACK, FloatTurnCache, TurnCache
from ..runtime import ThreadActor
from .config import EngineConfig, ModelSpec, turn_reserve_bytes
from .enums import Room, Tier
from .errors import BudgetExceeded, CacheMiss, ContextOverflow, EngineStopped, UnknownAgent
from .generation import Generation
from .model import LoadedModel, load_model
from .pool import CachePool, HotEntry
from .protocol import (
    CacheInfo,
    CacheQuery,
    DropCache,
    EngineMessage,
    EngineStats,
    Export,
    Fork,
    Generate,
    GetModelInfo,
    Install,
    ModelInfo,
    Release,
    Reserve,
    StatsQuery,
    Written,
    check_agent_id,
)

__all__ = ("EngineActor",)


def _settle_random_state() -> None:
    """Evaluate MLX's global random key: building a model splits it lazily on this thread,
    and a lazy array tied to a thread that has exited aborts the process at exit."""
    mx.eval(list(cast(Any, mx.random.state)))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class EngineActor(ThreadActor):
    """Owns the model and every MLX array, on its own OS thread.

    ``Generate`` requests are queued; ``on_idle`` alternates one prefill chunk of the oldest
    prefilling request with one batched decode step of every decoding agent, so long prompts
    never starve decodes and new agents join the batch while others decode. Each agent's
    cache stays in the engine between turns, quantized; a turn reads it through a working
    cache of the attention mode's class (``EngineConfig.attention``). The CachePool keeps
    every byte of it, and of staged and exported caches, within one budget.
    """

    def __init__(self, model: ModelSpec = None, config: EngineConfig | None = None) -> None:
        self._spec = model
        self.config = config or EngineConfig()
        self.codec = self.config.codec or DEFAULT_CODEC
        self.turn_cache = self.config.turn_cache()
        self.lm: LoadedModel
        self.pool = CachePool(
            self.config.budget_bytes,
            self.config.policy,
            persistent=self.config.persistent,
            make_kv=self._new_kv,
            batch_bytes=lambda: self._batch_cache.nbytes if self._batch_cache else 0,
        )
        self._prefilling: deque[Generation] = deque()
        self._ready: deque[Generation] = deque()  # prefilled, waiting for a batch slot
        self._batch: list[Generation] = []
        self._batch_cache: TurnCache | None = None
        self._steps = 0
        self._generated = 0
        self._max_batch_seen = 0
        self._ready_turns = 0
        self._shared_turns = 0
        self._shared_tokens = 0
        # Ready copies built ahead of a turn (agent, entry, layers so far), oldest first.
        self._readying: deque[tuple[str, HotEntry, list[KVCache]]] = deque()

    # -- lifecycle --------------------------------------------------------------------
    def on_start(self) -> None:
        spec = self._spec
        keep_freed_buffers()  # turns reuse freed pages instead of faulting in fresh ones
        self.lm = spec() if callable(spec) else load_model(spec, weights=self.config.weights)
        _settle_random_state()
        self._eos = frozenset(self.lm.tokenizer.eos_token_ids)
        # The ids a turn may hold (the GGUF loader checks the embedding has a row for each);
        # ModelInfo says it, so that the warm tier refuses a cache of other ids.
        self._vocab_size = self.lm.tokenizer.vocab_size
        self.turn_cache.prepare(self.lm.model)
        # A codec or geometry this engine cannot store fails here, not mid-turn.
        segment_layout(self.codec, self.lm.geometry)(0, 1)

    def on_stop(self) -> None:
        # MLX arrays made on this thread must die before it exits: MLX aborts the process
        # when such an array outlives its thread (seen with mlx 0.32 on CPU).
        for request in (*self._prefilling, *self._ready, *self._batch):
            request.reply.fail(EngineStopped("the engine stopped before this generation ended"))
        self._prefilling.clear()
        self._ready.clear()
        self._readying.clear()
        self._batch.clear()
        self._batch_cache = None
        for entry in self.pool.entries():
            entry.kv.work = entry.kv.ready = None
        self.__dict__.pop("pool", None)
        self.__dict__.pop("lm", None)
        gc.collect()
        _settle_random_state()
        mx.synchronize()

    def _new_kv(self) -> AgentKV:
        return AgentKV(self.codec, self.lm.geometry, turn_cache=self.turn_cache)

    # -- messages ---------------------------------------------------------------------
    def receive(self, message: EngineMessage) -> Any:
        pool = self.pool
        match message:
            case Generate():
                self._admit(message)
                return None
            case Export(agent):
                return pool.export(agent)
            case Written(agent, export_id, upto, failed):
                return pool.written(agent, export_id, upto, failed=failed)
            case Reserve(agent, nbytes, wait):
                room = pool.reserve(agent, nbytes)
                if room is Room.NO_ROOM and wait:
                    assert self.reply is not None
                    return pool.wait_for_room(agent, nbytes, self.reply.detach())
                return room
            case Install(agent, tokens, ranges, pin, read_s):
                nbytes = sum(int(a.nbytes) for *_, t in ranges for a in t.values())
                pool.rates.disk(nbytes, read_s)
                installed = pool.install(
                    agent, nbytes, lambda: self._staged(tokens, ranges), pin=pin
                )
                if installed and not pin and self.config.ready_copies:
                    self._ready_ahead(agent)  # a hint: make the turn to come start ready
                return installed
            case Release(agent):
                return pool.release(agent)
            case GetModelInfo():
                return self._model_info(), self.lm.tokenizer
            case DropCache(agent):
                return pool.drop(agent)
            case Fork(source, new, tokens):
                entry = pool.get(check_agent_id(source))
                check_agent_id(new)
                if entry is None or entry.busy or entry.kv.tokens != tokens:
                    return False
                kv = entry.kv.fork(self._new_kv())
                return pool.install(new, kv.stored_bytes, lambda: kv, pin=False, from_disk=False)
            case CacheQuery(agent):
                entry = pool.get(agent)
                if entry is None:
                    raise UnknownAgent(f"agent {agent!r} has no hot cache")
                return CacheInfo(
                    agent=agent,
                    tokens=len(entry.kv.tokens),
                    nbytes=entry.kv.nbytes,
                    busy=entry.busy,
                    persisted=entry.persisted,
                )
            case StatsQuery():
                return self._stats()
        raise TypeError(f"the engine does not handle {type(message).__name__}")

    def _model_info(self) -> ModelInfo:
        return ModelInfo(
            name=self.lm.name,
            fingerprint=self.lm.fingerprint,
            context_length=self.lm.context_length,
            n_layers=self.lm.n_layers,
            n_kv_heads=self.lm.n_kv_heads,
            head_dim=self.lm.head_dim,
            codec=self.codec.describe(),
            vocab_size=self._vocab_size,
            geometry=self.lm.geometry.describe(),
        )

    def _stats(self) -> EngineStats:
        pool = self.pool
        pool.measure()
        return EngineStats(
            agents_cached=len(pool),
            cache_bytes=pool.used,
            budget_bytes=pool.limit,
            peak_bytes=pool.peak,
            prefilling=len(self._prefilling),
            decoding=len(self._batch),
            waiting=len(self._ready),
            steps=self._steps,
            generated_tokens=self._generated,
            max_batch_seen=self._max_batch_seen,
            demoted_warm=pool.demotions[Tier.WARM],
            demoted_cold=pool.demotions[Tier.COLD],
            ready_agents=sum(e.kv.ready is not None for e in pool.entries()),
            ready_bytes=sum(e.kv.ready_bytes for e in pool.entries()),
            dropped_ready=pool.ready_drops,
            ready_turns=self._ready_turns,
            shared_turns=self._shared_turns,
            shared_tokens=self._shared_tokens,
            installs=pool.installs,
            warm_writes=pool.writes,
            warm_write_failures=pool.write_failures,
        )

    def _admit(self, msg: Generate) -> None:
        """Queue a generation; every check happens before any state changes."""
        agent = check_agent_id(msg.agent)
        assert self.reply is not None
        if not msg.tokens:
            raise ValueError("the prompt is empty")
        vocab = self._vocab_size
        if min(msg.tokens) < 0 or max(msg.tokens) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        limit = self.lm.context_length
        if len(msg.tokens) >= limit:
            raise ContextOverflow(
                f"prompt of {len(msg.tokens)} tokens does not fit the context of {limit} tokens"
            )
        cuts = msg.cuts
        if any(not 0 < c < len(msg.tokens) for c in cuts) or list(cuts) != sorted(set(cuts)):
            raise ValueError("cuts must increase and lie inside the prompt")
        if msg.warm and agent not in self.pool:
            raise CacheMiss(f"agent {agent!r} is not hot: stage its warm cache first")
        sampling = msg.sampling
        sampling.validate()
        if len(msg.tokens) + sampling.max_tokens > limit:
            sampling = msgspec.structs.replace(sampling, max_tokens=limit - len(msg.tokens))
        key = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else time.time_ns() % (1 << 63)
            key = mx.random.key(seed)
        self._drop_cancelled()  # a cancelled turn of this agent ends before the new one
        entry = self.pool.claim(agent)  # the first change of state
        request = Generation(
            agent=agent,
            prompt=list(msg.tokens),
            sampling=sampling,
            reply=self.reply.detach(),
            sent_at=msg.sent_at,
            entry=entry,
            todo=[],
            reused=0,
            key=key,
            detok=self.lm.tokenizer.detokenizer(),
            eos=self._eos,
            reserve=0,
            warm=msg.warm,
            cuts=cuts,
        )
        self._reuse(request, entry)
        # In the order the agents sent them: a turn sent again after a CacheMiss (its cache
        # was demoted while it waited) keeps its place.
        at = len(self._prefilling)
        while (
            at > 0
            and not self._prefilling[at - 1].active
            and self._prefilling[at - 1].sent_at > request.sent_at
        ):
            at -= 1
        self._prefilling.insert(at, request)

    def _reuse(self, request: Generation, entry: HotEntry) -> None:
        """Base the request on ``entry``: reuse the longest common prefix of its tokens (the
        last prompt token is always fed again so that its logits are there to sample from)
        and size the working cache the rest needs."""
        kv = entry.kv
        prompt = request.prompt
        keep = kv.reusable(min(_common_prefix(kv.tokens, prompt), len(prompt) - 1))
        kv.trim(keep)
        entry.persisted = min(entry.persisted, keep)
        if entry.shared_from is not None and keep < entry.shared_from[1]:
            entry.shared_from = None  # cut below what it shared: its write is its own
        request.shared = 0
        if keep == 0 and self.config.share_prefixes:
            keep = request.shared = self._share_prefix(request.agent, entry, prompt)
        quantized = self.turn_cache.quantized
        request.entry = entry
        request.todo = list(prompt[keep:])
        request.reused = keep
        request.reserve = turn_reserve_bytes(
            kv.geometry,
            (len(prompt) - keep if quantized else len(prompt)) + request.sampling.max_tokens,
            stored_bytes=kv.stored_bytes if quantized else None,
        )

    def _share_prefix(self, agent: str, entry: HotEntry, prompt: list[int]) -> int:
        """Base ``entry`` (empty) on the longest run of another hot cache's stored ranges
        that ``prompt`` begins with, token for token (the last prompt token stays to be
        fed): the arrays are shared, not copied. Returns the tokens it reuses (0: none)."""
        limit = len(prompt) - 1
        best: tuple[int, str, AgentKV, int] | None = None
        for name, other in self.pool.items():
            if name == agent or not other.kv.ranges or other.kv.tokens[:1] != prompt[:1]:
                continue
            bounds = other.kv.boundaries()
            for count in range(len(bounds), 0, -1):
                stop = bounds[count - 1]
                if best is not None and stop <= best[0]:
                    break
                if stop <= limit and other.kv.tokens[:stop] == prompt[:stop]:
                    best = (stop, name, other.kv, count)
                    break
        if best is None:
            return 0
        stop, source, source_kv, count = best
        kv = entry.kv
        source_kv.share_into(kv, count)
        if kv.reusable(stop) != stop:  # a sliding window no longer held there
            kv.trim(0)
            return 0
        entry.shared_from = (source, stop)
        self._shared_turns += 1
        self._shared_tokens += stop
        self.pool.measure()
        return stop

    def _staged(self, tokens: list[int], ranges: list[tuple[int, int, dict[str, Any]]]) -> AgentKV:
        """A staged warm cache (host arrays) as a hot one (one copy into MLX)."""
        kv = self._new_kv()
        kv.tokens = list(tokens)
        geometry = self.lm.geometry
        sliding = geometry.sliding
        kv.ranges = [
            StoredRange.from_numpy(start, stop, geometry.n_layers, tensors, sliding)
            for start, stop, tensors in ranges
        ]
        if kv.stored_tokens != len(tokens):
            raise ValueError("staged ranges do not cover the staged tokens")
        # The warm tier keeps sliding layers' tensors for the last ranges only.
        lacking = [r for r in kv.ranges if any(not r.holds_layer(i) for i in sliding)]
        if lacking:
            if lacking != kv.ranges[: len(lacking)]:
                raise ValueError("staged sliding-layer tensors are not the last ranges")
            kv.window_start = lacking[-1].stop
        kv.slide(len(tokens))  # what it read is on disk
        mx.eval(list(kv.stored_arrays()))
        return kv

    # -- the work loop ----------------------------------------------------------------
    def on_idle(self) -> bool:
        self._drop_cancelled()
        self.pool.grant_waiters()  # stagings waiting for room: whatever changed may help
        progressed = False
        if self._prefilling:
            progressed = self._prefill_step(self._prefilling[0])
        while self._ready and len(self._batch) < self.config.max_batch:
            self._join_batch(self._ready.popleft())
        if self._batch:
            self._decode_step()
            progressed = True
        building = self._build_ready_step()  # one layer at a time, between steps
        # Waiting only for memory (writes to disk to finish): sleep until a message comes.
        return building or (progressed and bool(self._prefilling or self._ready or self._batch))

    def _ready_ahead(self, agent: str) -> None:
        """Queue building an idle agent's ready copy (dequantized attention only)."""
        entry = self.pool.get(agent)
        if entry is None or self.turn_cache.quantized or entry.kv.ready is not None:
            return
        kv = entry.kv
        nbytes = (kv.stored_tokens + READY_SLACK) * kv.geometry.fp32_bytes_per_token()
        if self.pool.reserve_ready(agent, nbytes):
            self._readying.append((agent, entry, []))

    def _build_ready_step(self) -> bool:
        """Dequantize one layer of the oldest ready copy being built; True while any is."""
        while self._readying:
            agent, entry, layers = self._readying[0]
            kv = entry.kv
            if (
                self.pool.get(agent) is not entry
                or entry.busy
                or kv.work is not None
                or kv.ready is not None
            ):
                self._readying.popleft()  # gone, or its turn came first: it dequantizes
                self.pool.ready_done(agent)
                continue
            layers.append(FloatTurnCache.row_layer(kv, len(layers), READY_SLACK))
            mx.eval([a for a in layers[-1].state if isinstance(a, mx.array)])
            if len(layers) == kv.geometry.n_layers:
                self._readying.popleft()
                kv.ready = FloatTurnCache(layers)
                self.pool.ready_done(agent)
            return True
        return False

    def _drop_cancelled(self) -> None:
        for queue in (self._prefilling, self._ready):
            for request in [r for r in queue if r.reply.cancelled]:
                queue.remove(request)
                self._park(request)
        gone = [i for i, r in enumerate(self._batch) if r.reply.cancelled]
        if gone:
            self._leave_batch(gone, finished=False)

    def _park(self, request: Generation, *, finished: bool = False) -> None:
        """The turn is over: store the new tokens quantized, drop the working copy.
        ``finished``: it ended normally, so its agent writes the new tokens next."""
        keep = self.config.ready_copies and self.pool.get(request.agent) is request.entry
        request.entry.kv.deactivate(keep_ready=keep)
        kv = request.entry.kv
        # Without a warm tier nothing is ever written: every range may go.
        kv.slide(request.entry.persisted if self.pool.persistent else len(kv.tokens))
        self.pool.end_turn(request.agent, request.entry, write_due=finished)

    def _start(self, request: Generation) -> bool | None:
        """Make room for the head request's working cache: True when it may start, False to
        wait for running turns or writes to free room, None when it was answered (failed)."""
        pool = self.pool
        if pool.get(request.agent) is not request.entry:
            # Its cache was demoted while it waited. With a warm copy the agent stages it
            # and sends the turn again (keeping its place); else what is hot now is used.
            if request.warm and request.agent not in pool:
                self._prefilling.popleft()
                self._park(request)
                request.reply.fail(
                    CacheMiss(f"agent {request.agent!r} was demoted while its turn waited")
                )
                return None
            self._reuse(request, pool.adopt(request.agent))
        if pool.start_turn(request.entry, request.reserve):
            return True
        if not pool.stuck(request.entry):
            return False  # running turns, writes or stagings will free room
        self._prefilling.popleft()
        self._park(request)
        request.reply.fail(
            BudgetExceeded(
                f"this turn may need {request.reserve} bytes of working cache besides "
                f"{request.entry.kv.stored_bytes} bytes of its own stored cache; the hot "
                f"budget is {pool.limit} bytes"
            )
        )
        return None

    def _prefill_step(self, request: Generation) -> bool:
        if not request.active:
            started = self._start(request)
            if started is not True:
                return started is None
            kv = request.entry.kv
            request.prefill_start = time.perf_counter()
            self._ready_turns += kv.ready is not None
            kv.activate()
            request.dequantize_s = time.perf_counter() - request.prefill_start
            if kv.ranges and not kv.turn_cache.quantized:
                self.pool.rates.dequantize(kv.stored_bytes, request.dequantize_s)
        kv = request.entry.kv
        at = len(kv.tokens)
        size = min([self.config.prefill_chunk] + [c - at for c in request.cuts if c > at])
        chunk = request.todo[:size]
        del request.todo[: len(chunk)]
        work = kv.activate()
        logits = self.lm.model(mx.array(chunk, dtype=mx.uint32)[None], cache=work.layers)
        request.tokens.extend(chunk)
        if request.todo:
            if len(kv.tokens) in request.cuts:
                kv.store_so_far()
            mx.eval(work.arrays())
            self.pool.measure()
            return True
        self._prefilling.popleft()
        pick = sample_rows(
            logits[:, -1, :],
            [request.sampling.temperature],
            [request.sampling.top_p],
            [request.next_key()],
        )
        token = cast(int, pick.item())
        request.prefill_end = time.perf_counter()
        self.pool.rates.prefill(
            len(request.prompt) - request.reused, request.prefill_end - request.prefill_start
        )
        self._generated += 1
        if request.emit(token):
            self._ready.append(request)
        else:
            self._park(request, finished=True)
        return True

    def _join_batch(self, request: Generation) -> None:
        kv = request.entry.kv
        assert kv.work is not None
        if self._batch_cache is None:
            self._batch_cache = kv.work.batch()
        else:
            self._batch_cache.extend(kv.work)
        kv.work = None  # the batch cache holds it now
        self._batch.append(request)
        self._max_batch_seen = max(self._max_batch_seen, len(self._batch))

    def _leave_batch(self, rows: list[int], *, finished: bool) -> None:
        batch = self._batch_cache
        assert batch is not None
        for i in rows:
            self._batch[i].entry.kv.work = batch.extract(i)
        keep = [i for i in range(len(self._batch)) if i not in set(rows)]
        leaving = [self._batch[i] for i in rows]
        self._batch = [self._batch[i] for i in keep]
        if keep:
            batch.filter(keep)
        else:
            self._batch_cache = None
        for request in leaving:
            self._park(request, finished=finished)

    def _decode_step(self) -> None:
        assert self._batch_cache is not None
        batch = self._batch
        inputs = mx.array([[r.generated[-1]] for r in batch], dtype=mx.uint32)
        logits = self.lm.model(inputs, cache=self._batch_cache.layers)[:, -1, :]
        picks = cast(
            list[int],
            sample_rows(
                logits,
                [r.sampling.temperature for r in batch],
                [r.sampling.top_p for r in batch],
                [r.next_key() for r in batch],
            ).tolist(),
        )
        self._steps += 1
        self._generated += len(picks)
        self.pool.measure()
        done = []
        for i, (request, token) in enumerate(zip(batch, picks, strict=True)):
            request.tokens.append(request.generated[-1])
            if not request.emit(token):
                done.append(i)
        if done:
            self._leave_batch(done, finished=True)
