"""Array code: the KV codec, stored and working caches, quantized attention, sampling, CPU
BLAS selection."""

from __future__ import annotations

from .blas import BlasInfo as BlasInfo
from .blas import SlowBlasWarning as SlowBlasWarning
from .blas import ensure_blas as ensure_blas

__all__ = ("BlasInfo", "SlowBlasWarning", "ensure_blas")
