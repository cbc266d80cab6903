"""Scenarios of several models: each role (agent) runs one of the scenario's ``models``, all
in one session under one memory limit (``kvactor.open(models=...)``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..actors.errors import InvalidAgentId
from ..actors.ids import check_agent_id

if TYPE_CHECKING:
    from ._format import Scenario

__all__ = ("agent_model", "model_folders", "models_problem", "session_models")


def agent_model(s: Scenario, name: str) -> str | None:
    """The model agent ``name`` runs (a fork: its source's); None without ``models``."""
    if not s.models:
        return None
    specs = {a.name: a for a in s.agents}
    spec = specs[name]
    while spec.model is None and spec.fork is not None:
        spec = specs[spec.fork]
    return spec.model if spec.model is not None else next(iter(s.models))


def models_problem(s: Scenario) -> tuple[str, str] | None:
    """The first problem of the scenario's ``models``, roles' ``model`` and
    ``memory_limit_mb``, as (message, field path), or None."""
    if not s.models:
        for i, agent in enumerate(s.agents):
            if agent.model is not None:
                return "an agent's model names one of the scenario's models", f"agents[{i}].model"
        return None
    for name, spec in s.models.items():
        try:
            check_agent_id(name)
        except InvalidAgentId as exc:
            return f"bad model name (it names a cache folder): {exc}", f"models.{name}"
        if not spec.strip():
            return "a model is 'default', 'tiny', 'tiny:SEED' or a path", f"models.{name}"
    if s.shared_context is not None:
        return "a shared context serves one model: drop models or shared_context", "models"
    if s.hot_agents is not None:
        return "hot_agents estimates one model's caches: use memory_limit_mb", "hot_agents"
    for i, agent in enumerate(s.agents):
        if agent.model is not None and agent.model not in s.models:
            known = ", ".join(s.models)
            return f"unknown model {agent.model!r}; models: {known}", f"agents[{i}].model"
        forked = agent.fork is not None and agent.model is not None
        if forked and agent_model(s, agent.fork or "") != agent.model:
            return "a fork runs its source's model", f"agents[{i}].model"
    return None


def session_models(s: Scenario) -> dict[str, Any]:
    """``kvactor.open``'s model options for the scenario: ``models``, ``memory_limit``,
    ``disk_limit`` and ``write_budget`` (each absent when the scenario does not say).
    Raises ScenarioError for a model path that does not exist."""
    from ._format import resolve_model

    options: dict[str, Any] = {}
    if s.models:
        options["models"] = {name: resolve_model(spec) for name, spec in s.models.items()}
    if s.memory_limit_mb is not None:
        options["memory_limit"] = int(s.memory_limit_mb * 1e6)
    if s.disk_limit_mb is not None:
        options["disk_limit"] = int(s.disk_limit_mb * 1e6)
    if s.write_budget_mb_per_day is not None:
        options["write_budget"] = int(s.write_budget_mb_per_day * 1e6)
    return options


def model_folders(s: Scenario, root: Path) -> list[Path]:
    """The warm tier's folders of the scenario's session under ``root``: one per model."""
    if not s.models:
        return [root]
    from ..actors.session import model_folder

    return [model_folder(root, name) for name in s.models]
