"""Every exception the actor kernel raises, and the root of all of kvactor's errors."""

from __future__ import annotations

__all__ = (
    "ActorDeadError",
    "ActorError",
    "AskTimeout",
    "KvactorError",
    "MailboxFull",
)


class KvactorError(Exception):
    """Base class of every error kvactor raises (the actor kernel's and the LLM layer's)."""


class ActorError(KvactorError):
    """Base class of the actor kernel's errors."""


class ActorDeadError(ActorError):
    """The actor has stopped or crashed for good: it will not handle this message."""


class MailboxFull(ActorError):
    """``tell_nowait`` found the actor's mailbox at capacity."""


class AskTimeout(ActorError, TimeoutError):
    """No reply came within the ask's timeout (the request was withdrawn)."""
