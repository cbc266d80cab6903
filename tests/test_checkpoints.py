"""Checkpoints of recurrent states (state-space and linear-attention layers): each stored
range keeps the states at its end, a turn resumes from the latest one at or before where
its prompt diverges, as many are kept as ``checkpoints`` says (hot and on disk, in the
budget), forks and shared prefixes share them, and a token fed past a turn's end by the
pipelined step is taken back. Tiny random models of every recurrent family, both attention
modes; real engine, files and actors."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
import safetensors.numpy
from multimodels import hot_pool

import kvactor
from kvactor.actors.engine._batch import DecodeBatch
from kvactor.actors.enums import Match, StageOutcome, Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.models._tiny import TINY_FAMILIES
from kvactor.actors.warm._prefetch import Stage

pytestmark = pytest.mark.one_backend  # checkpoints of each recurrent family, not the event loop


RECURRENT = [
    f
    for f in sorted(TINY_FAMILIES)
    if f != "kimi_linear" and make_tiny_model(0, f).geometry.recurrent
]
MODES: list[kvactor.Attention] = ["dequantized", "quantized"]
ATTENTION = pytest.mark.parametrize("attention", MODES)
FAMILY = pytest.mark.parametrize("family", RECURRENT)
BASE = "The quick brown fox jumps over the lazy dog by the river. "
SAMPLE: dict[str, Any] = {"max_tokens": 6, "temperature": 1.0, "seed": 5}


def tiny(family: str) -> Any:
    return functools.partial(make_tiny_model, 0, family)


def _pool(kv: Any) -> Any:
    return hot_pool(kv)


def _prompts(first: kvactor.Completion, second: kvactor.Completion | None = None) -> list[str]:
    """Turn 2 extends turn 1; turn 3 extends turn 2; the diverging turn keeps turn 1 (its
    prompt and answer) and asks something else than turn 2."""
    two = BASE + first.text + " Then what happened?"
    out = [two, BASE + first.text + " Where did it go instead?"]
    if second is not None:
        out.insert(1, two + second.text + " And after that?")
    return out


async def _three_then_diverge(
    family: str,
    attention: kvactor.Attention,
    root: Path | None,
    reload: bool,
    checkpoints: int = 8,
) -> tuple[list[kvactor.Completion], kvactor.CacheInfo]:
    async with kvactor.open(
        tiny(family), attention=attention, checkpoints=checkpoints, cache_dir=root
    ) as kv:
        agent = await kv.spawn_agent("a")
        t1 = await agent.complete(BASE, **SAMPLE)
        t2 = await agent.complete(_prompts(t1)[0], **SAMPLE)
        t3 = await agent.complete(_prompts(t1, t2)[1], **SAMPLE)
        info = await kv.cache_info("a")
        turns = [t1, t2, t3]
        if not reload:
            turns.append(await agent.complete(_prompts(t1)[-1], **SAMPLE))
            return turns, info
    async with kvactor.open(
        tiny(family), attention=attention, checkpoints=checkpoints, cache_dir=root
    ) as kv:
        agent = await kv.spawn_agent("a")
        turns.append(await agent.complete(_prompts(t1)[-1], **SAMPLE))
        return turns, info


@FAMILY
@ATTENTION
async def test_a_diverge_resumes_from_a_checkpoint_as_a_replay_of_the_turns_up_to_it(
    tmp_path: Path, family: str, attention: kvactor.Attention
) -> None:
    # Agent A takes three turns, then a fourth that keeps its first turn and diverges in
    # the second: it resumes from the checkpoint at the end of the first turn. Agent B
    # replays only the first turn and then asks the same: the same tokens (the states are
    # exact, the attention layers hold what they would have held). Reloaded from disk
    # before the fourth turn, A does the same.
    hot, info = await _three_then_diverge(family, attention, None, reload=False)
    warm, _ = await _three_then_diverge(family, attention, tmp_path, reload=True)
    async with kvactor.open(tiny(family), attention=attention, checkpoints=8) as kv:
        b = await kv.spawn_agent("b")
        b1 = await b.complete(BASE, **SAMPLE)
        replay = await b.complete(_prompts(b1)[-1], **SAMPLE)
    assert b1.token_ids == hot[0].token_ids
    diverged = hot[3]
    assert diverged.match == Match.DIVERGE and replay.match == Match.EXTEND
    # Two checkpoints a turn: one token before the prompt's end, and the turn's end.
    end_of_first = hot[0].timings.prompt_tokens + len(hot[0].token_ids) - 1  # last pick unfed
    assert info.checkpoints == 6 and info.checkpoint_tokens[1] == end_of_first
    assert info.checkpoint_tokens[0] == hot[0].timings.prompt_tokens - 1
    assert diverged.timings.reused_tokens == replay.timings.reused_tokens == end_of_first
    assert diverged.token_ids == replay.token_ids
    assert warm[3].path == Tier.WARM
    assert [t.token_ids for t in warm] == [t.token_ids for t in hot]
    assert warm[3].timings.reused_tokens == diverged.timings.reused_tokens


@ATTENTION
async def test_only_the_last_checkpoints_stay_and_a_turn_below_them_starts_afresh(
    tmp_path: Path, attention: kvactor.Attention
) -> None:
    # checkpoints=2 keeps the last turn's two: the turn that diverges in the second turn
    # finds no checkpoint at or before it and prefills everything, kept hot as reloaded.
    family = "qwen3_next"
    state = make_tiny_model(0, family).geometry.state_bytes
    hot, info = await _three_then_diverge(family, attention, None, False, checkpoints=2)
    warm, _ = await _three_then_diverge(family, attention, tmp_path, True, checkpoints=2)
    assert info.checkpoints == 2 and info.checkpoint_bytes == 2 * state
    assert info.checkpoint_tokens[-1] == info.tokens
    assert hot[3].match == Match.DIVERGE and hot[3].timings.reused_tokens == 0
    assert warm[3].path == Tier.COLD and warm[3].timings.reused_tokens == 0
    assert [t.token_ids for t in warm] == [t.token_ids for t in hot]
    # On disk as many state files as checkpoints, and the manifest says format 3.
    folder = tmp_path / "agents" / "a"
    assert len(list(folder.glob("st-*.safetensors"))) == 2
    manifest = json.loads((folder / "manifest.json").read_bytes())["manifest"]
    assert manifest["format_version"] == 3 and manifest["states"]
    assert sorted(s["file"] for s in manifest["state_segments"]) == sorted(
        p.name for p in folder.glob("st-*.safetensors")
    )


@ATTENTION
async def test_a_damaged_state_file_is_refused_and_the_agent_starts_cold(
    tmp_path: Path, attention: kvactor.Attention
) -> None:
    async with kvactor.open(tiny("lfm2"), attention=attention, cache_dir=tmp_path) as kv:
        t1 = await (await kv.spawn_agent("a")).complete(BASE, **SAMPLE)
    newest = max((tmp_path / "agents" / "a").glob("st-*.safetensors"), key=lambda p: p.name)
    data = bytearray(newest.read_bytes())
    data[-2] ^= 0xFF
    newest.write_bytes(bytes(data))
    async with kvactor.open(tiny("lfm2"), attention=attention, cache_dir=tmp_path) as kv:
        assert kv.prefetcher is not None
        result = await kv.prefetcher.ask(Stage("a"), timeout=None)
        assert result.outcome is StageOutcome.REJECTED
        assert newest.name in result.detail and "checksum mismatch" in result.detail
        again = await (await kv.spawn_agent("a")).complete(BASE, **SAMPLE)
    assert again.path == Tier.COLD and again.token_ids == t1.token_ids


@FAMILY
async def test_a_token_fed_past_a_turns_end_is_taken_back_from_the_states(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pipelined step feeds each row one token past its turn's end; the row leaves with
    # its state from before that step. The checkpoints written at the turn's end are the
    # very bytes an unpipelined run writes.
    async def states(root: Path) -> list[dict[str, Any]]:
        async with kvactor.open(
            tiny(family), cache_dir=root, max_batch=2, deterministic=True
        ) as kv:
            agents = [await kv.spawn_agent(f"a{i}") for i in range(3)]
            async with anyio.create_task_group() as tg:  # decoding in one batch
                for i, agent in enumerate(agents):
                    tg.start_soon(functools.partial(agent.complete, f"{i} " + BASE, **SAMPLE))
        files = sorted((root / "agents").glob("*/st-*.safetensors"))
        return [safetensors.numpy.load_file(str(f)) for f in files]

    pipelined = await states(tmp_path / "pipelined")
    monkeypatch.setattr(DecodeBatch, "pipelined", False)
    plain = await states(tmp_path / "plain")
    assert len(pipelined) == len(plain) >= 6
    for a, b in zip(pipelined, plain, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name] == b[name]).all(), name


@ATTENTION
async def test_forks_and_shared_contexts_share_checkpoints(
    tmp_path: Path, attention: kvactor.Attention
) -> None:
    family = "granitemoehybrid"
    doc = "A shared document about foxes and rivers. " * 3
    async with kvactor.open(tiny(family), attention=attention, cache_dir=tmp_path / "one") as kv:
        source = await kv.spawn_agent("src")
        s1 = await source.complete(BASE, **SAMPLE)
        fork = await kv.fork("src", "copy")
        pool = _pool(kv)
        mine, theirs = pool.get("src").kv.ranges, pool.get("copy").kv.ranges
        assert [r.stop for r in mine] == [r.stop for r in theirs]
        assert all(
            a is b
            for r, q in zip(mine, theirs, strict=True)
            for i in r.states
            for a, b in zip(r.states[i].values(), q.states[i].values(), strict=True)
        )
        prompt = _prompts(s1)[-1]
        from_fork = await fork.complete(prompt, **SAMPLE)
        from_source = await source.complete(prompt, **SAMPLE)
        await kv.context("doc", doc)
        shared = await (await kv.spawn_agent("u", context="doc")).generate("Why?", **SAMPLE)
        stats = await kv.stats()
    assert from_fork.timings.reused_tokens == from_source.timings.reused_tokens > 0
    assert from_fork.token_ids == from_source.token_ids
    assert stats.shared_turns >= 1 and shared.timings.reused_tokens >= stats.shared_tokens > 0
    # After a restart the context's checkpoint is shared from disk (its state file linked).
    async with kvactor.open(tiny(family), attention=attention, cache_dir=tmp_path / "one") as kv:
        await kv.context("doc", doc)
        again = await (await kv.spawn_agent("v", context="doc")).generate("Why?", **SAMPLE)
    assert again.timings.reused_tokens == shared.timings.reused_tokens
    assert again.token_ids == shared.token_ids
    v_files = {p.name for p in (tmp_path / "one" / "agents" / "v").glob("st-*")}
    doc_files = {p.name for p in (tmp_path / "one" / "agents" / "doc").glob("st-*")}
    assert v_files & doc_files


def test_a_recurrent_state_takes_back_only_the_last_marked_step() -> None:
    from kvactor.kernels.recurrent import RecurrentCache

    cache = RecurrentCache(1)
    cache[0] = mx.zeros((2, 3))
    cache.mark_step()
    cache[0] = mx.ones((2, 3))
    cache[0] = mx.full((2, 3), 2.0)  # a second write in the same forward keeps the first
    row = cache.extract(1)
    row.unfeed(1)
    assert mx.array_equal(row[0], mx.zeros((1, 3))).item()
    with pytest.raises(ValueError, match="only the last marked step"):
        row.unfeed(1)
    cache.unfeed(1)
    assert mx.array_equal(cache[0], mx.zeros((2, 3))).item()
