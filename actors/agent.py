"""The agent actor: one conversation, its token history, and its turns through the engine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from ..runtime import Actor, ActorRef
from ._tokenizer import Tokenizer
from .protocol import Finished, Generate, Piece, Sampling

__all__ = ("AgentActor", "GetHistory", "Turn")


class Turn(msgspec.Struct, frozen=True, tag=True):
    """A user message; the reply streams text pieces, then one Finished."""

    text: str
    sampling: Sampling


class GetHistory(msgspec.Struct, frozen=True, tag=True):
    pass


class AgentActor(Actor):
    """Keeps an agent's conversation and the exact tokens its engine cache holds.

    Each turn renders the chat template and, when the new prompt extends the text of the
    last one (the usual case), tokenizes only the new suffix and appends it to the cached
    tokens, so the engine prefills only what is new and the generated tokens stay reused.
    Turns of one agent run one at a time, in order.
    """

    def __init__(
        self, agent_id: str, engine: ActorRef[Any], tokenizer: Tokenizer, system: str | None
    ) -> None:
        self.agent_id = agent_id
        self.engine = engine
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.tokens: list[int] = []  # what the engine's cache holds for this agent (or will)
        self.text = ""  # the text those tokens spell

    async def receive(self, message: Turn | GetHistory) -> Any:
        match message:
            case Turn(text, sampling):
                if not text.strip():
                    raise ValueError("the prompt is empty")
                return self._turn(text, sampling)
            case GetHistory():
                return [dict(m) for m in self.messages]
        raise TypeError(f"an agent does not handle {type(message).__name__}")

    def _prompt_tokens(self, rendered: str) -> list[int]:
        if self.text and rendered.startswith(self.text):
            return self.tokens + self.tokenizer.encode(rendered[len(self.text) :])
        return self.tokenizer.encode(rendered)

    async def _turn(self, text: str, sampling: Sampling) -> AsyncIterator[str | Finished]:
        messages = [*self.messages, {"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens = self._prompt_tokens(rendered)
        request = Generate(self.agent_id, tokens, sampling, time.perf_counter())
        finished: Finished | None = None
        async with self.engine.stream(request) as items:
            async for item in items:
                if isinstance(item, Piece):
                    if item.text:
                        yield item.text
                elif isinstance(item, Finished):
                    finished = item
        if finished is None:
            raise RuntimeError("the engine ended a generation without saying why")
        self.messages = [*messages, {"role": "assistant", "content": finished.text}]
        if finished.reason == "stop":
            # The stop string's tokens are in the cache but not in the text: re-tokenize;
            # the engine then reuses the common prefix.
            generated = self.tokenizer.encode(finished.text)
        elif finished.reason == "eos":
            generated = finished.token_ids[:-1]
        else:
            generated = finished.token_ids
        self.tokens = tokens + generated
        self.text = rendered + finished.text
        yield finished
