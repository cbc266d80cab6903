"""Admission: at most ``max_pending`` turn requests in flight; past that a request is
refused at once with a 429 (``Retry-After: 1``) instead of queueing behind the others."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from prometheus_client import Gauge

from ._errors import ApiError


class Admission:
    """The turn requests in flight, counted in the ``kvactor_requests_in_flight`` gauge.

    A request holds a slot for as long as it is answered: ``async with admission.slot():``
    (a streamed reply keeps its slot until the stream ends or its client leaves).
    """

    def __init__(self, max_pending: int, gauge: Gauge) -> None:
        self.max_pending = max_pending
        self._gauge = gauge
        # Invariant: the slots held now; only slot() changes it.
        self._pending = 0

    @property
    def pending(self) -> int:
        """The requests holding a slot now."""
        return self._pending

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the block. Raises ApiError (429) when all are held."""
        if self._pending >= self.max_pending:
            raise ApiError(
                429,
                f"{self._pending} requests in flight: retry shortly",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        self._pending += 1
        self._gauge.inc()
        try:
            yield
        finally:
            self._pending -= 1
            self._gauge.dec()
