"""The agent actor: one conversation, the exact tokens its cache holds, and its turns.

Each turn renders the prompt (the chat template over the history, or the caller's raw
prompt), compares its characters with the text the cache already spells and picks:

- EXACT: the same text: reuse every cached token (the engine re-feeds only the last one);
- EXTEND: the cache spells a prefix: reuse it, tokenize and prefill only the rest;
- DIVERGE: they share a shorter prefix: reuse up to the last token boundary inside it and
  trim the rest.

The boundary is verified: the cached token just before it must come out the same when the
new suffix is tokenized after it, so the tokens kept are the ones a fresh tokenization of
the new prompt would most likely produce there. Generated tokens stay in the cache, so the
next turn of a growing conversation prefills only what is new.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from ..runtime import Actor, ActorDeadError, ActorRef
from ._tokenizer import Tokenizer
from .enums import Match, Tier
from .errors import CacheMiss, ContextOverflow, StoreWriteError
from .protocol import (
    AgentMessage,
    AgentSnapshot,
    AgentState,
    Completion,
    EngineMessage,
    Export,
    Exported,
    Finished,
    Generate,
    GetState,
    Piece,
    Sampling,
    Snapshot,
    Turn,
    Written,
)
from .warm_tier import WarmTier

__all__ = ("AgentActor", "AgentEnv", "check_history", "match_prefix", "prompt_chars_limit")

log = logging.getLogger("kvactor.agent")


ROLES = frozenset({"system", "user", "assistant"})


def check_history(history: object) -> list[dict[str, str]]:
    """A conversation as a list of ``{"role": ..., "content": ...}`` (roles system, user,
    assistant; contents str), copied. Raises ValueError (TypeError for wrong types) for
    anything else, an empty list, or one whose last message is not the user's."""
    if not isinstance(history, list) or not history:
        raise ValueError("the conversation must be a non-empty list of messages")
    out = []
    for i, m in enumerate(history):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"message {i} must have exactly the keys 'role' and 'content'")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {sorted(ROLES)}, not {role!r}")
        if not isinstance(content, str):
            raise TypeError(f"message {i}: content must be a str")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "user":
        raise ValueError("the last message must be the user's")
    return out


def _common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: prompts share thousands of characters.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_prefix(
    tokenizer: Tokenizer,
    tokens: list[int],
    text: str,
    new_text: str,
    literal: Sequence[tuple[int, int]] = (),
) -> tuple[list[int], Match]:
    """The tokens for ``new_text`` that reuse as much of ``tokens`` (which spell ``text``) as
    is safe, and the kind of match. ``literal``: spans of ``new_text`` whose special-token
    text is ordinary text (see ``Tokenizer.render_chat``)."""
    if not tokens:
        return tokenizer.encode(new_text, literal=literal), Match.NEW
    common = _common_chars(text, new_text)
    if common == len(text) == len(new_text):
        return list(tokens), Match.EXACT
    kind = Match.EXTEND if common == len(text) else Match.DIVERGE
    keep = len(tokens) if kind is Match.EXTEND else _tokens_within(tokenizer, tokens, common)
    while keep > 0:
        prefix = tokenizer.decode(tokens[:keep])
        if "\ufffd" in prefix[-1:] or not new_text.startswith(prefix):
            keep -= 1  # ends inside a character, or past the shared text
            continue
        suffix = new_text[len(prefix) :]
        if not suffix:
            return list(tokens[:keep]), kind
        last = tokenizer.decode(tokens[keep - 1 : keep])
        within = _shift(literal, len(prefix) - len(last))
        if _splits_after(tokenizer, last, suffix, within):
            return list(tokens[:keep]) + tokenizer.encode(
                suffix, literal=_shift(literal, len(prefix))
            ), kind
        keep -= 1  # the suffix would merge into the last cached token: step back
    return tokenizer.encode(new_text, literal=literal), Match.DIVERGE


def _shift(spans: Sequence[tuple[int, int]], offset: int) -> list[tuple[int, int]]:
    """``spans`` of a text as spans of ``text[offset:]`` (cut at its start)."""
    return [(max(a - offset, 0), b - offset) for a, b in spans if b > offset]


def _splits_after(
    tokenizer: Tokenizer, head: str, suffix: str, literal: Sequence[tuple[int, int]] = ()
) -> bool:
    """Whether tokenizing ``head + suffix`` puts a token boundary right after ``head``: then
    the suffix does not merge into the last cached token, and tokenizing it on its own is
    what a fresh tokenization would do there. ``literal``: spans of ``head + suffix``."""
    text = head + suffix[:64]
    spans = [(a, min(b, len(text))) for a, b in literal if a < len(text)]
    ids = tokenizer.encode(text, literal=spans)
    detok = tokenizer.detokenizer()
    length = 0
    for token in ids:
        length += len(detok.add(token))
        if length >= len(head):
            return length == len(head)
    return False


def _tokens_within(tokenizer: Tokenizer, tokens: list[int], chars: int) -> int:
    """The largest k such that the text of tokens[:k] has at most ``chars`` characters."""
    detok = tokenizer.detokenizer()
    length = 0
    for k, token in enumerate(tokens):
        length += len(detok.add(token))
        if length > chars:
            return k
    return len(tokens)


def system_cut(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    tokens: list[int],
    cached: str = "",
) -> tuple[int, ...]:
    """Where the leading system message(s) of ``messages`` end in ``tokens`` (their rendered
    prompt), as ``Generate.cuts``: ``()`` when nothing follows them, when ``cached`` (the
    text the agent's cache holds) holds them already, or when their tokens are not a
    prefix of ``tokens``. A system prompt so stored on its own is shared by every agent
    that starts with it, and computed alike by those that share it and those that do not."""
    k = 0
    while k < len(messages) and messages[k].get("role") == "system":
        k += 1
    if k == 0 or k == len(messages):
        return ()
    head, literal = tokenizer.render_chat(messages[:k], add_generation_prompt=False)
    if cached.startswith(head):
        return ()
    ids = tokenizer.encode(head, literal=literal)
    return (len(ids),) if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids else ()


#: Tries of one turn: a warm cache staged for it may be demoted again while it waits.
_ATTEMPTS = 64


class _Prompt(msgspec.Struct, frozen=True):
    """A turn's prompt as the engine gets it: the conversation it answers, its tokens (the
    cached ones it reuses first), how they matched the cache, and where its system prompt
    ends (``Generate.cuts``)."""

    messages: list[dict[str, str]]
    tokens: list[int]
    match: Match
    cuts: tuple[int, ...]


@dataclass(frozen=True)
class AgentEnv:
    """What every agent actor of a session shares: the engine, the tokenizer, the warm
    tier (None: none), and the longest prompt, in characters, that could fit the model's
    context (``prompt_chars_limit``): one past it is refused before it is tokenized."""

    engine: ActorRef[EngineMessage]
    tokenizer: Tokenizer
    warm: WarmTier | None
    max_prompt_chars: int


def prompt_chars_limit(tokenizer: Tokenizer, context_length: int) -> int:
    """Characters past which no prompt fits ``context_length`` tokens: no token spells
    more characters than the longest one in the vocabulary."""
    longest = max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))
    return context_length * max(longest, 1)


@dataclass
class _Outcome:
    """What running a turn on the engine came to: its Finished record, the tier its cache
    came from, and the seconds spent loading it from disk."""

    finished: Finished | None = None
    path: Tier = Tier.HOT
    load_s: float = 0.0


class AgentActor(Actor):
    """Keeps an agent's conversation and the exact tokens its engine cache holds.

    With a warm tier, the new tokens of every turn are written to disk at its end, before
    its Completion (which says whether that worked); a new process restores the
    conversation from there, and the first turn stages the warm cache into the engine
    instead of re-prefilling. Turns of one agent run one at a time, in order.
    """

    def __init__(
        self,
        agent_id: str,
        env: AgentEnv,
        system: str | None,
        start: AgentSnapshot | None = None,
        context: str | None = None,
        scope: str = "",
    ) -> None:
        self.agent_id = agent_id
        self.scope = scope  # whose cached prefixes it may share (Generate.scope)
        self.context = context  # the shared context its system prompt is, if any
        self.engine = env.engine
        self.tokenizer = env.tokenizer
        self.warm = env.warm
        self._max_chars = env.max_prompt_chars
        self.system = system
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.tokens: list[int] = []  # what the engine's cache holds for this agent
        self.text = ""  # the text those tokens spell
        self.persisted = 0  # tokens safe in the warm tier
        self.restored = False
        self.turns = 0
        if start is not None:  # a fork without a warm tier: its source's state, as it was
            self._take(start)

    def _take(self, state: AgentSnapshot) -> None:
        self.tokens, self.text = list(state.tokens), state.text
        self.messages = [dict(m) for m in state.messages]

    async def on_start(self) -> None:
        if self.warm is None or self.tokens:
            return
        saved = await self.warm.restore(self.agent_id)
        if saved is None:
            return
        if self.system and saved.messages[:1] != [{"role": "system", "content": self.system}]:
            log.warning("agent %r: system prompt changed; not resuming its warm cache", self.name)
            return
        self._take(saved)
        self.persisted = len(saved.tokens)
        self.restored = True

    async def receive(self, message: AgentMessage) -> Any:
        match message:
            case Turn(text, sampling, raw, history) if history is not None:
                return self._turn(text, sampling, raw, check_history(history))
            case Turn(text, sampling, prime=True):
                return self._turn(text, sampling, False, prime=True)
            case Turn(text, sampling, raw):
                if not text.strip():
                    raise ValueError("the prompt is empty")
                return self._turn(text, sampling, raw)
            case Snapshot():
                return AgentSnapshot(list(self.tokens), self.text, [dict(m) for m in self.messages])
            case GetState():
                return AgentState(
                    agent=self.agent_id,
                    messages=[dict(m) for m in self.messages],
                    tokens=len(self.tokens),
                    persisted=self.persisted,
                    restored=self.restored,
                    turns=self.turns,
                )
        raise TypeError(f"an agent does not handle {type(message).__name__}")

    def _check_length(self, text: str, raw: bool, history: list[dict[str, str]] | None) -> None:
        """Raises ContextOverflow for a turn whose text alone could not fit the context (at
        once, before the prompt is rendered or tokenized)."""
        messages = [] if raw else history if history is not None else self.messages
        chars = len(text) + sum(len(m["content"]) for m in messages)
        if chars > self._max_chars:
            raise ContextOverflow(
                f"the prompt has {chars} characters: more than any prompt that fits the "
                f"model's context can have ({self._max_chars})"
            )

    def _prompt(
        self, text: str, raw: bool, history: list[dict[str, str]] | None, prime: bool
    ) -> _Prompt:
        """Render the turn's prompt and match it against what the cache holds (on a worker
        thread: a long prompt takes a while, and the event loop serves others meanwhile)."""
        literal: Sequence[tuple[int, int]] = ()
        render = self.tokenizer.render_chat
        if prime:  # the conversation as it is: a shared context's system prompt
            messages = self.messages
            prompt, literal = render(messages, add_generation_prompt=False)
        elif history is not None:  # the caller's conversation replaces ours
            messages = history
            prompt, literal = render(messages, add_generation_prompt=True)
        elif raw:  # the caller's text as it is, special tokens included (an explicit opt-in)
            messages = self.messages
            prompt = text
        else:
            messages = [*self.messages, {"role": "user", "content": text}]
            # Special tokens come from the template only: markers in contents stay text.
            prompt, literal = render(messages, add_generation_prompt=True)
        tokens, match = match_prefix(self.tokenizer, self.tokens, self.text, prompt, literal)
        cuts = () if raw else system_cut(self.tokenizer, messages, tokens, self.text)
        return _Prompt(messages, tokens, match, cuts)

    async def _turn(
        self,
        text: str,
        sampling: Sampling,
        raw: bool,
        history: list[dict[str, str]] | None = None,
        *,
        prime: bool = False,
    ) -> AsyncIterator[str | Completion]:
        if self.context is not None and not self.tokens and self.warm is not None:
            # Its shared context hot, if it fits: the engine shares what is hot.
            with contextlib.suppress(Exception):
                await self.warm.hot(self.context)
        if prime:
            sampling = msgspec.structs.replace(sampling, max_tokens=1)
        self._check_length(text, raw, history)
        prompt = await anyio.to_thread.run_sync(self._prompt, text, raw, history, prime)
        write_ran = False  # this turn's write ran (or there is no warm tier)
        outcome = _Outcome()
        try:
            async for piece in self._generate(prompt, sampling, outcome):
                yield piece
            saving = time.perf_counter()  # the last token is out: what follows is the save
            finished = outcome.finished
            assert finished is not None
            if not raw and not prime:
                self.messages = [*prompt.messages, {"role": "assistant", "content": finished.text}]
            self.tokens = finished.cache_tokens
            self.text = self.tokenizer.decode(self.tokens)
            self.turns += 1
            # The new tokens are made durable before the caller hears the turn is done,
            # so that the answer can say whether they were. Once started, the write
            # finishes even if the caller leaves: the engine pins the exported bytes
            # until it hears the end.
            error = None
            if self.warm is not None:
                with anyio.CancelScope(shield=True):
                    error = await self._persist()
            save_s = time.perf_counter() - saving
            write_ran = True
        finally:
            if not write_ran and self.warm is not None:
                # Left before its write (cancelled, failed): if the engine finished the
                # turn, it expects a write that will not come. Tell it so.
                with anyio.CancelScope(shield=True), contextlib.suppress(ActorDeadError):
                    await self.engine.tell(Written(self.agent_id, 0, 0))
        yield Completion(
            text=finished.text,
            finish_reason=finished.reason,
            token_ids=finished.token_ids,
            timings=msgspec.structs.replace(finished.timings, load_s=outcome.load_s, save_s=save_s),
            path=outcome.path,
            match=prompt.match,
            saved=self.warm is not None and error is None,
            save_error=error,
        )

    async def _generate(
        self, prompt: _Prompt, sampling: Sampling, outcome: _Outcome
    ) -> AsyncIterator[str]:
        """Run the turn on the engine, its text pieces as they come; ``outcome`` gets the
        Finished record, the tier the cache came from and the seconds spent loading it.

        A cache demoted while its turn waited (for room, behind other turns) is staged
        again and the turn sent again: it keeps its place in the queue. The last attempt
        takes whatever is hot (a re-prefill): a bound, never reached in practice, so that
        the loop always ends."""
        started = time.perf_counter()  # a reload on the way counts in the turn's TTFT
        for attempt in range(_ATTEMPTS):
            warm = self.persisted > 0 and attempt < _ATTEMPTS - 1
            request = Generate(
                self.agent_id,
                prompt.tokens,
                sampling,
                started,
                warm=warm,
                cuts=prompt.cuts,
                scope=self.scope,
            )
            try:
                async with self.engine.stream(request) as items:
                    async for item in items:
                        if isinstance(item, Piece):
                            if item.text:
                                yield item.text
                        elif isinstance(item, Finished):
                            outcome.finished = item
                break
            except CacheMiss:
                if self.warm is None:
                    raise
                outcome.path = Tier.WARM
                staging = time.perf_counter()
                staged = await self.warm.stage(self.agent_id)
                outcome.load_s += time.perf_counter() - staging
                if not staged:
                    self.persisted = 0  # unreadable or refused: start cold
                    outcome.path = Tier.COLD
        if outcome.finished is None:
            raise RuntimeError("the engine ended a generation without saying why")
        if outcome.finished.timings.reused_tokens == 0:
            outcome.path = Tier.COLD

    async def _persist(self) -> str | None:
        """Append what the warm tier lacks of this agent's cache; returns why that failed
        (None: saved). ``persisted`` stays what is really on disk, so after a failure the
        next write starts there again and repairs the warm copy."""
        assert self.warm is not None
        try:
            exported: Exported = await self.engine.ask(Export(self.agent_id))
        except Exception as exc:
            return self._save_failed(exc)
        error = None
        try:
            await self._write(self.warm, exported)
        except Exception as exc:
            error = self._save_failed(exc)
        finally:
            upto = self.persisted
            written = Written(self.agent_id, exported.export_id, upto, failed=error is not None)
            await self.engine.tell(written)
        return error

    async def _write(self, warm: WarmTier, exported: Exported) -> None:
        """Write ``exported``, linking its shared prefix where it has one; ``persisted``
        follows what is on disk after each step (a write that fails midway keeps it)."""
        upto = self.persisted = exported.persisted
        if exported.shared_upto and upto == 0:
            # Its first tokens are another agent's segments: link them, write the rest.
            shared = exported.tokens[: exported.shared_upto]
            if await warm.share(
                self.agent_id,
                exported.shared_from,
                tokens=shared,
                text=self.tokenizer.decode(shared),
                messages=self.messages,
            ):
                upto = self.persisted = exported.shared_upto
        for start, stop, tensors in exported.ranges:
            if stop <= upto:
                continue  # linked
            await warm.append(
                self.agent_id,
                start,
                tensors,
                tokens=exported.tokens[:stop],
                text=self.tokenizer.decode(exported.tokens[:stop]),
                messages=self.messages,
            )
            upto = self.persisted = stop

    def _save_failed(self, exc: Exception) -> str:
        # The caller hears of it (Completion.save_error); a traceback only for the unexpected.
        unexpected = not isinstance(exc, StoreWriteError)
        log.warning("agent %r: warm cache not written: %s", self.agent_id, exc, exc_info=unexpected)
        return f"{type(exc).__name__}: {exc}"
