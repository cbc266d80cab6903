"""The engine as one model's agents see it: :class:`ModelRef` wraps every message for its
model (``ForModel``); :func:`sum_stats` adds the models' statistics."""

from __future__ import annotations

from typing import Any

import msgspec

from ...runtime import DEFAULT_ASK_TIMEOUT, ActorRef, ReplyStream
from ..messages import EngineMessage, ForModel
from ..records import EngineStats

__all__ = ("ModelRef", "sum_stats")


class ModelRef(ActorRef[EngineMessage]):
    """The engine as one model's agents, warm tier and session see it: every message sent
    through it goes to ``model`` (wrapped in :class:`ForModel`)."""

    __slots__ = ("model",)

    def __init__(self, engine: ActorRef[Any], model: str) -> None:
        super().__init__(engine._cell)
        self.model = model

    def tell_nowait(self, message: EngineMessage) -> None:
        super().tell_nowait(ForModel(self.model, message))  # type: ignore[arg-type]

    async def tell(self, message: EngineMessage) -> None:
        await super().tell(ForModel(self.model, message))  # type: ignore[arg-type]

    async def ask(
        self, message: EngineMessage, *, timeout: float | None = DEFAULT_ASK_TIMEOUT
    ) -> Any:
        return await super().ask(ForModel(self.model, message), timeout=timeout)  # type: ignore[arg-type]

    def stream(self, message: EngineMessage, *, item_timeout: float | None = None) -> ReplyStream:
        return super().stream(ForModel(self.model, message), item_timeout=item_timeout)  # type: ignore[arg-type]


_MAXED = frozenset({"max_batch_seen", "peak_bytes"})


def sum_stats(parts: list[EngineStats]) -> EngineStats:
    """``parts`` summed field by field (numbers added; the rest: the first's)."""
    first = parts[0]
    values: dict[str, Any] = {}
    for name in first.__struct_fields__:
        items = [getattr(p, name) for p in parts]
        if name in _MAXED:
            values[name] = max(items)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            values[name] = sum(items)
        else:
            values[name] = items[0]
    return msgspec.structs.replace(first, **values)
