"""A tiny random model whose greedy answers depend on their whole context, for the tests
that claim "the same tokens" (alone and batched, hot and warm, across restarts).

``make_tiny_model``'s weights are small beside its embeddings: its residual stream is the
input token's embedding, so a greedy turn of the tiny llama repeats one token, decided at
the prefill, whatever its cache holds in the decode steps (a batch whose rows read each
other's keys answered as alone). :func:`lively` is the same model with its layers'
weights scaled up (embeddings and norms as they are): attention then moves the answer,
and turns of different histories answer differently at every step
(``tests/test_engine.py::test_the_lively_model_answers_by_its_whole_context``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map_with_path

from kvactor.actors.models import LoadedModel, make_tiny_model

#: How much the layers' weights are scaled up.
SCALE = 10.0


def _make(seed: int, family: str, scale: float, overrides: dict[str, Any]) -> LoadedModel:
    lm = make_tiny_model(seed, family, **overrides)

    def scaled(path: str, array: mx.array) -> mx.array:
        return array if "embed" in path or "norm" in path else array * scale

    lm.model.update(tree_map_with_path(scaled, lm.model.parameters()))
    mx.eval(lm.model.parameters())
    return lm


def lively(
    seed: int = 0, family: str = "llama", *, scale: float = SCALE, **overrides: Any
) -> Callable[[], LoadedModel]:
    """A factory (``kvactor.open``'s model) of ``make_tiny_model(seed, family,
    **overrides)`` (the llama's heads 64 wide unless ``overrides`` say otherwise) with its
    layers' weights scaled by ``scale``."""
    if family == "llama":
        overrides = {"head_dim": 64, **overrides}
    return functools.partial(_make, seed, family, scale, overrides)
