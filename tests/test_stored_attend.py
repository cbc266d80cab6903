"""Attention over the stored form on the CPU (``kernels.stored_attend``, numba): the same
attention as the reference (dequantize, then MLX's matmuls and softmax) within fp32
rounding, for every width and group, masks, batches, the Hadamard basis, learned sinks
and regions it does not cover; and the engine's kernel choice (real MLX, real numba)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvactor.kernels import fused, stored_attend
from kvactor.kernels._qmath import rotate_rows
from kvactor.kernels.qattend import Coded, attend_parts
from kvactor.kernels.qbatch import QuantizedBatchCache
from kvactor.kernels.qcodec import DEFAULT_CODEC

WIDTHS = (2, 3, 4, 5, 6, 8)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    # numba is a dependency on Linux: where the kernel cannot compile, say why.
    assert fused.wait(300), fused.unavailable()


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the numba path ran (the tests below must reach it)."""
    calls: list[int] = []
    real = stored_attend.attend

    def counting(*args: Any, **kwargs: Any) -> mx.array:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stored_attend, "attend", counting)
    return calls


def _coded(
    x: mx.array, bits: int, group: int, *, rotated: bool = False, scale: float = 3.0
) -> Coded:
    """``x`` ``(B, H, W, D)`` quantized (its values spread wide, so every code occurs)."""
    x = scale * x
    if rotated:
        x = rotate_rows(x)
    q, s, b = mx.quantize(x, group_size=group, bits=bits)
    mx.eval(q, s, b)
    return Coded(bits, group, rotated, (q, s, b))


def _region(
    rows: int, heads: int, width: int, dim: int, bits: tuple[int, int], group: int, seed: int
) -> tuple[Coded, Coded]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    shape = (rows, heads, width, dim)
    return (
        _coded(mx.random.normal(shape, key=k1), bits[0], group),
        _coded(mx.random.normal(shape, key=k2), bits[1], group),
    )


def _inputs(
    rows: int, heads: int, repeats: int, n: int, dim: int, tail: int, seed: int = 0
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    k1, k2, k3 = mx.random.split(mx.random.key(100 + seed), 3)
    q = mx.random.normal((rows, heads * repeats, n, dim), key=k1)
    tail_kv = (
        mx.random.normal((rows, heads, tail, dim), key=k2),
        mx.random.normal((rows, heads, tail, dim), key=k3),
    )
    return q, tail_kv


def _both(
    q: mx.array,
    regions: list[tuple[Coded, Coded]],
    tail: tuple[mx.array, mx.array],
    mask: mx.array | None = None,
    sinks: mx.array | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    scale = q.shape[-1] ** -0.5
    got = attend_parts(q, scale, regions, tail, mask, "stored", sinks)
    want = attend_parts(q, scale, regions, tail, mask, "reference", sinks)
    return np.array(got), np.array(want)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_width_and_group(bits: int, group: int, taken: list[int]) -> None:
    regions = [_region(1, 3, 300, 128, (bits, bits), group, seed=bits)]
    q, tail = _inputs(1, 3, 3, 1, 128, tail=1)
    got, want = _both(q, regions, tail)
    assert taken, "the stored path declined a region it covers"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_keys_and_values_of_other_widths_and_several_regions(taken: list[int]) -> None:
    # The default codec's shape: 8-bit sinks, then keys 5-bit and values 3-bit.
    regions = [
        _region(1, 3, 4, 64, (8, 8), 64, seed=1),
        _region(1, 3, 700, 64, (5, 3), 64, seed=2),
    ]
    q, tail = _inputs(1, 3, 3, 2, 64, tail=2)
    got, want = _both(q, regions, tail)
    assert len(taken) == 1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_masked_columns_and_rows_of_a_batch(taken: list[int]) -> None:
    # Three rows, their left padding masked in each region and the tail (as a batch's
    # mask has it), a mask per head too: each row attends over its own columns alone.
    rows, heads, n = 3, 2, 3
    regions = [
        _region(rows, heads, 40, 64, (4, 4), 32, 5),
        _region(rows, heads, 90, 64, (3, 6), 64, 6),
    ]
    q, tail = _inputs(rows, heads, 2, n, 64, tail=4)
    keep = np.ones((rows, heads, n, 40 + 90 + 4), bool)
    keep[0, :, :, :13] = False  # row 0: the first 13 columns of region 0 are padding
    keep[1, :, :, 40:80] = False  # row 1: 40 of region 1
    keep[2, 1, :, :130] = False  # row 2, head 1: only the tail
    keep[0, :, 1, 20:30] = False  # row 0's second query: 10 columns fewer (per query)
    keep[1, 0, 2, 100:] = False  # row 1, head 0, third query: nothing of region 1
    for i in range(n):  # causal over the tail
        keep[:, :, i, 130 + i + 2 :] = False
    mask = mx.array(keep)
    got, want = _both(q, regions, tail, mask)
    assert taken
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    unmasked, _ = _both(q, regions, tail)
    assert not np.allclose(unmasked, got, atol=1e-3)  # the mask does change it


def test_a_tail_longer_than_a_chunk(taken: list[int]) -> None:
    # A quantized turn that decodes long grows its float tail past the kernel's chunk of
    # 256 tokens: the tail's partials come in several chunks, masked as a batch has them.
    rows, heads, n, tail = 2, 3, 2, 600
    regions = [
        _region(rows, heads, 4, 64, (8, 8), 64, 21),
        _region(rows, heads, 70, 64, (5, 3), 64, 22),
    ]
    q, tail_kv = _inputs(rows, heads, 3, n, 64, tail=tail, seed=23)
    keep = np.ones((rows, 1, n, 4 + 70 + tail), bool)
    keep[1, :, :, : 4 + 70 + 300] = False  # row 1: left padding into the tail's second chunk
    keep[:, :, 0, -1] = False  # causal: the first query does not see the last column
    got, want = _both(q, regions, tail_kv, mx.array(keep))
    assert taken
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_regions_in_the_hadamard_basis(taken: list[int]) -> None:
    k1, k2, k3, k4 = mx.random.split(mx.random.key(7), 4)
    shape = (1, 3, 200, 64)
    plain = (
        _coded(mx.random.normal(shape, key=k1), 8, 64),
        _coded(mx.random.normal(shape, key=k2), 8, 64),
    )
    turned = (
        _coded(mx.random.normal(shape, key=k3), 5, 64, rotated=True),
        _coded(mx.random.normal(shape, key=k4), 3, 64, rotated=True),
    )
    q, tail = _inputs(1, 3, 3, 1, 64, tail=1)
    got, want = _both(q, [plain, turned], tail)
    assert taken
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_learned_sinks_join_as_mlx_does(taken: list[int]) -> None:
    regions = [_region(1, 2, 50, 64, (4, 4), 64, seed=9)]
    q, tail = _inputs(1, 2, 2, 1, 64, tail=3)
    sinks = mx.random.normal((4,), key=mx.random.key(10))
    got, want = _both(q, regions, tail, sinks=sinks)
    assert taken
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    without, _ = _both(q, regions, tail)
    assert not np.allclose(without, got, atol=1e-3)


def test_what_it_does_not_cover_takes_mlx_kernels(
    taken: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    q, tail = _inputs(1, 2, 2, 1, 64, tail=1)
    fp = mx.random.normal((1, 2, 30, 64), key=mx.random.key(11))
    float_region = (Coded(16, 64, False, (fp,)), Coded(16, 64, False, (fp,)))
    quantized = _region(1, 2, 30, 64, (4, 4), 64, seed=12)
    assert not stored_attend.covers([float_region], 2, (64, 64))  # a plain float region
    assert not stored_attend.covers([quantized], stored_attend.MAX_QUERIES + 1, (64, 64))
    assert stored_attend.covers([quantized], stored_attend.MAX_QUERIES, (64, 64))
    got, want = _both(q, [float_region], tail)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    assert not taken
    monkeypatch.setenv("KVACTOR_FUSED", "0")  # the switch turns it off with the dequantize
    assert not stored_attend.covers([quantized], 2, (64, 64))
    got, want = _both(q, [quantized], tail)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    assert not taken


def test_a_tail_alone_of_another_value_width_takes_mlx_kernels(taken: list[int]) -> None:
    # MLA (deepseek_v2): keys 192 wide, values 128. With nothing stored, only the tail.
    q = mx.random.normal((1, 4, 1, 192), key=mx.random.key(31))
    tail = (
        mx.random.normal((1, 2, 3, 192), key=mx.random.key(32)),
        mx.random.normal((1, 2, 3, 128), key=mx.random.key(33)),
    )
    got, want = _both(q, [], tail)
    assert got.shape == (1, 4, 1, 128)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    assert not taken


def test_auto_picks_it_on_the_cpu_for_a_few_queries_a_row() -> None:
    kv = mx.random.normal((1, 2, 40, 64), key=mx.random.key(13))
    parts = DEFAULT_CODEC.quantize(kv, 0, role="key"), DEFAULT_CODEC.quantize(kv, 0, role="value")
    cache = QuantizedBatchCache.from_parts(DEFAULT_CODEC, 2, (64, 64), *parts, 40)
    for n, want in ((1, "stored"), (8, "stored"), (9, "reference"), (300, "reference")):
        cache.update_and_fetch(*(mx.zeros((1, 2, n, 64)) for _ in range(2)))
        queries = mx.zeros((1, 4, n, 64))  # 2 query heads a KV head: 2n queries a row
        assert cache._kernel_for(queries) == want, n
