"""kvactor: many LLM agents on one machine, as actors with tiered KV caches.

Importing kvactor first loads an optimized BLAS into the process when one is installed
(before MLX is imported), since MLX's Linux CPU wheel bundles a slow reference BLAS.
"""

from __future__ import annotations

from .kernels.blas import ensure_blas as ensure_blas

BLAS = ensure_blas()

from .actors import *  # noqa: E402, F403
from .actors import __all__ as _actors_all  # noqa: E402
from .kernels.qcodec import DEFAULT_CODEC as DEFAULT_CODEC  # noqa: E402
from .kernels.qcodec import KVCodec as KVCodec  # noqa: E402
from .runtime import *  # noqa: E402, F403
from .runtime import __all__ as _runtime_all  # noqa: E402

__all__ = ("BLAS", "DEFAULT_CODEC", "KVCodec", "ensure_blas", *_actors_all, *_runtime_all)
