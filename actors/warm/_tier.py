"""The warm tier as an agent sees it: restore its conversation, stage its cache into the
engine, append the new tokens of a turn, link a shared prefix. :class:`WarmTier` is the
protocol the agent actor is written against; :class:`ActorWarmTier` is it over the store
and prefetch actors."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ...runtime import ActorRef
from ..errors import CacheRejected
from ..records import AgentSnapshot
from ._manifest import ANSWERS_KEY, held_answers, held_state
from ._prefetch import Prefetch, PrefetchMessage, Stage, StageResult
from ._protocol import Append, Manifest, Note, ShareCache, StoreMessage

__all__ = ("ActorWarmTier", "WarmTier")

log = logging.getLogger("kvactor.session")


class WarmTier(Protocol):
    """What an agent actor asks of the warm tier."""

    async def restore(self, agent: str) -> AgentSnapshot | None:
        """The agent's saved state (None: nothing saved, or refused: it starts cold)."""
        ...

    async def stage(self, agent: str) -> bool:
        """Stage its warm cache into the hot tier for a turn; False: it starts cold."""
        ...

    async def append(
        self,
        agent: str,
        start: int,
        tensors: dict[str, Any],
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, Any]],
        answers: list[int] | None = None,
        leaving: bool = False,
    ) -> bool:
        """Write a stored range from token ``start`` and commit the agent's state (with
        ``answers``: where its answers began, ``ANSWERS_KEY``); False
        when a ``leaving`` write found no room (``Append.leaving``: nothing written).
        Raises StoreWriteError when it could not be written."""
        ...

    async def note(
        self,
        agent: str,
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, Any]],
        bounds: list[int],
        answers: list[int] | None = None,
    ) -> None:
        """Write-back's turn end: commit the conversation and the tokens its cache holds
        (its warm cache unchanged). Raises StoreWriteError when it could not be written."""
        ...

    async def share(
        self,
        agent: str,
        source: str,
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, Any]],
    ) -> bool:
        """Give ``agent`` (nothing on disk yet) a warm cache of ``tokens`` linked from
        ``source``'s segments; False when that cannot be done (write them instead)."""
        ...

    async def hot(self, agent: str) -> None:
        """Stage ``agent``'s warm cache into the hot tier if it is not hot and there is
        room (a shared context an agent is about to reuse); never waits for room."""
        ...


class ActorWarmTier:
    """The warm tier backed by the store and prefetch actors."""

    def __init__(self, store: ActorRef[StoreMessage], prefetch: ActorRef[PrefetchMessage]) -> None:
        self.store = store
        self.prefetch = prefetch

    async def restore(self, agent: str) -> AgentSnapshot | None:
        try:
            manifest = await self.store.ask(Manifest(agent))
        except CacheRejected as exc:
            log.warning("agent %r starts cold: %s", agent, exc)
            return None
        if manifest is None:
            return None
        messages = [dict(m) for m in manifest.messages]
        # Cold, or (write-back) gone on past its warm cache: the tokens it held, if kept.
        tokens, text, bounds = held_state(manifest)
        if tokens or manifest.n_tokens == 0:
            answers = held_answers(manifest, len(tokens))
            return AgentSnapshot(
                tokens, text, messages, bounds, on_disk=manifest.n_tokens, answers=answers
            )
        bounds = sorted({e.start + e.use for e in manifest.segments})
        answers = held_answers(manifest, manifest.n_tokens)
        return AgentSnapshot(
            list(manifest.token_ids), manifest.text, messages, bounds, answers=answers
        )

    async def stage(self, agent: str) -> bool:
        result: StageResult = await self.prefetch.ask(Stage(agent), timeout=None)
        if not result.staged:
            why = f"{result.outcome}: {result.detail}" if result.detail else result.outcome
            log.warning("agent %r: warm cache not staged (%s): starting cold", agent, why)
        return result.staged

    async def append(
        self,
        agent: str,
        start: int,
        tensors: dict[str, Any],
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, Any]],
        answers: list[int] | None = None,
        leaving: bool = False,
    ) -> bool:
        extra = {ANSWERS_KEY: answers} if answers else {}
        append = Append(agent, start, tensors, tokens, text, messages, extra, leaving=leaving)
        return await self.store.ask(append, timeout=120) is not None

    async def note(
        self,
        agent: str,
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, Any]],
        bounds: list[int],
        answers: list[int] | None = None,
    ) -> None:
        note = Note(agent, tokens, text, messages, bounds, answers or [])
        await self.store.ask(note, timeout=120)

    async def share(
        self,
        agent: str,
        source: str,
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, Any]],
    ) -> bool:
        info = await self.store.ask(ShareCache(source, agent, tokens, text, messages), timeout=120)
        return info is not None

    async def hot(self, agent: str) -> None:
        await self.prefetch.ask(Prefetch(agent), timeout=None)
