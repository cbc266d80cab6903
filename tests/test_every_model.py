"""Every mlx-lm model type that can be built from a tiny config (``tests/_every_model.py``)
goes through ``kvactor.open()`` and one turn in both attention modes: it runs, or open()
refuses it naming its family (and the layer); no model kills the engine mid-turn.

What each type does is pinned (``_every_model.OUTCOMES``): a type that runs fails the test
if it starts being refused, a refused one if it is refused otherwise or starts to run, and
a type is skipped only when it has no tiny config or mlx-lm alone cannot build and run it
from that config (checked here without kvactor), as pinned. A type mlx-lm adds fails until
its outcome is pinned."""

from __future__ import annotations

import functools

import anyio
import pytest
from _every_model import OUTCOMES, mlx_lm_runs, model_types, tiny_config

import kvactor
from kvactor.actors.models._load import tiny_model

MODES: tuple[kvactor.Attention, ...] = ("dequantized", "quantized")


async def _one_turn(family: str, config: dict[str, object], attention: kvactor.Attention) -> int:
    model = functools.partial(tiny_model, family, config)
    async with kvactor.open(model, attention=attention) as kv:
        agent = await kv.spawn_agent("a", system="Be brief.")
        done = await agent.generate("Say something.", max_tokens=3)
        return len(done.token_ids)


@pytest.mark.parametrize("family", model_types())
def test_every_model_type_runs_or_is_refused_at_open(family: str) -> None:
    expected = OUTCOMES.get(family)
    assert expected is not None, "a new mlx-lm model type: pin its outcome in _every_model.py"
    config, why = tiny_config(family)
    if config is None:
        assert expected == "no tiny config", f"{family} has no tiny config now: {why}"
        pytest.skip(why)
    assert expected != "no tiny config", f"{family} has a tiny config now: pin what it does"
    cannot = mlx_lm_runs(family, config)
    if cannot is not None:
        assert expected == "mlx-lm cannot", f"mlx-lm no longer builds or runs {family}: {cannot}"
        pytest.skip(f"mlx-lm cannot build or run it from the tiny config: {cannot[:160]}")
    assert expected != "mlx-lm cannot", f"mlx-lm builds and runs {family} now: pin what it does"
    if expected == "refused by the probe":
        with pytest.raises(ValueError, match=f"^model family '{family}': layer") as refused:
            tiny_model(family, config)
        assert "mlx-lm's own caches" not in str(refused.value)
        return
    tiny_model(family, config)  # kvactor's probe takes it
    for attention in MODES:
        if expected == "refused at open":
            with pytest.raises(kvactor.ModelLoadError, match=f"model family '{family}'"):
                anyio.run(_one_turn, family, config, attention)
        else:
            assert expected == "runs"
            assert 1 <= anyio.run(_one_turn, family, config, attention) <= 3
