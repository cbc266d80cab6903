"""Agent ids: what a safe one is (it names a cache folder later)."""

from __future__ import annotations

import re

from .errors import InvalidAgentId

__all__ = (
    "AGENT_ID_MAX",
    "check_agent_id",
    "namespace_of",
)


AGENT_ID_MAX = 128


_AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_agent_id(agent: object) -> str:
    """Return ``agent`` if it is a safe id (it names a cache file later); else raise.

    Raises InvalidAgentId for a non-string, an empty or over-long id, or any character
    outside letters, digits, ``.``, ``_``, ``-`` (so no ``/``, ``\\``, ``..`` or NUL).
    """
    if not isinstance(agent, str):
        raise InvalidAgentId(f"agent id must be a str, got {type(agent).__name__}")
    shown = repr(agent) if len(agent) <= 40 else f"{agent[:40]!r}... ({len(agent)} characters)"
    if not 0 < len(agent) <= AGENT_ID_MAX:
        raise InvalidAgentId(f"agent id must have 1 to {AGENT_ID_MAX} characters: {shown}")
    if not _AGENT_ID.fullmatch(agent) or ".." in agent:
        raise InvalidAgentId(
            f"agent id {shown} may only use letters, digits, '.', '_', '-' "
            "(starting with a letter or digit, no '..')"
        )
    return agent


def namespace_of(agent: str) -> str | None:
    """The namespace of agent id ``agent``: what comes before its first ``.`` (a server's
    tenant label: its agents are ``<label>.<id>``); None for an id without one."""
    head, dot, _ = agent.partition(".")
    return head if dot else None
