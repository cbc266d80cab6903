"""The named values of the LLM layer: tiers, how a turn found its cache, why things ended.

Each is a ``str`` enum, so it prints, compares and serializes (JSON, msgspec) as its
value: ``Tier.HOT == "hot"`` and ``f"{Tier.HOT}"`` is ``hot``. Code names them through
these classes only.
"""

from __future__ import annotations

from enum import Enum

__all__ = ("FinishReason", "Match", "Room", "StageOutcome", "Tier", "TurnPath")


class _StrEnum(str, Enum):
    """A str-valued enum that formats as its value (``enum.StrEnum`` needs Python 3.11)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Tier(_StrEnum):
    """Where an agent's cache is, and so how a turn found it (``Completion.path``):
    quantized in the engine (hot), a file on disk (warm), or only its text (cold)."""

    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


class TurnPath(_StrEnum):
    """How a turn found its cache, as reports group turns: the tier it came from, with
    PREFETCHED for a hot turn whose warm cache a prefetch hint had staged ahead of it."""

    COLD = "cold"
    WARM = "warm"
    PREFETCHED = "prefetched"
    HOT = "hot"


class Match(_StrEnum):
    """How a prompt compared with the text an agent's cache spells."""

    NEW = "new"  # nothing cached
    EXACT = "exact"  # the same text: reuse every token
    EXTEND = "extend"  # the cache spells a prefix: prefill only the rest
    DIVERGE = "diverge"  # a shorter common prefix: reuse up to a token boundary in it


class FinishReason(_StrEnum):
    """Why a generation ended."""

    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop string
    LENGTH = "length"  # max_tokens (or the context) reached
    TOOL_CALLS = "tool_calls"  # the turn ended in tool calls (Completion.tool_calls)
    ENDED = "ended"  # the session ended it early (Session.end_turns: a server stopping)


class Room(_StrEnum):
    """The hot tier's answer to a request for room to stage a warm cache."""

    RESERVED = "reserved"  # room is held for it now
    HOT = "hot"  # nothing to do: the cache is already hot
    NO_ROOM = "no room"  # not now (asked without waiting)
    TOO_BIG = "too big"  # larger than the whole budget


class StageOutcome(_StrEnum):
    """What staging a warm cache into the hot tier came to."""

    STAGED = "staged"
    HOT = "hot"  # already hot
    NO_WARM_CACHE = "no warm cache"
    NO_ROOM = "no room"
    TOO_BIG = "too big"
    REJECTED = "rejected"  # refused by verification (the detail says why)

    @property
    def hot(self) -> bool:
        """Whether the cache is hot afterwards."""
        return self in (StageOutcome.STAGED, StageOutcome.HOT)
