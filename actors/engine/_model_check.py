"""A model's turns tried once at start, so that a family kvactor cannot run is refused at
``open()`` (naming the family and the layer), never by a dead engine mid-turn."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ...kernels.agent_cache import AgentKV
from ...kernels.qcodec import KVCodec
from ...kernels.turn_cache import Entries, TurnCache
from ..errors import ModelLoadError
from ..models import LoadedModel, failing_layer, first_differing_layer

__all__ = ("check_turns",)


def _turn(lm: LoadedModel, kv: AgentKV, prompt: list[int]) -> mx.array:
    """A prefill of ``prompt`` in two chunks with a stored cut between them, then its end;
    the first chunk's logits."""
    work = kv.activate()
    first = None
    for chunk in (prompt[:-1], prompt[-1:]):
        logits = lm.model(mx.array([chunk], dtype=mx.uint32), cache=work.layers)
        first = logits if first is None else first
        kv.tokens.extend(chunk)
        if len(kv.tokens) < len(prompt):
            kv.store_so_far()
    kv.deactivate()
    assert first is not None
    return first


def _same_as_mlx_lm(lm: LoadedModel, prompt: list[int], logits: mx.array) -> bool:
    """Whether ``logits`` (of ``prompt`` over an empty working cache: nothing quantized
    yet) are mlx-lm's own, to rounding (a rotated basis rounds differently)."""
    ref = lm.model(mx.array([prompt], dtype=mx.uint32), cache=make_prompt_cache(lm.model))
    scale = float(mx.abs(ref).max().item()) + 1e-6  # type: ignore[arg-type]
    return bool(mx.allclose(logits, ref, rtol=1e-3, atol=1e-3 * scale).item())


def _try(lm: LoadedModel, codec: KVCodec, turn_cache: type[TurnCache]) -> tuple[bool, list[int]]:
    """Two agents' turns, then a pipelined decode step of both in one batch, one row taken
    back and out: whether the first prefill gave mlx-lm's logits, and the entries whose
    attention did not read the working cache."""
    kvs = [AgentKV(codec, lm.geometry, turn_cache=turn_cache) for _ in range(2)]
    prompts = ([1, 2, 3, 4], [5, 6])
    same = _same_as_mlx_lm(lm, prompts[0][:-1], _turn(lm, kvs[0], prompts[0]))
    _turn(lm, kvs[1], prompts[1])
    for kv in kvs:
        kv.activate()
    batch = kvs[0].lend_work().batch()
    batch.extend(kvs[1].lend_work())
    batch.before_step()
    logits = lm.model(mx.array([[7], [8]], dtype=mx.uint32), cache=batch.layers)
    unattended = cast(Entries, batch).check_attended()
    row = batch.extract(0)
    row.unfeed(1)
    batch.filter([1])
    mx.eval(logits, row.arrays(), batch.arrays())
    return same, unattended


def check_turns(lm: LoadedModel, codec: KVCodec, turn_cache: type[TurnCache]) -> None:
    """Run a few tokens of turns of ``lm`` through working caches of ``turn_cache`` (the
    attention mode) as the engine would: prefill with a stored cut, a new turn over the
    stored cache, a batched decode step, a row leaving with its token taken back.

    Raises ModelLoadError naming the model family and the layer when anything fails, when
    an attention layer does not read the working cache (it would compute over something
    else), or when a prefill over it does not give mlx-lm's logits to rounding; a model
    prepared for the class (``TurnCache.prepare``) first."""
    model: Any = lm.model
    family = getattr(model, "model_type", lm.name)
    mode = "quantized" if turn_cache.quantized else "dequantized"
    try:
        same, unattended = _try(lm, codec, turn_cache)
    except Exception as exc:
        at = failing_layer(exc, getattr(model, "layers", None))
        where = f"layer {at}" if at is not None else "a turn"
        raise ModelLoadError(
            f"model family {family!r}: {where} fails in {mode} attention: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if unattended:
        layer = lm.geometry.model_layer(unattended[0])
        raise ModelLoadError(
            f"model family {family!r}: layer {layer}'s attention does not run over kvactor's "
            f"{mode} cache (it does not call mlx-lm's scaled_dot_product_attention)"
        )
    if not same:
        kv = AgentKV(codec, lm.geometry, turn_cache=turn_cache)
        tokens = mx.array([[1, 2, 3]], dtype=mx.uint32)
        at = first_differing_layer(model, tokens, kv.activate().layers, make_prompt_cache(model))
        where = f"layer {at}'s output differs" if at is not None else "its logits differ"
        raise ModelLoadError(
            f"model family {family!r}: {where} over kvactor's {mode} cache from "
            "mlx-lm's own (a layer that reads its cached keys or values outside attention, "
            "as a latent MLA cache does; a codec without rotation may run it dequantized)"
        )
