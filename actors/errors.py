"""Every exception the LLM layer (engine, agents, session, store, model loading) raises.

All derive from KvactorError, the root the actor kernel's errors share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime import KvactorError

if TYPE_CHECKING:
    from .records import Completion

__all__ = (
    "AgentBusy",
    "AgentExists",
    "BudgetExceeded",
    "CacheDirLocked",
    "CacheMiss",
    "CacheRejected",
    "CacheTooLarge",
    "ContextOverflow",
    "EngineStopped",
    "InvalidAgentId",
    "KvactorError",
    "ModelExportError",
    "ModelLoadError",
    "StoreWriteError",
    "TurnEnded",
    "UnknownAgent",
    "UnsafeCachePath",
)


class InvalidAgentId(KvactorError, ValueError):
    """An agent id that is empty, too long, or could escape a directory (``/``, ``..``)."""


class UnsafeCachePath(InvalidAgentId):
    """A folder under the cache root (``agents/``, ``rejected/`` or an agent's) that is a
    symlink: following it could read, move or delete files outside the root."""


class UnknownAgent(KvactorError, KeyError):
    """No agent (or no cache) with that id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AgentExists(KvactorError, ValueError):
    """An agent of that name already exists (running, or its cache on disk): a spawn or
    an import under that name is refused (an import with ``replace`` replaces it)."""


class AgentBusy(KvactorError):
    """The agent already has a generation in flight in the engine."""


class ContextOverflow(KvactorError, ValueError):
    """The prompt does not fit in the model's context window."""


class EngineStopped(KvactorError):
    """The engine stopped (shutdown or crash) while a generation was in flight."""


class TurnEnded(EngineStopped):
    """The session is ending its turns (``Session.end_turns``, a server stopping): this
    turn had not begun to decode, or came after, and was not run."""


class CacheMiss(KvactorError):
    """The agent's cache is not hot in the engine: stage its warm copy first."""


class BudgetExceeded(KvactorError):
    """The hot tier's byte budget cannot hold what this request needs."""


class CacheRejected(KvactorError):
    """A warm cache that is corrupt, hostile, or made by another model, codec or format."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(f"{reason} ({path})" if path else reason)
        self.reason = reason
        self.path = path


class CacheTooLarge(CacheRejected):
    """An agent file whose cache is larger than the import takes (its ``max_bytes``)."""


class StoreWriteError(KvactorError):
    """Writing a warm cache failed (disk full, I/O error); its previous state is intact.

    Raised by a turn (``on_save_error="raise"``), ``completion`` holds the turn's answer."""

    completion: Completion | None = None


class CacheDirLocked(KvactorError):
    """Another session (in this process or another one) is using the cache directory."""


class ModelLoadError(KvactorError):
    """A model could not be found, fetched, verified or loaded."""


class ModelExportError(KvactorError):
    """A model directory export was refused (the folder holds other files) or failed."""


class HostLost(KvactorError):
    """An engine host's process died while it served a call (its pending turns fail with
    this). Ray restarts it; its agents resume from their warm caches on their next call.
    A host that is gone for good (its node lost) hands its agents to the hosts that keep
    their replicas (``replicas=2``); the message says where each went."""
