"""``kvactor.open()``: a session on a model, in this process or over a cluster.

Its keywords are declared once, in :class:`OpenOptions` (and :class:`ClusterOptions` for
the cluster's own); their defaults are :class:`~kvactor.actors.config.EngineConfig`'s and
the session's.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, overload

from ..kernels.qcodec import KVCodec
from .config import Attention, EngineConfig, ModelSpec
from .memory_limit import default_memory_limit
from .policy import EvictionPolicy
from .session import OnSaveError, Session

if TYPE_CHECKING:
    from typing import Unpack

    from .cluster import ClusterSession
    from .placement import PlacementPolicy

__all__ = ("ClusterOptions", "OpenOptions", "Opening", "open")

_T = TypeVar("_T")


class OpenOptions(TypedDict, total=False):
    """The keywords of ``kvactor.open`` (see its doc for what each does)."""

    max_batch: int
    prefill_chunk: int
    weights: str
    mailbox_size: int
    budget_bytes: int | None
    codec: KVCodec | None
    policy: EvictionPolicy | None
    cache_dir: str | os.PathLike[str] | None
    delete_rejected: bool
    attention: Attention
    on_save_error: OnSaveError
    ready_copies: bool
    share_prefixes: bool
    deterministic: bool
    tool_wait_s: float
    checkpoints: int
    models: Mapping[str, ModelSpec] | None
    memory_limit: int | None
    pin_models: tuple[str, ...] | list[str]
    model_ttl_s: float | None


class ClusterOptions(OpenOptions, total=False):
    """``kvactor.open``'s keywords with ``cluster=``: each host's, plus the cluster's own
    (``kvactor.actors.cluster.open_cluster``)."""

    hosts_per_node: int
    placement: PlacementPolicy | None
    ray_options: dict[str, Any] | None
    replicas: int


_SESSION_KEYS = ("mailbox_size", "cache_dir", "delete_rejected", "on_save_error")
_MODELS_KEYS = ("models", "memory_limit", "pin_models", "model_ttl_s")
_ENGINE_KEYS = tuple(
    k for k in OpenOptions.__annotations__ if k not in _SESSION_KEYS + _MODELS_KEYS
)
_CLUSTER_KEYS = tuple(
    k for k in ClusterOptions.__annotations__ if k not in OpenOptions.__annotations__
)


class Opening(Generic[_T]):
    """What ``open()`` returns: await it (the started session), or use it as ``async
    with`` (closed on the way out). ``start`` starts the session; ``close`` is its
    ``__aexit__``."""

    def __init__(
        self,
        start: Callable[[], Coroutine[Any, Any, _T]],
        close: Callable[
            [type[BaseException] | None, BaseException | None, TracebackType | None],
            Awaitable[object],
        ],
    ) -> None:
        self._start = start
        self._close = close

    def __await__(self) -> Generator[Any, None, _T]:
        return self._start().__await__()

    async def __aenter__(self) -> _T:
        return await self._start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close(exc_type, exc, tb)


@overload
def open(
    model: ModelSpec = None, *, cluster: None = None, **options: Unpack[OpenOptions]
) -> Opening[Session]: ...


@overload
def open(
    model: ModelSpec = None, *, cluster: str, **options: Unpack[ClusterOptions]
) -> Opening[ClusterSession]: ...


def open(
    model: ModelSpec = None, *, cluster: str | None = None, **options: Any
) -> Opening[Session] | Opening[ClusterSession]:
    """Open a session on ``model``: None for the default model (fetched once, verified), a
    ``.gguf`` file, a local MLX / Hugging Face model directory, or a callable returning a
    LoadedModel. ``max_batch`` (8) agents decode together; prompts are prefilled
    ``prefill_chunk`` (256) tokens at a time between decode steps.

    ``cache_dir`` turns on the warm tier there (``kvactor.default_cache_dir()`` is the
    usual place): every turn's new tokens are written to disk, demoted agents reload from
    there, and agents of a new session resume from it. The session holds the directory's
    lock: ``open`` raises CacheDirLocked when another session (of any process) has it.
    A turn whose write fails says so in its Completion (``saved``, ``save_error``); with
    ``on_save_error="raise"`` it raises StoreWriteError instead, holding the Completion.
    ``budget_bytes`` bounds the hot tier; ``codec`` picks how caches are stored (default
    ``DEFAULT_CODEC``: keys 5-bit, values 3-bit in groups of 64, Hadamard-rotated, 4 sink
    tokens at 8 bits); ``policy`` picks whom to demote (default ``WorkflowPolicy``: by
    the hints of ``Session.hint``, LRU order without them). ``delete_rejected`` deletes
    warm caches that are refused (another model, corrupt) instead of setting them
    aside. ``mailbox_size`` (64) bounds each actor's mailbox.
    ``attention``: ``"quantized"`` runs attention and batches over the stored quantized
    caches, ``"dequantized"`` over a float copy made at each turn's start; ``"auto"``
    (default) picks quantized on a GPU and dequantized on the CPU (see EngineConfig).
    ``ready_copies`` (dequantized attention): hot agents keep their float copy between
    turns while the budget has room, so their next turn starts at once (dropped first when
    room is needed; answers are the same either way). ``share_prefixes``: a turn that
    reuses nothing of its own cache reuses the stored ranges of another hot cache its
    prompt begins with (a shared context: ``Session.context``), shared, not prefilled
    (the sharing agent attends over the stored values, as a warm resume does: see
    EngineConfig). ``tool_wait_s`` (30): how long a turn that ended in tool calls keeps
    its agent's cache hot ahead of idle agents, for the turn that brings the results.
    ``deterministic`` (False): a row's greedy answer never depends on what else runs in
    its batch (batch-invariant decode, ~10% slower on a CPU; see EngineConfig).
    ``checkpoints`` (recurrent layers: Qwen3.5, Mamba-2 ...): how many stored ranges of an
    agent keep the recurrent states at their end (default 4: the last two turns' prompts
    and answers), where a diverging turn can resume.
    ``models``: several models in one session, by name (``{"router": path_a, "coder": path_b}``;
    give no ``model`` then): one engine holds them all, each agent runs one (``spawn_agent(name,
    model="coder")``), each model's agents batch together, and each model's warm tier is
    ``cache_dir/models/<name>``. ``memory_limit``: the bytes the session may hold for its
    models, all counted: weights, activations, hot tiers, MLX's kept buffers (default:
    ``MEMORY_SHARE``, 3/4, of the machine's RAM, with one model or several; ``None`` with one
    model: no limit over the whole, only ``budget_bytes`` over its hot tier). A turn that needs
    room demotes idle caches to warm, then unloads an idle model (least recently used; never one
    of ``pin_models``; ``model_ttl_s``: unload one idle that long anyway); a model that cannot
    fit with one turn of its own fails ``open`` with ModelLoadError saying what it needs.
    ``cluster``: the session's engines run as Ray actors over a cluster ("auto", "local",
    an address or ``ray://host:port``), one engine host per node; the keywords then go to
    ``kvactor.actors.cluster.open_cluster`` (``cache_dir`` required; ``hosts_per_node``,
    ``placement``, ``ray_options``, ``replicas``) and every host's own session
    (``memory_limit`` is then each host's; default: its share of its node's). Without it
    Ray is never imported.

    Raises TypeError for an unknown keyword, ValueError for a bad value (an
    ``on_save_error`` other than "report" or "raise", a budget below 1 ...)."""
    known = ClusterOptions.__annotations__ if cluster is not None else OpenOptions.__annotations__
    unknown = sorted(set(options) - set(known))
    if unknown:
        hint = " (cluster options need cluster=...)" if set(unknown) & set(_CLUSTER_KEYS) else ""
        raise TypeError(f"open() got unexpected keywords {unknown}{hint}")
    if cluster is not None:
        from .cluster import open_cluster

        if set(options) & (set(_MODELS_KEYS) - {"memory_limit"}):
            raise TypeError(
                "a cluster session serves one model: no models=, pin_models= or model_ttl_s="
            )
        if options.get("cache_dir") is None:
            raise ValueError("a cluster keeps each host's warm tier under cache_dir: give one")
        return open_cluster(model, cluster=cluster, **options)
    engine = {k: options[k] for k in _ENGINE_KEYS if k in options}
    if engine.get("policy", 0) is None:
        del engine["policy"]  # the default policy
    cache_dir = options.get("cache_dir")
    config = EngineConfig(**engine, persistent=cache_dir is not None)
    models = options.get("models")
    # Absent: MEMORY_SHARE of RAM; None given: no limit over the whole (one model only).
    limit = options.get("memory_limit", default_memory_limit())
    if models is not None:
        if model is not None:
            raise ValueError("give model or models, not both")
        if limit is None:
            raise ValueError("several models need a memory limit: give bytes or leave it out")
    elif options.get("pin_models") or options.get("model_ttl_s") is not None:
        raise ValueError("pin_models and model_ttl_s are for several models (models=)")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"memory_limit must be a positive int of bytes, not {limit!r}")
    session = Session(
        dict(models) if models is not None else model,
        config,
        options.get("mailbox_size", 64),
        cache_dir,
        options.get("delete_rejected", False),
        options.get("on_save_error", "report"),
        memory_limit=limit,
        pins=frozenset(options.get("pin_models", ())),
        model_ttl_s=options.get("model_ttl_s"),
    )
    return Opening(session.start, session.__aexit__)
