"""What a scenario run measured: turn records, events, the summary (see ``kvactor.scenario``)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from ..actors.enums import FinishReason, Match, Tier, TurnPath
from ..actors.records import EngineStats, ModelInfo
from ._format import Scenario

__all__ = (
    "AgentRow",
    "ColdReference",
    "ContextRecord",
    "Event",
    "Footprint",
    "PathSummary",
    "PhaseStarted",
    "Results",
    "RunStarted",
    "Savings",
    "Sharing",
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
    Of the ``reused_tokens``, ``shared_tokens`` were another agent's cache shared at the
    turn's start (a shared context: ``Timings.shared_tokens``) and ``forked_tokens`` the
    cache a fork took over from its source (its first turn).
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
    shared_tokens: int = 0
    forked_tokens: int = 0


class ContextRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The shared context, made before the first phase: its tokens, and ``path`` COLD when
    it was prefilled then (``seconds``: that prefill, a measured cold prefill) or WARM
    when it was resumed from disk (``seconds``: the reload)."""

    tokens: int
    path: Tier
    seconds: float


class Footprint(msgspec.Struct, frozen=True, kw_only=True):
    """The caches' bytes at the end of the run. ``hot_bytes``: the stored (quantized)
    arrays of the ``hot_caches``, an array that several hold (a shared context's, a fork
    source's) once; ``hot_bytes_each``: each cache counted whole, as if it held its own
    copy. ``disk_bytes``: the warm tier's files of the scenario's agents (and context),
    a file hard-linked into several agents' folders once; ``disk_bytes_each``: every link
    counted, as copies would be."""

    hot_caches: int
    hot_bytes: int
    hot_bytes_each: int
    disk_files: int
    disk_bytes: int
    disk_bytes_each: int


class PathSummary(msgspec.Struct, frozen=True, kw_only=True):
    """TTFT of the turns of one kind. ``label``: cold, warm, prefetched (hot because the
    hint staged it from disk), hot, extend (the warm, prefetched and hot turns whose
    prompt extended the cache) or shared (the turns that shared another agent's cache).
    ``mean_queue_s``: before the prefill started (a reload from disk included).
    ``est_cold_ttft_s``: the mean of their estimated TTFT had they re-prefilled the
    whole prompt."""

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
    at the end of the run, in a session of its own (``reused_tokens``: 0, nothing there to
    share), next to that turn's TTFT with its cache."""

    index: int
    agent: str
    prompt_tokens: int
    ttft_s: float
    turn_ttft_s: float
    turn_path: str  # "{path}/{match}" of that turn
    reused_tokens: int = 0


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


class Sharing(msgspec.Struct, frozen=True, kw_only=True):
    """Prefix sharing over the run, against agents that each prefill their own prompts
    (no shared cache, no forks; every other turn as it was).

    ``prefilled_tokens``: the turns' new tokens plus the shared context's prefill
    (``context_tokens``, 0 when it was resumed from disk); ``independent_tokens``: what
    those agents would have prefilled, each turn's new tokens plus those it shared or
    took over from its fork source. ``ttft_s``: the turns' TTFT plus the making of the
    context; ``independent_ttft_s``: the turns' TTFT with each sharing or forked turn's
    estimated as a cold prefill of its whole prompt (as ``Savings``; None without an
    estimate)."""

    shared_turns: int
    shared_tokens: int
    forked_turns: int
    forked_tokens: int
    context_tokens: int
    prefilled_tokens: int
    independent_tokens: int
    ttft_s: float
    independent_ttft_s: float | None


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    paths: list[PathSummary]
    savings: Savings | None
    references: list[ColdReference]  # the longest turn's first
    sharing: Sharing | None = None  # None: no shared context and nothing shared or forked


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
    context: ContextRecord | None = None
    footprint: Footprint | None = None


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
    model: str | None = None  # the model it runs, in a session of several


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
    context: ContextRecord | None = None


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
SHARED = "shared"  # the summary's group of turns that shared another agent's cache


def turn_path(record: TurnRecord) -> TurnPath:
    """The turn's path as reports group it (PREFETCHED for a hot turn a hint staged)."""
    return TurnPath.PREFETCHED if record.prefetched else TurnPath(record.path)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def cold_model(
    turns: Sequence[TurnRecord],
    references: Sequence[ColdReference] = (),
    context: ContextRecord | None = None,
) -> tuple[Callable[[int], float], str] | None:
    """TTFT of a cold prefill of n tokens, from what this run measured: piecewise linear
    through the mean of its cold turns, its cold references and the shared context's
    prefill, proportional to n below the first point and above the last. Without any,
    prompt tokens / the prefill rate of the turns' new parts. None when nothing was
    prefilled."""
    cold = [t for t in turns if t.path is Tier.COLD]
    points: list[tuple[float, float]] = []
    parts = []
    if cold:
        points.append((_mean([t.prompt_tokens for t in cold]), _mean([t.ttft_s for t in cold])))
        parts.append(f"{len(cold)} cold turns ({points[0][0]:.0f} tokens on average)")
    if context is not None and context.path is Tier.COLD:
        points.append((float(context.tokens), context.seconds))
        parts.append(f"the shared context's prefill of {context.tokens} tokens")
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


def summarize(
    turns: Sequence[TurnRecord],
    references: Sequence[ColdReference] = (),
    context: ContextRecord | None = None,
) -> Summary:
    """TTFT by path, the time saved against prefilling every prompt from scratch, and
    (with a shared context, or turns that shared or forked) what sharing saved."""
    model = cold_model(turns, references, context)

    def est(t: TurnRecord) -> float:
        if t.path is Tier.COLD or model is None:
            return t.ttft_s
        return model[0](t.prompt_tokens)

    groups: list[tuple[str, list[TurnRecord]]] = [
        *((p, [t for t in turns if turn_path(t) is p]) for p in TurnPath),
        (Match.EXTEND, [t for t in turns if t.path is not Tier.COLD and t.match is Match.EXTEND]),
        (SHARED, [t for t in turns if t.shared_tokens > 0]),
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
    sharing = None
    shared = [t for t in turns if t.shared_tokens > 0]
    forked = [t for t in turns if t.forked_tokens > 0]
    if context is not None or shared or forked:
        context_tokens = context.tokens if context and context.path is Tier.COLD else 0
        prefilled = sum(t.prefilled_tokens for t in turns)
        independent = None
        if model is not None:
            independent = sum(
                model[0](t.prompt_tokens) if t.shared_tokens or t.forked_tokens else t.ttft_s
                for t in turns
            )
        sharing = Sharing(
            shared_turns=len(shared),
            shared_tokens=sum(t.shared_tokens for t in shared),
            forked_turns=len(forked),
            forked_tokens=sum(t.forked_tokens for t in forked),
            context_tokens=context_tokens,
            prefilled_tokens=prefilled + context_tokens,
            independent_tokens=sum(
                t.prefilled_tokens + t.shared_tokens + t.forked_tokens for t in turns
            ),
            ttft_s=sum(t.ttft_s for t in turns) + (context.seconds if context else 0.0),
            independent_ttft_s=independent,
        )
    return Summary(paths=paths, savings=savings, references=list(references), sharing=sharing)
