"""One model's work inside the engine: its hot tier, decode batch and queues; message
dispatch and scheduling (chunked prefill, continuous batched decode). Not an actor: the
engine actor (``_engine.py``) owns it and calls it on its thread, replies passed in
explicitly. The hot tier's accounting is the CachePool's."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any, cast

import mlx.core as mx
import msgspec

from ...kernels import fused
from ...kernels.agent_cache import AgentKV, Unverified
from ...kernels.attention import query_repeats
from ...kernels.float_turn import FloatPrefix
from ...kernels.memory import keep_freed_buffers
from ...kernels.qcodec import DEFAULT_CODEC
from ...kernels.quantized_turn import QuantizedTurnCache
from ...kernels.rowwise import bind_rows
from ...kernels.stored import segment_layout
from ...kernels.turn_cache import TurnCache
from ...runtime import Reply
from ..enums import FinishReason, Room, Tier
from ..errors import (
    AgentBusy,
    BudgetExceeded,
    CacheMiss,
    ContextOverflow,
    EngineStopped,
    ModelLoadError,
    TurnEnded,
)
from ..hot import CachePool, HotEntry, MoveLog, PostWrite, WriteBudget
from ..ids import check_agent_id
from ..messages import (
    CacheQuery,
    DropCache,
    EndTurns,
    EngineMessage,
    Export,
    Fork,
    Generate,
    GetModelInfo,
    Hint,
    HotQuery,
    Install,
    InstallStreamed,
    Release,
    Reserve,
    StatsQuery,
    TierEvents,
    ToolWait,
    WarmVictims,
    Written,
)
from ..models import LoadedModel, Tokenizer, load_model
from ..records import EngineStats, ModelInfo
from ..tools import GrammarCompiler
from ._batch import DecodeBatch
from ._config import EngineConfig, ModelSpec, turn_reserve_bytes
from ._generation import Generation
from ._memory import attention_heads, attention_score_bytes
from ._model_check import check_turns
from ._picking import host_bound, pick, pick_in_graph

__all__ = ("DETACHED", "ModelRunner", "settle_random_state")

#: What :meth:`ModelRunner.receive` returns when it took the reply over (a turn streams
#: through it; a staging answers once there is room): the caller must not answer it.
DETACHED: Any = object()


def settle_random_state() -> None:
    """Evaluate MLX's global random key: building a model splits it lazily on this thread,
    and a lazy array tied to a thread that has exited aborts the process at exit."""
    mx.eval(list(cast(Any, mx.random.state)))


class ModelRunner:
    """One model and every MLX array of its turns, on the engine's thread.

    ``Generate`` requests are queued; :meth:`step` alternates one prefill chunk of the
    oldest prefilling request with one batched decode step of every decoding agent
    (pipelined: ``DecodeBatch``), so long prompts never starve decodes and new agents join
    the batch while others decode. Each agent's cache stays here between turns, quantized;
    a turn reads it through a working cache of the attention mode's class
    (``EngineConfig.attention``). The CachePool owns every hot cache and keeps every byte of
    it, and of staged and exported caches, within one budget; the runner runs turns on them
    through the pool's methods.

    Its lifecycle: made unloaded; :meth:`load` (the model, its hot tier, its batch), then
    :meth:`receive` and :meth:`step` any number of times; :meth:`unload` fails what is still
    queued and drops every array; :meth:`load` may follow again. Invariant: messages and
    steps reach it only while it is loaded (asserted).
    """

    def __init__(
        self,
        model: ModelSpec = None,
        config: EngineConfig | None = None,
        post: PostWrite | None = None,
        write_budget: WriteBudget | None = None,
    ) -> None:
        self._spec = model
        self.config = config or EngineConfig()
        self.codec = self.config.codec or DEFAULT_CODEC
        self.turn_cache = self.config.turn_cache()
        if self.config.deterministic:  # batches attend row by row (kernels.rowwise)
            self.turn_cache = self.turn_cache.invariant()
        self.lm: LoadedModel
        self.pool: CachePool
        self.batch: DecodeBatch
        self._loaded = False
        self._prefilling: deque[Generation] = deque()
        self._ready: deque[Generation] = deque()  # prefilled, waiting for a batch slot
        self._generated = 0  # first tokens, sampled at the end of a prefill
        self._grammars: GrammarCompiler  # compiles Generate.constraint (set at load)
        self._ready_turns = self._stored_first_turns = 0
        self._dequantized = 0  # stored tokens made float at a turn's start
        # Query heads a KV head where a float turn's first forward may attend over the
        # stored form (set at load; None: it may not): FloatTurnCache.defers.
        self._stored_first: int | None = None
        self._ending = False  # EndTurns came: turns end, new ones are refused
        self.moves = MoveLog()  # its hot tier's moves, kept across loads (each pool's log)
        # Under a write budget (write-back): its window (the engine's, one for every model),
        # kept across loads as the log is, and who writes what the hot tier sends out (its
        # agents, through the session).
        self._write_budget = write_budget if self.config.write_back else None
        self._post = post

    @property
    def loaded(self) -> bool:
        return self._loaded

    # -- lifecycle --------------------------------------------------------------------
    def load(self) -> None:
        """Load the model and make its hot tier and batch. Raises ModelLoadError (or
        ValueError) for a model that cannot run here, naming the family and layer."""
        assert not self._loaded, "load() of a loaded runner"
        spec = self._spec
        keep_freed_buffers()  # turns reuse freed pages instead of faulting in fresh ones
        fused.warm()  # the fused dequantize compiles beside the model's load (CPU only)
        self.lm = spec() if callable(spec) else load_model(spec, weights=self.config.weights)
        settle_random_state()
        config = self.config
        self.pool = CachePool(
            config.budget_bytes,
            config.policy,
            persistent=config.persistent,
            codec=self.codec,
            geometry=self.lm.geometry,
            turn_cache=self.turn_cache,
            ready_copies=config.ready_copies,
            checkpoints=config.checkpoints,
            moves=self.moves,
            write_budget=self._write_budget,
            post=self._post,
        )
        self.batch = DecodeBatch(self.lm.model)
        self._eos = frozenset(self.lm.tokenizer.eos_token_ids)
        # The ids a turn may hold (the GGUF loader checks the embedding has a row for each);
        # ModelInfo says it, so that the warm tier refuses a cache of other ids.
        self._vocab_size = self.lm.tokenizer.vocab_size
        self._grammars = GrammarCompiler(self.lm.tokenizer)
        try:
            self.turn_cache.prepare(self.lm.model, self.lm.geometry)
        except TypeError as exc:
            family = getattr(self.lm.model, "model_type", self.lm.name)
            raise ModelLoadError(f"model family {family!r}: {exc}") from exc
        if self.config.deterministic:
            # A decode step's projections of few rows round as a batch's (kernels.rowwise).
            bind_rows(self.lm.model, self.config.max_batch)
        self._stored_first = self._first_over_stored()
        # A codec or geometry this engine cannot store fails here, not mid-turn; and so
        # does a model whose layers cannot run over this attention mode's caches.
        try:
            segment_layout(self.codec, self.lm.geometry)(0, 1)
        except ValueError as exc:
            family = getattr(self.lm.model, "model_type", self.lm.name)
            raise ValueError(f"model family {family!r}: {exc}") from None
        check_turns(self.lm, self.codec, self.turn_cache)
        self._loaded = True

    def _first_over_stored(self) -> int | None:
        """Whether a float turn's first forward may attend over the stored form (the
        model's attention bound to the quantized working cache too): its query heads a KV
        head, or None (quantized turns, bit-exact turns, a model that cannot)."""
        if self.turn_cache.quantized or self.config.deterministic:
            return None
        repeats = query_repeats(self.lm.model)
        if repeats is None or not FloatPrefix.serves(self.lm.geometry):
            return None
        try:
            QuantizedTurnCache.prepare(self.lm.model, self.lm.geometry)
        except TypeError:
            return None
        return repeats

    def unload(self) -> None:
        """Fail the turns still here and drop the model, its hot caches and its batch (an
        engine under a memory limit unloads an idle model this way; ``load`` brings it
        back). Safe after a load that failed half-way, and when unloaded."""
        self._loaded = False
        batch = self.__dict__.get("batch")
        rows = batch.clear() if batch is not None else []
        for request in (*self._prefilling, *self._ready, *rows):
            request.reply.fail(EngineStopped("the engine stopped before this generation ended"))
        self._prefilling.clear()
        self._ready.clear()
        if "pool" in self.__dict__:
            self.pool.close()
        self.__dict__.pop("pool", None)
        self.__dict__.pop("batch", None)
        self.__dict__.pop("lm", None)
        self._generated = self._ready_turns = self._dequantized = 0  # anew after a load
        self._stored_first_turns = 0

    def queued_need(self) -> int | None:
        """None when no turn is queued; else the bytes the oldest queued turn's working
        cache needs beyond its hot tier's room now (0: it runs, or it fits)."""
        if not self._prefilling:
            return None
        head, pool = self._prefilling[0], self.pool
        if head.active or pool.limit is None:
            return 0
        return max(head.reserve + pool.committed() - pool.limit, 0)

    def attention_bytes(self) -> int:
        """A bound on the fp32 attention scores (and their softmax) of the work here now:
        a prefill chunk over the longest queued prompt, a decode step over its rows."""
        if not self._loaded:
            return 0
        heads = attention_heads(self.lm)
        prompt = max((len(r.prompt) for r in self._prefilling), default=0)
        rows = [*self.batch.rows, *self._ready]
        longest = max((len(r.prompt) + r.sampling.max_tokens for r in rows), default=0)
        chunk = min(self.config.prefill_chunk, prompt)
        scores = attention_score_bytes(heads, chunk, prompt)
        return scores + attention_score_bytes(heads, len(rows), longest)

    def settled(self) -> bool:
        """No turn is queued or running and nothing is being written, staged or built:
        dropping the hot tier now loses nothing that is not on disk (or re-prefillable)."""
        return not self._loaded or (
            not (self._prefilling or self._ready or len(self.batch)) and self.pool.stuck()
        )

    # -- messages ---------------------------------------------------------------------
    def info(self) -> tuple[ModelInfo, Tokenizer]:
        """What the model is (as its warm tier records it) and its tokenizer."""
        assert self._loaded, "info() of an unloaded runner"
        return self.lm.info(self.codec), self.lm.tokenizer

    def receive(self, message: EngineMessage, reply: Reply | None) -> Any:
        """Handle ``message``: its answer, or DETACHED after taking ``reply`` over (a turn
        streams its pieces through it; a staging waits for room)."""
        assert self._loaded, "a message for an unloaded runner"
        pool = self.pool
        match message:
            case Generate():
                assert reply is not None, "a turn needs its reply"
                self._admit(message, reply)
                return DETACHED
            case Export(agent, admit):
                return pool.export_admitted(agent) if admit else pool.export(agent)
            case Written(agent, export_id, upto, failed):
                return pool.written(agent, export_id, upto, failed=failed)
            case Reserve(agent, nbytes, wait):
                room = pool.reserve(agent, nbytes, prefetch=not wait)
                if room is Room.NO_ROOM and wait:
                    assert reply is not None, "a staging that waits needs its reply"
                    pool.wait_for_room(agent, nbytes, reply.detach())
                    return DETACHED
                return room
            case Install(agent, tokens, ranges, pin, read_s):
                nbytes = sum(int(a.nbytes) for *_, t in ranges for a in t.values())
                pool.rates.disk(nbytes, read_s)
                installed = pool.warm.install(
                    agent, nbytes, lambda: self._staged(tokens, ranges), pin=pin
                )
                if installed and not pin:
                    pool.ready_ahead(agent)  # a hint: make the turn to come start ready
                return installed
            case InstallStreamed(agent, tokens, read, pin):
                return pool.warm.install(
                    agent, read.nbytes, lambda: self._streamed(tokens, read), pin=pin
                )
            case Release(agent):
                return pool.release(agent)
            case GetModelInfo():
                return self.info()
            case DropCache(agent):
                return pool.drop(agent)
            case Fork(source, new, tokens):
                return pool.fork(check_agent_id(source), check_agent_id(new), tokens)
            case CacheQuery(agent):
                return pool.info(agent)
            case HotQuery():
                return pool.infos()
            case TierEvents(since):
                return self.moves.after(since)
            case ToolWait(agent, ttl_s):
                pool.tool_wait(agent, self.config.tool_wait_s if ttl_s is None else ttl_s)
                return None
            case Hint():
                return pool.hint(message)
            case StatsQuery():
                return self.stats()
            case EndTurns():
                return self.end_turns()
            case WarmVictims():
                return pool.cold_victims(message)
        raise TypeError(f"the engine does not handle {type(message).__name__}")

    def stats(self) -> EngineStats:
        """This model's figures (its hot tier's, its batch's, its turns')."""
        assert self._loaded, "stats() of an unloaded runner"
        pool, batch = self.pool, self.batch
        pool.measure()
        return EngineStats(
            agents_cached=len(pool),
            cache_bytes=pool.used,
            budget_bytes=pool.limit,
            peak_bytes=pool.peak,
            prefilling=len(self._prefilling),
            decoding=len(batch),
            waiting=len(self._ready),
            steps=batch.steps,
            generated_tokens=self._generated + batch.generated,
            max_batch_seen=batch.max_seen,
            demoted_warm=pool.demotions[Tier.WARM],
            demoted_cold=pool.demotions[Tier.COLD],
            ready_agents=pool.ready_agents,
            ready_bytes=pool.ready_bytes,
            shared_ready_bytes=pool.ready.shared.nbytes,
            working_bytes=pool.ledger.working(),
            dropped_ready=pool.ready.drops,
            ready_turns=self._ready_turns,
            stored_first_turns=self._stored_first_turns,
            dequantized_tokens=self._dequantized + round(pool.ready.dequantized),
            shared_turns=pool.shared_turns,
            shared_tokens=pool.shared_tokens,
            tool_waits=pool.tool_waits,
            constrained_tokens=batch.masked,
            mask_s=batch.mask_s,
            installs=pool.warm.installs,
            warm_writes=pool.warm.writes,
            warm_write_failures=pool.warm.write_failures,
            written_back=back.sent if (back := pool.write_back) is not None else 0,
            written_back_bytes=back.sent_bytes if back is not None else 0,
            write_back_refused=back.refused if back is not None else 0,
            write_budget_spent=(back.budget.spent(time.monotonic()) if back is not None else 0),
        )

    def end_turns(self) -> int:
        """End every turn (``EndTurns``); the count. A decoding turn ends at its next step,
        or now when it waits for a batch slot; a turn not decoding yet fails."""
        self._ending = True
        for request in self.batch.rows:
            request.ending = True
        for request in self._ready:
            request.finish(FinishReason.ENDED)
            self._park(request, finished=True)
        for request in self._prefilling:
            self._park(request)
            request.reply.fail(TurnEnded("the session ended its turns before this one decoded"))
        ended = len(self.batch) + len(self._ready) + len(self._prefilling)
        self._ready.clear()
        self._prefilling.clear()
        return ended

    def _admit(self, msg: Generate, reply: Reply) -> None:
        """Queue a generation; every check happens before any state changes."""
        agent = check_agent_id(msg.agent)
        if self._ending:
            raise TurnEnded("the session ended its turns: no turn starts now")
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
        answers = msg.answers
        if list(answers) != sorted(set(answers)) or any(
            a <= 0 or not any(c > a for c in cuts) for a in answers
        ):
            raise ValueError("answers must increase and each lie below a cut")
        if self.lm.geometry.recurrent and len(msg.tokens) > 1:
            # A checkpoint of the recurrent states where the next turn most likely diverges
            # (a redo of this answer, a template that renders it anew) or resumes.
            cuts = tuple(sorted({*cuts, len(msg.tokens) - 1}))
        if msg.warm and agent not in self.pool:
            raise CacheMiss(f"agent {agent!r} is not hot: stage its warm cache first")
        sampling = msg.sampling
        sampling.validate()
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        # Compiled before any state changes: a bad grammar fails here, nothing kept.
        grammar = None if msg.constraint is None else self._grammars.compile(msg.constraint)
        if len(msg.tokens) + sampling.max_tokens > limit:
            sampling = msgspec.structs.replace(sampling, max_tokens=limit - len(msg.tokens))
        key = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else time.time_ns() % (1 << 63)
            key = mx.random.key(seed)
        self._drop_cancelled()  # a cancelled turn of this agent ends before the new one
        entry = self.pool.claim(agent, msg.scope)  # the first change of state
        request = Generation(
            agent=agent,
            prompt=list(msg.tokens),
            sampling=sampling,
            reply=reply.detach(),
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
            answers=answers,
            grammar=grammar,
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
        """Base the request on ``entry`` (what of its cache, or of another's, the prompt
        reuses: ``CachePool.base``) and size the working cache the rest needs."""
        prompt = request.prompt
        keep, request.shared = self.pool.base(
            request.agent, entry, prompt, share=self.config.share_prefixes
        )
        kv = entry.kv
        quantized = self.turn_cache.quantized
        request.entry = entry
        request.todo = list(prompt[keep:])
        request.reused = keep
        request.reserve = turn_reserve_bytes(
            kv.geometry,
            (len(prompt) - keep if quantized else len(prompt)) + request.sampling.max_tokens,
            stored_bytes=kv.stored_bytes - kv.checkpoint_bytes if quantized else None,
            checkpoints=1 + sum(c > keep for c in request.cuts),
        )

    def _staged(self, tokens: list[int], ranges: list[tuple[int, int, dict[str, Any]]]) -> AgentKV:
        """A staged warm cache (host arrays) as a hot one (one copy into MLX)."""
        kv = self.pool.new_kv()
        kv.fill_staged(tokens, ranges)
        return kv

    def _streamed(self, tokens: list[int], read: Any) -> AgentKV:
        """A warm cache streaming in (``InstallStreamed``): its arrays allocated here, the
        store's reader threads started on writing their bytes into them."""
        kv = self.pool.new_kv()
        read.start(kv.fill_streamed(tokens, read.ranges(), read))
        return kv

    # -- the work loop ----------------------------------------------------------------
    def step(self) -> bool:
        """One round of work: a prefill chunk, a decode step, a layer of a ready copy;
        whether there is more to do at once (False: only a message can help)."""
        assert self._loaded, "a step of an unloaded runner"
        self._drop_cancelled()
        self.pool.grant_waiters()  # stagings waiting for room: whatever changed may help
        progressed = False
        if self._prefilling:
            progressed = self._prefill_step(self._prefilling[0])
        batch = self.batch
        while self._ready and len(batch) < self.config.max_batch:
            batch.join(self._ready.popleft())
        if len(batch):
            done = batch.step()
            self.pool.batch_bytes(batch.nbytes)  # before the rows that left count again
            for request in done:
                self._park(request, finished=True)
            progressed = True
        building = self.pool.build_ready_step()  # one layer at a time, between steps
        # Waiting only for memory (writes to disk to finish): sleep until a message comes.
        return building or (progressed and bool(self._prefilling or self._ready or len(batch)))

    def _drop_cancelled(self) -> None:
        for queue in (self._prefilling, self._ready):
            for request in [r for r in queue if r.reply.cancelled]:
                queue.remove(request)
                self._park(request)
        batch = self.batch
        gone = [i for i, r in enumerate(batch.rows) if r.reply.cancelled]
        if gone:
            left = batch.leave(gone)
            self.pool.batch_bytes(batch.nbytes)
            for request in left:
                self._park(request)

    def _park(self, request: Generation, *, finished: bool = False) -> None:
        """The turn is over: its new tokens stored quantized, its working copy dropped or
        kept ready (``CachePool.end_turn``). ``finished``: it ended normally, so its agent
        writes the new tokens next."""
        self.pool.end_turn(request.agent, request.entry, finished=finished)

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

    def _chunk(self, request: Generation, at: int, work: TurnCache) -> tuple[int, bool]:
        """How many prompt tokens the next forward feeds from ``at``: up to the next cut or
        answer start (``Generate.answers``), ``prefill_chunk`` at most; and whether they
        attend step by step. Inside an answer, with ``deterministic``, as its decode steps
        fed them: up to ``max_batch`` at a time, each position attending as its step did
        (their projections round as a decode step's: ``kernels.rowwise``) where the working
        cache can (``TurnCache.can_step``; full attention only), else one a step. Changes
        nothing: the caller sets the cache's mode for the forward."""
        ends = [c for c in request.cuts if c > at]
        if self.config.deterministic and ends:
            began = [a for a in request.answers if a <= at]
            if began and not any(began[-1] < c <= at for c in request.cuts):
                rows, geometry = min(self.config.max_batch, ends[0] - at), self.lm.geometry
                plain = not geometry.recurrent and not geometry.sliding
                if rows > 1 and plain and work.can_step():
                    return rows, True
                return 1, False
        ends += [a for a in request.answers if a > at]
        return min([self.config.prefill_chunk] + [e - at for e in ends]), False

    def _prefill_step(self, request: Generation) -> bool:
        if not request.active:
            started = self._start(request)
            if started is not True:
                return started is None
            kv = request.entry.kv
            request.prefill_start = time.perf_counter()
            self._ready_turns += kv.ready is not None
            first = self._first_queries(request)
            request.landing = kv.landing
            try:
                made = self.pool.working_copy(request.agent, request.entry, first=first)
            except Unverified as exc:  # a copy made first waits for every byte
                return self._unverified(request, exc)
            self._stored_first_turns += kv.stored_first
            self._dequantized += made
            request.dequantize_s = time.perf_counter() - request.prefill_start
            if made:  # a ready copy or a shared prefix's taken as it is: nothing measured
                per_token = kv.stored_bytes / max(len(kv.tokens), 1)
                self.pool.rates.dequantize(round(made * per_token), request.dequantize_s)
        kv = request.entry.kv
        at = len(kv.tokens)
        work = kv.activate()
        size, stepwise = self._chunk(request, at, work)
        chunk = request.todo[:size]
        del request.todo[: len(chunk)]
        if stepwise:
            work.stepwise(True)
        work.dispatching(True)  # its layers run as the rest of its graph is built
        try:
            logits = self.lm.model(mx.array(chunk, dtype=mx.uint32)[None], cache=work.layers)
        finally:
            work.dispatching(False)
            if stepwise:
                work.stepwise(False)
        try:  # a copy filled beside this forward: all in before anything else reads it
            copied = work.landed()
        except RuntimeError as exc:
            return self._copy_failed(request, exc)
        if copied is not None:
            request.copy_s, request.copy_wait_s = copied.fill_s, copied.waited_s
        if request.landing is not None:  # streamed in: trusted from here, or dropped
            try:
                self._settled(request)
            except Unverified as exc:
                return self._unverified(request, exc)
        request.tokens.extend(chunk)
        if request.todo:
            if len(kv.tokens) in request.cuts:
                self.pool.store_so_far(request.agent, request.entry)
            mx.eval(work.arrays())
            self.pool.measure()
            return True
        self._prefilling.popleft()
        last = logits[:, -1, :]
        rows = [request]
        picked = pick(last, rows, [True]) if host_bound(rows) else pick_in_graph(last, rows)
        token = cast(int, picked.item())
        request.prefill_end = time.perf_counter()
        self.pool.rates.prefill(  # the forward's own time: its working copy's left out
            len(request.prompt) - request.reused,
            request.prefill_end - request.prefill_start - request.dequantize_s,
        )
        self._generated += 1
        if request.emit(token):
            if request.entry.kv.stored_first:  # its float copy, now the first token is out
                self._float_after_stored(request)
            self._ready.append(request)
        else:
            self._park(request, finished=True)
        return True

    def _settled(self, request: Generation) -> None:
        """Wait for the rest of the turn's streamed cache and its checksums (its first
        forward ran as its layers landed); the read's seconds go into the turn's timings
        and the pool's disk rate. Raises Unverified (nothing of the turn answered yet)."""
        read, kv = request.landing, request.entry.kv
        kv.settle()
        request.landing = None
        request.stream_s, request.stream_wait_s = read.read_s, read.waited_s
        self.pool.rates.disk(read.nbytes, read.read_s)

    def _unverified(self, request: Generation, exc: Unverified) -> bool:
        """The turn's cache streamed in and failed its checksum (or could not be read):
        drop it and fail the turn with CacheMiss before anything of it was answered. Its
        agent stages it again; the store then reads it whole, refuses it with the reason,
        and the agent goes on cold."""
        self._prefilling.popleft()
        request.entry.kv.clear_working()
        self._park(request)
        with contextlib.suppress(AgentBusy):  # another turn of it queued: it fails there too
            self.pool.drop(request.agent)
        request.reply.fail(
            CacheMiss(f"agent {request.agent!r}: its warm cache failed as it streamed in: {exc}")
        )
        return True

    def _copy_failed(self, request: Generation, exc: RuntimeError) -> bool:
        """The turn's float copy could not be filled beside its first forward (which then
        read what it held): fail the turn before anything of it was answered, its working
        copy dropped; its stored cache is untouched and its next turn starts afresh."""
        self._prefilling.popleft()
        request.entry.kv.clear_working()
        self._park(request)
        request.reply.fail(exc)
        return True

    def _first_queries(self, request: Generation) -> int:
        """The queries a row of ``request``'s first forward where it may attend over the
        stored form (``CachePool.working_copy``): the whole prompt left in one forward,
        no cut or answer inside; else 0."""
        repeats = self._stored_first
        at = len(request.entry.kv.tokens)
        todo = len(request.todo)
        if repeats is None or not 0 < todo <= self.config.prefill_chunk:
            return 0
        if any(c > at for c in (*request.cuts, *request.answers)):
            return 0
        return todo * repeats

    def _float_after_stored(self, request: Generation) -> None:
        """The float working copy of a turn whose first forward attended over the stored
        form, made after its first token (in its decode time); measured as any copy."""
        kv = request.entry.kv
        t0 = time.perf_counter()
        made = self.pool.float_after_stored(request.agent, request.entry)
        self._dequantized += made
        if made:
            per_token = kv.stored_bytes / max(kv.stored_tokens, 1)
            self.pool.rates.dequantize(round(made * per_token), time.perf_counter() - t0)
