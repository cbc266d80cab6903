"""What a scenario run measured: turn records, events, the summary (see ``kvactor.scenario``)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from ._scenario_format import Scenario
from .actors import EngineStats, ModelInfo
from .actors.enums import FinishReason, Match, Tier, TurnPath

__all__ = (
    "AgentRow",
    "ColdReference",
    "Event",
    "PathSummary",
    "PhaseStarted",
    "Results",
    "RunStarted",
    "Savings",
    "Summary",
    "TurnFinished",
    "TurnRecord",
    "TurnStarted",
    "cold_model",
    "load_results",
    "summarize",
    "write_results",
)


# ---------------------------------------------------------------------------- results
class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One agent's turn in one phase: how its cache was found and what it cost.

    ``path`` is cold / warm / hot as the agent reports it; ``prefetched`` marks a hot turn
    whose cache was staged from disk by the prefetch hint (it was not hot when hinted).
    ``cache_tokens`` / ``cache_bytes`` are the agent's hot cache right after the turn.
    ``start_s`` counts from the start of the first phase; ``wall_s`` is the whole turn.
    """

    index: int
    phase: str
    phase_index: int
    agent: str
    path: Tier
    match: Match
    prefetched: bool
    ttft_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    decode_tok_s: float
    finish_reason: FinishReason
    cache_tokens: int
    cache_bytes: int
    start_s: float
    wall_s: float
    text: str


class PathSummary(msgspec.Struct, frozen=True, kw_only=True):
    """TTFT of the turns of one kind. ``label``: cold, warm, prefetched (hot because the
    hint staged it from disk), hot, or extend (the warm, prefetched and hot turns whose
    prompt extended the cache). ``mean_queue_s``: before the prefill started (a reload
    from disk included). ``est_cold_ttft_s``: the mean of their estimated TTFT had they
    re-prefilled the whole prompt."""

    label: str
    turns: int
    mean_ttft_s: float
    median_ttft_s: float
    mean_queue_s: float
    mean_prompt_tokens: float
    mean_reused_tokens: float
    est_cold_ttft_s: float


class ColdReference(msgspec.Struct, frozen=True, kw_only=True):
    """A measured cold prefill: the prompt of turn ``index`` prefilled again from scratch
    by a throwaway agent at the end of the run, next to that turn's TTFT with its cache."""

    index: int
    agent: str
    prompt_tokens: int
    ttft_s: float
    turn_ttft_s: float
    turn_path: str  # "{path}/{match}" of that turn


class Savings(msgspec.Struct, frozen=True, kw_only=True):
    """Time to first token of the whole run against prefilling every prompt from scratch.

    Cold turns count as measured; each other turn's cold TTFT is estimated from the cold
    prefills measured in this run (``method`` says how). Queueing is left out of the
    estimate, so the saving is if anything understated."""

    method: str
    actual_ttft_s: float
    est_cold_ttft_s: float
    saved_s: float
    saved_fraction: float


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    paths: list[PathSummary]
    savings: Savings | None
    references: list[ColdReference]  # the longest turn's first


class Results(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a run measured, with the scenario (as run) echoed."""

    scenario: Scenario
    model: ModelInfo
    cache_dir: str | None
    budget_bytes: int | None
    budget_note: str
    resumed: list[str]
    reset: str | None
    turns: list[TurnRecord]
    summary: Summary
    stats: EngineStats
    wall_s: float
    started_at: float


class AgentRow(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the live table: where an agent's cache is now (hot / warm / cold, with
    its tokens and bytes: in memory when hot, on disk when warm) and its last turn."""

    agent: str
    tier: Tier
    tokens: int
    nbytes: int
    turns: int
    last_path: Tier | None
    last_match: Match | None
    last_ttft_s: float | None


class RunStarted(msgspec.Struct, frozen=True, kw_only=True):
    """The session is open. ``found_warm``: agents of this scenario with a warm cache on
    disk before the run; ``resumed``: those that resume it; ``reset``: why earlier caches
    were forgotten (None: they were not)."""

    scenario: Scenario
    model: ModelInfo
    cache_dir: str | None
    budget_bytes: int | None
    budget_note: str
    found_warm: list[str]
    resumed: list[str]
    resumed_tokens: int
    reset: str | None
    total_turns: int
    agents: list[AgentRow]


class PhaseStarted(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    name: str
    agents: list[str]


class TurnStarted(msgspec.Struct, frozen=True, kw_only=True):
    phase_index: int
    agent: str
    index: int
    total: int


class TurnFinished(msgspec.Struct, frozen=True, kw_only=True):
    record: TurnRecord
    total: int
    agents: list[AgentRow]  # every agent's tier right after this turn


Event = RunStarted | PhaseStarted | TurnStarted | TurnFinished


def write_results(results: Results, path: str | Path) -> None:
    """Write ``results`` as indented JSON. Raises OSError."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=2) + b"\n")


def load_results(path: str | Path) -> Results:
    """Read a results file. Raises OSError, msgspec.ValidationError / DecodeError."""
    return msgspec.json.decode(Path(path).read_bytes(), type=Results)


# ---------------------------------------------------------------------------- summary
def turn_path(record: TurnRecord) -> TurnPath:
    """The turn's path as reports group it (PREFETCHED for a hot turn a hint staged)."""
    return TurnPath.PREFETCHED if record.prefetched else TurnPath(record.path)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def cold_model(
    turns: Sequence[TurnRecord], references: Sequence[ColdReference] = ()
) -> tuple[Callable[[int], float], str] | None:
    """TTFT of a cold prefill of n tokens, from what this run measured: piecewise linear
    through the mean of its cold turns and its cold references, proportional to n below
    the first point and above the last. Without either, prompt tokens / the prefill
    rate of the turns' new parts. None when nothing was prefilled."""
    cold = [t for t in turns if t.path is Tier.COLD]
    points: list[tuple[float, float]] = []
    parts = []
    if cold:
        points.append((_mean([t.prompt_tokens for t in cold]), _mean([t.ttft_s for t in cold])))
        parts.append(f"{len(cold)} cold turns ({points[0][0]:.0f} tokens on average)")
    if references:
        points += [(float(r.prompt_tokens), r.ttft_s) for r in references]
        sizes = " and ".join(str(r.prompt_tokens) for r in sorted(references, key=_tokens))
        plural = "s" if len(references) > 1 else ""
        parts.append(f"cold reference prefill{plural} of {sizes} tokens")
    points = sorted(p for p in points if p[0] > 0 and p[1] > 0)
    if points:

        def estimate(n: int) -> float:
            if n <= points[0][0]:
                return n * points[0][1] / points[0][0]
            for (n0, t0), (n1, t1) in itertools.pairwise(points):
                if n <= n1:
                    return t0 + (n - n0) * (t1 - t0) / (n1 - n0)
            return n * points[-1][1] / points[-1][0]

        return estimate, "interpolated from " + " and ".join(parts)
    some = [t for t in turns if t.prefill_s > 0 and t.prefilled_tokens > 1]
    if not some:
        return None
    rate = sum(t.prefilled_tokens for t in some) / sum(t.prefill_s for t in some)
    return (
        lambda n: n / rate,
        f"prompt tokens / {rate:.0f} tok/s, the prefill rate of the new part of {len(some)} "
        "turns (no cold prefill was measured)",
    )


def _tokens(reference: ColdReference) -> int:
    return reference.prompt_tokens


def summarize(turns: Sequence[TurnRecord], references: Sequence[ColdReference] = ()) -> Summary:
    """TTFT by path, and the time saved against prefilling every prompt from scratch."""
    model = cold_model(turns, references)

    def est(t: TurnRecord) -> float:
        if t.path is Tier.COLD or model is None:
            return t.ttft_s
        return model[0](t.prompt_tokens)

    groups: list[tuple[TurnPath | Match, list[TurnRecord]]] = [
        *((p, [t for t in turns if turn_path(t) is p]) for p in TurnPath),
        (Match.EXTEND, [t for t in turns if t.path is not Tier.COLD and t.match is Match.EXTEND]),
    ]
    paths = [
        PathSummary(
            label=label,
            turns=len(group),
            mean_ttft_s=_mean([t.ttft_s for t in group]),
            median_ttft_s=statistics.median(t.ttft_s for t in group),
            mean_queue_s=_mean([t.queue_s for t in group]),
            mean_prompt_tokens=_mean([t.prompt_tokens for t in group]),
            mean_reused_tokens=_mean([t.reused_tokens for t in group]),
            est_cold_ttft_s=_mean([est(t) for t in group]),
        )
        for label, group in groups
        if group
    ]
    savings = None
    if model is not None:
        actual = sum(t.ttft_s for t in turns)
        cold_total = sum(est(t) for t in turns)
        savings = Savings(
            method=model[1],
            actual_ttft_s=actual,
            est_cold_ttft_s=cold_total,
            saved_s=cold_total - actual,
            saved_fraction=(cold_total - actual) / cold_total if cold_total > 0 else 0.0,
        )
    return Summary(paths=paths, savings=savings, references=list(references))
