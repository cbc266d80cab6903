"""Array code: the KV codec, stored and working caches, quantized attention, sampling, CPU
BLAS selection."""

from __future__ import annotations

if __name__ != "kvactor.kernels":  # one import name per file: see docs/layout.md
    raise ImportError(f"import kvactor.kernels, not {__name__}: each file has one import name")

from .blas import BlasInfo as BlasInfo
from .blas import SlowBlasWarning as SlowBlasWarning
from .blas import ensure_blas as ensure_blas

__all__ = ("BlasInfo", "SlowBlasWarning", "ensure_blas")
