"""The engine actor: the only owner of MLX. Chunked prefill, continuous batched decode."""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..kernels.sampling import sample_rows
from ..runtime import Reply, ThreadActor
from .errors import AgentBusy, ContextOverflow, EngineStopped, UnknownAgent
from .model import LoadedModel, load_model
from .protocol import (
    CacheInfo,
    CacheQuery,
    DropCache,
    EngineStats,
    Finished,
    Generate,
    GetModelInfo,
    ModelInfo,
    Piece,
    Sampling,
    StatsQuery,
    Timings,
    check_agent_id,
)

__all__ = ("EngineActor", "EngineConfig")

ModelSpec = str | os.PathLike[str] | None | Callable[[], LoadedModel]


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch``: agents decoding in one forward. ``prefill_chunk``: prompt tokens per
    prefill step; decode steps of other agents run between chunks."""

    max_batch: int = 8
    prefill_chunk: int = 256
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")


@dataclass
class _Cached:
    """An agent's KV cache while it is not decoding: per-layer caches and the tokens in them."""

    layers: list[KVCache]
    tokens: list[int]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


@dataclass
class _Request:
    agent: str
    prompt: list[int]
    sampling: Sampling
    reply: Reply
    sent_at: float
    received_at: float
    cache: _Cached
    todo: list[int]
    reused: int
    key: mx.array | None
    detok: Any
    held: str = ""  # text held back while it could still become a stop string
    text: str = ""
    generated: list[int] = field(default_factory=list)
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    first_token_at: float = 0.0

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


class EngineActor(ThreadActor):
    """Owns the model and every MLX array, on its own OS thread.

    ``Generate`` requests are queued; ``on_idle`` alternates one prefill chunk of the oldest
    prefilling request with one batched decode step of every decoding agent, so long prompts
    never starve decodes and new agents join the batch while others decode. Each agent's
    cache stays in the engine between turns.
    """

    def __init__(self, model: ModelSpec = None, config: EngineConfig | None = None) -> None:
        self._spec = model
        self.config = config or EngineConfig()
        self.lm: LoadedModel
        self._caches: dict[str, _Cached] = {}
        self._prefilling: deque[_Request] = deque()
        self._ready: deque[_Request] = deque()  # prefilled, waiting for a batch slot
        self._batch: list[_Request] = []
        self._batch_cache: list[BatchKVCache] | None = None
        self._steps = 0
        self._generated = 0
        self._max_batch_seen = 0

    # -- lifecycle --------------------------------------------------------------------
    def on_start(self) -> None:
        spec = self._spec
        self.lm = spec() if callable(spec) else load_model(spec, weights=self.config.weights)
        _settle_random_state()
        self._eos = self.lm.tokenizer.eos_token_ids

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

    # -- messages ---------------------------------------------------------------------
    def receive(self, message: Any) -> Any:
        match message:
            case Generate():
                self._admit(message)
                return None
            case GetModelInfo():
                return ModelInfo(
                    name=self.lm.name,
                    fingerprint=self.lm.fingerprint,
                    context_length=self.lm.context_length,
                    n_layers=self.lm.n_layers,
                ), self.lm.tokenizer
            case DropCache(agent):
                if self._is_busy(agent):
                    raise AgentBusy(f"agent {agent!r} is generating; cancel it first")
                return self._caches.pop(agent, None) is not None
            case CacheQuery(agent):
                cached = self._caches.get(agent)
                if cached is None and not self._is_busy(agent):
                    raise UnknownAgent(f"no cache for agent {agent!r}")
                return CacheInfo(
                    agent=agent,
                    tokens=len(cached.tokens) if cached else 0,
                    nbytes=cached.nbytes if cached else 0,
                    busy=self._is_busy(agent),
                )
            case StatsQuery():
                return EngineStats(
                    agents_cached=len(self._caches),
                    cache_bytes=sum(c.nbytes for c in self._caches.values()),
                    prefilling=len(self._prefilling),
                    decoding=len(self._batch),
                    waiting=len(self._ready),
                    steps=self._steps,
                    generated_tokens=self._generated,
                    max_batch_seen=self._max_batch_seen,
                )
        raise TypeError(f"the engine does not handle {type(message).__name__}")

    def _is_busy(self, agent: str) -> bool:
        return any(r.agent == agent for r in (*self._prefilling, *self._ready, *self._batch))

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
        if self._is_busy(agent):
            raise AgentBusy(f"agent {agent!r} already has a generation in flight")
        sampling = msg.sampling
        sampling.validate()
        if len(msg.tokens) + sampling.max_tokens > limit:
            sampling = Sampling(
                max_tokens=limit - len(msg.tokens),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed,
                stop=sampling.stop,
            )
        cache = self._caches.pop(agent, None) or _Cached(self.lm.make_cache(), [])
        # Reuse the longest common prefix; the last prompt token is always fed again so
        # that its logits are there to sample from.
        keep = min(_common_prefix(cache.tokens, msg.tokens), len(msg.tokens) - 1)
        if keep < len(cache.tokens):
            for layer in cache.layers:
                layer.trim(len(cache.tokens) - keep)
            del cache.tokens[keep:]
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
                received_at=time.perf_counter(),
                cache=cache,
                todo=list(msg.tokens[keep:]),
                reused=keep,
                key=key,
                detok=self.lm.tokenizer.detokenizer(),
            )
        )

    # -- the work loop ----------------------------------------------------------------
    def on_idle(self) -> bool:
        self._drop_cancelled()
        if self._prefilling:
            self._prefill_step(self._prefilling[0])
        while self._ready and len(self._batch) < self.config.max_batch:
            self._join_batch(self._ready.popleft())
        if self._batch:
            self._decode_step()
        return bool(self._prefilling or self._ready or self._batch)

    def _drop_cancelled(self) -> None:
        for queue in (self._prefilling, self._ready):
            for request in [r for r in queue if r.reply.cancelled]:
                queue.remove(request)
                self._park(request)
        gone = [i for i, r in enumerate(self._batch) if r.reply.cancelled]
        if gone:
            self._leave_batch(gone)

    def _park(self, request: _Request) -> None:
        """Keep what the request's cache holds for the agent's next turn."""
        self._caches[request.agent] = request.cache

    def _prefill_step(self, request: _Request) -> None:
        if not request.prefill_start:
            request.prefill_start = time.perf_counter()
        chunk = request.todo[: self.config.prefill_chunk]
        del request.todo[: len(chunk)]
        logits = self.lm.model(mx.array(chunk, dtype=mx.uint32)[None], cache=request.cache.layers)
        request.cache.tokens.extend(chunk)
        if request.todo:
            mx.eval([layer.state[:2] for layer in request.cache.layers])
            return
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

    def _join_batch(self, request: _Request) -> None:
        merged = [BatchKVCache.merge([layer]) for layer in request.cache.layers]
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
            request.cache.layers = [layer.extract(i) for layer in self._batch_cache]
            self._park(request)
        keep = [i for i in range(len(self._batch)) if i not in set(rows)]
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._batch_cache = None
            return
        for layer in self._batch_cache:
            layer.filter(mx.array(keep))

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
        done = []
        for i, (request, token) in enumerate(zip(batch, picks, strict=True)):
            request.cache.tokens.append(request.generated[-1])
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
                cached_tokens=len(request.cache.tokens),  # the last pick is not fed
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
