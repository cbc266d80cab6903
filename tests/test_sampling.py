"""Sampling options beyond temperature and top-p: top-k, min-p, penalties, logit biases,
stop lists. Kernels on real MLX arrays; turns on a tiny random-weight model."""

from __future__ import annotations

import functools
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from lively import lively

import kvactor
from kvactor.actors.engine._picking import _penalized
from kvactor.actors.enums import FinishReason
from kvactor.actors.messages import Generate
from kvactor.actors.models import make_tiny_model
from kvactor.actors.options import Sampling
from kvactor.actors.records import Finished
from kvactor.kernels.sampling import (
    adjust_logits,
    apply_bitmask,
    min_p_filter,
    sample_rows,
    top_k_filter,
)

tiny = functools.partial(make_tiny_model, 0, head_dim=64)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"logit_bias": {"seven": 1}}, "logit_bias"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"top_k": "many"}, "top_k"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_option(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        Sampling.from_options(options)


def test_an_unknown_option_is_both_a_type_error_and_a_value_error() -> None:
    for kind in (TypeError, ValueError):
        with pytest.raises(kind, match=r"unknown sampling option.*top_q"):
            Sampling.from_options({"top_q": 3})


def test_logit_bias_takes_json_keys_and_sorts_them() -> None:
    s = Sampling.from_options({"logit_bias": {"9": -100, 3: 2.5}})
    assert s.logit_bias == ((3, 2.5), (9, -100.0)) and s.penalized
    assert not Sampling.from_options({"top_k": 5, "min_p": 0.1}).penalized


def test_adjust_logits_changes_only_the_named_entries() -> None:
    logits = mx.array([[2.0, -2.0, 1.0, 0.5], [4.0, 3.0, -1.0, 0.0]])
    out = adjust_logits(
        logits,
        mx.array([0, 0, 1], dtype=mx.int32),
        mx.array([0, 1, 2], dtype=mx.int32),
        mx.array([2.0, 2.0, 1.0]),
        mx.array([0.0, -0.5, 7.0]),
    )
    assert out.tolist() == [[1.0, -4.5, 1.0, 0.5], [4.0, 3.0, 6.0, 0.0]]


def _floats(a: mx.array) -> list[float]:
    return [float(v) for v in np.array(a).reshape(-1)]


def test_apply_bitmask_keeps_allowed_bits_and_drops_the_rest() -> None:
    logits = mx.random.normal((2, 40), key=mx.random.key(1))
    mask = np.zeros((2, 2), dtype=np.int32)
    mask[0] = -1  # all allowed
    mask[1, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (bit 31: the sign)
    mask[1, 1] = 1 << 5  # token 37
    out = apply_bitmask(logits, mx.array(mask))
    assert mx.array_equal(out[0], logits[0]).item()
    allowed = [i for i, v in enumerate(_floats(out[1])) if v != float("-inf")]
    assert allowed == [3, 31, 37]
    narrow = apply_bitmask(logits, mx.array(np.full((2, 1), -1, dtype=np.int32)))
    assert all(v == float("-inf") for v in _floats(narrow[:, 32:]))


def test_top_k_and_min_p_filters() -> None:
    row = mx.array([0.0, 3.0, 1.0, 2.0, -1.0])
    kept = [v != float("-inf") for v in _floats(top_k_filter(row, 2))]
    assert kept == [False, True, False, True, False]
    # probabilities relative to the best: e^(x - 3); min_p 0.3 keeps x >= 3 + ln 0.3
    kept = [v != float("-inf") for v in _floats(min_p_filter(row, 0.3))]
    assert kept == [False, True, False, True, False]
    key = mx.random.key(0)
    for _ in range(20):
        key, sub = mx.random.split(key)
        picked = sample_rows(row[None], [1.0], [1.0], [sub], top_ks=[1], min_ps=[0.0]).item()
        assert picked == 1


class _Row:
    """What ``_penalized`` reads of a turn: its settings and its tokens so far."""

    def __init__(self, sampling: Sampling, prompt: list[int], generated: list[int]) -> None:
        self.sampling = sampling
        self.prompt = prompt
        self.generated = generated
        self.counts = {t: generated.count(t) for t in set(generated)}


def test_penalties_follow_their_definitions() -> None:
    logits = mx.array([[1.0, -1.0, 2.0, 0.5, 3.0, 0.0]])
    s = Sampling(
        repetition_penalty=2.0,
        repetition_context_size=3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=((5, 10.0),),
    )
    # context [.., 0, 1 | 2, 2]: the last 3 are 1, 2, 2; generated 2 twice
    row = _Row(s, prompt=[4, 0, 1], generated=[2, 2])
    out = _penalized(logits, [row], [True])  # type: ignore[list-item]
    assert out.tolist() == [[1.0, -2.0, 2.0 / 2 - 0.5 - 0.5, 0.5, 3.0, 10.0]]


async def _tokens(session: Any, agent: str, prompt: list[int], sampling: Sampling) -> Finished:
    done = None
    request = Generate(agent, prompt, sampling, time.perf_counter())
    async with session.engine.stream(request) as items:
        async for item in items:
            if isinstance(item, Finished):
                done = item
    assert done is not None
    return done


async def test_biases_ban_and_force_tokens_and_greedy_rows_beside_them_keep_their_tokens() -> None:
    # Rows beside others keep their tokens in the mode that promises it (README).
    # On a model whose tokens depend on their cache (tests/lively.py).
    async with kvactor.open(lively(), deterministic=True) as session:
        plain = await _tokens(session, "p", [1, 40, 41], Sampling(max_tokens=12))
        banned = plain.token_ids[0]
        forced = Sampling(max_tokens=5, logit_bias=((77, 100.0),))
        ban = Sampling(max_tokens=12, logit_bias=((banned, -100.0),))
        penalized = Sampling(max_tokens=12, frequency_penalty=2.0, repetition_penalty=1.5)
        import anyio

        results: dict[str, Finished] = {}

        async def run(name: str, prompt: list[int], sampling: Sampling) -> None:
            results[name] = await _tokens(session, name, prompt, sampling)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "p2", [1, 40, 41], Sampling(max_tokens=12))
            tg.start_soon(run, "f", [1, 50], forced)
            tg.start_soon(run, "b", [1, 40, 41], ban)
            tg.start_soon(run, "r", [1, 60, 61], penalized)
        assert results["p2"].token_ids == plain.token_ids  # the same beside host-bound rows
        assert results["f"].token_ids == [77] * 5
        assert banned not in results["b"].token_ids
        alone = await _tokens(session, "r2", [1, 60, 61], penalized)
        assert alone.token_ids == results["r"].token_ids  # host-bound rows: batch-invariant too
        stats = await session.stats()
        assert stats.max_batch_seen >= 2


async def test_several_stop_strings_end_the_turn_at_the_first_that_appears() -> None:
    async with kvactor.open(tiny) as session:
        agent = await session.spawn_agent("a")
        free = await agent.generate("hello there", max_tokens=24)
        text = free.text
        assert len(text) > 6
        first, later = text[4:6], text[-2:]
        done = await agent.chat(
            [{"role": "user", "content": "hello there"}], max_tokens=24, stop=[later, first]
        )
        assert done.finish_reason is FinishReason.STOP
        assert done.text == text[: text.index(first)]
