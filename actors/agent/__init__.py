"""The agent actor: an agent's conversation, its prompts rendered and matched against what its
cache spells, its turns, and its writes to the warm tier."""

from __future__ import annotations

from ._actor import AgentActor as AgentActor
from ._actor import AgentEnv as AgentEnv
from ._actor import prompt_chars_limit as prompt_chars_limit
from ._conversation import check_history as check_history

__all__ = (
    "AgentActor",
    "AgentEnv",
    "check_history",
    "prompt_chars_limit",
)
