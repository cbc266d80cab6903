"""The turns decoding together: one working cache of their rows, and a pipelined step.

Each step feeds every row its last pick and samples the next. The step after is built and
launched (``mx.async_eval``) before this step's tokens are read on the host, as mlx-lm's
``generate_step`` does: reading, detokenizing and sending a step's text, and building the
next graph, overlap the next step's compute. A row whose turn ends at a step was fed one
token more by the step in flight: it leaves with that token taken back
(``TurnCache.unfeed``: a recurrent layer returns to its state from before that step,
which it keeps for every step: ``TurnCache.before_step``), so its cache holds exactly
what an unpipelined run leaves. Every
step computes what it would have computed alone: the same tokens.

A step with rows whose picks need their tokens on the host (a grammar's mask, penalties:
``_picking``) launches its forward pass alone; the picks of the step before are read, the
masks computed from them while that forward runs, and then its picks are launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import mlx.core as mx

from ...kernels.turn_cache import TurnCache
from ._generation import Generation
from ._picking import host_bound, pick, pick_in_graph

__all__ = ("DecodeBatch",)


@dataclass
class _Step:
    """A step launched, its picks not read yet: one per row of ``rows``, in order.
    ``logits``: a host-bound step's, its picks launched after the step before is read."""

    picks: mx.array | None
    rows: list[Generation]
    logits: mx.array | None = None


class DecodeBatch:
    """The decoding turns (rows, in order), their batched working cache and the step in
    flight. The engine's; rows join after their prefill and leave when their turn ends or
    is cancelled, handing their working cache back to their agent's ``AgentKV``."""

    pipelined: ClassVar[bool] = True
    """False: read each step's tokens before building the next (what
    ``bench/engine_overhead.py`` compares against); the tokens are the same."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.rows: list[Generation] = []
        self._cache: TurnCache | None = None
        self._pending: _Step | None = None
        self.steps = 0
        self.generated = 0
        self.max_seen = 0
        self.mask_s = 0.0  # host seconds spent on grammar masks (rows that left)
        self.masked = 0  # tokens picked under a grammar's mask (rows that left)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the batched working cache (its rows' caches left their entries)."""
        return self._cache.nbytes if self._cache is not None else 0

    def join(self, request: Generation) -> None:
        """Add a prefilled turn (its working cache moves into the batch)."""
        work = request.entry.kv.lend_work()
        if self._cache is None:
            self._cache = work.batch()
        else:
            self._cache.extend(work)
        self.rows.append(request)
        self.max_seen = max(self.max_seen, len(self.rows))

    def leave(self, rows: list[int]) -> list[Generation]:
        """Take rows ``rows`` out (their working caches back to their agents); returns their
        turns, in that order."""
        cache = self._cache
        assert cache is not None
        fed = {id(r) for r in self._pending.rows} if self._pending is not None else set()
        leaving = [self.rows[i] for i in rows]
        for request in leaving:
            if request.grammar is not None:
                self.mask_s += request.grammar.mask_s
                self.masked += request.grammar.masks
        for i, request in zip(rows, leaving, strict=True):
            work = cache.extract(i)
            if id(request) in fed:
                work.unfeed(1)  # the step in flight fed it a token past its turn's end
            request.entry.kv.take_work(work)
        gone = set(rows)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        if keep:
            cache.filter(keep)
        else:
            self._cache = None
            self._pending = None
        return leaving

    def step(self) -> list[Generation]:
        """One step: launch the next, read the one in flight (pipelined), or both in turn.
        Returns the turns that ended (already out of the batch)."""
        if not self.pipelined:
            self._pending = self._launch()
            self._pick(self._pending)
            done = self._read(self._pending)
            self._pending = None
        else:
            launched = self._launch() if self._needs_step() else None
            done = self._read(self._pending) if self._pending is not None else []
            if launched is not None:
                self._pick(launched)  # a host-bound step's masks, from what was just read
            self._pending = launched
        return self.leave([self.rows.index(r) for r in done]) if done else []

    def _needs_step(self) -> bool:
        """Whether a step after the one in flight can give any row a token: not when every
        row's turn ends with its pick in flight (its token budget is spent)."""
        pending = self._pending
        if pending is None:
            return True
        fed = {id(r) for r in pending.rows}
        return any(
            id(r) not in fed or len(r.generated) + 1 < r.sampling.max_tokens for r in self.rows
        )

    def _launch(self) -> _Step:
        """Build and launch a step over every row: rows in the step in flight are fed its
        picks (not read yet), rows that joined since their last pick."""
        assert self._cache is not None
        rows = list(self.rows)
        pending = self._pending
        inputs = []
        fed = 0
        if pending is not None:
            at = {id(r): i for i, r in enumerate(pending.rows)}
            index = [at[id(r)] for r in rows if id(r) in at]  # a prefix of the rows
            fed = len(index)
            if fed:
                assert pending.picks is not None
                same = index == list(range(len(pending.rows)))
                inputs.append(pending.picks if same else pending.picks[mx.array(index)])
        if fed < len(rows):
            inputs.append(mx.array([r.generated[-1] for r in rows[fed:]], dtype=mx.uint32))
        tokens = inputs[0] if len(inputs) == 1 else mx.concatenate(inputs)
        self._cache.before_step()  # recurrent layers keep their state from before (unfeed)
        logits = self._model(tokens[:, None], cache=self._cache.layers)[:, -1, :]
        if host_bound(rows):
            mx.async_eval(logits)
            return _Step(None, rows, logits)
        picks = pick_in_graph(logits, rows).astype(mx.uint32)
        mx.async_eval(picks)
        return _Step(picks, rows)

    def _pick(self, step: _Step) -> None:
        """Launch a host-bound step's picks: its rows' tokens so far are all read."""
        if step.logits is None:
            return
        here = {id(r) for r in self.rows}
        live = [id(r) in here and not r.finished for r in step.rows]
        step.picks = pick(step.logits, step.rows, live).astype(mx.uint32)
        step.logits = None
        mx.async_eval(step.picks)

    def _read(self, step: _Step) -> list[Generation]:
        """Read a step's picks and send them; the turns that ended at it."""
        assert step.picks is not None
        picks = cast(list[int], step.picks.tolist())
        self.steps += 1
        here = {id(r) for r in self.rows}
        done = []
        for request, token in zip(step.rows, picks, strict=True):
            if id(request) not in here:
                continue  # left meanwhile (cancelled)
            self.generated += 1
            request.tokens.append(request.generated[-1])  # what this step fed it
            if not request.emit(token):
                done.append(request)
        return done

    def clear(self) -> list[Generation]:
        """Drop every row and the step in flight (the engine stops); returns the turns."""
        rows, self.rows = self.rows, []
        self._cache = None
        self._pending = None
        return rows
