"""Where the warm tier's files live: the cache root's folders, reached without following
a symlink below the root."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UnsafeCachePath
from ..ids import check_agent_id

__all__ = ("agent_dir", "contained", "default_cache_dir", "rejected_dir")


def default_cache_dir() -> Path:
    """``$KVACTOR_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/kvactor/agents-cache``, else
    ``~/.cache/kvactor/agents-cache``."""
    explicit = os.environ.get("KVACTOR_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvactor" / "agents-cache"


def contained(root: str | os.PathLike[str], *parts: str) -> Path:
    """``<root>/<parts...>`` once every component below the root is checked not to be a
    symlink (missing ones are fine: nothing to follow yet). The root itself may be one.

    Raises UnsafeCachePath naming the first component that resolves elsewhere.
    """
    # A symlinked folder could lead anywhere: deleting or moving through it would act
    # outside the root. Each component's real path must be the root's plus its own name.
    real = os.path.realpath(root)
    for i in range(1, len(parts) + 1):
        real = os.path.join(real, parts[i - 1])
        if os.path.realpath(real) != real:
            where = "/".join(parts[:i])
            raise UnsafeCachePath(
                f"{where} under {root} is a symlink, which could lead outside the cache root"
            )
    return Path(root).joinpath(*parts)


def agent_dir(root: str | os.PathLike[str], agent: str) -> Path:
    """``<root>/agents/<agent>``. Raises InvalidAgentId for an unsafe id (checked before any
    path work), UnsafeCachePath when ``agents/`` or the agent's folder is a symlink."""
    return contained(root, "agents", check_agent_id(agent))


def rejected_dir(root: str | os.PathLike[str], agent: str) -> Path:
    """``<root>/rejected/<agent>``, where a refused cache is set aside; raises as
    ``agent_dir`` does."""
    return contained(root, "rejected", check_agent_id(agent))
