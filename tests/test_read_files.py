"""A warm cache written over many departures (a file each) is read with its files side by
side (``actors.warm._fileio.each_file``): it answers as a cache written at once does, and
a refusal still names the first bad file in token order (tiny model, real files, real
actors)."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import pytest

import kvactor
from kvactor.actors.enums import StageOutcome, Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm._fileio import each_file
from kvactor.actors.warm._prefetch import Stage

tiny = functools.partial(make_tiny_model, 0, head_dim=64)
TURNS = ["the first question", "a second one", "then a third", "and the fourth"]


def test_each_file_ends_every_call_then_raises_the_first_in_order() -> None:
    second_failed = threading.Event()
    ended: list[int] = []

    def call(i: int) -> int:
        if i == 0:  # fails after the second did: its error still comes first
            assert second_failed.wait(10), "the calls did not run side by side"
            ended.append(i)
            raise ValueError("the first")
        if i == 1:
            second_failed.set()
            raise KeyError("the second")
        ended.append(i)
        return i

    with pytest.raises(ValueError, match="the first"):
        each_file(call, [0, 1, 2, 3])
    assert sorted(ended) == [0, 2, 3]  # every call had ended
    assert each_file(lambda i: i * 2, [1, 2, 3]) == [2, 4, 6]  # in order


async def build(root: Path, agent: str) -> list[str]:
    """The turns of ``TURNS``, a session each: a file per departure. Their answers."""
    answers = []
    for turn in TURNS:
        async with kvactor.open(tiny, cache_dir=root) as kv:
            a = await kv.spawn_agent(agent)
            answers.append((await a.generate(turn, max_tokens=5)).text)
    return answers


def segments(root: Path, agent: str) -> list[Path]:
    """The agent's segment files, in token order (its manifest's)."""
    folder = root / "agents" / agent
    manifest = json.loads((folder / "manifest.json").read_bytes())["manifest"]
    return [folder / s["file"] for s in sorted(manifest["segments"], key=lambda s: s["start"])]


async def test_a_cache_in_a_file_per_departure_answers_as_a_hot_one(tmp_path: Path) -> None:
    answers = await build(tmp_path, "many")
    assert len(segments(tmp_path, "many")) >= len(TURNS)
    async with kvactor.open(tiny, cache_dir=tmp_path / "hot") as kv:
        hot = await kv.spawn_agent("hot")
        for turn, answer in zip(TURNS, answers, strict=True):
            assert (await hot.generate(turn, max_tokens=5)).text == answer
        last_hot = await hot.generate("the last turn", max_tokens=6)
    async with kvactor.open(tiny, cache_dir=tmp_path) as kv:
        last = await (await kv.spawn_agent("many")).generate("the last turn", max_tokens=6)
    assert (last.path, last_hot.path) == (Tier.WARM, Tier.HOT)
    assert last.token_ids == last_hot.token_ids


async def test_the_first_bad_file_in_token_order_names_the_refusal(tmp_path: Path) -> None:
    await build(tmp_path, "many")
    files = segments(tmp_path, "many")
    second, last = files[1], files[-1]
    flipped = bytearray(second.read_bytes())
    flipped[-1] ^= 0xFF  # a data byte: its checksum no longer matches
    second.write_bytes(bytes(flipped))
    last.write_bytes(last.read_bytes()[:-16])  # cut short: refused at its open, sooner
    async with kvactor.open(tiny, cache_dir=tmp_path) as kv:
        staged = await kv.prefetcher.ask(Stage("many"), timeout=None)  # type: ignore[union-attr]
        assert staged.outcome == StageOutcome.REJECTED
        assert f"{second.name}: checksum mismatch" in staged.detail
        assert last.name not in staged.detail
        turn = await (await kv.spawn_agent("many")).generate("again", max_tokens=4)
    assert turn.path == Tier.COLD  # refused with its reason, the agent goes on cold
