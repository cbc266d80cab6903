"""The actor kernel: actors, refs, mailboxes, supervision. It knows nothing about LLMs."""

from __future__ import annotations

if __name__ != "kvactor.runtime":  # one import name per file: see docs/layout.md
    raise ImportError(f"import kvactor.runtime, not {__name__}: each file has one import name")

from ._actor import Actor as Actor
from ._actor import ThreadActor as ThreadActor
from ._debug import DEBUG as DEBUG
from ._errors import ActorDeadError as ActorDeadError
from ._errors import ActorError as ActorError
from ._errors import AskTimeout as AskTimeout
from ._errors import KvactorError as KvactorError
from ._errors import MailboxFull as MailboxFull
from ._loop import LoopCaller as LoopCaller
from ._mailbox import MailboxStatistics as MailboxStatistics
from ._ref import DEFAULT_ASK_TIMEOUT as DEFAULT_ASK_TIMEOUT
from ._ref import ActorRef as ActorRef
from ._reply import Reply as Reply
from ._reply import ReplyStream as ReplyStream
from ._runtime import Runtime as Runtime
from ._supervision import RestartPolicy as RestartPolicy

__all__ = (
    "DEBUG",
    "DEFAULT_ASK_TIMEOUT",
    "Actor",
    "ActorDeadError",
    "ActorError",
    "ActorRef",
    "AskTimeout",
    "KvactorError",
    "LoopCaller",
    "MailboxFull",
    "MailboxStatistics",
    "Reply",
    "ReplyStream",
    "RestartPolicy",
    "Runtime",
    "ThreadActor",
)
