"""Opening a session in this process: ``kvactor.open()`` without ``cluster=``.

Its keywords are declared once, in :class:`OpenOptions` (a cluster adds its own:
``ClusterOptions``); their defaults are :class:`~kvactor.actors.engine.EngineConfig`'s and
the session's. :class:`Opening` is what ``open`` returns, here or on a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar

from ...kernels.qcodec import KVCodec
from ..engine import Attention, EngineConfig, ModelSpec, default_memory_limit
from ..hot import EvictionPolicy
from ._models import DEFAULT
from ._session import OnSaveError, Session

if TYPE_CHECKING:
    pass

__all__ = ("MODELS_KEYS", "OpenOptions", "Opening", "open_session")

_T = TypeVar("_T")


class OpenOptions(TypedDict, total=False):
    """The keywords of ``kvactor.open`` (see its doc for what each does)."""

    max_batch: int
    prefill_chunk: int
    weights: str
    mailbox_size: int
    budget_bytes: int | None
    codec: KVCodec | None
    policy: EvictionPolicy | str | None
    cache_dir: str | os.PathLike[str] | None
    delete_rejected: bool
    attention: Attention
    on_save_error: OnSaveError
    ready_copies: bool
    share_prefixes: bool
    deterministic: bool
    tool_wait_s: float
    checkpoints: int
    write_budget: int | None
    write_window_s: float
    models: Mapping[str, ModelSpec] | None
    memory_limit: int | None
    pin_models: tuple[str, ...] | list[str]
    model_ttl_s: float | None
    disk_limit: int | None
    disk_quota: int | None
    warm_ttl_s: float | None


_SESSION_KEYS = (
    "mailbox_size",
    "cache_dir",
    "delete_rejected",
    "on_save_error",
    "disk_limit",
    "disk_quota",
    "warm_ttl_s",
)
MODELS_KEYS = ("models", "memory_limit", "pin_models", "model_ttl_s")
_ENGINE_KEYS = tuple(k for k in OpenOptions.__annotations__ if k not in _SESSION_KEYS + MODELS_KEYS)


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


def open_session(model: ModelSpec = None, **options: Any) -> Opening[Session]:
    """``kvactor.open(model, **options)`` in this process (see ``kvactor.open``). Raises
    TypeError for an unknown keyword, ValueError for a bad value."""
    unknown = sorted(set(options) - set(OpenOptions.__annotations__))
    if unknown:
        raise TypeError(f"open() got unexpected keywords {unknown}")
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
    # Absent: the default (a share of the free disk, at most 30 GiB); None: no limit.
    disk = options.get("disk_limit", DEFAULT)
    if (
        disk is not None
        and disk is not DEFAULT
        and (isinstance(disk, bool) or not isinstance(disk, int) or disk < 1)
    ):
        raise ValueError(f"disk_limit must be a positive int of bytes or None, not {disk!r}")
    quota = options.get("disk_quota")
    if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota < 1):
        raise ValueError(f"disk_quota must be a positive int of bytes or None, not {quota!r}")
    ttl = options.get("warm_ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0):
        raise ValueError(f"warm_ttl_s must be a positive number of seconds or None, not {ttl!r}")
    if (quota is not None or ttl is not None) and cache_dir is None:
        raise ValueError("disk_quota and warm_ttl_s limit the warm tier: give a cache_dir")
    if options.get("write_budget") is not None and cache_dir is None:
        raise ValueError("write_budget limits the warm tier's writes: give a cache_dir")
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
        disk_limit=disk,
        disk_quota=quota,
        warm_ttl_s=ttl,
    )
    return Opening(session.start, session.__aexit__)
