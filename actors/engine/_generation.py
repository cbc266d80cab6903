"""One generation in the engine: its prompt, sampling state, and the text it sends back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ...runtime import Reply
from ..enums import FinishReason
from ..hot import HotEntry
from ..options import Sampling
from ..records import Finished, Piece, Timings
from ..tools import RowGrammar

__all__ = ("Generation",)


@dataclass
class Generation:
    """A ``Generate`` request from admission to its ``Finished``: the tokens still to
    prefill, the random key, and the text held back while it could become a stop string."""

    agent: str
    prompt: list[int]
    sampling: Sampling
    reply: Reply
    sent_at: float
    entry: HotEntry
    todo: list[int]  # prompt tokens not prefilled yet
    reused: int  # prompt tokens found in the cache
    key: mx.array | None
    detok: Any
    eos: frozenset[int]
    reserve: int  # bytes its working cache may grow to (checked against the budget)
    warm: bool = False  # the agent has a warm copy: a cache demoted meanwhile is staged again
    held: str = ""
    text: str = ""
    generated: list[int] = field(default_factory=list)
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    dequantize_s: float = 0.0  # making its working copy (0 from a ready copy)
    # Its cache streaming in as its first forward runs (AgentKV.landing), until settled;
    # then the read's seconds and how long the forward waited for bytes.
    landing: Any = None
    stream_s: float = 0.0
    stream_wait_s: float = 0.0
    # Its float copy filled beside its first forward (kernels.beside): the filling's
    # seconds, and how long that forward waited for it.
    copy_s: float = 0.0
    copy_wait_s: float = 0.0
    shared: int = 0  # prompt tokens reused from another agent's stored ranges
    cuts: tuple[int, ...] = ()  # where the prefill stores a range (Generate.cuts)
    answers: tuple[int, ...] = ()  # where decoded answers began (Generate.answers)
    grammar: RowGrammar | None = None  # its constraint's state (Generate.constraint)
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times (penalties)
    finished: bool = False  # its Finished was sent
    ending: bool = False  # the session ends its turns: this one ends at its next token

    @property
    def tokens(self) -> list[int]:
        """What the agent's cache holds (grows as the prompt and picks are fed)."""
        return self.entry.kv.tokens

    @property
    def active(self) -> bool:
        """Its working cache exists (room was granted)."""
        return self.entry.running

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    def emit(self, token: int) -> bool:
        """Send one sampled token's text; finish if the generation ends here. Returns True
        while it goes on decoding."""
        self.generated.append(token)
        if self.sampling.penalized:
            self.counts[token] = self.counts.get(token, 0) + 1
        if token in self.eos:
            return self.finish(FinishReason.EOS)
        grammar = self.grammar
        if grammar is not None and not grammar.consume(token):
            # Never for a token sampled under its mask; a guard, not a path.
            return self.finish(FinishReason.STOP)
        self.held += self.detok.add(token)
        stops = self.sampling.stop
        stop = next((s for s in stops if s in self.held), None)
        if stop is not None:
            self.held = self.held[: self.held.index(stop)]
            return self.finish(FinishReason.STOP)
        # Hold back a tail that could be the start of a stop string.
        hold = max(
            (k for s in stops for k in range(1, len(s)) if self.held.endswith(s[:k])),
            default=0,
        )
        cut = len(self.held) - hold
        out, self.held = self.held[:cut], self.held[cut:]
        self.text += out
        self.reply.send(Piece(out, token))
        if grammar is not None and grammar.done:
            return self.finish(FinishReason.STOP)  # the grammar is complete
        if len(self.generated) >= self.sampling.max_tokens:
            return self.finish(FinishReason.LENGTH)
        if self.ending:
            return self.finish(FinishReason.ENDED)
        return True

    def finish(self, reason: FinishReason) -> bool:
        """Send the held text and the ``Finished`` record, resolve the reply; returns False."""
        self.finished = True
        if reason is not FinishReason.STOP:
            self.held += self.detok.flush()
        rest = self.held
        self.text += rest
        if rest:
            self.reply.send(Piece(rest, -1))
        now = time.perf_counter()
        self.reply.send(
            Finished(
                reason=reason,
                text=self.text,
                token_ids=list(self.generated),
                cache_tokens=list(self.tokens),  # the last pick is not fed
                timings=Timings(
                    queue_s=(self.prefill_start or now) - self.sent_at,
                    prefill_s=self.prefill_end - self.prefill_start,
                    ttft_s=self.prefill_end - self.sent_at,
                    decode_s=now - self.prefill_end,
                    prompt_tokens=len(self.prompt),
                    reused_tokens=self.reused,
                    prefilled_tokens=len(self.prompt) - self.reused,
                    generated_tokens=len(self.generated),
                    dequantize_s=self.dequantize_s,
                    stream_s=self.stream_s,
                    stream_wait_s=self.stream_wait_s,
                    copy_s=self.copy_s,
                    copy_wait_s=self.copy_wait_s,
                    shared_tokens=self.shared,
                ),
            )
        )
        self.reply.resolve(None)
        return False
