"""Every mlx-lm model type that can be built from a tiny config (``tests/_every_model.py``)
goes through ``kvactor.open()`` and one turn in both attention modes: it runs, or open()
refuses it naming its family (and the layer); no model kills the engine mid-turn. Types
that cannot be built from a small config are skipped with the reason."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest
from _every_model import model_types, tiny_config

import kvactor
from kvactor.actors.models._load import tiny_model

MODES: tuple[kvactor.Attention, ...] = ("dequantized", "quantized")


def _build(family: str) -> tuple[Any, str | None]:
    """A factory of the tiny model (None: refused by the geometry probe, with why)."""
    config, why = tiny_config(family)
    if config is None:
        pytest.skip(why)
    try:
        tiny_model(family, config)
    except ValueError as exc:
        text = str(exc)
        if not text.startswith(f"model family {family!r}") or "mlx-lm's own caches" in text:
            pytest.skip(f"mlx-lm cannot build or run it from the tiny config: {text[:160]}")
        return None, text  # kvactor cannot store its caches: open() refuses it so
    except Exception as exc:
        pytest.skip(f"mlx-lm cannot build it from the tiny config: {type(exc).__name__}: {exc}")
    return functools.partial(tiny_model, family, config), None


async def _one_turn(model: Any, attention: kvactor.Attention) -> kvactor.Completion:
    async with kvactor.open(model, attention=attention) as kv:
        agent = await kv.spawn_agent("a", system="Be brief.")
        return await agent.generate("Say something.", max_tokens=3)


@pytest.mark.parametrize("family", model_types())
def test_every_model_type_runs_or_is_refused_at_open(family: str) -> None:
    model, refused = _build(family)
    for attention in MODES:
        if refused is not None:
            config = tiny_config(family)[0]
            assert config is not None
            with pytest.raises(ValueError, match=f"model family '{family}': layer"):
                anyio.run(_one_turn, functools.partial(tiny_model, family, config), attention)
            continue
        try:
            done = anyio.run(_one_turn, model, attention)
        except kvactor.ModelLoadError as exc:  # refused at open, by name: not mid-turn
            assert f"model family {family!r}" in str(exc)
            continue
        assert 1 <= len(done.token_ids) <= 3
