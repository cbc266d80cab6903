"""Every exception the LLM layer (engine, agents, session) raises."""

from __future__ import annotations

__all__ = (
    "AgentBusy",
    "ContextOverflow",
    "EngineStopped",
    "InvalidAgentId",
    "KvactorError",
    "UnknownAgent",
)


class KvactorError(Exception):
    """Base class of kvactor's LLM-layer errors."""


class InvalidAgentId(KvactorError, ValueError):
    """An agent id that is empty, too long, or could escape a directory (``/``, ``..``)."""


class UnknownAgent(KvactorError, KeyError):
    """No agent (or no cache) with that id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AgentBusy(KvactorError):
    """The agent already has a generation in flight in the engine."""


class ContextOverflow(KvactorError, ValueError):
    """The prompt does not fit in the model's context window."""


class EngineStopped(KvactorError):
    """The engine stopped (shutdown or crash) while a generation was in flight."""
