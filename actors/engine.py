"""The engine actor: the only owner of MLX. Chunked prefill, continuous batched decode."""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import BatchKVCache

from ..kernels.agent_cache import AgentKV, StoredRange
from ..kernels.qbatch import install_attention
from ..kernels.qcodec import DEFAULT_CODEC, KVCodec
from ..kernels.sampling import sample_rows
from ..runtime import Reply, ThreadActor
from .errors import (
    AgentBusy,
    BudgetExceeded,
    CacheMiss,
    ContextOverflow,
    EngineStopped,
    UnknownAgent,
)
from .model import LoadedModel, load_model
from .pool import Candidate, EvictionPolicy, LRUPolicy, MemoryBudget
from .protocol import (
    CacheInfo,
    CacheQuery,
    DropCache,
    EngineStats,
    Export,
    Exported,
    Finished,
    Generate,
    GetModelInfo,
    Install,
    ModelInfo,
    Piece,
    Release,
    Reserve,
    Sampling,
    StatsQuery,
    Timings,
    Written,
    check_agent_id,
)

__all__ = ("EngineActor", "EngineConfig", "turn_reserve_bytes")

ModelSpec = str | os.PathLike[str] | None | Callable[[], LoadedModel]
Attention = Literal["auto", "quantized", "dequantized"]


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch``: agents decoding in one forward. ``prefill_chunk``: prompt tokens per
    prefill step (decode steps of other agents run between chunks). ``codec``: how stored
    caches are quantized (None: the default Q4 codec). ``budget_bytes``: the hot tier's
    byte budget (None: unbounded). ``persistent``: a warm tier exists, so only caches safe
    on disk may be demoted; without one, demotion drops a cache to cold (text only).
    ``attention``: how turns read an agent's stored cache. ``"quantized"``: attention runs
    over the quantized parts as stored (``mx.quantized_matmul``), batches are
    QuantizedBatchCaches, and only the running turn's tokens are float. ``"dequantized"``:
    each turn dequantizes the agent's cache into a float copy once, and batches are
    mlx-lm BatchKVCaches of those. ``"auto"``: quantized on a GPU; dequantized on the CPU,
    where MLX's quantized matmul is slower than float attention (bench/decode_batch.py).
    The stored bytes, and so hot/warm equality, are the same either way."""

    max_batch: int = 8
    prefill_chunk: int = 256
    weights: str = "auto"
    codec: KVCodec | None = None
    budget_bytes: int | None = None
    persistent: bool = False
    policy: EvictionPolicy = field(default_factory=LRUPolicy)
    attention: Attention = "auto"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ValueError("budget_bytes must be positive (or None for no budget)")
        if self.attention not in get_args(Attention):
            raise ValueError(
                f"attention must be one of {get_args(Attention)}, not {self.attention!r}"
            )

    def quantized_attention(self) -> bool:
        """Whether turns attend over the quantized cache (resolving ``"auto"`` for the
        device MLX runs on now)."""
        if self.attention == "auto":
            return mx.default_device() != mx.cpu
        return self.attention == "quantized"


@dataclass
class _Entry:
    """An agent's hot cache and its bookkeeping."""

    kv: AgentKV
    last_used: float = 0.0
    persisted: int = 0  # tokens known to be safe in the warm tier
    busy: bool = False  # a request is using it
    pinned: bool = False  # staged for a turn that is about to start: not a demotion victim

    @property
    def clean(self) -> bool:
        return self.persisted >= len(self.kv.tokens)


@dataclass
class _Request:
    agent: str
    prompt: list[int]
    sampling: Sampling
    reply: Reply
    sent_at: float
    entry: _Entry
    todo: list[int]
    reused: int
    key: mx.array | None
    detok: Any
    reserve: int  # bytes its working copy may grow to (checked against the budget)
    active: bool = False  # its working copy exists
    held: str = ""  # text held back while it could still become a stop string
    text: str = ""
    generated: list[int] = field(default_factory=list)
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    first_token_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.entry.kv.tokens

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


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


def turn_reserve_bytes(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    tokens: int,
    *,
    stored_bytes: int | None = None,
) -> int:
    """What a turn reserves in the hot budget for its working cache, twice (the batch pads
    rows and merging copies them). With dequantized attention (``stored_bytes`` None) that
    is fp32 K and V of all ``tokens`` (prompt + max_tokens); with quantized attention, fp32
    K and V of the ``tokens`` the turn adds, plus a copy of the agent's ``stored_bytes``
    with scales widened to fp32 (at most 1.5x). Tokens count in steps of 256."""
    fp_bytes_per_token = 2 * 4 * n_layers * n_kv_heads * head_dim
    fp = (-(-tokens // 256) * 256) * fp_bytes_per_token
    if stored_bytes is None:
        return 2 * fp
    return 2 * (fp + stored_bytes * 3 // 2)


class EngineActor(ThreadActor):
    """Owns the model and every MLX array, on its own OS thread.

    ``Generate`` requests are queued; ``on_idle`` alternates one prefill chunk of the oldest
    prefilling request with one batched decode step of every decoding agent, so long prompts
    never starve decodes and new agents join the batch while others decode. Each agent's
    cache stays in the engine between turns, quantized; during a turn it is read either
    as stored (quantized attention, batched in a QuantizedBatchCache) or through a float
    working copy made at the turn's start (``EngineConfig.attention``). One byte budget
    covers all of it, plus caches being written to disk and prefetches being staged; when
    a request needs room, the policy demotes idle agents (hot → warm when their warm copy
    is complete, hot → cold without a warm tier).
    """

    def __init__(self, model: ModelSpec = None, config: EngineConfig | None = None) -> None:
        self._spec = model
        self.config = config or EngineConfig()
        self.codec = self.config.codec or DEFAULT_CODEC
        self.budget = MemoryBudget(self.config.budget_bytes)
        self.lm: LoadedModel
        self._caches: dict[str, _Entry] = {}
        self._prefilling: deque[_Request] = deque()
        self._ready: deque[_Request] = deque()  # prefilled, waiting for a batch slot
        self._batch: list[_Request] = []
        self._batch_cache: list[Any] | None = None  # BatchKVCache or QuantizedBatchCache
        self._pinned: dict[int, int] = {}  # export id -> bytes still being written
        self._reserved: dict[str, int] = {}  # agent -> bytes of a prefetch being staged
        self._room_waiters: deque[tuple[str, int, Reply]] = deque()
        self._export_ids = 0
        self._steps = 0
        self._generated = 0
        self._max_batch_seen = 0
        self._demotions = {"warm": 0, "cold": 0}
        self._installs = 0

    # -- lifecycle --------------------------------------------------------------------
    def on_start(self) -> None:
        spec = self._spec
        self.lm = spec() if callable(spec) else load_model(spec, weights=self.config.weights)
        _settle_random_state()
        self._eos = self.lm.tokenizer.eos_token_ids
        self._quantized = self.config.quantized_attention()
        if self._quantized:
            install_attention(self.lm.model)
        # A codec that cannot store this model's heads fails here, not mid-turn.
        for role in ("key", "value"):
            self.codec.expected_parts(0, 1, self.lm.n_kv_heads, self.lm.head_dim, role=role)

    def on_stop(self) -> None:
        # MLX arrays made on this thread must die before it exits: MLX aborts the process
        # when such an array outlives its thread (seen with mlx 0.32 on CPU).
        for request in (*self._prefilling, *self._ready, *self._batch):
            request.reply.fail(EngineStopped("the engine stopped before this generation ended"))
        self._prefilling.clear()
        self._ready.clear()
        self._batch.clear()
        self._batch_cache = None
        self._caches.clear()
        self.__dict__.pop("lm", None)
        gc.collect()
        _settle_random_state()
        mx.synchronize()

    def _new_kv(self) -> AgentKV:
        return AgentKV(
            self.codec,
            self.lm.n_layers,
            self.lm.n_kv_heads,
            self.lm.head_dim,
            quantized=self._quantized,
        )

    # -- messages ---------------------------------------------------------------------
    def receive(self, message: Any) -> Any:
        match message:
            case Generate():
                self._admit(message)
                return None
            case Export(agent):
                return self._export(agent)
            case Written(agent, export_id, upto):
                self._pinned.pop(export_id, None)
                entry = self._caches.get(agent)
                if entry is not None and upto <= len(entry.kv.tokens):
                    entry.persisted = max(entry.persisted, upto)
                self._measure()
                self._grant_waiters()
                return None
            case Reserve(agent, nbytes, wait):
                return self._reserve(agent, nbytes, wait)
            case Install(agent, tokens, ranges, pin):
                return self._install(agent, tokens, ranges, pin)
            case Release(agent):
                self._reserved.pop(agent, None)
                self._measure()
                self._grant_waiters()
                return None
            case GetModelInfo():
                return ModelInfo(
                    name=self.lm.name,
                    fingerprint=self.lm.fingerprint,
                    context_length=self.lm.context_length,
                    n_layers=self.lm.n_layers,
                    n_kv_heads=self.lm.n_kv_heads,
                    head_dim=self.lm.head_dim,
                    codec=self.codec.describe(),
                ), self.lm.tokenizer
            case DropCache(agent):
                entry = self._caches.get(agent)
                if entry is not None and entry.busy:
                    raise AgentBusy(f"agent {agent!r} is generating; cancel it first")
                self._reserved.pop(agent, None)
                dropped = self._caches.pop(agent, None) is not None
                self._measure()
                return dropped
            case CacheQuery(agent):
                entry = self._caches.get(agent)
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
                self._measure()
                return EngineStats(
                    agents_cached=len(self._caches),
                    cache_bytes=self.budget.used,
                    budget_bytes=self.budget.limit,
                    peak_bytes=self.budget.peak,
                    prefilling=len(self._prefilling),
                    decoding=len(self._batch),
                    waiting=len(self._ready),
                    steps=self._steps,
                    generated_tokens=self._generated,
                    max_batch_seen=self._max_batch_seen,
                    demoted_warm=self._demotions["warm"],
                    demoted_cold=self._demotions["cold"],
                    installs=self._installs,
                )
        raise TypeError(f"the engine does not handle {type(message).__name__}")

    def _admit(self, msg: Generate) -> None:
        agent = check_agent_id(msg.agent)
        assert self.reply is not None
        if not msg.tokens:
            raise ValueError("the prompt is empty")
        vocab = self.lm.tokenizer.vocab_size
        if min(msg.tokens) < 0 or max(msg.tokens) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        limit = self.lm.context_length
        if len(msg.tokens) >= limit:
            raise ContextOverflow(
                f"prompt of {len(msg.tokens)} tokens does not fit the context of {limit} tokens"
            )
        entry = self._caches.get(agent)
        if entry is not None and entry.busy:
            raise AgentBusy(f"agent {agent!r} already has a generation in flight")
        if entry is None and msg.warm:
            raise CacheMiss(f"agent {agent!r} is not hot: stage its warm cache first")
        sampling = msg.sampling
        sampling.validate()
        if len(msg.tokens) + sampling.max_tokens > limit:
            sampling = msgspec.structs.replace(sampling, max_tokens=limit - len(msg.tokens))
        if entry is None:
            entry = self._caches[agent] = _Entry(self._new_kv())
        kv = entry.kv
        # Reuse the longest common prefix; the last prompt token is always fed again so
        # that its logits are there to sample from.
        keep = min(_common_prefix(kv.tokens, msg.tokens), len(msg.tokens) - 1)
        kv.trim(keep)
        entry.persisted = min(entry.persisted, keep)
        entry.busy = True
        entry.pinned = False
        entry.last_used = time.monotonic()
        key = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else time.time_ns() % (1 << 63)
            key = mx.random.key(seed)
        self._prefilling.append(
            _Request(
                agent=agent,
                prompt=list(msg.tokens),
                sampling=sampling,
                reply=self.reply.detach(),
                sent_at=msg.sent_at,
                entry=entry,
                todo=list(msg.tokens[keep:]),
                reused=keep,
                key=key,
                detok=self.lm.tokenizer.detokenizer(),
                reserve=turn_reserve_bytes(
                    kv.n_layers,
                    kv.n_kv_heads,
                    kv.head_dim,
                    (len(msg.tokens) - keep if kv.quantized else len(msg.tokens))
                    + sampling.max_tokens,
                    stored_bytes=kv.stored_bytes if kv.quantized else None,
                ),
            )
        )

    # -- memory -----------------------------------------------------------------------
    def _measure(self) -> int:
        used = sum(e.kv.nbytes for e in self._caches.values())
        if self._batch_cache is not None:
            used += sum(layer.nbytes for layer in self._batch_cache)
        used += sum(self._pinned.values()) + sum(self._reserved.values())
        self.budget.set_used(used)
        return used

    def _committed(self) -> int:
        """Bytes in use, counting each active turn's working copy at its reserved maximum
        (the reserve covers the batch's padding and the merge copy)."""
        used = self._measure()
        working = sum(r.entry.kv.work_bytes for r in self._prefilling if r.active)
        if self._batch_cache is not None:
            working += sum(layer.nbytes for layer in self._batch_cache)
        reserved = sum(r.reserve for r in self._active())
        return used - working + max(working, reserved)

    def _active(self) -> list[_Request]:
        return [r for r in (*self._prefilling, *self._ready, *self._batch) if r.active]

    def _candidates(self) -> list[Candidate]:
        persistent = self.config.persistent
        return [
            Candidate(agent, e.kv.nbytes, e.last_used, e.clean)
            for agent, e in self._caches.items()
            if not e.busy and not e.pinned and (e.clean or not persistent)
        ]

    def _make_room(self, need: int) -> bool:
        """Demote idle agents until ``need`` more bytes fit; False (demoting nobody) when
        even demoting every idle agent would not make enough room now."""
        limit = self.budget.limit
        if limit is None:
            return True
        missing = self._committed() + need - limit
        if missing <= 0:
            return True
        candidates = self._candidates()
        if sum(c.nbytes for c in candidates) < missing:
            return False
        persistent = self.config.persistent
        for agent in self.config.policy.victims(candidates, missing):
            entry = self._caches.pop(agent)
            self._demotions["warm" if entry.clean and persistent else "cold"] += 1
        return self._committed() + need <= limit

    def _cannot_ever_fit(self) -> bool:
        """Nothing running, pinned, staged or demotable is left to free, and still no room."""
        return not (
            self._active()
            or self._pinned
            or self._reserved
            or self._candidates()
            or any(e.pinned or (not e.busy and not e.clean) for e in self._caches.values())
        )

    def _reserve(self, agent: str, nbytes: int, wait: bool) -> str | None:
        """Room for staging ``nbytes`` of the agent's warm cache: "reserved", "hot" (nothing
        to do), "no room" (when not waiting) or "too big". With ``wait`` the answer is
        deferred until running turns have freed enough."""
        if agent in self._caches:
            return "hot"
        if agent in self._reserved:
            return "reserved"
        if self.budget.limit is not None and nbytes > self.budget.limit:
            return "too big"
        if self._make_room(nbytes):
            self._reserved[agent] = nbytes
            self._measure()
            return "reserved"
        if not wait:
            return "no room"
        assert self.reply is not None
        self._room_waiters.append((agent, nbytes, self.reply.detach()))
        return None

    def _grant_waiters(self) -> None:
        while self._room_waiters:
            agent, nbytes, reply = self._room_waiters[0]
            if reply.cancelled:
                self._room_waiters.popleft()
                continue
            if agent in self._caches:
                self._room_waiters.popleft()
                reply.resolve("hot")
                continue
            if not self._make_room(nbytes):
                return
            self._room_waiters.popleft()
            self._reserved[agent] = nbytes
            self._measure()
            reply.resolve("reserved")

    def _install(
        self,
        agent: str,
        tokens: list[int],
        ranges: list[tuple[int, int, dict[str, Any]]],
        pin: bool,
    ) -> bool:
        """Turn a staged warm cache (host arrays) into a hot one (one copy into MLX)."""
        reserved = self._reserved.pop(agent, None)
        if agent in self._caches:
            return False  # already hot: that copy is at least as new
        if reserved is None and not self._make_room(sum(_host_bytes(t) for *_, t in ranges)):
            raise BudgetExceeded(f"no room in the hot tier for agent {agent!r}")
        kv = self._new_kv()
        kv.tokens = list(tokens)
        kv.ranges = [
            StoredRange.from_numpy(start, stop, self.lm.n_layers, tensors)
            for start, stop, tensors in ranges
        ]
        if kv.stored_tokens != len(tokens):
            raise ValueError("staged ranges do not cover the staged tokens")
        mx.eval([a for r in kv.ranges for k, v in r.layers for a in (*k.values(), *v.values())])
        self._caches[agent] = _Entry(kv, time.monotonic(), persisted=len(tokens), pinned=pin)
        self._installs += 1
        self._measure()
        return True

    def _export(self, agent: str) -> Exported:
        """Host views of an idle agent's stored ranges past what is persisted, pinned in the
        budget until the matching ``Written`` arrives."""
        entry = self._caches.get(agent)
        if entry is None:
            raise UnknownAgent(f"agent {agent!r} has no hot cache to export")
        if entry.busy:
            raise AgentBusy(f"agent {agent!r} is generating")
        ranges = entry.kv.ranges_from(entry.persisted)
        self._export_ids += 1
        self._pinned[self._export_ids] = sum(r.nbytes for r in ranges)
        return Exported(
            export_id=self._export_ids,
            persisted=entry.persisted,
            tokens=list(entry.kv.tokens),
            ranges=[(r.start, r.stop, r.to_numpy()) for r in ranges],
        )

    # -- the work loop ----------------------------------------------------------------
    def on_idle(self) -> bool:
        self._drop_cancelled()
        progressed = False
        if self._prefilling:
            progressed = self._prefill_step(self._prefilling[0])
        while self._ready and len(self._batch) < self.config.max_batch:
            self._join_batch(self._ready.popleft())
        if self._batch:
            self._decode_step()
            progressed = True
        # Waiting only for memory (writes to disk to finish): sleep until a message comes.
        return progressed and bool(self._prefilling or self._ready or self._batch)

    def _drop_cancelled(self) -> None:
        for queue in (self._prefilling, self._ready):
            for request in [r for r in queue if r.reply.cancelled]:
                queue.remove(request)
                self._park(request)
        gone = [i for i, r in enumerate(self._batch) if r.reply.cancelled]
        if gone:
            self._leave_batch(gone)

    def _park(self, request: _Request) -> None:
        """The turn is over: store the new tokens quantized, drop the working copy."""
        entry = request.entry
        entry.kv.deactivate()
        entry.busy = False
        entry.last_used = time.monotonic()
        self._measure()
        self._grant_waiters()

    def _prefill_step(self, request: _Request) -> bool:
        if not request.active:
            if not self._make_room(request.reserve):
                if self._cannot_ever_fit():
                    self._prefilling.popleft()
                    self._park(request)
                    request.reply.fail(
                        BudgetExceeded(
                            f"this turn may need {request.reserve} bytes of working cache "
                            f"besides {request.entry.kv.stored_bytes} bytes of its own stored "
                            f"cache; the hot budget is {self.budget.limit} bytes"
                        )
                    )
                    return True
                return False  # wait for running turns to end or writes to finish
            request.entry.kv.activate()
            request.active = True
            request.prefill_start = time.perf_counter()
        chunk = request.todo[: self.config.prefill_chunk]
        del request.todo[: len(chunk)]
        work = request.entry.kv.activate()
        logits = self.lm.model(mx.array(chunk, dtype=mx.uint32)[None], cache=work)
        request.tokens.extend(chunk)
        if request.todo:
            mx.eval([layer.state for layer in work])
            self._measure()
            return True
        self._prefilling.popleft()
        pick = sample_rows(
            logits[:, -1, :],
            [request.sampling.temperature],
            [request.sampling.top_p],
            [request.next_key()],
        )
        token = cast(int, pick.item())
        request.prefill_end = request.first_token_at = time.perf_counter()
        if self._emit(request, token):
            self._ready.append(request)
        else:
            self._park(request)
        return True

    def _join_batch(self, request: _Request) -> None:
        kv = request.entry.kv
        assert kv.work is not None
        merged: list[Any] = (
            kv.work  # one-row QuantizedBatchCaches
            if self._quantized
            else [BatchKVCache.merge([layer]) for layer in kv.work]
        )
        kv.work = None  # the batch cache holds it now
        if self._batch_cache is None:
            self._batch_cache = merged
        else:
            for batch_layer, new in zip(self._batch_cache, merged, strict=True):
                batch_layer.extend(new)
        self._batch.append(request)
        self._max_batch_seen = max(self._max_batch_seen, len(self._batch))

    def _leave_batch(self, rows: list[int]) -> None:
        assert self._batch_cache is not None
        for i in rows:
            request = self._batch[i]
            request.entry.kv.work = [layer.extract(i) for layer in self._batch_cache]
        keep = [i for i in range(len(self._batch)) if i not in set(rows)]
        leaving = [self._batch[i] for i in rows]
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._batch_cache = None
        else:
            for layer in self._batch_cache:
                layer.filter(mx.array(keep))
        for request in leaving:
            self._park(request)

    def _decode_step(self) -> None:
        assert self._batch_cache is not None
        batch = self._batch
        inputs = mx.array([[r.generated[-1]] for r in batch], dtype=mx.uint32)
        logits = self.lm.model(inputs, cache=self._batch_cache)[:, -1, :]
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
        self._measure()
        done = []
        for i, (request, token) in enumerate(zip(batch, picks, strict=True)):
            request.tokens.append(request.generated[-1])
            if not self._emit(request, token):
                done.append(i)
        if done:
            self._leave_batch(done)

    # -- output -----------------------------------------------------------------------
    def _emit(self, request: _Request, token: int) -> bool:
        """Send one sampled token's text; finish the request if it ends here.

        Returns True while the request goes on decoding.
        """
        request.generated.append(token)
        self._generated += 1
        sampling = request.sampling
        if token in self._eos:
            return self._finish(request, "eos")
        request.held += request.detok.add(token)
        stop = next((s for s in sampling.stop if s in request.held), None)
        if stop is not None:
            request.held = request.held[: request.held.index(stop)]
            return self._finish(request, "stop")
        # Hold back a tail that could be the start of a stop string.
        hold = max(
            (k for s in sampling.stop for k in range(1, len(s)) if request.held.endswith(s[:k])),
            default=0,
        )
        out, request.held = (
            request.held[: len(request.held) - hold],
            request.held[len(request.held) - hold :],
        )
        request.text += out
        request.reply.send(Piece(out, token))
        if len(request.generated) >= sampling.max_tokens:
            return self._finish(request, "length")
        return True

    def _finish(self, request: _Request, reason: str) -> bool:
        if reason != "stop":
            request.held += request.detok.flush()
        text = request.held
        request.text += text
        if text:
            request.reply.send(Piece(text, -1))
        now = time.perf_counter()
        request.reply.send(
            Finished(
                reason=reason,
                text=request.text,
                token_ids=list(request.generated),
                cache_tokens=list(request.tokens),  # the last pick is not fed
                timings=Timings(
                    queue_s=(request.prefill_start or now) - request.sent_at,
                    prefill_s=request.prefill_end - request.prefill_start,
                    ttft_s=request.first_token_at - request.sent_at,
                    decode_s=now - request.first_token_at,
                    prompt_tokens=len(request.prompt),
                    reused_tokens=request.reused,
                    prefilled_tokens=len(request.prompt) - request.reused,
                    generated_tokens=len(request.generated),
                ),
            )
        )
        request.reply.resolve(None)
        return False


def _host_bytes(tensors: dict[str, Any]) -> int:
    return sum(int(a.nbytes) for a in tensors.values())
