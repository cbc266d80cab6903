"""The models of a session (``Session``'s base): starting the engine over one model or
several, and which model, engine and warm tier each agent uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from ...runtime import ActorRef, Runtime
from ..agent import AgentEnv
from ..engine import EngineActor, EngineConfig, ModelRef, ModelsEngine, ModelSpec, record_limit
from ..messages import EndTurns, EngineMessage, ModelsQuery
from ..models import Tokenizer
from ..records import EngineStats, ModelInfo, ModelState
from ..warm import (
    ActorWarmTier,
    CacheDirLock,
    CacheIdentity,
    ExpectFn,
    PrefetchMessage,
    StoreMessage,
    lock_cache_dir,
)
from ._model_part import ModelPart, model_folder, start_part

__all__ = ("Models", "SessionModels")

#: What ``kvactor.open(models=...)`` takes: a name per model, each a ModelSpec.
Models = dict[str, ModelSpec]


class SessionModels:
    """A session's models: each one's part (engine reference, ModelInfo, warm tier), and
    the model of each running agent. Only the session writes these."""

    _model: ModelSpec | Models
    config: EngineConfig
    cache_dir: Path | None
    runtime: Runtime
    memory_limit: int | None
    _delete_rejected: bool
    _pins: frozenset[str]
    _model_ttl_s: float | None
    _flat: bool
    _parts: dict[str, ModelPart]
    _agent_models: dict[str, str]
    _model_locks: list[CacheDirLock]
    engine: ActorRef[EngineMessage]
    model: ModelInfo
    tokenizer: Tokenizer
    store: ActorRef[StoreMessage] | None
    prefetcher: ActorRef[PrefetchMessage] | None
    warm: ActorWarmTier | None
    identity: CacheIdentity | None
    layout: ExpectFn | None
    _env: AgentEnv

    def agent(self, name: str) -> Any:
        raise NotImplementedError

    async def stats(self) -> EngineStats:
        raise NotImplementedError

    async def _start_models(self) -> None:
        """Spawn the engine (loading the models) and start each model's part."""
        spec, root, rejected = self._model, self.cache_dir, self._delete_rejected
        if not isinstance(spec, dict):
            engine = await self.runtime.spawn(EngineActor, spec, self.config, name="engine")
            part = await start_part(
                self.runtime, None, engine, self.config, root, delete_rejected=rejected
            )
            self._parts[part.name] = part
        else:
            limit = self.memory_limit
            assert limit is not None
            multi = await self.runtime.spawn(
                ModelsEngine,
                spec,
                self.config,
                limit,
                self._pins,
                self._model_ttl_s,
                name="engine",
            )
            for name in spec:
                folder = None if root is None else model_folder(root, name)
                if self._flat:  # one model given as ``model``: its warm tier is the root
                    folder = root
                elif folder is not None:
                    lock = await anyio.to_thread.run_sync(lock_cache_dir, folder)
                    self._model_locks.append(lock)
                part = await start_part(
                    self.runtime,
                    name,
                    ModelRef(multi, name),
                    self.config,
                    folder,
                    delete_rejected=rejected,
                    suffix=f":{name}",
                )
                self._parts[name] = part
        if root is not None and self.memory_limit is not None:
            await anyio.to_thread.run_sync(record_limit, root, self.memory_limit, list(self._parts))
        first = next(iter(self._parts.values()))
        self.engine, self.model, self.tokenizer = first.engine, first.model, first.tokenizer
        self.store, self.prefetcher, self.warm = first.store, first.prefetcher, first.warm
        self.identity, self.layout, self._env = first.identity, first.layout, first.env

    @property
    def models(self) -> dict[str, ModelInfo]:
        """The session's models by name (one model: under its own name)."""
        return {name: part.model for name, part in self._parts.items()}

    def _part(self, model: str | None) -> ModelPart:
        """Model ``model``'s part (None: the first). Raises ValueError for an unknown one."""
        if model is None:
            return next(iter(self._parts.values()))
        try:
            return self._parts[model]
        except KeyError:
            raise ValueError(f"no model {model!r}: the models are {sorted(self._parts)}") from None

    def _same_model(self, source: str, model: str | None) -> ModelPart:
        """The model of an agent made from running agent ``source``: ``source``'s. Raises
        ValueError for another one (a cache never serves another model)."""
        part = self._part(self._agent_models.get(source))
        if model is not None and self._part(model) is not part:
            raise ValueError(
                f"{source!r} runs model {part.name!r}, not {model!r}: forks and shared "
                "contexts stay within a model"
            )
        return part

    def model_of(self, name: str) -> str:
        """The model running agent ``name`` runs. Raises UnknownAgent."""
        self.agent(name)
        return self._agent_models[name]

    def engine_for(self, name: str) -> ActorRef[EngineMessage]:
        """The engine as running agent ``name``'s model sees it (the session's ``engine``
        when it is not running)."""
        return self._part(self._agent_models.get(name)).engine

    async def model_states(self) -> list[ModelState]:
        """Each model: loaded or not, pinned, weights, loads (one model: always loaded)."""
        if len(self._parts) == 1 and not isinstance(self._model, dict):
            stats = await self.stats()
            name = next(iter(self._parts))
            return [ModelState(name, True, True, stats.weights_bytes, 1, 0.0)]
        states: list[ModelState] = await self._multi_ref().ask(ModelsQuery())
        return states

    async def end_turns(self) -> int:
        """End every turn, for a close to come (a server stopping): a decoding turn ends
        at its next step with finish_reason ``"ended"`` and is saved as any turn; a turn
        not decoding yet, and any asked for later, fails with TurnEnded. Returns how many
        turns it ended."""
        ref = self._multi_ref() if isinstance(self.engine, ModelRef) else self.engine
        ended: int = await ref.ask(EndTurns())
        return ended

    def _multi_ref(self) -> ActorRef[object]:
        engine = self.engine
        assert isinstance(engine, ModelRef)
        return ActorRef(engine._cell)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests choose a model by: several models' (as ``models=`` named
        them), else none (one model serves any name)."""
        return tuple(self._parts) if len(self._parts) > 1 else ()

    @property
    def max_prompt_chars(self) -> int:
        """Characters past which no prompt fits any model's context."""
        return max(part.env.max_prompt_chars for part in self._parts.values())
