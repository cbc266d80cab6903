"""The quantized batch cache: attention over stored parts, batch edits (tiny model, real MLX)."""

from __future__ import annotations

import random
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvactor.actors.engine import EngineConfig
from kvactor.actors.models import LoadedModel, make_tiny_model
from kvactor.kernels import fused
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.attention import bind_attention
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.qbatch import QuantizedBatchCache
from kvactor.kernels.qcodec import DEFAULT_CODEC, KVCodec
from kvactor.kernels.quantized_turn import QuantizedTurnCache
from kvactor.kernels.rotated import RotatedBasis

CODECS = [
    DEFAULT_CODEC,  # K5/V3 + rotation + 8-bit sinks
    KVCodec(bits=4),  # plain Q4 g64, no sinks
    KVCodec(bits=4, key_bits=8, rotate=True, sink_tokens=4),  # keys >= 8 bits: cut, not sinks
    KVCodec(bits=8, key_bits=16),  # fp16 keys next to 8-bit values
    KVCodec(bits=16),
]


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    assert fused.wait(300), fused.unavailable()  # the "stored" kernel compiles with it
    loaded = make_tiny_model(0, head_dim=64)
    QuantizedTurnCache.prepare(loaded.model)
    FloatTurnCache.prepare(loaded.model)  # one model, both modes
    return loaded


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(n)]


def stored(lm: LoadedModel, codec: KVCodec, toks: list[int], turns: list[int]) -> AgentKV:
    """An agent cache holding ``toks``, stored in one range per turn."""
    kv = AgentKV(codec, lm.geometry)
    at = 0
    for n in turns:
        lm.model(mx.array(toks[at : at + n])[None], cache=kv.activate().layers)
        kv.tokens.extend(toks[at : at + n])
        at += n
        kv.deactivate()
    return kv


def quantized(kv: AgentKV, kernel: Any = "quantized_matmul") -> list[QuantizedBatchCache]:
    # The fused kernel by default, whatever the query count: "auto" would pick the
    # reference for prefills on the CPU, and these tests must check the fused path too.
    return list(QuantizedTurnCache.with_kernel(kernel).start(kv).layers)


def float_copy(kv: AgentKV) -> list[Any]:
    """The dequantized working cache of ``kv`` (per-layer mlx-lm KVCaches)."""
    try:
        return list(kv.activate().layers)
    finally:
        kv.work = None


def close(diff: mx.array, atol: float = 1e-4) -> bool:
    return bool(mx.abs(diff).max() < atol)


def logits_of(lm: LoadedModel, toks: list[int], cache: list[Any]) -> mx.array:
    out = lm.model(mx.array(toks)[None], cache=cache)
    mx.eval(out)
    return out


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_attention_over_stored_parts_equals_attention_over_their_float_copy(
    lm: LoadedModel, codec: KVCodec
) -> None:
    # Three ranges, the first shorter than the sinks: region cuts fall inside ranges.
    kv = stored(lm, codec, tokens(50, 1), [3, 30, 17])
    new = tokens(6, 2)
    expected = logits_of(lm, new, float_copy(kv))  # dequantized float copy, plain attention
    for kernel in ("reference", "quantized_matmul", "stored", "auto"):
        got = logits_of(lm, new, quantized(kv, kernel))
        assert close(got - expected), kernel


def test_an_empty_cache_attends_to_its_tail_only(lm: LoadedModel) -> None:
    kv = AgentKV(DEFAULT_CODEC, lm.geometry)
    new = tokens(9, 3)
    plain = logits_of(lm, new, [KVCache() for _ in range(lm.n_layers)])
    got = logits_of(lm, new, quantized(kv))
    assert close(got - plain)


@pytest.mark.parametrize("kernel", ["quantized_matmul", "stored"])
def test_a_batch_decodes_every_row_as_it_would_alone(lm: LoadedModel, kernel: str) -> None:
    lengths, prefills = (2, 40, 70), (5, 1, 9)  # row 0 holds fewer tokens than the sinks
    rows = [
        quantized(stored(lm, DEFAULT_CODEC, tokens(n, i), [n]), kernel)
        for i, n in enumerate(lengths)
    ]
    for i, (caches, n) in enumerate(zip(rows, prefills, strict=True)):
        logits_of(lm, tokens(n, 10 + i), caches)
    batch = [QuantizedBatchCache.merge([r[layer] for r in rows]) for layer in range(lm.n_layers)]
    assert batch[0].stored_lengths() == list(lengths)
    assert batch[0].tail_lengths() == list(prefills)

    def alone(i: int, caches: list[QuantizedBatchCache], step: list[int]) -> mx.array:
        return logits_of(lm, step, [c.extract(i) for c in caches])[0, -1]

    steps = [[7], [8], [9]]
    expect = [alone(i, batch, steps[i]) for i in range(3)]
    got = lm.model(mx.array(steps), cache=batch)[:, -1]
    for i in range(3):
        assert close(got[i] - expect[i])
    # Drop the middle row, keep the others in a new order, and decode on.
    for layer in batch:
        layer.filter([2, 0])
    assert batch[0].stored_lengths() == [70, 2]
    assert batch[0].tail_lengths() == [prefills[2] + 1, prefills[0] + 1]
    expect = [alone(0, batch, [3]), alone(1, batch, [4])]
    got = lm.model(mx.array([[3], [4]]), cache=batch)[:, -1]
    for i in range(2):
        assert close(got[i] - expect[i])
    # A row taken out holds its turn's tokens, unpadded.
    row = batch[0].extract(1)
    k, v = row.tail(0)
    assert k.shape == v.shape == (1, lm.n_kv_heads, prefills[0] + 2, lm.head_dim)


def test_a_batch_holds_the_past_quantized(lm: LoadedModel) -> None:
    kv = stored(lm, DEFAULT_CODEC, tokens(512, 4), [256, 256])
    fp32 = sum(layer.nbytes for layer in float_copy(kv))  # fp32 K and V of 512 tokens
    batch = quantized(kv)
    held = sum(layer.nbytes for layer in batch)
    # 5-bit keys, 3-bit values, fp32 scales: ~0.16 of the fp32 copy (0.31 of fp16).
    assert held < 0.2 * fp32
    assert held < 1.5 * kv.stored_bytes


def test_binding_attention_leaves_other_caches_models_and_mlx_lm_alone() -> None:
    from mlx_lm.models import base, llama

    sdpa = llama.scaled_dot_product_attention
    loaded, other = make_tiny_model(0, head_dim=64), make_tiny_model(0, head_dim=64)
    new = tokens(12, 5)
    before = logits_of(loaded, new, [KVCache() for _ in range(loaded.n_layers)])
    assert bind_attention(loaded.model, QuantizedBatchCache) == loaded.n_layers
    assert bind_attention(loaded.model, QuantizedBatchCache) == 0  # idempotent
    assert bind_attention(loaded.model, RotatedBasis) == loaded.n_layers  # a second class
    assert bind_attention(loaded.model, RotatedBasis) == 0
    after = logits_of(loaded, new, [KVCache() for _ in range(loaded.n_layers)])
    assert mx.array_equal(before, after).item()
    # Per model: mlx-lm's modules and another model of the same class are untouched.
    assert llama.scaled_dot_product_attention is sdpa is base.scaled_dot_product_attention
    assert type(other.model.layers[0].self_attn) is llama.Attention
    assert isinstance(loaded.model.layers[0].self_attn, llama.Attention)
    with pytest.raises(TypeError, match="no attention layer"):
        bind_attention(loaded.model.layers[0].mlp, QuantizedBatchCache)
    # The bound model attends over a quantized batch and a rotated float copy; the unbound
    # one cannot, and says so rather than attend in the wrong basis.
    kv = stored(loaded, DEFAULT_CODEC, tokens(20, 7), [20])
    assert close(logits_of(loaded, new, quantized(kv)) - logits_of(loaded, new, float_copy(kv)))
    with pytest.raises((TypeError, ValueError, AttributeError)):
        logits_of(other, new, quantized(kv))
    with pytest.raises(RuntimeError, match="prepare the model"):
        stored(other, DEFAULT_CODEC, tokens(20, 7), [20])


def test_bad_use_gets_clear_errors(lm: LoadedModel) -> None:
    kv = stored(lm, DEFAULT_CODEC, tokens(20, 6), [20])
    layer = quantized(kv)[0]
    other = quantized(stored(lm, KVCodec(bits=4), tokens(20, 6), [20]))[0]
    with pytest.raises(ValueError, match="another codec"):
        layer.extend(other)
    with pytest.raises(IndexError, match="outside a batch of 1"):
        layer.extract(1)
    with pytest.raises(ValueError, match="no tail tokens"):
        layer.tail(0)
    with pytest.raises(ValueError, match="kernel must be"):
        QuantizedBatchCache(DEFAULT_CODEC, (64, 64), [], [[0]], kernel="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        EngineConfig(attention="quantized", budget_bytes=0)
    parts = kv.ranges[0].layers[0]
    with pytest.raises(ValueError, match="not 21"):
        QuantizedBatchCache.from_parts(DEFAULT_CODEC, lm.n_kv_heads, (64, 64), *parts, 21)


@pytest.mark.parametrize("kernel", ["reference", "quantized_matmul", "stored"])
def test_learned_sinks_join_attention_over_stored_parts_as_mlx_does(kernel: str) -> None:
    # gpt-oss's per-head sink logits: one more softmax column with no value, as mlx's own
    # attention takes them (the tiny gpt_oss runs the whole quantized path: test_families).
    from kvactor.kernels.qattend import attend_parts

    key = mx.random.key(3)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    q = mx.random.normal((1, 4, 3, 64), key=k1)
    k = mx.random.normal((1, 2, 5, 64), key=k2)
    v = mx.random.normal((1, 2, 5, 64), key=k3)
    sinks = mx.random.normal((4,), key=k4)
    mask = mx.ones((1, 1, 3, 5), dtype=mx.bool_)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None, sinks=sinks)
    got = attend_parts(q, 0.125, [], (k, v), mask, cast(Any, kernel), sinks)
    assert mx.allclose(got, want, atol=1e-5).item()
    without = attend_parts(q, 0.125, [], (k, v), mask, cast(Any, kernel))
    assert not mx.allclose(without, want, atol=1e-3).item()  # the sinks do change it
