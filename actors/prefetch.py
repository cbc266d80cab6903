"""The prefetch actor: stages warm caches from disk into the engine ahead of need."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio
import msgspec

from ..runtime import Actor, ActorRef
from .errors import CacheRejected, UnknownAgent
from .protocol import Install, Release, Reserve
from .store import CacheIdentity, ExpectFn, read_cache, read_manifest

__all__ = ("Prefetch", "PrefetchActor", "Stage", "StageResult")

log = logging.getLogger("kvactor.prefetch")


class Stage(msgspec.Struct, frozen=True, tag=True):
    """Make the agent's warm cache hot now (ask): an agent needs it for its next turn."""

    agent: str


class Prefetch(msgspec.Struct, frozen=True, tag=True):
    """A hint (tell): the agent probably runs next; stage its warm cache if there is room."""

    agent: str


class StageResult(msgspec.Struct, frozen=True):
    agent: str
    staged: bool  # True: the cache is hot now (or already was)
    reason: str  # "staged", "hot", "no warm cache", "no room", "rejected: ..."
    nbytes: int = 0
    read_s: float = 0.0
    install_s: float = 0.0


class PrefetchActor(Actor):
    """Reads and verifies a warm cache into host memory off the event loop and off the
    engine's thread, then hands the arrays to the engine, which only copies them in. Room
    is reserved in the hot budget before reading, so staged bytes always count."""

    def __init__(
        self,
        engine: ActorRef[Any],
        root: str | os.PathLike[str],
        identity: CacheIdentity,
        expect: ExpectFn,
    ) -> None:
        self.engine = engine
        self.root = root
        self.identity = identity
        self.expect = expect
        self.staged = 0
        self.hints = 0

    async def receive(self, message: Stage | Prefetch) -> Any:
        match message:
            case Stage(agent):
                return await self._stage(agent, wait=True)
            case Prefetch(agent):
                self.hints += 1
                try:
                    result = await self._stage(agent, wait=False)
                except Exception as exc:  # a hint must never crash the actor
                    log.warning("prefetch of %r failed: %s", agent, exc)
                    return None
                log.debug("prefetch %s: %s", agent, result.reason)
                return result
        raise TypeError(f"the prefetch actor does not handle {type(message).__name__}")

    async def _stage(self, agent: str, *, wait: bool) -> StageResult:
        try:
            manifest = await anyio.to_thread.run_sync(
                read_manifest, self.root, self.identity, agent
            )
        except CacheRejected as exc:
            return StageResult(agent, False, f"rejected: {exc}")
        if manifest is None:
            return StageResult(agent, False, "no warm cache")
        nbytes = sum(s.nbytes for s in manifest.segments)
        answer = await self.engine.ask(Reserve(agent, nbytes, wait), timeout=None)
        if answer == "hot":
            return StageResult(agent, True, "hot")
        if answer != "reserved":
            return StageResult(agent, False, str(answer))
        try:
            t0 = time.perf_counter()
            loaded = await anyio.to_thread.run_sync(
                read_cache, self.root, self.identity, self.expect, agent
            )
            t1 = time.perf_counter()
            await self.engine.ask(
                Install(agent, list(loaded.manifest.token_ids), loaded.ranges(), pin=wait),
                timeout=None,
            )
        except (CacheRejected, UnknownAgent) as exc:
            await self.engine.ask(Release(agent))
            return StageResult(agent, False, f"rejected: {exc}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.engine.ask(Release(agent))
            raise
        self.staged += 1
        return StageResult(agent, True, "staged", loaded.nbytes, t1 - t0, time.perf_counter() - t1)
