"""A recurrent layer's working cache: its fixed-size state, for one row or a batch.

State-space and linear-attention layers (Mamba-2, gated delta nets, short convolutions)
keep mlx-lm's ``ArraysCache``: a convolution state and an SSM or delta-rule state after the
last token, replaced (not edited) at every forward. A state cannot be trimmed: a turn
resumes from a *checkpoint*, the state stored with each range of an agent's cache
(``StoredRange.states``), and a token fed past a turn's end (the pipelined decode step)
is taken back by returning to the state from before that step: :class:`RecurrentCache`
keeps it when told a step may be taken back (:meth:`RecurrentCache.mark_step`). Keeping it
costs no copy, only the memory of one more state: the arrays are immutable.

Rows join and leave a batch as K/V rows do (``extend``, ``filter``, ``extract``); a decode
step feeds one token to every row, so a batch has no padding to mask. A row taken out of a
batch is copied (``mx.contiguous``): a slice would keep the whole batch's state alive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .geometry import StateGeometry

__all__ = ("RecurrentCache",)

Parts = dict[str, mx.array]


def _rows(arrays: Sequence[mx.array | None], index: mx.array | slice) -> list[mx.array | None]:
    return [None if a is None else mx.contiguous(a[index]) for a in arrays]


class RecurrentCache(ArraysCache):
    """One recurrent layer's state for a batch of rows (an mlx-lm ``ArraysCache``: the
    models read and replace its entries).

    Invariant: ``_before`` is the state before the last forward that :meth:`mark_step`
    announced (None: nothing to take back); only this class writes it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.cache: list[mx.array | None] = [None] * size  # type: ignore[assignment]
        self._before: list[mx.array | None] | None = None
        self._marked = False

    @classmethod
    def from_parts(
        cls, geometry: StateGeometry, parts: Mapping[str, mx.array] | None
    ) -> RecurrentCache:
        """One row at a stored checkpoint (``parts``, as :meth:`parts` gave them), or an
        empty one (None or ``{}``: no token yet). Raises KeyError for missing parts."""
        row = cls(len(geometry.shapes))
        if parts:
            row.cache = [parts[str(j)] for j in range(len(geometry.shapes))]
        return row

    def __setitem__(self, idx: int, value: mx.array) -> None:
        if self._marked:  # the first entry a marked forward replaces: keep the old state
            self._before = list(self.cache)
            self._marked = False
        self.cache[idx] = value

    def mark_step(self) -> None:
        """The next forward feeds one token to every row and may be taken back
        (:meth:`unfeed`)."""
        self._marked = True
        self._before = None

    def unfeed(self, n: int) -> None:
        """Take back the one token the last marked forward fed every row. Raises ValueError
        for ``n`` other than 1, or when no marked forward ran since the state was last
        taken back."""
        if n != 1 or self._before is None:
            raise ValueError("a recurrent state can take back only the last marked step")
        self.cache, self._before = self._before, None

    def parts(self) -> Parts:
        """A one-row cache's state as stored parts (``"0"``, ``"1"`` ...: own copies, not
        views of a batch's arrays). Raises ValueError for an empty cache or several rows."""
        if any(a is None for a in self.cache):
            raise ValueError("a recurrent layer has no state yet")
        if self.batch_size != 1:
            raise ValueError("only a one-row state is stored")
        return {str(j): mx.contiguous(a) for j, a in enumerate(self.cache) if a is not None}

    # -- batch edits ----------------------------------------------------------------
    def extend(self, other: Any) -> None:
        """Append ``other``'s rows (in place); what could be taken back is forgotten."""
        if not isinstance(other, RecurrentCache):
            raise TypeError("a recurrent batch takes recurrent rows only")
        super().extend(other)
        self._before = None

    def filter(self, batch_indices: Any) -> None:
        """Keep only the rows ``batch_indices`` (in that order), in place."""
        index = batch_indices if isinstance(batch_indices, mx.array) else mx.array(batch_indices)
        self.cache = _rows(self.cache, index)
        if self._before is not None:
            self._before = _rows(self._before, index)

    def extract(self, idx: int) -> RecurrentCache:
        """Row ``idx`` alone (copied), with its state from before the last marked step."""
        row = RecurrentCache(len(self.cache))
        row.cache = _rows(self.cache, slice(idx, idx + 1))
        if self._before is not None:
            row._before = _rows(self._before, slice(idx, idx + 1))
        return row

    @property
    def nbytes(self) -> int:
        held = list(self.cache) + (self._before or [])
        return sum(a.nbytes for a in held if a is not None)

    def arrays(self) -> list[mx.array]:
        """Every array, for ``mx.eval``."""
        return [a for a in (*self.cache, *(self._before or [])) if a is not None]
