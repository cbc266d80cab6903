"""What a scenario run prints: one line per turn, a table of every agent's tier, and the
end-of-run summary.

The live view prints one line per turn and a table of every agent's tier; on a terminal
the table is redrawn in place after each turn, elsewhere (CI logs, pipes) it is printed
once per phase. The summary gives TTFT by path, the time saved against re-prefilling,
the engine's demotions and reloads, and (with a shared context or forks) what sharing
saved against agents that each prefill their own prompts.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from typing import IO

from ..actors.enums import Tier
from ..text import size, table
from ._results import (
    SHARED,
    AgentRow,
    Event,
    PhaseStarted,
    Results,
    RunStarted,
    TurnFinished,
    TurnRecord,
    TurnStarted,
    turn_path,
)

__all__ = ("WIDTH", "LiveView", "agent_table", "format_summary", "turn_line")

WIDTH = 92  # summary paragraphs wrap here


# ----------------------------------------------------------------------------- tables
def agent_table(rows: Sequence[AgentRow]) -> list[str]:
    """Every agent's tier and last turn; with several models, the model each runs."""
    several = any(r.model is not None for r in rows)
    body = [
        (
            r.agent,
            *([r.model or "-"] if several else []),
            r.tier,
            str(r.tokens),
            size(r.nbytes) if r.nbytes else "-",
            str(r.turns),
            f"{r.last_path}/{r.last_match}" if r.last_path else "-",
            f"{r.last_ttft_s:.2f} s" if r.last_ttft_s is not None else "-",
        )
        for r in rows
    ]
    head = ("agent", *(["model"] if several else []), "tier", "tokens", "cache", "turns")
    head += ("last path", "last TTFT")
    return table(head, body, {c + several for c in (2, 3, 4, 6)})


def turn_line(record: TurnRecord, total: int) -> str:
    width = len(str(total))
    own = record.reused_tokens - record.shared_tokens - record.forked_tokens
    parts = []
    if record.shared_tokens:
        parts.append(f"{record.shared_tokens} shared")
    if record.forked_tokens:
        parts.append(f"{record.forked_tokens} forked")
    if own or not parts:
        parts.append(f"{own} reused")
    reused = " + ".join([*parts, f"{record.prefilled_tokens} new"])
    return (
        f"  [{record.index + 1:>{width}}/{total}] {record.agent:<10} "
        f"{turn_path(record):<10} {record.match:<7} TTFT {record.ttft_s:6.2f} s  "
        f"prompt {record.prompt_tokens} ({reused})  "
        f"-> {record.generated_tokens} tokens at {record.decode_tok_s:.1f} tok/s"
    )


def format_summary(results: Results) -> list[str]:
    """The end-of-run report: TTFT by path, time saved, engine statistics."""
    summary, stats = results.summary, results.stats
    rows = [
        (
            p.label,
            str(p.turns),
            f"{p.mean_ttft_s:.2f} s",
            f"{p.median_ttft_s:.2f} s",
            f"{p.mean_queue_s * 1000:.0f} ms",
            f"{p.mean_prompt_tokens:.0f}",
            f"{p.mean_reused_tokens:.0f}",
            f"{p.est_cold_ttft_s:.2f} s",
        )
        for p in summary.paths
    ]
    head = ("path", "turns", "mean TTFT", "median", "queue", "prompt tok", "reused", "if cold")
    out = [f"TTFT by path ({len(results.turns)} turns):", *table(head, rows, set(range(1, 8)))]
    legend = (
        "cold: nothing reused; warm: reloaded from disk for the turn; prefetched: staged from "
        "disk while the previous turn decoded; hot: still in memory; extend: the non-cold turns "
        "whose prompt extended the cached one. queue: before the prefill (a reload from disk "
        "included). if cold: the estimated TTFT had the whole prompt been prefilled."
    )
    if any(p.label == SHARED for p in summary.paths):
        legend += " shared: the turns that shared another agent's cache (the shared context)."
    out += textwrap.wrap(legend, WIDTH, initial_indent="  ", subsequent_indent="  ")
    paragraphs = []
    for ref in summary.references[:1]:  # the longest turn
        turn = results.turns[ref.index]
        queued = f" ({turn.queue_s:.2f} s of it queued)" if turn.queue_s >= 0.05 else ""
        paragraphs.append(
            f"cold reference (measured): {ref.agent}'s prompt of turn {ref.index + 1}, "
            f"{ref.prompt_tokens} tokens, "
            f"prefilled from scratch took {ref.ttft_s:.2f} s; with its cache ({turn.path}/"
            f"{turn.match}, {turn.reused_tokens} tokens reused) that turn took "
            f"{ref.turn_ttft_s:.2f} s{queued}: "
            f"{ref.ttft_s / max(ref.turn_ttft_s, 1e-9):.1f}x faster."
        )
    saving = summary.savings
    if saving is not None:
        paragraphs.append(
            f"time to first token over all turns: {saving.actual_ttft_s:.1f} s measured, "
            f"{saving.est_cold_ttft_s:.1f} s estimated had every prompt been prefilled from "
            f"scratch: {saving.saved_s:.1f} s saved ({saving.saved_fraction:.0%}). Estimate: "
            f"{saving.method}; queueing left out."
        )
    budget = f" of a {size(stats.budget_bytes)} budget" if stats.budget_bytes else " (no budget)"
    paragraphs.append(
        f"engine: {stats.ready_turns} turns started from a ready float copy, "
        f"{stats.dropped_ready} ready copies dropped for room; "
        f"{stats.demoted_warm} demotions to warm, {stats.demoted_cold} to cold, "
        f"{stats.installs} reloads from disk; hot-tier peak {size(stats.peak_bytes)}{budget}; "
        f"{stats.generated_tokens} tokens generated; wall time {results.wall_s:.1f} s."
    )
    if stats.memory_limit_bytes is not None:
        memory = (
            f"memory: peak {size(stats.memory_peak_bytes)} counted (weights, activations, "
            f"caches, MLX's kept buffers) of a {size(stats.memory_limit_bytes)} limit"
        )
        if stats.models_loaded > 1 or stats.model_loads or stats.model_unloads:
            memory += (
                f"; {stats.models_loaded} model(s) loaded at the end, {stats.model_loads} "
                f"loads and {stats.model_unloads} unloads for room (median swap "
                f"{stats.swap_s:.2f} s)"
            )
        paragraphs.append(memory + ".")
    if stats.warm_limit_bytes is not None:
        paragraphs.append(
            f"warm tier: {size(stats.warm_bytes)} on disk of a {size(stats.warm_limit_bytes)} "
            f"limit, {size(stats.warm_written_bytes)} written; "
            f"{stats.demoted_warm_to_cold} agents made cold for room on disk."
        )
    if stats.warm_write_failures:
        paragraphs.append(
            f"warm tier: {stats.warm_write_failures} of "
            f"{stats.warm_writes + stats.warm_write_failures} writes failed (see the log): "
            "those turns were not saved until a later write of the same agent succeeded."
        )
    if summary.sharing is not None:
        paragraphs.append(sharing_paragraph(results))
    for paragraph in paragraphs:
        out += ["", *textwrap.wrap(paragraph, WIDTH, subsequent_indent="  ")]
    if summary.sharing is not None:
        out += sharing_table(results)
    return out


def sharing_paragraph(results: Results) -> str:
    """What was shared: the context, the turns that shared it, the forks."""
    sharing = results.summary.sharing
    assert sharing is not None
    said = []
    context = results.context
    if context is not None:
        made = (
            f"prefilled once in {context.seconds:.1f} s"
            if context.path is Tier.COLD
            else f"resumed from disk in {context.seconds:.1f} s"
        )
        said.append(f"the shared context ({context.tokens} tokens) was {made}")
    if sharing.shared_turns:
        said.append(
            f"{_count(sharing.shared_turns, 'turn')} shared {sharing.shared_tokens} tokens of "
            "its cache instead of prefilling them"
        )
    elif context is not None:
        said.append("no turn shared its cache (share_prefixes = false?)")
    if sharing.forked_turns:
        said.append(
            f"{_count(sharing.forked_turns, 'fork')} took over {sharing.forked_tokens} tokens "
            "of a source's cache"
        )
    return (
        f"shared prefixes: {'; '.join(said)}. Against agents that each prefill their own "
        "prompts (no shared context, no forks):"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def sharing_table(results: Results) -> list[str]:
    """Tokens prefilled, time to first tokens and bytes: as run, and as independent
    agents would have needed (estimated time; bytes as if nothing were shared)."""
    sharing = results.summary.sharing
    assert sharing is not None
    ratio = sharing.independent_tokens / max(sharing.prefilled_tokens, 1)
    rows = [
        (
            "tokens prefilled",
            f"{sharing.prefilled_tokens:,}",
            f"{sharing.independent_tokens:,}",
            f"{ratio:.1f}x",
        )
    ]
    if sharing.independent_ttft_s is not None:
        rows.append(
            (
                "time to first tokens",
                f"{sharing.ttft_s:.1f} s",
                f"{sharing.independent_ttft_s:.1f} s",
                f"{sharing.independent_ttft_s / max(sharing.ttft_s, 1e-9):.1f}x",
            )
        )
    footprint = results.footprint
    if footprint is not None:
        rows.append(
            (
                f"hot caches ({footprint.hot_caches})",
                size(footprint.hot_bytes),
                size(footprint.hot_bytes_each),
                f"{footprint.hot_bytes_each / max(footprint.hot_bytes, 1):.1f}x",
            )
        )
        if footprint.disk_files:
            rows.append(
                (
                    "warm tier on disk",
                    size(footprint.disk_bytes),
                    size(footprint.disk_bytes_each),
                    f"{footprint.disk_bytes_each / max(footprint.disk_bytes, 1):.1f}x",
                )
            )
    lines = table(("", "shared", "independent", ""), rows, {1, 2, 3})
    notes = (
        "time to first tokens: the turns' TTFT plus making the shared context; for "
        "independent agents each sharing or forked turn is estimated as a cold prefill of "
        "its whole prompt. hot caches: their stored bytes at the end, shared arrays once; "
        "independent: each cache whole. disk: hard-linked files once; independent: each "
        "link as a copy."
    )
    return [*lines, *textwrap.wrap(notes, WIDTH, initial_indent="  ", subsequent_indent="  ")]


# -------------------------------------------------------------------------- live view
class LiveView:
    """Prints a run as it happens. On a terminal the agent table is redrawn in place
    after every turn; otherwise it is printed after each phase."""

    def __init__(self, out: IO[str] | None = None, *, redraw: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.redraw = self.out.isatty() if redraw is None else redraw
        self.live = 0  # lines of the live block on screen
        self.phases: list[str] = []
        self.phase_sizes: list[int] = []
        self.done_in_phase = 0
        self.table: list[str] = []

    def write(self, lines: Sequence[str], live: Sequence[str] = ()) -> None:
        """Print ``lines`` for good, then (on a terminal) the live block under them."""
        if self.live:
            self.out.write(f"\x1b[{self.live}F\x1b[J")  # up to the block's start, clear
        for line in lines:
            self.out.write(line + "\n")
        self.live = 0
        if self.redraw:
            for line in live:
                self.out.write(line + "\n")
            self.live = len(live)
        self.out.flush()

    def __call__(self, event: Event) -> None:
        match event:
            case RunStarted():
                self.started(event)
            case PhaseStarted(index=index, name=name, agents=agents):
                self.done_in_phase = 0
                self.write([f"phase {index + 1}/{len(self.phases)} {name}: {', '.join(agents)}"])
            case TurnStarted(agent=agent, index=index, total=total):
                if self.redraw:
                    self.write([], [*self.table, f"  ... {agent}'s turn ({index + 1}/{total})"])
            case TurnFinished(record=record, total=total, agents=rows):
                self.done_in_phase += 1
                table_lines = self.table = agent_table(rows)
                end_of_phase = self.done_in_phase == self.phase_sizes[record.phase_index]
                if self.redraw:
                    self.write([turn_line(record, total)], table_lines)
                    if end_of_phase:
                        self.write(table_lines)  # keep the phase's final state
                else:
                    self.write([turn_line(record, total), *(table_lines if end_of_phase else [])])

    def started(self, event: RunStarted) -> None:
        s = event.scenario
        self.phases = [p.name for p in s.phases]
        every = len(s.agents)
        self.phase_sizes = [len(p.agents) if p.agents else every for p in s.phases]
        lines = [
            f"scenario {s.name!r}: {every} agents, {len(s.phases)} phases, "
            f"{event.total_turns} turns; model {event.model.name} "
            f"({event.model.n_layers} layers)",
            f"hot budget: {size(event.budget_bytes) if event.budget_bytes else 'none'}"
            f" ({event.budget_note})",
            f"warm tier: {event.cache_dir or 'none (demoted caches are lost)'}",
        ]
        context = event.context
        if context is not None:
            how = "prefilled" if context.path is Tier.COLD else "resumed from disk"
            lines.append(
                f"shared context: {context.tokens} tokens, {how} in {context.seconds:.1f} s: "
                "every agent's system prompt, shared"
            )
        elif s.shared_context is not None:
            lines.append(
                "shared context: not shared (share_prefixes = false): every agent's system "
                "prompt, prefilled by each"
            )
        if event.reset is not None:
            lines.append(
                f"found warm caches for {len(event.found_warm)} agents, but {event.reset}: "
                "forgot them, starting cold"
            )
        elif event.resumed:
            lines.append(
                f"found warm caches for {len(event.resumed)} agents from a previous run "
                f"({event.resumed_tokens} tokens): resuming from disk"
            )
        elif event.found_warm:
            lines.append(
                f"found warm caches for {len(event.found_warm)} agents that cannot be resumed "
                "(another model or codec, or a changed system prompt): starting cold"
            )
        elif event.cache_dir is not None:
            lines.append("no warm caches from a previous run: starting cold")
        self.table = agent_table(event.agents)
        self.write([*lines, ""], self.table)
        if not self.redraw:
            self.write(self.table)
