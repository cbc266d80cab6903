from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import kvactor  # noqa: F401 - first: loads the BLAS before mlx.core

# isort: split

import mlx.core as mx
import numpy as np
import pytest

from kvactor.kernels import qcodec
from kvactor.kernels._qparts import concat_parts, parts_tokens
from kvactor.kernels.qcodec import DEFAULT_CODEC, FP16_CODEC, KVCodec, Role

H, D = 3, 64
ROLES: tuple[Role, ...] = ("key", "value")


def normal(tokens: int, seed: int = 0, heads: int = H, dim: int = D) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(1, heads, tokens, dim)).astype(np.float32))


def with_outliers(tokens: int, seed: int = 0) -> mx.array:
    # Like post-RoPE keys: a few channels an order of magnitude larger than the rest.
    x = np.array(normal(tokens, seed))
    x[..., [3, 17, 40]] *= 25.0
    return mx.array(x)


def round_trip(codec: KVCodec, x: mx.array, start: int = 0) -> mx.array:
    return codec.dequantize(codec.quantize(x, start), start, x.shape[2])


def rms(a: mx.array, b: mx.array) -> float:
    return float(mx.sqrt(mx.mean((a - b) ** 2)))


def bitwise_equal(a: dict[str, mx.array], b: dict[str, mx.array]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])) for k in a
    )


def sylvester(n: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def test_all_names_exist() -> None:
    for name in qcodec.__all__:
        assert hasattr(qcodec, name)


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("bits", "group", "bound"),
    [(8, 32, 0.006), (8, 64, 0.008), (4, 32, 0.09), (4, 64, 0.13), (3, 64, 0.26), (2, 64, 0.6)],
)
def test_round_trip_error_is_bounded(bits: int, group: int, bound: float) -> None:
    x = normal(50)
    y = round_trip(KVCodec(bits=bits, group_size=group), x)
    assert y.shape == x.shape and y.dtype == mx.float32
    # MLX's affine grid keeps 0.0 exact by snapping the scale, so the far edge of a group may
    # clip: the bound is about one step (range / (2^bits - 1)), not half of one.
    groups = x.reshape(1, H, 50, D // group, group)
    step = (mx.max(groups, axis=-1) - mx.min(groups, axis=-1)) / (2**bits - 1)
    error = mx.max(mx.abs(y - x).reshape(groups.shape), axis=-1)
    assert float(mx.max(error / step)) <= 1.1
    assert rms(x, y) < bound


def test_smaller_groups_and_more_bits_are_more_accurate() -> None:
    x = normal(50)
    errors = [rms(x, round_trip(KVCodec(bits=b, group_size=g), x)) for b, g in [(4, 64), (4, 32)]]
    assert errors[1] < errors[0]
    assert rms(x, round_trip(KVCodec(bits=8), x)) < errors[1] / 8


def test_fp16_codec_round_trips_to_fp16_precision() -> None:
    x = normal(20)
    parts = FP16_CODEC.quantize(x, 0)
    assert set(parts) == {"x"} and parts["x"].dtype == mx.float16
    assert np.array_equal(np.array(round_trip(FP16_CODEC, x)), np.array(x.astype(mx.float16)))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_reference_dequantize_matches_mlx_bitwise(bits: int, group: int) -> None:
    x = normal(9, seed=bits, dim=128).astype(mx.float16)
    q, s, b = mx.quantize(x, group_size=group, bits=bits)
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    mine = qcodec.dequantize_reference(q, s, b, group, bits)
    theirs = mx.dequantize(q, s, b, group_size=group, bits=bits)
    assert mine.dtype == theirs.dtype == mx.float32
    np.testing.assert_array_equal(np.array(mine), np.array(theirs))


def test_dequantize_is_the_same_on_every_path() -> None:
    # The CPU path (plain ops) and the mx.dequantize path give the same bits.
    codec = KVCodec(bits=3, key_bits=5, rotate=True, sink_tokens=4)
    x = with_outliers(12)
    for role in ROLES:
        parts = codec.quantize(x, 0, role=role)
        bits, group = (5, 64) if role == "key" else (3, 64)
        by_mlx = mx.concatenate(
            [
                mx.dequantize(
                    parts[p + "q"],
                    parts[p + "s"].astype(mx.float32),
                    parts[p + "b"].astype(mx.float32),
                    group_size=group,
                    bits=8 if p else bits,
                )
                for p in ("sink_", "")
            ],
            axis=2,
        )
        expected = mx.hadamard_transform(by_mlx)
        got = codec.dequantize(parts, 0, 12, role=role)
        np.testing.assert_array_equal(np.array(got), np.array(expected))


def test_default_codec_round_trip() -> None:
    x = with_outliers(20)
    for role in ROLES:
        y = DEFAULT_CODEC.dequantize(DEFAULT_CODEC.quantize(x, 0, role=role), 0, 20, role=role)
        assert rms(x, y) < rms(x, round_trip(KVCodec(bits=3), x))


def test_dequantize_dtype() -> None:
    x = normal(8)
    y = KVCodec().dequantize(KVCodec().quantize(x, 0), 0, 8, mx.float16)
    assert y.dtype == mx.float16


def test_fp16_scales_cost_nothing_at_4_bits() -> None:
    # The stored scales/biases are fp16; against fp32 ones the error must not grow (> 1%).
    x = normal(200, seed=3)
    q, s, b = mx.quantize(x, group_size=64, bits=4)
    reference = rms(x, mx.dequantize(q, s, b, group_size=64, bits=4))
    assert rms(x, round_trip(KVCodec(), x)) <= reference * 1.01


# ---------------------------------------------------------------------- rotation


def test_rotation_is_the_orthonormal_sylvester_hadamard() -> None:
    x = normal(10)
    h = sylvester(D)
    np.testing.assert_allclose(h @ h.T, np.eye(D), atol=1e-12)
    rotated = np.array(mx.hadamard_transform(x))
    np.testing.assert_allclose(rotated, np.array(x) @ h, atol=1e-5)


def test_rotation_alone_is_exact() -> None:
    # H is symmetric and orthonormal, so rotating twice (store, then load) is the identity.
    x = normal(10)
    back = mx.hadamard_transform(mx.hadamard_transform(x))
    np.testing.assert_allclose(np.array(back), np.array(x), atol=1e-5)


def test_rotation_shrinks_error_on_outlier_channels() -> None:
    x = with_outliers(100)
    plain = rms(x, round_trip(KVCodec(), x))
    rotated = rms(x, round_trip(KVCodec(rotate=True), x))
    assert rotated < 0.5 * plain


def test_a_width_that_is_not_a_power_of_two_turns_in_blocks() -> None:
    # MLA keys 96 wide: three Hadamard blocks of 32, orthonormal, and quantized in groups
    # of 32 (64 does not divide 96).
    from kvactor.kernels._qmath import rotate, rotate_rows, rotation_block

    assert [rotation_block(w) for w in (64, 96, 192, 128, 160)] == [64, 32, 64, 128, 32]
    x = normal(6, dim=96)
    blocks = x.reshape(1, H, 6, 3, 32)
    want = mx.hadamard_transform(blocks).reshape(x.shape)
    np.testing.assert_allclose(np.array(rotate(x)), np.array(want), atol=1e-5)
    np.testing.assert_array_equal(np.array(rotate_rows(x)), np.array(want))
    np.testing.assert_allclose(np.array(rotate(rotate(x))), np.array(x), atol=1e-5)
    codec = KVCodec(rotate=True)
    assert codec.group_for("value", 96) == 32
    parts = codec.quantize(x, 0)
    assert parts["s"].shape[-1] == 3
    assert {k: v.shape for k, v in parts.items()} == {
        k: shape for k, (shape, _) in codec.expected_parts(0, 6, H, 96).items()
    }
    back = codec.dequantize(parts, 0, 6)
    assert rms(x, back) < 0.2 * rms(x, mx.zeros_like(x))


ROTATING = [
    DEFAULT_CODEC,
    KVCodec(rotate=True),
    KVCodec(bits=4, key_bits=8, rotate=True, sink_tokens=4),  # keys cut at 4, not sinks
    KVCodec(bits=2, group_size=32, rotate=True, sink_tokens=9),
]


@pytest.mark.parametrize("codec", ROTATING, ids=lambda c: c.name)
def test_rotating_as_tokens_arrive_stores_the_same_bytes(codec: KVCodec) -> None:
    # A rotated working cache rotates each step's K/V as it enters (prefill chunks, then one
    # token per decode step, as rows of a batch), and quantizes the turn's tokens with
    # rotated=True: the bytes must be those of quantizing the plain K/V, for every range.
    x = with_outliers(60, seed=3)
    batch = mx.concatenate([normal(60, seed=4), x, normal(60, seed=6)])  # x is row 1
    bounds = [0, 7, 8, 9, 40, 60]
    entered = mx.concatenate(
        [qcodec.rotate_rows(batch[:, :, a:b])[1:2] for a, b in itertools.pairwise(bounds)],
        axis=2,
    )
    assert entered.dtype == mx.float32
    for a, b in [(0, 3), (3, 9), (9, 60), (0, 60)]:  # turns: their own cuts
        for role in ROLES:
            want = codec.quantize(x[:, :, a:b], a, role=role)
            got = codec.quantize(entered[:, :, a:b], a, role=role, rotated=True)
            assert bitwise_equal(got, want), (a, b, role)


@pytest.mark.parametrize("codec", [*ROTATING, KVCodec(), FP16_CODEC], ids=lambda c: c.name)
def test_dequantizing_into_the_rotated_basis_skips_only_the_rotation(codec: KVCodec) -> None:
    x = with_outliers(20, seed=7)
    for role in ROLES:
        parts = codec.quantize(x, 0, role=role)
        plain = codec.dequantize(parts, 0, 20, role=role)
        rotated = codec.dequantize(parts, 0, 20, role=role, rotated=True)
        if codec.rotates(role):
            np.testing.assert_allclose(
                np.array(mx.hadamard_transform(rotated)), np.array(plain), atol=1e-4
            )
        else:
            np.testing.assert_array_equal(np.array(rotated), np.array(plain))


def test_only_quantized_roles_of_a_rotating_codec_are_rotated() -> None:
    assert DEFAULT_CODEC.rotates("key") and DEFAULT_CODEC.rotates("value")
    assert not KVCodec(bits=4).rotates()
    half = KVCodec(bits=16, key_bits=4, rotate=True)  # fp16 values are stored as they are
    assert half.rotates("key") and not half.rotates("value")
    x = normal(5)
    assert bitwise_equal(
        half.quantize(x, 0, role="value", rotated=True), half.quantize(x, 0, role="value")
    )


# ---------------------------------------------------------------------- sinks


def test_sink_tokens_come_back_at_8_bit_accuracy() -> None:
    x = with_outliers(40)
    y = round_trip(KVCodec(sink_tokens=6), x)
    y8 = round_trip(KVCodec(bits=8), x)
    y4 = round_trip(KVCodec(), x)
    np.testing.assert_array_equal(np.array(y[:, :, :6]), np.array(y8[:, :, :6]))
    np.testing.assert_array_equal(np.array(y[:, :, 6:]), np.array(y4[:, :, 6:]))
    assert rms(x[:, :, :6], y[:, :, :6]) < rms(x[:, :, :6], y4[:, :, :6]) / 8


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize(("start", "n"), [(0, 3), (2, 3), (0, 10), (3, 10), (5, 4), (9, 4)])
def test_ranges_inside_and_across_the_sink_boundary(rotate: bool, start: int, n: int) -> None:
    codec = KVCodec(sink_tokens=5, rotate=rotate)
    whole = normal(16)
    x = whole[:, :, start : start + n]
    parts = codec.quantize(x, start)
    n_sink = max(0, min(5 - start, n))
    assert ("sink_q" in parts) == (n_sink > 0)
    assert ("q" in parts) == (n_sink < n)
    assert parts_tokens(parts) == n
    # The same tokens decode to the same values whichever range they were stored in.
    full = round_trip(codec, whole)
    np.testing.assert_array_equal(
        np.array(codec.dequantize(parts, start, n)), np.array(full[:, :, start : start + n])
    )


def test_sinks_are_ignored_at_8_bits_and_above() -> None:
    assert set(KVCodec(bits=8, sink_tokens=4).quantize(normal(8), 0)) == {"q", "s", "b"}


# ---------------------------------------------------------------------- appending


@pytest.mark.parametrize(
    "codec",
    [
        KVCodec(),
        KVCodec(bits=8, group_size=32),
        KVCodec(rotate=True),
        KVCodec(rotate=True, sink_tokens=4),
        KVCodec(sink_tokens=32),
        FP16_CODEC,
        DEFAULT_CODEC,
    ],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("cuts", [[1], [4], [7], [3, 4, 20], [33]])
def test_quantizing_in_pieces_is_bitwise_the_same(codec: KVCodec, cuts: list[int]) -> None:
    x = normal(40, seed=5)
    bounds = [0, *cuts, 40]
    for role in ROLES:
        pieces = [
            codec.quantize(x[:, :, a:b], a, role=role)
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        assert bitwise_equal(concat_parts(pieces), codec.quantize(x, 0, role=role))


def test_concat_refuses_sinks_after_body() -> None:
    codec = KVCodec(sink_tokens=4)
    x = normal(8)
    head, tail = codec.quantize(x[:, :, :6], 0), codec.quantize(x[:, :, 6:], 6)
    with pytest.raises(ValueError, match="sink parts after body"):
        concat_parts([tail, head])


def test_concat_refuses_mixed_codecs() -> None:
    x = normal(4)
    with pytest.raises(ValueError, match="mix"):
        concat_parts([FP16_CODEC.quantize(x, 0), KVCodec().quantize(x, 4)])


def test_empty_ranges() -> None:
    codec = KVCodec(sink_tokens=4)
    assert codec.quantize(normal(0), 0) == {}
    assert codec.expected_parts(7, 0, H, D) == {}
    assert concat_parts([]) == {}
    assert parts_tokens({}) == 0


# ---------------------------------------------------------------------- parts and bytes


@pytest.mark.parametrize(
    "codec",
    [KVCodec(), KVCodec(bits=8), KVCodec(bits=3, group_size=32), FP16_CODEC, DEFAULT_CODEC],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 9), (2, 9), (100, 5)])
def test_expected_parts_match_quantize(codec: KVCodec, start: int, n: int) -> None:
    total = 0
    for role in ROLES:
        parts = codec.quantize(normal(n), start, role=role)
        mx.eval(parts)
        described = {k: (tuple(v.shape), np.array(v).dtype.name) for k, v in parts.items()}
        assert described == codec.expected_parts(start, n, H, D, role=role)
        total += sum(v.nbytes for v in parts.values())
    assert total == codec.nbytes(n, H, D, start)


def test_q4_g64_is_0_28125_of_fp16() -> None:
    # 4 bits per value plus an fp16 scale and bias per 64 values: (4 + 32/64) / 16.
    exact = Fraction(4) / 16 + Fraction(2 * 16, 64) / 16
    assert exact == Fraction(9, 32)
    codec = KVCodec(bits=4, group_size=64)
    assert codec.bytes_ratio_vs_fp16(D) == float(exact) == 0.28125
    fp16 = FP16_CODEC.nbytes(4096, H, D)
    assert fp16 == 2 * 4096 * H * D * 2
    assert Fraction(codec.nbytes(4096, H, D), fp16) == exact
    assert KVCodec(group_size=32).bytes_ratio_vs_fp16(D) == 0.3125
    assert KVCodec(bits=8).bytes_ratio_vs_fp16(D) == 0.53125
    assert KVCodec(key_bits=8).bytes_ratio_vs_fp16(D) == 0.40625


def test_default_codec_fits_the_byte_budget() -> None:
    assert DEFAULT_CODEC.bytes_ratio_vs_fp16(D) == 0.28125  # K 5.5 + V 3.5 bits = 2 x 4.5
    # Sinks cost a few 8-bit tokens once per sequence, not a rate.
    assert DEFAULT_CODEC.nbytes(4096, H, D) / FP16_CODEC.nbytes(4096, H, D) <= 0.30


def test_default_model_shape_is_26_5_mb_at_4k() -> None:
    assert KVCodec().nbytes(4096, 3, 64) * 30 == 26_542_080


def test_dequantize_refuses_parts_of_another_range() -> None:
    codec = KVCodec(sink_tokens=4)
    parts = codec.quantize(normal(6), 0)
    with pytest.raises(ValueError, match="do not match"):
        codec.dequantize(parts, 4, 6)
    with pytest.raises(ValueError, match="tokens"):
        codec.dequantize(parts, 0, 7)


# ---------------------------------------------------------------------- keys vs values


def test_keys_and_values_may_differ() -> None:
    codec = KVCodec(key_bits=8)
    x = normal(6)
    assert codec.quantize(x, 0, role="key")["q"].shape[-1] == D * 8 // 32
    assert codec.quantize(x, 0, role="value")["q"].shape[-1] == D * 4 // 32
    with pytest.raises(ValueError, match="pass role"):
        codec.quantize(x, 0)
    with pytest.raises(ValueError, match="role must be"):
        codec.quantize(x, 0, role="query")  # type: ignore[arg-type]
    assert codec.nbytes(10, H, D) == sum(
        int(np.prod(shape)) * np.dtype(dtype).itemsize
        for role in ROLES
        for shape, dtype in codec.expected_parts(0, 10, H, D, role=role).values()
    )


def test_same_settings_spelled_twice_are_one_codec() -> None:
    assert KVCodec(key_bits=4, key_group_size=64) == KVCodec()
    assert KVCodec(key_bits=4).symmetric


# ---------------------------------------------------------------------- descriptions


@pytest.mark.parametrize(
    "codec",
    [KVCodec(), DEFAULT_CODEC, FP16_CODEC, KVCodec(bits=8, group_size=32, key_bits=16)],
    ids=lambda c: c.name,
)
def test_description_round_trip(codec: KVCodec) -> None:
    d = codec.describe()
    assert all(isinstance(v, (int, str)) for v in d.values())
    assert KVCodec.from_description(d) == codec
    assert KVCodec.from_description(dict(d)).describe() == d


@pytest.mark.parametrize(
    "change",
    [
        {"format": "other"},
        {"version": 2},
        {"bits": 7},
        {"bits": "4"},
        {"bits": True},
        {"group_size": 48},
        {"key_bits": None},
        {"rotate": 1},
        {"sink_tokens": -1},
        {"sink_bits": 16},
        {"scale_dtype": "float32"},
        {"extra": 1},
    ],
)
def test_bad_descriptions_are_refused(change: dict[str, object]) -> None:
    d: dict[str, object] = {**KVCodec().describe(), **change}
    with pytest.raises(ValueError):
        KVCodec.from_description(d)


def test_missing_description_key_is_refused() -> None:
    d = KVCodec().describe()
    del d["rotate"]
    with pytest.raises(ValueError, match="missing"):
        KVCodec.from_description(d)


def test_different_codecs_describe_differently() -> None:
    codecs = [KVCodec(), DEFAULT_CODEC, KVCodec(rotate=True), KVCodec(sink_tokens=4), FP16_CODEC]
    assert len({tuple(sorted(c.describe().items())) for c in codecs}) == len(codecs)


# ---------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bits": 7},
        {"bits": 1},
        {"bits": 4.0},
        {"group_size": 16},
        {"group_size": 256},
        {"key_bits": 9},
        {"key_group_size": 100},
        {"sink_tokens": -1},
        {"rotate": "yes"},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KVCodec(**kwargs)


def test_the_group_shrinks_to_divide_the_width_or_the_width_is_refused() -> None:
    codec = KVCodec(group_size=128)
    assert [codec.group_for("key", w) for w in (128, 256, 64, 96, 32)] == [128, 128, 64, 32, 32]
    # 128 does not divide D: the group is the next size down that does, in every method.
    assert codec.quantize(normal(2), 0)["s"].shape[-1] == D // codec.group_for("key", D)
    assert codec.expected_parts(0, 2, H, D)["s"][0][-1] == D // codec.group_for("key", D)
    assert codec.bytes_ratio_vs_fp16(D) == KVCodec(group_size=64).bytes_ratio_vs_fp16(D)
    for width in (48, 16):
        with pytest.raises(ValueError, match=f"divides width {width}"):
            codec.quantize(normal(2, dim=width), 0)
        with pytest.raises(ValueError, match=f"divides width {width}"):
            codec.expected_parts(0, 2, H, width)
    assert KVCodec(bits=16).expected_parts(0, 2, H, 48)["x"][0] == (1, H, 2, 48)


def test_bad_inputs_are_refused() -> None:
    codec = KVCodec()
    with pytest.raises(ValueError, match="expected"):
        codec.quantize(mx.zeros((3, 4, 64)), 0)
    with pytest.raises(ValueError, match="expected"):
        codec.quantize(mx.zeros((2, 3, 4, 64)), 0)
    with pytest.raises(ValueError, match="start"):
        codec.quantize(normal(2), -1)
    with pytest.raises(ValueError):
        codec.expected_parts(-1, 2, H, D)


def test_names() -> None:
    assert KVCodec().name == "q4g64"
    assert FP16_CODEC.name == "fp16"
    assert KVCodec(bits=8, rotate=True, sink_tokens=32).name == "q8g64+h+s32"
    assert DEFAULT_CODEC.name == "k5v3g64+h+s4"
    assert KVCodec(bits=3, key_bits=5, key_group_size=32).name == "k5g32v3g64"


def test_pieces_are_bitwise_the_same_at_scale() -> None:
    # Decode appends one token at a time and prefill 256 at a time; at this size a rotation
    # whose rounding depends on how many rows it sees (a BLAS matmul) flips some stored values.
    bounds = [*range(64), *range(64, 4096, 256), 4096]
    for seed in range(4):
        x = normal(4096, seed=seed) * 3
        for role in ROLES:
            pieces = [
                DEFAULT_CODEC.quantize(x[:, :, a:b], a, role=role)
                for a, b in itertools.pairwise(bounds)
            ]
            assert bitwise_equal(concat_parts(pieces), DEFAULT_CODEC.quantize(x, 0, role=role))


@pytest.mark.parametrize("rotated", [False, True])
def test_dequantize_with_room_joins_ranges_bit_for_bit(rotated: bool) -> None:
    # AgentKV.dequantize joins the integer codes of every range (sinks in the first) and the
    # room before one scale pass: the same bits as dequantizing each range and joining floats.
    from kvactor.kernels.agent_cache import AgentKV
    from kvactor.kernels.geometry import CacheGeometry
    from kvactor.kernels.stored import StoredRange

    codec = KVCodec(bits=3, key_bits=5, rotate=True, sink_tokens=4)
    x = with_outliers(20)
    cuts = [(0, 7), (7, 8), (8, 20)]
    kv = AgentKV(codec, CacheGeometry.uniform(1, x.shape[1], x.shape[3]))
    kv.ranges = [
        StoredRange(
            a,
            b,
            [
                (
                    codec.quantize(x[:, :, a:b], a, role="key"),
                    codec.quantize(x[:, :, a:b], a, role="value"),
                )
            ],
        )
        for a, b in cuts
    ]
    kv.tokens = list(range(20))
    for role in ROLES:
        kind = 0 if role == "key" else 1
        want = mx.concatenate(
            [
                codec.dequantize(
                    r.layers[0][kind], r.start, r.stop - r.start, role=role, rotated=rotated
                )
                for r in kv.ranges
            ],
            axis=2,
        )
        for room in (0, 5):
            got = kv.dequantize(0, role, rotated=rotated, room=room)
            assert got.dtype == mx.float32 and got.shape[2] == 20 + room
            np.testing.assert_array_equal(np.array(got[:, :, :20]), np.array(want))
            assert not np.array(got[:, :, 20:]).any()


def test_segment_layout_gives_each_caller_its_own_answer() -> None:
    # The layout of a range is kept for the next load that asks: a caller that changes
    # its answer must not change the next one's.
    from kvactor.kernels.geometry import CacheGeometry
    from kvactor.kernels.stored import segment_layout

    expect = segment_layout(DEFAULT_CODEC, CacheGeometry.uniform(2, H, D))
    first = expect(0, 10)
    want = dict(first)
    first.clear()
    assert expect(0, 10) == want and want
    assert expect(0, 11) != want  # another range: another answer


def test_a_stored_ranges_bytes_follow_what_it_lets_go() -> None:
    # The hot tier reads a range's bytes every decode step: counted once, and again
    # when a checkpoint or a sliding layer's parts are let go.
    from kvactor.kernels.stored import StoredRange

    x = with_outliers(12)
    parts = [(DEFAULT_CODEC.quantize(x, 0, role="key"), DEFAULT_CODEC.quantize(x, 0, role="value"))]
    r = StoredRange(0, 12, parts * 2, {2: {"h": mx.zeros((1, 4, 8))}})

    def counted() -> int:
        return sum(a.nbytes for a in r.arrays())

    assert r.nbytes == counted() > 0
    r.drop_states()
    assert r.nbytes == counted() and not r.states
    r.drop_layer(1)
    assert r.nbytes == counted() and r.layers[1] == ({}, {})
    r.drop_layer(0)
    assert r.nbytes == 0
