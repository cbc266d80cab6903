"""The server's Prometheus metrics: declared once (the tables below), made in a private
registry per app so that two apps (or two tests) never share a count."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..actors.enums import Tier
from ..actors.records import Completion
from ._served import Served

# How long /metrics waits for the engine's figures: the engine answers between steps, and
# a step of a long prefill takes seconds on a CPU; past this the last figures are shown.
STATS_WAIT_S = 0.06

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# kvactor_<name>: a field of ``Session.stats()``, read when /metrics is asked.
_ENGINE_GAUGES = (
    ("cache_bytes", "Hot-tier bytes in use"),
    ("budget_bytes", "Hot-tier budget (0: none)"),
    ("peak_bytes", "Hot-tier peak bytes"),
    ("agents_cached", "Agents with a hot cache"),
    ("ready_agents", "Hot agents keeping a float copy"),
    ("demoted_warm", "Caches demoted to the warm tier"),
    ("demoted_cold", "Caches dropped (no warm copy)"),
    ("installs", "Caches reloaded from the warm tier"),
    ("warm_writes", "Turns written to the warm tier"),
    ("warm_write_failures", "Turns whose warm write failed"),
    ("max_batch_seen", "The largest decode batch so far"),
    ("decoding", "Agents decoding now"),
    ("waiting", "Turns waiting to start"),
    ("tool_waits", "Hot agents waiting on their tool calls' results (kept hot for tool_wait_s)"),
    ("constrained_tokens", "Tokens picked under a grammar's mask (tool calls, response formats)"),
    ("memory_limit_bytes", "The session's memory limit over models, caches and MLX (0: none)"),
    ("memory_bytes", "Bytes counted against the memory limit now"),
    ("memory_peak_bytes", "Peak bytes counted against the memory limit"),
    ("weights_bytes", "Weights of the models loaded now (with a memory limit)"),
    ("models_loaded", "Models loaded now (with a memory limit)"),
    ("model_loads", "Models loaded for a turn since the session started"),
    ("model_unloads", "Models unloaded for room since the session started"),
    ("warm_bytes", "Bytes the warm tier's agents hold on disk (a file several link: once)"),
    ("warm_limit_bytes", "The warm tier's disk limit (0: none)"),
    ("warm_written_bytes_total", "Bytes the warm tier wrote (segments and manifests)"),
    ("written_back_bytes_total", "Bytes of caches written back as they left memory"),
    ("write_back_refused", "Caches left cold as they left memory, for want of write budget"),
    ("write_budget_spent_bytes", "Bytes of the SSD write budget's window spent now"),
)

# kvactor_<name> of the stats field whose name differs (a counter's _total)
_RENAMED = {
    "warm_written_bytes_total": "warm_written_bytes",
    "written_back_bytes_total": "written_back_bytes",
    "write_budget_spent_bytes": "write_budget_spent",
}

# kvactor_warm_tier_<name>: a field of ``Session.warm_stats()``.
_WARM_GAUGES = (
    ("reads", "Warm caches read and verified"),
    ("bytes_read", "Bytes the warm tier read"),
    ("read_s", "Seconds the warm tier spent reading and verifying"),
    ("writes", "Appends to warm caches"),
    ("bytes_written", "Bytes the warm tier wrote (segments and manifests)"),
    ("write_s", "Seconds the warm tier spent writing (fsyncs included)"),
    ("rejected", "Warm caches refused when read (their agents went cold)"),
)


class Metrics:
    """One app's metrics: turns (counted by :meth:`turn`), HTTP requests and the requests
    in flight (counted by the app), the engine's and warm tier's figures (read by
    :meth:`render`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "kvactor_ttft_seconds",
            "Time to first token of a turn, by path",
            ["path"],
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.ttft_part = Histogram(
            "kvactor_ttft_part_seconds",
            "Where a turn's time to first token went: prompt (rendering, tokenizing and "
            "matching it, before the rest), queue (waiting), load (reading its warm cache), "
            "dequantize (making the working copy) and prefill",
            ["part"],
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.turns = Counter(
            "kvactor_turns", "Turns by the tier their cache came from", ["path"], registry=r
        )
        self.prompt_tokens = Counter("kvactor_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvactor_cached_tokens", "Prompt tokens reused from a cache", registry=r
        )
        self.generated_tokens = Counter("kvactor_generated_tokens", "Generated tokens", registry=r)
        self.tool_calls = Counter(
            "kvactor_tool_calls",
            "Tool calls the model made (in turns that ended in them)",
            registry=r,
        )
        self.tool_call_turns = Counter(
            "kvactor_tool_call_turns", "Turns that ended in tool calls", registry=r
        )
        self.cancelled = Counter(
            "kvactor_turns_cancelled",
            "Turns cancelled because their client left, by reply (whole or stream)",
            ["reply"],
            registry=r,
        )
        self.stats_age = Gauge(
            "kvactor_engine_stats_age_seconds",
            "How old the engine's figures shown are (the engine was mid-step when asked)",
            registry=r,
        )
        self._last: dict[str, tuple[float, Any]] = {}  # the figures last read, and when
        self.requests = Counter(
            "kvactor_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.in_flight = Gauge("kvactor_requests_in_flight", "Requests being answered", registry=r)
        self.engine = {
            name: Gauge(f"kvactor_{name}", help_, registry=r) for name, help_ in _ENGINE_GAUGES
        }
        self.demotions = Gauge(
            "kvactor_demotions_total",
            "Caches demoted, by tier: hot to warm, and to cold (hot dropped with no warm "
            "copy, or warm made cold for the disk limit)",
            ["to"],
            registry=r,
        )
        self.mask_seconds = Gauge(
            "kvactor_grammar_mask_seconds",
            "Host seconds spent computing grammar masks and following their tokens",
            registry=r,
        )
        self.warm = {
            name: Gauge(f"kvactor_warm_tier_{name}", help_, registry=r)
            for name, help_ in _WARM_GAUGES
        }
        self.warm_rate = Gauge(
            "kvactor_warm_tier_bytes_per_second",
            "The warm tier's read and write rates (bytes over their own time)",
            ["direction"],
            registry=r,
        )

    def turn(self, done: Completion, prefetched: bool = False) -> None:
        """Count a finished turn; ``prefetched``: a prefetch had staged its cache (a hot
        turn then counts under path ``prefetched``)."""
        t = done.timings
        path = "prefetched" if prefetched and done.path == Tier.HOT else str(done.path)
        self.ttft.labels(path).observe(t.ttft_s)
        self.ttft_part.labels("prompt").observe(t.prompt_s)
        self.ttft_part.labels("queue").observe(t.queue_s - t.load_s)
        self.ttft_part.labels("load").observe(t.load_s)
        self.ttft_part.labels("dequantize").observe(t.dequantize_s)
        self.ttft_part.labels("prefill").observe(t.prefill_s - t.dequantize_s)
        self.turns.labels(path).inc()
        self.prompt_tokens.inc(t.prompt_tokens)
        self.cached_tokens.inc(t.reused_tokens)
        self.generated_tokens.inc(t.generated_tokens)
        if done.tool_calls:
            self.tool_call_turns.inc()
            self.tool_calls.inc(len(done.tool_calls))

    async def _timely(self, name: str, read: Callable[[], Awaitable[Any]]) -> Any:
        """``read()``'s figures if they come within STATS_WAIT_S, else the last ones read
        (None before any); the engine's age goes to ``kvactor_engine_stats_age_seconds``."""
        with anyio.move_on_after(STATS_WAIT_S):
            self._last[name] = (anyio.current_time(), await read())
        if name not in self._last:
            return None
        at, figures = self._last[name]
        if name == "engine":
            self.stats_age.set(anyio.current_time() - at)
        return figures

    async def render(self, session: Served) -> bytes:
        """The Prometheus text of every metric, the session's figures read now (or, while
        the engine or the warm tier is mid-step, as they were last read)."""
        figures: dict[str, Any] = {}

        async def read(name: str, reader: Callable[[], Awaitable[Any]]) -> None:
            figures[name] = await self._timely(name, reader)

        async with anyio.create_task_group() as tg:  # both within one STATS_WAIT_S
            tg.start_soon(read, "engine", session.stats)
            tg.start_soon(read, "warm", session.warm_stats)
        stats, io = figures["engine"], figures["warm"]
        if stats is not None:
            for name, gauge in self.engine.items():
                gauge.set(getattr(stats, _RENAMED.get(name, name), 0) or 0)
            self.demotions.labels("warm").set(stats.demoted_warm)
            self.demotions.labels("cold").set(stats.demoted_cold + stats.demoted_warm_to_cold)
            self.mask_seconds.set(getattr(stats, "mask_s", 0.0))
        if io is not None:
            for name, gauge in self.warm.items():
                gauge.set(getattr(io, name))
            self.warm_rate.labels("read").set(io.bytes_read / io.read_s if io.read_s else 0)
            rate = io.bytes_written / io.write_s if io.write_s else 0
            self.warm_rate.labels("write").set(rate)
        return generate_latest(self.registry)
