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

from ...runtime import Actor, ActorDeadError, ActorRef
from ..enums import FinishReason, Match, Tier
from ..errors import CacheMiss, ContextOverflow, StoreWriteError, UnknownAgent
from ..messages import (
    AgentMessage,
    EngineMessage,
    Export,
    Flush,
    Generate,
    GetState,
    Snapshot,
    ToolWait,
    Turn,
    WriteBack,
    Written,
)
from ..models import Tokenizer
from ..options import Constraint, Sampling
from ..records import (
    AgentSnapshot,
    AgentState,
    Completion,
    Exported,
    Finished,
    Piece,
    ToolCall,
    ToolCallDelta,
    ToolRequest,
)
from ..tools import ToolFormat, ToolStream, detect_format, render_with_tools
from ..warm import WarmTier
from ._conversation import check_history
from ._prefix_match import match_prefix, system_cut

__all__ = ("AgentActor", "AgentEnv", "check_history", "match_prefix", "prompt_chars_limit")

log = logging.getLogger("kvactor.agent")


#: Tries of one turn: a warm cache staged for it may be demoted again while it waits.
_ATTEMPTS = 64


class _Prompt(msgspec.Struct, frozen=True):
    """A turn's prompt as the engine gets it: the conversation it answers, its tokens (the
    cached ones it reuses first), how they matched the cache, and where its system prompt
    ends (``Generate.cuts``)."""

    messages: list[dict[str, Any]]
    tokens: list[int]
    match: Match
    cuts: tuple[int, ...]
    constraint: Constraint | None = None
    answers: tuple[int, ...] = ()


@dataclass(frozen=True)
class AgentEnv:
    """What every agent actor of a session shares: the engine, the tokenizer, the warm
    tier (None: none), and the longest prompt, in characters, that could fit the model's
    context (``prompt_chars_limit``): one past it is refused before it is tokenized."""

    engine: ActorRef[EngineMessage]
    tokenizer: Tokenizer
    warm: WarmTier | None
    max_prompt_chars: int
    tool_format: ToolFormat | None = None  # None: read from the tokenizer's chat template
    # Under a write budget: a turn's end notes the conversation only; the engine sends the
    # cache to be written as it leaves the hot tier (WriteBack), and stopping writes it.
    write_back: bool = False


def _finish(reason: FinishReason, calls: list[ToolCall], reader: ToolStream | None) -> FinishReason:
    """TOOL_CALLS when the turn ended in whole calls; LENGTH when the token limit cut one
    off (the whole ones before it are still given), as OpenAI reports it; ENDED always."""
    cut_off = reader is not None and reader.cut_off and reason == FinishReason.LENGTH
    if cut_off or reason == FinishReason.ENDED:
        return reason
    return FinishReason.TOOL_CALLS if calls else reason


def _assistant(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant message of a turn, its tool calls as a template renders them."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


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

    Under a write budget (``AgentEnv.write_back``) a turn's end commits only the
    conversation and its token ids (the manifest); the cache is written when the engine
    sends it out (``WriteBack``: it left the hot tier, or was told done), on ``Flush``, and
    when the actor stops, if the budget has room. A crash loses the cache of the turns
    since its last write, never their text: the next turn prefills them again.
    """

    def __init__(
        self,
        agent_id: str,
        env: AgentEnv,
        system: str | None,
        start: AgentSnapshot | None = None,
        context: str | None = None,
        scope: str = "",
        tool_wait_s: float | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.scope = scope  # whose cached prefixes it may share (Generate.scope)
        self.context = context  # the shared context its system prompt is, if any
        self.engine = env.engine
        self.tokenizer = env.tokenizer
        self.warm = env.warm
        self.write_back = env.write_back and env.warm is not None
        self._max_chars = env.max_prompt_chars
        self.tool_format = env.tool_format or detect_format(env.tokenizer)
        self.tool_wait_s = tool_wait_s  # how long a tool wait keeps the cache hot (None: engine's)
        self.system = system
        self.messages: list[dict[str, Any]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.tokens: list[int] = []  # what the engine's cache holds for this agent
        # Where that cache's stored ranges end: a re-prefill cut there (after the cache
        # was dropped) rebuilds the ranges as they were, and answers as the cache would.
        self.bounds: list[int] = []
        # Where its answers began, each decoded one token a step up to the next bound: a
        # re-prefill feeds them so (Generate.answers).
        self.answers: list[int] = []
        self.text = ""  # the text those tokens spell
        self.persisted = 0  # tokens safe in the warm tier
        self.restored = False
        self.turns = 0
        self._write_s = 0.0  # the last turn's write to the warm tier (Timings.write_s)
        if start is not None:  # a fork without a warm tier: its source's state, as it was
            self._take(start)

    def _take(self, state: AgentSnapshot) -> None:
        self.tokens, self.text = list(state.tokens), state.text
        self.messages = [dict(m) for m in state.messages]
        self.bounds = [b for b in state.bounds if 0 < b <= len(self.tokens)]
        self.answers = [a for a in state.answers if 0 < a < len(self.tokens)]

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
        # A cold cache's tokens are known but not on disk: its next turn prefills them.
        self.persisted = len(saved.tokens) if saved.on_disk is None else saved.on_disk
        self.restored = True

    async def on_stop(self) -> None:
        """Under a write budget: write what the warm tier lacks of its cache, if the budget
        has room (a session closing, an agent released)."""
        if self.write_back and self.persisted < len(self.tokens):
            with anyio.CancelScope(shield=True), contextlib.suppress(ActorDeadError):
                await self._persist(admit=True, leaving=True)

    async def receive(self, message: AgentMessage) -> Any:
        match message:
            case WriteBack(exported):
                return await self._write_back(exported)
            case Flush():
                if self.write_back and self.persisted < len(self.tokens):
                    with anyio.CancelScope(shield=True):
                        await self._persist()
                return None
            case Turn(text, sampling, raw, history, tools=tools) if history is not None:
                return self._turn(text, sampling, raw, check_history(history), tools=tools)
            case Turn(text, sampling, prime=True):
                return self._turn(text, sampling, False, prime=True)
            case Turn(text, sampling, raw, tools=tools):
                if not text.strip():
                    raise ValueError("the prompt is empty")
                if raw and tools is not None:
                    raise ValueError("a raw prompt takes no tools (use chat)")
                return self._turn(text, sampling, raw, tools=tools)
            case Snapshot():
                return AgentSnapshot(
                    list(self.tokens),
                    self.text,
                    [dict(m) for m in self.messages],
                    list(self.bounds),
                    answers=list(self.answers),
                )
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

    def _check_length(self, text: str, raw: bool, history: list[dict[str, Any]] | None) -> None:
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
        self,
        text: str,
        raw: bool,
        history: list[dict[str, Any]] | None,
        prime: bool,
        tools: ToolRequest | None = None,
    ) -> _Prompt:
        """Render the turn's prompt and match it against what the cache holds (on a worker
        thread: a long prompt takes a while, and the event loop serves others meanwhile)."""
        literal: Sequence[tuple[int, int]] = ()
        fmt = self.tool_format
        offered = tools.tools if tools is not None else []

        def render(
            messages: list[dict[str, Any]], add_generation_prompt: bool
        ) -> tuple[str, tuple[tuple[int, int], ...]]:
            # Tools, or a conversation with tool messages, in the model's own format.
            if offered or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
                return render_with_tools(
                    self.tokenizer, fmt, messages, offered, add_generation_prompt
                )
            return self.tokenizer.render_chat(messages, add_generation_prompt)

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
        shown = (
            messages
            if raw or fmt.native or not offered
            else fmt.generic_messages(messages, offered)
        )
        cuts = (
            ()
            if raw or (offered and fmt.native)
            else system_cut(self.tokenizer, shown, tokens, self.text)
        )
        constraint = fmt.constraint(tools) if tools is not None else None
        return _Prompt(messages, tokens, match, cuts, constraint)

    async def _turn(
        self,
        text: str,
        sampling: Sampling,
        raw: bool,
        history: list[dict[str, Any]] | None = None,
        *,
        prime: bool = False,
        tools: ToolRequest | None = None,
    ) -> AsyncIterator[str | ToolCallDelta | Completion]:
        if self.context is not None and not self.tokens and self.warm is not None:
            # Its shared context hot, if it fits: the engine shares what is hot.
            with contextlib.suppress(Exception):
                await self.warm.hot(self.context)
        if prime:
            sampling = msgspec.structs.replace(sampling, max_tokens=1)
        self._check_length(text, raw, history)
        rendering = time.perf_counter()
        prompt = await anyio.to_thread.run_sync(self._prompt, text, raw, history, prime, tools)
        prompt = self._cut(prompt)
        prompt_s = time.perf_counter() - rendering
        # Tool calls are read out of the text (never left in it) when tools are offered.
        reader = ToolStream(self.tool_format) if tools is not None and tools.tools else None
        write_ran = False  # this turn's write ran (or there is no warm tier)
        outcome = _Outcome()
        try:
            async for piece in self._generate(prompt, sampling, outcome):
                for event in reader.feed(piece) if reader is not None else (piece,):
                    yield event
            for event in reader.close() if reader is not None else ():
                yield event
            saving = time.perf_counter()  # the last token is out: what follows is the save
            finished = outcome.finished
            assert finished is not None
            content, calls = finished.text, []
            if reader is not None:
                content = reader.content
                if tools is not None and tools.choice != "none":
                    calls = reader.calls
                if calls:
                    content = content.strip()
            if not raw and not prime:
                self.messages = [*prompt.messages, _assistant(content, calls)]
            self.tokens = finished.cache_tokens
            self.text = self.tokenizer.decode(self.tokens)
            reused = finished.timings.reused_tokens
            self.bounds = sorted(
                {b for b in self.bounds if b < reused}
                | ({reused} if reused else set())
                | {c for c in prompt.cuts if reused < c < len(self.tokens)}
                | {len(self.tokens)}
            )
            # Its answer's tokens were decoded one a step after the prompt's.
            decoded = len(self.tokens) > len(prompt.tokens)
            self.answers = [*prompt.answers, *([len(prompt.tokens)] if decoded else [])]
            self.turns += 1
            # The new tokens are made durable before the caller hears the turn is done,
            # so that the answer can say whether they were. Once started, the write
            # finishes even if the caller leaves: the engine pins the exported bytes
            # until it hears the end.
            error = None
            self._write_s = 0.0
            if self.warm is not None:
                with anyio.CancelScope(shield=True):
                    error = await (self._note() if self.write_back else self._persist())
            save_s = time.perf_counter() - saving
            write_ran = True
        finally:
            if not write_ran and self.warm is not None:
                # Left before its write (cancelled, failed): if the engine finished the
                # turn, it expects a write that will not come. Tell it so.
                with anyio.CancelScope(shield=True), contextlib.suppress(ActorDeadError):
                    await self.engine.tell(Written(self.agent_id, 0, 0))
        if calls:
            # The next turn brings the results: keep this cache hot meanwhile.
            with contextlib.suppress(ActorDeadError):
                await self.engine.tell(ToolWait(self.agent_id, self.tool_wait_s))
        yield Completion(
            text=content,
            finish_reason=_finish(finished.reason, calls, reader),
            token_ids=finished.token_ids,
            timings=msgspec.structs.replace(
                finished.timings,
                load_s=outcome.load_s,
                save_s=save_s,
                write_s=self._write_s,
                prompt_s=prompt_s,
            ),
            path=outcome.path,
            match=prompt.match,
            saved=self.warm is not None and error is None and not self.write_back,
            save_error=error,
            tool_calls=calls,
        )

    def _cut(self, prompt: _Prompt) -> _Prompt:
        """``prompt`` with its cuts and answers (``Generate``) within the part of it this
        agent's cache holds.

        Cuts: the prompt's own, and the ends of the stored ranges: a cache that is still
        there reuses past them (they change nothing); one that was dropped is prefilled
        again range by range, each from the stored form of the ones before, as the cache
        was made. A prompt that leaves the cache inside a stored range is cut where it
        leaves, as a kept cache is (that range's stored form up to there, the rest
        prefilled anew). Answers: where the answers in those ranges began, so that the
        re-prefill feeds them as they were decoded."""
        held = 0
        for a, b in zip(self.tokens, prompt.tokens, strict=False):
            if a != b:
                break
            held += 1
        known = {b for b in self.bounds if b <= held and b < len(prompt.tokens)}
        if 0 < held < len(prompt.tokens) and any(b > held for b in self.bounds):
            known.add(held)
        cuts = tuple(sorted(known.union(prompt.cuts)))
        answers = tuple(a for a in self.answers if any(a < c <= held for c in cuts))
        return msgspec.structs.replace(prompt, cuts=cuts, answers=answers)

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
                answers=prompt.answers,
                scope=self.scope,
                constraint=prompt.constraint,
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

    async def _persist(self, *, admit: bool = False, leaving: bool = False) -> str | None:
        """Append what the warm tier lacks of this agent's cache; returns why that failed
        (None: saved). ``persisted`` stays what is really on disk, so after a failure the
        next write starts there again and repairs the warm copy. ``admit``: under a write
        budget, only if the budget has room (else nothing is written); an agent with no
        hot cache then has nothing to write (it left the tier, written or cold)."""
        assert self.warm is not None
        try:
            exported: Exported | None = await self.engine.ask(Export(self.agent_id, admit))
        except UnknownAgent as exc:
            return None if self.write_back else self._save_failed(exc)
        except Exception as exc:
            return self._save_failed(exc)
        if exported is None:
            log.info("agent %r: its cache stays unwritten: the write budget is spent", self.name)
            return None
        error = None
        writing = time.perf_counter()
        try:
            await self._write(self.warm, exported, leaving=leaving)
        except Exception as exc:
            error = self._save_failed(exc)
        finally:
            self._write_s = time.perf_counter() - writing
            upto = self.persisted
            written = Written(self.agent_id, exported.export_id, upto, failed=error is not None)
            await self.engine.tell(written)
        return error

    async def _note(self) -> str | None:
        """Write-back's turn end: commit the conversation and the tokens the cache holds
        (not the cache); returns why that failed (None: noted)."""
        assert self.warm is not None
        try:
            await self.warm.note(
                self.agent_id,
                tokens=list(self.tokens),
                text=self.text,
                messages=self.messages,
                bounds=list(self.bounds),
                answers=list(self.answers),
            )
        except Exception as exc:
            return self._save_failed(exc)
        return None

    async def _write_back(self, exported: Exported) -> None:
        """The engine sent this cache out (``WriteBack``): write it unless a turn ran since
        (then its cache is newer and will be written as it leaves), and answer Written."""
        error = None
        with anyio.CancelScope(shield=True):
            try:
                if self.warm is not None and exported.tokens == self.tokens:
                    await self._write(self.warm, exported)
            except Exception as exc:
                error = self._save_failed(exc)
            finally:
                upto = self.persisted if exported.tokens == self.tokens else exported.persisted
                written = Written(self.agent_id, exported.export_id, upto, error is not None)
                with contextlib.suppress(ActorDeadError):
                    await self.engine.tell(written)

    async def _write(self, warm: WarmTier, exported: Exported, *, leaving: bool = False) -> None:
        """Write ``exported``, linking its shared prefix where it has one; ``persisted``
        follows what is on disk after each step (a write that fails midway keeps it).
        ``leaving``: the agent stops under write-back; the store may decline (no room but
        what other leaving agents' caches hold), and what is left stays unwritten."""
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
            if not await warm.append(
                self.agent_id,
                start,
                tensors,
                tokens=exported.tokens[:stop],
                text=self.tokenizer.decode(exported.tokens[:stop]),
                messages=self.messages,
                answers=[a for a in self.answers if a < stop],
                leaving=leaving,
            ):
                log.info("agent %r: its cache stays unwritten: the disk limit is full", self.name)
                return
            upto = self.persisted = stop

    def _save_failed(self, exc: Exception) -> str:
        # The caller hears of it (Completion.save_error); a traceback only for the unexpected.
        unexpected = not isinstance(exc, StoreWriteError)
        log.warning("agent %r: warm cache not written: %s", self.agent_id, exc, exc_info=unexpected)
        return f"{type(exc).__name__}: {exc}"
