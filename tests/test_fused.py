"""The fused dequantize (``kernels.fused``, numba): a layer's stored codes to floats in one
pass, bit for bit the values of the plain MLX ops, for every width, group, sink count and
split into ranges; the plain ops again with ``KVACTOR_FUSED=0`` (real MLX, real numba)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvactor.kernels import fused
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.geometry import CacheGeometry
from kvactor.kernels.qcodec import DEFAULT_CODEC, KVCodec, Role
from kvactor.kernels.stored import StoredRange


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    # numba is a dependency on Linux: where the kernel cannot compile, say why.
    assert fused.wait(300), fused.unavailable()


def _kv(codec: KVCodec, head_dim: int, cuts: tuple[int, ...], seed: int = 0) -> AgentKV:
    """A cache of 2 layers and 3 KV heads stored in ranges ending at ``cuts``, its values
    spread wide (outliers included) so that every code of every width occurs."""
    mx.random.seed(seed)
    kv = AgentKV(codec, CacheGeometry.uniform(2, 3, head_dim))
    ranges, start = [], 0
    for stop in cuts:
        layers = []
        for _ in range(2):
            k, v = (3 * mx.random.normal((1, 3, stop - start, head_dim)) for _ in range(2))
            layers.append(
                (codec.quantize(k, start, role="key"), codec.quantize(v, start, role="value"))
            )
            mx.eval(layers[-1])
        ranges.append(StoredRange(start, stop, layers))
        start = stop
    kv.ranges = ranges
    kv.tokens = list(range(start))
    return kv


def _both(
    kv: AgentKV, monkeypatch: pytest.MonkeyPatch, room: int, layer: int = 1, role: str = "key"
) -> tuple[np.ndarray, np.ndarray]:
    rotated = kv.codec.rotate
    parts = [r.layers[layer][0 if role == "key" else 1] for r in kv.ranges]
    direct = fused.dequantize(parts, kv.codec.role_spec(role)[0], room)  # type: ignore[arg-type]
    assert direct is not None, "the fused path declined a layer it covers"
    got = kv.dequantize(layer, role, rotated=rotated, room=room)  # type: ignore[arg-type]
    assert np.array_equal(np.array(direct), np.array(got))
    monkeypatch.setenv("KVACTOR_FUSED", "0")
    assert not fused.ready()
    plain = kv.dequantize(layer, role, rotated=rotated, room=room)  # type: ignore[arg-type]
    monkeypatch.delenv("KVACTOR_FUSED")
    return np.array(got), np.array(plain)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_width_and_group(bits: int, group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = KVCodec(bits=bits, group_size=group, sink_tokens=4)
    got, plain = _both(_kv(codec, 128, (3, 70, 333)), monkeypatch, room=0, role="value")
    assert got.shape == (1, 3, 333, 128) and got.dtype == np.float32
    assert np.array_equal(got, plain)


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("room", [0, 256])
def test_default_codec_in_ranges_with_room(
    role: str, room: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    got, plain = _both(_kv(DEFAULT_CODEC, 64, (9, 10, 300, 1024)), monkeypatch, room, role=role)
    assert got.shape == (1, 3, 1024 + room, 64)
    assert np.array_equal(got, plain)
    assert not got[:, :, 1024:].any()  # the room is zeros
    assert len(np.unique(got[0, 0, 5])) > 2  # values, not a broadcast fill


def test_ranges_asked_apart_are_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix's ranges and the ranges after it, asked apart, hold the tokens of asking all."""
    kv = _kv(DEFAULT_CODEC, 64, (4, 100, 260), seed=1)
    whole = np.array(kv.dequantize(0, "value", rotated=True))
    head = np.array(kv.dequantize(0, "value", rotated=True, ranges=slice(0, 1)))
    tail = np.array(kv.dequantize(0, "value", rotated=True, ranges=slice(1, None), room=3))
    assert np.array_equal(np.concatenate([head, tail[:, :, :-3]], axis=2), whole)


def test_off_switch_and_the_gpu_path_decline() -> None:
    kv = _kv(DEFAULT_CODEC, 64, (50,))
    parts = [kv.ranges[0].layers[0][0]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVACTOR_FUSED", "0")
        assert fused.dequantize(parts, 5) is None
        assert fused.unavailable() is not None
    assert fused.dequantize(parts, 5) is not None
    assert fused.unavailable() is None


def test_refuses_parts_that_do_not_fit_their_range() -> None:
    kv = _kv(DEFAULT_CODEC, 64, (4, 100))
    kv.ranges[1] = StoredRange(4, 90, kv.ranges[1].layers)  # 96 tokens named 86
    with pytest.raises(ValueError, match="hold 96 tokens, not 86"):
        kv.dequantize(0, "key", rotated=True)


def test_layers_at_once_hold_the_plain_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AgentKV.dequantize_layers`` (the arrays made side by side, then filled): each
    layer's keys and values are what ``dequantize`` gives with the plain ops."""
    kv = _kv(DEFAULT_CODEC, 64, (4, 200, 333, 600), seed=2)
    for ranges, room in ((slice(None), 256), (slice(0, 2), 0), (slice(2, None), 5)):
        made = kv.dequantize_layers([1, 0], rotated=True, room=room, ranges=ranges)
        assert made is not None and len(made) == 2
        monkeypatch.setenv("KVACTOR_FUSED", "0")
        assert kv.dequantize_layers([0], rotated=True) is None  # the caller's plain path
        for layer, pair in zip([1, 0], made, strict=True):
            roles: tuple[Role, Role] = ("key", "value")
            for role, got in zip(roles, pair, strict=True):
                plain = kv.dequantize(layer, role, rotated=True, room=room, ranges=ranges)
                assert np.array_equal(np.array(got), np.array(plain))
        monkeypatch.delenv("KVACTOR_FUSED")
    assert kv.dequantize_layers([0], rotated=False) is None  # only in the stored basis


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_a_copy_filled_on_one_thread_is_the_copy_over_every_core(bits: int) -> None:
    """``fused.allocate`` then ``fill_one`` (a copy filled beside a forward,
    ``kernels.beside``): the values of ``dequantize_many``, bit for bit, room zeros."""
    kv = _kv(KVCodec(bits=bits, group_size=32, sink_tokens=4), 64, (3, 70, 333), seed=3)
    roles: tuple[Role, Role] = ("key", "value")
    jobs: list[fused.Job] = [
        ([r.layers[layer][j] for r in kv.ranges], kv.codec.role_spec(role)[0], 7)
        for layer in (0, 1)
        for j, role in enumerate(roles)
    ]
    made = fused.allocate(jobs)
    assert made is not None
    outs, fills = made
    for fill in fills:
        fused.fill_one(fill)
    every_core = fused.dequantize_many(jobs)
    assert every_core is not None
    for got, want in zip(outs, every_core, strict=True):
        assert got.shape == (1, 3, 340, 64)
        assert np.array_equal(np.array(got), np.array(want))
        assert not np.array(got)[:, :, 333:].any()
