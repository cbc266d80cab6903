"""Every model family kvactor is tested on, as tiny random-weight models built from a
config: llama, qwen3, gemma3_text (sliding-window layers, a window smaller than the tests'
contexts), deepseek_v2 (multi-head latent attention: keys and values of different widths;
a mixture of experts), and the 2026 lineup: recurrent / linear-attention layers beside
attention ones (qwen3_5, qwen3_next, lfm2, granitemoehybrid, nemotron_h with an MLP layer
that keeps no cache, falcon_h1 with both in each layer, mamba2 with no attention at all),
gemma4_text (layers that reuse another layer's K/V), gpt_oss (learned attention sinks) and
olmo3; kimi_linear is refused at open (its latent MLA cache). Real engine, real files,
real actors, both attention modes. Checkpoints of recurrent states: test_checkpoints.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
from lively import lively
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache
from test_budget import MEMORY_LIMIT, mlx_bound

import kvactor
from kvactor.actors.engine import Attention, turn_reserve_bytes
from kvactor.actors.enums import Match, StageOutcome, Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.models._probe import probe_geometry
from kvactor.actors.models._tiny import TINY_FAMILIES
from kvactor.actors.warm._prefetch import Stage
from kvactor.kernels.agent_cache import DEFAULT_CHECKPOINTS
from kvactor.kernels.geometry import LayerGeometry, StateGeometry
from kvactor.kernels.qcodec import DEFAULT_CODEC
from kvactor.kernels.stored import cache_nbytes

pytestmark = pytest.mark.one_backend  # the families' caches through the tiers, not the event loop


FAMILIES = sorted(TINY_FAMILIES)
#: Families refused at open() (in both attention modes, with the default codec), and why.
REFUSED = {"kimi_linear": "layer 1"}
RUNS = [f for f in FAMILIES if f not in REFUSED]
ATTENTION = pytest.mark.parametrize("attention", ["dequantized", "quantized"])
FAMILY = pytest.mark.parametrize("family", RUNS)
SYSTEM = "You are a careful agent."
WINDOW = TINY_FAMILIES["gemma3_text"]["sliding_window"]


def tiny(family: str) -> Any:
    # The tiny llama's heads are 16 wide by default: 64 lets the default codec store them.
    extra = {"head_dim": 64} if family == "llama" else {}
    return functools.partial(make_tiny_model, 0, family, **extra)


def test_geometry_is_read_from_the_model() -> None:
    gemma = make_tiny_model(0, "gemma3_text").geometry.layers
    assert gemma == (
        LayerGeometry(1, 64, 64, WINDOW),
        LayerGeometry(1, 64, 64, None),
        LayerGeometry(1, 64, 64, WINDOW),
        LayerGeometry(1, 64, 64, None),
    )
    # MLA: keys are qk_nope + qk_rope wide, values v_head_dim, one KV head per query head.
    deepseek = make_tiny_model(0, "deepseek_v2").geometry.layers
    assert deepseek == (LayerGeometry(2, 96, 64, None),) * 2
    assert make_tiny_model(0, "qwen3").geometry.layers == (LayerGeometry(1, 64, 64, None),) * 2
    llama = make_tiny_model(0, "llama", head_dim=64)
    assert llama.geometry.layers == (LayerGeometry(2, 64, 64, None),) * 2
    assert (llama.n_layers, llama.n_kv_heads, llama.head_dim) == (2, 2, 64)


def test_the_2026_geometries_are_read_from_the_models() -> None:
    # Qwen3.5: gated delta layers 0 and 2 (a conv state and a delta state, fp32), full
    # attention in 1 and 3; nothing else stored for them.
    qwen = make_tiny_model(0, "qwen3_5").geometry
    assert qwen.layers == (None, LayerGeometry(1, 64, 64), None, LayerGeometry(1, 64, 64))
    state = StateGeometry(((1, 3, 128), (1, 2, 32, 32)), ("float32", "float32"))
    assert qwen.states == (state, None, state, None)
    assert qwen.state_bytes == 2 * state.nbytes == 2 * 4 * (3 * 128 + 2 * 32 * 32)
    # Falcon-H1: each layer keeps a CacheList of a Mamba-2 state and K/V: two entries.
    falcon = make_tiny_model(0, "falcon_h1").geometry
    assert falcon.slots == ((0, 1), (2, 3))
    assert falcon.kv_layers == (1, 3) and falcon.state_layers == {0, 2}
    # Nemotron-H: Mamba, MLP (no cache), attention, Mamba; Gemma 4: the last two layers
    # reuse the first two's K/V. Neither is stored twice.
    nemotron = make_tiny_model(0, "nemotron_h").geometry
    assert nemotron.model_layers == (0, None, 1, 2) and nemotron.n_layers == 3
    gemma = make_tiny_model(0, "gemma4_text").geometry
    assert gemma.model_layers == (0, 1, None, None)
    assert gemma.layers == (LayerGeometry(1, 64, 64, WINDOW), LayerGeometry(1, 64, 64, None))
    assert "without a cache of their own" in gemma.summary()
    # Mamba-2: states only; gpt-oss: a sliding layer and a global one.
    assert make_tiny_model(0, "mamba2").geometry.kv_layers == ()
    assert make_tiny_model(0, "gpt_oss").geometry.sliding == {0}


@pytest.mark.parametrize("attention", ["dequantized", "quantized"])
@pytest.mark.parametrize("family", sorted(REFUSED))
async def test_a_family_kvactor_cannot_run_is_refused_at_open(
    family: str, attention: Attention
) -> None:
    with pytest.raises(kvactor.ModelLoadError, match=rf"'{family}': {REFUSED[family]}"):
        async with kvactor.open(tiny(family), attention=attention):
            pass


def test_a_layer_without_a_standard_cache_is_refused_by_name() -> None:
    lm = make_tiny_model(0, "qwen3")
    model = lm.model
    # A real mlx-lm cache kvactor does not store (pre-quantized K/V) in the first layer.
    model.make_cache = lambda: [QuantizedKVCache(), KVCache()]
    with pytest.raises(ValueError, match=r"'qwen3': layer 0 keeps a QuantizedKVCache"):
        probe_geometry(model, "qwen3")
    # Fewer caches than layers, and the second layer does not run at all (zip stops).
    model.make_cache = lambda: [KVCache()]
    with pytest.raises(ValueError, match=r"layer 1 did not run .*1 caches for 2 layers"):
        probe_geometry(model, "qwen3")
    # A recurrent state where the model keeps K/V: its forward fails, named.
    model.make_cache = lambda: [ArraysCache(2), KVCache()]
    with pytest.raises(ValueError, match=r"'qwen3': .* fails with mlx-lm's own caches"):
        probe_geometry(model, "qwen3")


async def test_a_width_the_codec_cannot_store_fails_at_open() -> None:
    # Heads 48 wide: no quantization group (32, 64) divides them. The error comes from
    # open(), naming the width, not from a dead engine in the middle of a turn.
    model = functools.partial(make_tiny_model, 0, "qwen3", head_dim=48)
    with pytest.raises(ValueError, match="divides width 48"):
        async with kvactor.open(model):
            pass


async def _conversation(
    family: str, attention: Attention, cache_dir: Path | None, turns: int
) -> list[kvactor.Completion]:
    async with kvactor.open(tiny(family), cache_dir=cache_dir, attention=attention) as kv:
        agent = await kv.spawn_agent("one", system=SYSTEM)
        out = []
        for prompt in ("describe the sliding window", "and the global layers?")[:turns]:
            out.append(await agent.generate(prompt, max_tokens=10))
        return out


def _first_turn_elsewhere(family: str, attention: str, root: Path) -> list[int]:
    """The first turn, run and saved by another process."""
    script = textwrap.dedent(
        f"""
        import anyio, functools, json, kvactor
        from kvactor.actors.models import make_tiny_model
        extra = {{"head_dim": 64}} if {family!r} == "llama" else {{}}
        model = functools.partial(make_tiny_model, 0, {family!r}, **extra)
        async def main():
            async with kvactor.open(model, cache_dir={str(root)!r}, attention={attention!r}) as kv:
                agent = await kv.spawn_agent("one", system={SYSTEM!r})
                done = await agent.generate("describe the sliding window", max_tokens=10)
                print(json.dumps(done.token_ids))
        anyio.run(main)
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow  # a subprocess per family and mode (~3 s each): the whole suite's
@FAMILY
@ATTENTION
def test_a_warm_reload_in_another_process_equals_the_cache_kept_hot(
    tmp_path: Path, family: str, attention: Attention
) -> None:
    first, hot = anyio.run(_conversation, family, attention, None, 2)
    assert hot.path == Tier.HOT
    assert _first_turn_elsewhere(family, attention, tmp_path) == first.token_ids

    async def resume() -> kvactor.Completion:
        async with kvactor.open(tiny(family), cache_dir=tmp_path, attention=attention) as kv:
            agent = await kv.spawn_agent("one", system=SYSTEM)
            return await agent.generate("and the global layers?", max_tokens=10)

    warm = anyio.run(resume)
    assert warm.path == Tier.WARM
    assert warm.timings.reused_tokens == hot.timings.reused_tokens > WINDOW
    assert warm.token_ids == hot.token_ids


@FAMILY
@ATTENTION
async def test_batched_turns_equal_solo_turns(family: str, attention: Attention) -> None:
    prompts = [f"agent {i} says {'abc'[i % 3] * (3 + 5 * i)}" for i in range(4)]

    async def run(max_batch: int) -> list[list[int]]:
        # The mode that promises batch-independent answers, on a model whose tokens depend
        # on its cache (tests/lively.py).
        async with kvactor.open(
            lively(0, family), max_batch=max_batch, attention=attention, deterministic=True
        ) as kv:
            agents = [await kv.spawn_agent(f"a{i}") for i in range(len(prompts))]
            out: list[list[int]] = [[] for _ in prompts]

            async def two_turns(i: int) -> None:
                for turn in range(2):
                    done = await agents[i].generate(f"{prompts[i]} #{turn}", max_tokens=8)
                    out[i] += done.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(two_turns, i)
            stats = await kv.stats()
            assert stats.max_batch_seen <= max_batch
            if max_batch > 1:
                assert stats.max_batch_seen > 1  # the turns did share a batch
            return out

    assert await run(4) == await run(1)


@ATTENTION
async def test_extend_and_diverge_across_the_sliding_window_edge(
    tmp_path: Path, attention: Attention
) -> None:
    # Raw prompts on the gemma model (window 16). Two turns extend the first (each reusing
    # everything before it); by then the sliding layers have dropped the first range. The
    # fourth diverges a few tokens before the end (inside what they still hold: it reuses
    # the rest); the fifth diverges more than a window behind, below what they dropped (it
    # starts from nothing). Kept hot, and reloaded from disk before each turn, the answers
    # are the same.
    base = "The quick brown fox jumps over the lazy dog, " * 2

    def prompt(answers: list[kvactor.Completion]) -> str | None:
        texts = [base]
        for i, more in enumerate((" Then what happened next?", " And what did the fox do?")):
            if len(answers) > i:
                texts.append(texts[-1] + answers[i].text + more)
        if len(answers) > 2:
            texts.append(texts[2][:-4] + " then?")
        if len(answers) > 3:
            texts.append(base[:30] + "and then it rests by the river bank.")
        return texts[len(answers)] if len(answers) < len(texts) else None

    async def run(reload: bool) -> list[kvactor.Completion]:
        out: list[kvactor.Completion] = []
        root = tmp_path / str(reload)
        while (text := prompt(out)) is not None:
            async with kvactor.open(tiny("gemma3_text"), cache_dir=root, attention=attention) as kv:
                agent = await kv.spawn_agent("raw")
                while text is not None:
                    out.append(await agent.complete(text, max_tokens=8))
                    text = prompt(out) if not reload else None
        return out

    hot, warm = await run(False), await run(True)
    assert len(hot) == 5
    assert [d.match for d in hot] == [Match.NEW, Match.EXTEND, Match.EXTEND] + [Match.DIVERGE] * 2
    assert [d.match for d in warm] == [d.match for d in hot]
    assert [d.path for d in warm[1:4]] == [Tier.WARM] * 3
    assert hot[2].timings.reused_tokens > hot[1].timings.reused_tokens > 2 * WINDOW
    assert hot[3].timings.reused_tokens == hot[2].timings.prompt_tokens - 4
    assert hot[4].timings.reused_tokens == warm[4].timings.reused_tokens == 0
    assert [d.token_ids for d in warm] == [d.token_ids for d in hot]


async def test_sliding_layers_keep_only_their_window() -> None:
    # Two of the four layers slide over 16 tokens: after a long conversation their stored
    # parts hold only the last ranges, the global layers hold everything.
    async def stored_bytes(window: int) -> tuple[int, list[int]]:
        model = functools.partial(make_tiny_model, 0, "gemma3_text", sliding_window=window)
        async with kvactor.open(model, attention="quantized") as kv:
            agent = await kv.spawn_agent("long")
            ids, text = [], ""
            for turn in range(6):  # each turn extends the last
                text += f" turn {turn}: " + "abcdefgh" * 4
                done = await agent.complete(text, max_tokens=4)
                assert done.timings.reused_tokens >= len(text) - 50
                ids += done.token_ids
                text += done.text
            return (await kv.stats()).cache_bytes, ids

    windowed, _ = await stored_bytes(WINDOW)
    whole, _ = await stored_bytes(1024)  # a window longer than the conversation
    assert windowed < 0.7 * whole


@FAMILY
@ATTENTION
async def test_the_budget_holds_and_changes_no_answer(
    tmp_path: Path, family: str, attention: Attention
) -> None:
    prompts = [f"agent {i}: {'xyz'[i % 3] * (4 + 3 * i)}" for i in range(6)]

    model = lively(0, family)  # its tokens depend on its cache (tests/lively.py)
    # Deterministic: the mode that promises answers independent of the batch.
    same: dict[str, Any] = {"attention": attention, "deterministic": True, "max_batch": 3}
    # Qwen3.5's tiny model needs ~107 MB with one turn (its activations).
    same["memory_limit"] = 256 << 20 if family == "qwen3_5" else MEMORY_LIMIT

    async def run_all(
        root: Path, **options: Any
    ) -> tuple[list[list[int]], kvactor.EngineStats, int]:
        """Every agent's tokens, the stats, and MLX's peak after a first agent ran two turns
        as long as the longest agent's alone (what mlx_bound starts from), when unbounded.
        Its prompts are other letters: no agent shares its cache."""
        async with kvactor.open(model, cache_dir=root, **same, **options) as kv:
            base = 0
            if "budget_bytes" not in options:
                alone = await kv.spawn_agent("alone")
                for n in range(2):
                    await alone.generate(f"agent 9: {'q' * (4 + 3 * 5)} {n}", max_tokens=6)
                base = (await kv.stats()).mlx_peak_bytes
            agents = [await kv.spawn_agent(f"a{i}") for i in range(len(prompts))]
            out: list[list[int]] = [[] for _ in prompts]

            async def turn(i: int, n: int) -> None:
                done = await agents[i].generate(f"{prompts[i]} {n}", max_tokens=6)
                out[i] += done.token_ids

            for n in range(2):
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(turn, i, n)
            return out, await kv.stats(), base

    free, _, base = await run_all(tmp_path / "free")
    # What a turn of up to 128 tokens needs alone, by the engine's own accounting (its
    # stored cache and the working cache it reserves): caches go warm and come back.
    # With recurrent layers the stored cache keeps up to DEFAULT_CHECKPOINTS states too, and
    # a turn stores two (its prompt's and its answer's).
    geometry = tiny(family)().geometry
    stored_kv = cache_nbytes(DEFAULT_CODEC, geometry, 128)
    stored = stored_kv + DEFAULT_CHECKPOINTS * geometry.state_bytes
    quantized = attention == "quantized"
    budget = stored + turn_reserve_bytes(
        geometry, 128, stored_bytes=stored_kv if quantized else None, checkpoints=2
    )
    tight, stats, _ = await run_all(tmp_path / "tight", budget_bytes=budget)
    assert stats.peak_bytes <= budget
    # MLX's own memory too: within the longest agent's turns alone plus the budget.
    assert stats.mlx_peak_bytes <= mlx_bound(base, budget, same["memory_limit"])
    assert stats.demoted_warm > 0
    assert tight == free


def test_tiny_families_build_deterministically() -> None:
    for family in FAMILIES:
        a, b = make_tiny_model(3, family), make_tiny_model(3, family)
        assert a.fingerprint == b.fingerprint
        ids = mx.array([[5, 6, 7]])
        assert mx.array_equal(a.model(ids), b.model(ids)).item()
    with pytest.raises(ValueError, match="family must be one of"):
        make_tiny_model(0, "mamba")


async def test_the_warm_tier_keeps_sliding_layers_for_the_last_ranges_only(
    tmp_path: Path,
) -> None:
    # On disk the sliding layers' tensors sit apart (win-<n> beside seg-<n>) and only the
    # files a turn resuming in the last range needs stay; a reload resumes from them as the
    # hot cache does. A damaged window file is refused like any other: the agent starts cold.
    prompts: list[str] = []

    async def conversation(root: Path | None, turns: int) -> list[kvactor.Completion]:
        async with kvactor.open(tiny("gemma3_text"), cache_dir=root) as kv:
            agent = await kv.spawn_agent("long")
            out, text = [], ""
            for turn in range(turns):
                text += f" turn {turn}: " + "abcdefgh" * 3
                prompts.append(text)
                out.append(await agent.complete(text, max_tokens=4))
                text += out[-1].text
            return out

    hot = await conversation(None, 7)
    await conversation(tmp_path, 6)
    folder = tmp_path / "agents" / "long"
    segs = sorted(folder.glob("seg-*.safetensors"))
    wins = sorted(folder.glob("win-*.safetensors"))
    assert len(segs) == 6 and 1 <= len(wins) <= 3
    manifest = json.loads((folder / "manifest.json").read_bytes())["manifest"]
    assert [w["file"] for w in manifest["window_segments"]] == [p.name for p in wins]
    async with kvactor.open(tiny("gemma3_text"), cache_dir=tmp_path) as kv:
        resumed = await (await kv.spawn_agent("long")).complete(prompts[6], max_tokens=4)
    assert resumed.path == Tier.WARM
    assert resumed.timings.reused_tokens == hot[-1].timings.reused_tokens > 100
    assert resumed.token_ids == hot[-1].token_ids

    newest = max(folder.glob("win-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF
    newest.write_bytes(bytes(data))
    async with kvactor.open(tiny("gemma3_text"), cache_dir=tmp_path) as kv:
        assert kv.prefetcher is not None
        result = await kv.prefetcher.ask(Stage("long"), timeout=None)
        assert result.outcome is StageOutcome.REJECTED
        assert newest.name in result.detail and "checksum mismatch" in result.detail
        done = await (await kv.spawn_agent("long")).complete(prompts[6], max_tokens=4)
        assert done.path == Tier.COLD and done.timings.reused_tokens == 0


@pytest.mark.parametrize(
    "damage",
    ["drop the last window segment", "shift a window segment", "windows without sliding layers"],
)
async def test_a_manifest_with_window_segments_that_do_not_fit_is_refused(
    tmp_path: Path, damage: str
) -> None:
    import msgspec

    from kvactor.actors.warm._manifest import CacheManifest, encode_manifest, load_manifest

    async with kvactor.open(tiny("gemma3_text"), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("w")
        text = ""
        for turn in range(3):
            text += f" turn {turn}: " + "abcdefgh" * 3
            text += (await agent.complete(text, max_tokens=4)).text
    folder = tmp_path / "agents" / "w"
    m = msgspec.json.decode(
        msgspec.json.encode(json.loads((folder / "manifest.json").read_bytes())["manifest"]),
        type=CacheManifest,
    )
    assert m.window_segments
    windows = list(m.window_segments)
    if damage == "drop the last window segment":
        windows = windows[:-1]
        reason = "window segments end at"
    elif damage == "shift a window segment":
        windows[0] = msgspec.structs.replace(windows[0], start=windows[0].start + 1)
        reason = "does not match a segment"
    else:
        m = msgspec.structs.replace(m, geometry=[[1, 64, 64, 0]] * 4)
        reason = "model without sliding-window layers"
    (folder / "manifest.json").write_bytes(
        encode_manifest(msgspec.structs.replace(m, window_segments=windows))
    )
    with pytest.raises(kvactor.CacheRejected, match=reason):
        load_manifest(folder, None, "w")
