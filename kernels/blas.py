"""Put an optimized CPU BLAS under MLX before MLX loads.

The Linux ``mlx[cpu]`` wheel links a bundled reference BLAS (~3.5 GFLOP/s fp32 matmul on our
CI machines). ``libmlx.so`` resolves ``cblas_sgemm`` through the process' global symbol scope
first, so a BLAS opened with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported wins, and fp32
matmul gets ~40x faster. Once MLX is loaded it is too late to interpose.

This module must not import MLX (``kvactor/__init__.py`` calls :func:`ensure_blas` first).

``KVACTOR_BLAS`` selects the library: unset or ``auto`` (OS OpenBLAS, then MKL from the ``mkl``
wheel), ``off``, ``openblas``, ``mkl``, or a path to a shared library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ("BlasInfo", "SlowBlasWarning", "ensure_blas")

_ENV = "KVACTOR_BLAS"
_FIX = (
    "install an optimized BLAS: `apt-get install libopenblas0-pthread` (Debian/Ubuntu) or "
    "`pip install mkl`, then start a new process; or set KVACTOR_BLAS=/path/to/libblas.so"
)


class SlowBlasWarning(RuntimeWarning):
    """Only the reference BLAS bundled with the mlx[cpu] wheel is active: CPU matmul is slow."""


@dataclass(frozen=True)
class BlasInfo:
    """What BLAS serves MLX's CPU matmuls in this process.

    ``name`` is ``"openblas"``, ``"mkl"``, ``"accelerate"``, ``"reference"`` or the file name of
    a library given in ``KVACTOR_BLAS``; ``path`` is the library file when known; ``loaded`` is
    true when this process loaded it for MLX; ``reason`` says why in words.
    """

    name: str
    path: str | None
    loaded: bool
    reason: str

    @property
    def optimized(self) -> bool:
        """True unless MLX runs on the slow reference BLAS."""
        return self.name != "reference"


_lock = threading.Lock()
_info: BlasInfo | None = None
# Keep the handle alive for the life of the process: closing it would unmap the BLAS.
_handle: ctypes.CDLL | None = None


def ensure_blas() -> BlasInfo:
    """Load an optimized BLAS with ``RTLD_GLOBAL`` if possible; idempotent.

    Never raises for a missing or unloadable library: the outcome is in the returned record.
    Emits :class:`SlowBlasWarning` (once per process) on Linux when only the reference BLAS
    will serve MLX, including when ``mlx.core`` was imported before this ran.
    """
    global _info
    with _lock:
        if _info is None:
            _info = _decide()
            if sys.platform.startswith("linux") and not _info.optimized:
                warnings.warn(
                    f"kvactor: MLX uses the slow reference BLAS ({_info.reason}); {_FIX}",
                    SlowBlasWarning,
                    stacklevel=2,
                )
        return _info


def _decide() -> BlasInfo:
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, False, "macOS: MLX uses Apple Accelerate")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", None, False, f"no BLAS selection on {sys.platform}")

    choice = os.environ.get(_ENV, "auto").strip()
    if choice.lower() == "off":
        return BlasInfo("reference", None, False, f"disabled by {_ENV}=off")

    # Whatever is already in the global scope (a launcher preloading a BLAS, say) serves MLX.
    present = _global_sgemm_path()
    if "mlx.core" in sys.modules:
        if present is not None:
            why = "in the global scope, but mlx.core was imported first: it serves MLX only if "
            return BlasInfo(_name_of(present), present, False, why + "it was there before MLX")
        return BlasInfo(
            "reference",
            None,
            False,
            "mlx.core was imported before ensure_blas(): too late to interpose a BLAS",
        )
    if present is not None:
        return BlasInfo(_name_of(present), present, False, "already in the global scope")

    lowered = choice.lower()
    if lowered in ("auto", ""):
        candidates = _openblas_candidates() + _mkl_candidates()
    elif lowered == "openblas":
        candidates = _openblas_candidates()
    elif lowered == "mkl":
        candidates = _mkl_candidates()
    else:
        if not Path(choice).is_file():
            return BlasInfo("reference", None, False, f"{_ENV}={choice}: no such file")
        candidates = [choice]

    errors: list[str] = []
    for candidate in candidates:
        loaded = _load_global(candidate)
        if isinstance(loaded, str):
            errors.append(loaded)
            continue
        path = _global_sgemm_path()
        if path is None:
            errors.append(f"{candidate}: no cblas_sgemm symbol")
            continue
        return BlasInfo(_name_of(path), path, True, f"loaded {candidate} with RTLD_GLOBAL")

    if not candidates:
        return BlasInfo("reference", None, False, "no OpenBLAS or MKL library found")
    return BlasInfo("reference", None, False, "could not load: " + "; ".join(errors))


def _load_global(candidate: str) -> ctypes.CDLL | str:
    """Open ``candidate`` into the global scope; an error string on failure."""
    global _handle
    try:
        handle = ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return f"{candidate}: {exc}"
    try:
        handle.cblas_sgemm  # noqa: B018 - probe: a LAPACK-only or broken lib lacks it
    except AttributeError:
        return f"{candidate}: no cblas_sgemm symbol"
    _handle = handle
    return handle


def _openblas_candidates() -> list[str]:
    triple = f"{platform.machine()}-linux-gnu"
    found: list[str] = []
    by_ldconfig = ctypes.util.find_library("openblas")
    if by_ldconfig:
        found.append(by_ldconfig)
    for directory in (f"/usr/lib/{triple}", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        # The pthread build first: it is what libopenblas0-pthread installs, and OpenMP
        # builds behave badly when another OpenMP runtime shares the process.
        for flavour in ("openblas-pthread/", "", "openblas-openmp/", "openblas-serial/"):
            for base in ("libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so"):
                path = f"{directory}/{flavour}{base}"
                if os.path.isfile(path):
                    found.append(path)
    return _unique(found)


def _mkl_candidates() -> list[str]:
    # The `mkl` wheel puts libmkl_rt.so.<major> under <prefix>/lib, outside the loader's path.
    found: list[str] = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found.extend(sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True))
    by_ldconfig = ctypes.util.find_library("mkl_rt")
    if by_ldconfig:
        found.append(by_ldconfig)
    return _unique(found)


def _unique(paths: list[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for path in paths:
        key = os.path.realpath(path) if os.path.isabs(path) else path
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def _global_sgemm_path() -> str | None:
    """The file that defines ``cblas_sgemm`` in the global scope, i.e. what MLX will bind."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p).value
        dladdr = process.dladdr
    except (OSError, AttributeError):
        return None
    dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    name = os.fsdecode(info.dli_fname)
    return os.path.realpath(name) if os.path.isabs(name) else name


def _name_of(path: str) -> str:
    base = os.path.basename(path).lower()
    if "openblas" in base:
        return "openblas"
    if "mkl" in base:
        return "mkl"
    if "blis" in base:
        return "blis"
    return os.path.basename(path)
