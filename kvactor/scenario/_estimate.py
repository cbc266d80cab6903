"""Before a scenario runs: the longest context its turns may need and the hot budget that
``hot_agents`` asks for (see ``kvactor.scenario``)."""

from __future__ import annotations

from collections.abc import Mapping

from ..actors.engine import turn_reserve_bytes
from ..actors.models import Tokenizer
from ..actors.records import ModelInfo
from ..kernels.geometry import CacheGeometry
from ..kernels.qcodec import KVCodec
from ..kernels.stored import cache_nbytes
from ._format import Scenario, shared_text, turn_plan, turn_prompt

__all__ = ("estimate_budget", "estimate_context")


def _codec_bytes_per_token(info: ModelInfo) -> float:
    """Stored (quantized) bytes one token costs, all layers (sink tokens at higher precision
    are left out: the count starts past them)."""
    codec = KVCodec.from_description(info.codec)
    n = 1024
    return cache_nbytes(codec, _geometry(info), n, start=codec.sink_tokens) / n


def _geometry(info: ModelInfo) -> CacheGeometry:
    if info.geometry:
        return CacheGeometry.from_description(info.geometry, info.states)
    return CacheGeometry.uniform(info.n_layers, info.n_kv_heads, info.head_dim)


def estimate_context(s: Scenario, tokenizer: Tokenizer, start_tokens: Mapping[str, int]) -> int:
    """The most tokens (prompt + reply) any turn of the run may need: the conversations
    are rendered with every reply ``max_tokens`` long, on top of the ``start_tokens``
    that resumed agents already hold. A small margin covers quoted replies that tokenize
    into more tokens than were generated."""
    unit = " a"  # one token per repeat in BPE vocabularies; a byte tokenizer counts bytes
    per_unit = len(tokenizer.encode(unit * 64)) / 64

    def reply(max_tokens: int) -> str:
        return unit * max(1, int(max_tokens / per_unit))

    def count(messages: list[dict[str, str]], add_generation_prompt: bool) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return len(tokenizer.encode(text))

    context = shared_text(s)
    head: dict[str, list[dict[str, str]]] = {}
    for a in s.agents:
        system = context if context is not None else a.system
        head[a.name] = [{"role": "system", "content": system}] if system else []
    forks = {a.name: a.fork for a in s.agents if a.fork is not None and a.name not in start_tokens}
    conversations = {name: list(messages) for name, messages in head.items() if name not in forks}
    offset = {
        name: max(0, tokens - (count(head[name], False) if head[name] else 0))
        for name, tokens in start_tokens.items()
    }
    # A resumed run quotes what the agents said at the end of the previous one.
    said = {name: reply(s.sampling.max_tokens) for name in start_tokens}
    longest = 0
    for _, phase, names in turn_plan(s):
        max_tokens = phase.max_tokens or s.sampling.max_tokens
        snapshot = dict(said)
        for name in names:  # a fork starts as its source's conversation at the phase start
            source = forks.get(name)
            if source is not None and name not in conversations:
                conversations[name] = list(conversations[source])
                offset[name] = offset.get(source, 0)
        for name in names:
            messages = conversations[name]
            first = name not in start_tokens and name not in forks and len(messages) <= 1
            prompt = turn_prompt(s, phase, name, snapshot, first=first)
            messages.append({"role": "user", "content": prompt})
            need = offset.get(name, 0) + count(messages, True) + max_tokens
            longest = max(longest, need)
            said[name] = reply(max_tokens)
            messages.append({"role": "assistant", "content": said[name]})
    return int(longest * 1.02) + 8


def estimate_budget(
    s: Scenario, info: ModelInfo, tokenizer: Tokenizer, start_tokens: Mapping[str, int]
) -> tuple[int, str]:
    """The hot budget for ``s.hot_agents``: room for ``concurrency`` running turns at the
    longest context of the run (``estimate_context``; the engine reserves twice a float
    working copy of prompt + max_tokens, rounded up to 256 tokens, plus the stored
    cache) and for ``hot_agents`` idle agents' quantized caches of that length."""
    assert s.hot_agents is not None
    longest = estimate_context(s, tokenizer, start_tokens)
    reserve = turn_reserve_bytes(_geometry(info), longest)
    cached = longest * _codec_bytes_per_token(info)
    budget = int(s.concurrency * (reserve + cached) + s.hot_agents * cached)
    note = (
        f"hot_agents = {s.hot_agents:g}: {s.concurrency} running turn(s) of <= {longest} "
        f"tokens ({reserve / 1e6:.1f} MB working copy each) + {s.hot_agents:g} idle "
        f"cache(s) of <= {cached / 1e6:.1f} MB"
    )
    return budget, note
