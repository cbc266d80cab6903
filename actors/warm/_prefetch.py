"""The prefetch actor: stages warm caches from disk into the engine ahead of need."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio
import msgspec

from ...kernels.memory import host_views
from ...runtime import Actor, ActorRef
from ..enums import Room, StageOutcome
from ..errors import CacheRejected, UnknownAgent
from ..messages import EngineMessage, Install, InstallStreamed, Release, Reserve
from ._manifest import CacheManifest, Loaded
from ._protocol import Load, Manifest, StoreMessage, Stream
from ._stream import StreamedRead

__all__ = ("Prefetch", "PrefetchActor", "PrefetchMessage", "Stage", "StageResult")

log = logging.getLogger("kvactor.prefetch")

# The engine's answers to Reserve other than RESERVED: nothing is staged.
_NOT_STAGED = {
    Room.HOT: StageOutcome.HOT,
    Room.NO_ROOM: StageOutcome.NO_ROOM,
    Room.TOO_BIG: StageOutcome.TOO_BIG,
}


class Stage(msgspec.Struct, frozen=True, tag=True):
    """Make the agent's warm cache hot now (ask): an agent needs it for its next turn."""

    agent: str


class Prefetch(msgspec.Struct, frozen=True, tag=True):
    """A hint (tell): the agent probably runs next; stage its warm cache if there is room."""

    agent: str


PrefetchMessage = Stage | Prefetch


class StageResult(msgspec.Struct, frozen=True):
    """What staging ``agent``'s warm cache came to, with the bytes and seconds it took."""

    agent: str
    outcome: StageOutcome
    detail: str = ""  # why the store refused the cache (REJECTED), else ""
    nbytes: int = 0  # bytes read from disk
    # asking the store to read and verify the cache (streamed: to open it and check its
    # headers; the read then runs beside the turn's first forward: Timings.stream_s)
    read_s: float = 0.0
    install_s: float = 0.0  # the engine copying it in (streamed: allocating its arrays)

    @property
    def staged(self) -> bool:
        """Whether the cache is hot now (staged here, or already hot)."""
        return self.outcome.hot


class PrefetchActor(Actor):
    """Asks the store for a warm cache, read and verified into host memory off the event
    loop and off the engine's thread, then hands the arrays to the engine, which only
    copies them in; for a Stage (a turn waits) the store instead opens the files and the
    engine's first forward of the turn runs as their layers stream into its arrays
    (``_stream``). Room is reserved in the hot budget before reading, so staged bytes
    always count. A cache the store refuses is the store's to handle: it says why in
    ListAgents and sets the cache aside (or deletes it, with ``delete_rejected``)."""

    #: Bytes from which a stage streams its cache in: below them the read is too short to
    #: pay for the finer split (bench/ttft.py, 3 runs each, streamed against read whole:
    #: 1.06x and 1.07x at 1K, a 6.7 MB cache; 0.88x at 2K, 13 MB; 0.86-1.02x at 4K).
    stream_min_bytes = 8 << 20
    #: Bytes per file, on average, from which a stage streams: a cache written over many
    #: departures is many small files, and a streamed read pays per file and per tensor
    #: (its files' headers checked, each tensor's array allocated and viewed) where a whole
    #: read checks them side by side (the default model, 8 warm turns each way: 2K in 10
    #: files of 1.3 MB streamed 1.18x read whole, 4K in 10 files of 2.7 MB 1.05-1.07x, 4K
    #: in 4 files of 6.7 MB 1.03x, stage 0.85x).
    stream_min_file_bytes = 4 << 20

    def __init__(self, engine: ActorRef[EngineMessage], store: ActorRef[StoreMessage]) -> None:
        self.engine = engine
        self.store = store
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
                log.debug("prefetch %s: %s %s", agent, result.outcome, result.detail)
                return result
        raise TypeError(f"the prefetch actor does not handle {type(message).__name__}")

    async def _stage(self, agent: str, *, wait: bool) -> StageResult:
        try:
            manifest: CacheManifest | None = await self.store.ask(Manifest(agent), timeout=None)
        except CacheRejected as exc:
            return StageResult(agent, StageOutcome.REJECTED, exc.reason)
        if manifest is None or manifest.n_tokens == 0:  # none, or made cold: prefill
            return StageResult(agent, StageOutcome.NO_WARM_CACHE)
        nbytes = sum(s.nbytes for s in manifest.all_segments)  # window and state files too
        room = Room(await self.engine.ask(Reserve(agent, nbytes, wait), timeout=None))
        if room != Room.RESERVED:
            return StageResult(agent, _NOT_STAGED[room])
        try:
            t0 = time.perf_counter()
            # A turn waits: its cache streams in as its first forward runs. A hint reads
            # it whole (nothing waits, and its forward may not come soon), as a small
            # cache or one in many small files does, and every stage with
            # KVACTOR_STREAM=0 (read at each stage) or where the engine's arrays are not
            # host memory the readers could write.
            streams = (
                wait
                and nbytes >= self.stream_min_bytes
                and nbytes >= self.stream_min_file_bytes * len(manifest.all_segments)
                and os.environ.get("KVACTOR_STREAM", "1") != "0"
                and host_views()
            )
            got: Loaded | StreamedRead = await self.store.ask(
                Stream(agent) if streams else Load(agent), timeout=None
            )
            t1 = time.perf_counter()
            tokens = list(got.manifest.token_ids)
            if isinstance(got, StreamedRead):
                try:
                    await self.engine.ask(InstallStreamed(agent, tokens, got, wait), timeout=None)
                finally:
                    got.close()  # its files, where it never started (installed: it did)
            else:
                install = Install(agent, tokens, got.ranges(), pin=wait, read_s=t1 - t0)
                await self.engine.ask(install, timeout=None)
        except (CacheRejected, UnknownAgent) as exc:
            await self.engine.ask(Release(agent))
            if isinstance(exc, CacheRejected):
                return StageResult(agent, StageOutcome.REJECTED, exc.reason)
            return StageResult(agent, StageOutcome.NO_WARM_CACHE)  # forgotten meanwhile
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.engine.ask(Release(agent))
            raise
        self.staged += 1
        t2 = time.perf_counter()
        return StageResult(agent, StageOutcome.STAGED, "", got.nbytes, t1 - t0, t2 - t1)
