"""What a session keeps per model: the engine as that model's agents see it, what the model
is, and its warm tier (a store and a prefetcher of its own, under its own folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio

from ...kernels.geometry import CacheGeometry
from ...kernels.qcodec import DEFAULT_CODEC
from ...kernels.stored import segment_layout
from ...runtime import ActorRef, Runtime
from ..agent import AgentEnv, prompt_chars_limit
from ..engine import EngineConfig
from ..messages import EngineMessage, GetModelInfo
from ..models import Tokenizer
from ..records import ModelInfo
from ..warm import (
    ActorWarmTier,
    CacheIdentity,
    DiskUsage,
    ExpectFn,
    PrefetchActor,
    PrefetchMessage,
    StoreActor,
    StoreMessage,
    settle_imports,
)

__all__ = ("ModelPart", "model_folder", "start_part")


def model_folder(root: Path, name: str) -> Path:
    """Where model ``name`` of a multi-model session keeps its warm tier under ``root``."""
    return root / "models" / name


@dataclass
class ModelPart:
    """One model of a session: its engine reference (every message reaches that model),
    what it is, what its agents share, and its warm tier (None: none)."""

    name: str
    engine: ActorRef[EngineMessage]
    model: ModelInfo
    tokenizer: Tokenizer
    env: AgentEnv
    store: ActorRef[StoreMessage] | None = None
    prefetcher: ActorRef[PrefetchMessage] | None = None
    warm: ActorWarmTier | None = None
    identity: CacheIdentity | None = None  # what its warm caches must match
    layout: ExpectFn | None = None  # their segments' layout
    root: Path | None = None  # the folder its warm tier keeps its agents under


async def start_part(
    runtime: Runtime,
    name: str | None,
    engine: ActorRef[EngineMessage],
    config: EngineConfig,
    root: Path | None,
    *,
    delete_rejected: bool,
    suffix: str = "",
    usage: DiskUsage | None = None,
    warm_ttl_s: float | None = None,
) -> ModelPart:
    """Ask the engine what its model is and start its warm tier under ``root`` (None:
    none); ``name`` None: the model's own name. ``suffix`` tells its actors' names apart;
    ``usage``: the disk limit's count its store keeps (shared by a directory's models);
    ``warm_ttl_s``: how long an agent's warm cache unused stays warm (None: no limit)."""
    model, tokenizer = await engine.ask(GetModelInfo())
    store = prefetcher = warm = identity = layout = None
    if root is not None:
        # Imports a crash stopped once verified are finished, other staging removed.
        await anyio.to_thread.run_sync(settle_imports, root)
        codec = config.codec or DEFAULT_CODEC
        identity = CacheIdentity(
            model_fingerprint=model.fingerprint,
            codec=codec.describe(),
            n_layers=model.n_layers,
            n_kv_heads=model.n_kv_heads,
            head_dim=model.head_dim,
            vocab_size=model.vocab_size,  # a cache of other ids would fail every turn
            geometry=model.geometry,
            states=model.states,
        )
        geometry = CacheGeometry.from_description(identity.layer_geometry(), model.states)
        layout = segment_layout(codec, geometry)
        store = await runtime.spawn(
            StoreActor,
            identity,
            layout,
            root,
            delete_rejected=delete_rejected,
            checkpoints=config.checkpoints,  # as many as its hot caches keep
            usage=usage,
            engine=engine,
            ttl_s=warm_ttl_s,
            name=f"store{suffix}",
        )
        prefetcher = await runtime.spawn(PrefetchActor, engine, store, name=f"prefetch{suffix}")
        warm = ActorWarmTier(store, prefetcher)
    limit = prompt_chars_limit(tokenizer, model.context_length)
    env = AgentEnv(engine, tokenizer, warm, limit, write_back=config.write_back)
    return ModelPart(
        name if name is not None else model.name,
        engine,
        model,
        tokenizer,
        env,
        store,
        prefetcher,
        warm,
        identity,
        layout,
        root,
    )
