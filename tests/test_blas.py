"""BLAS selection: in-process record, and fresh subprocesses (a BLAS must load before MLX)."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest

import kvactor.kernels
from kvactor.kernels.blas import BlasInfo, SlowBlasWarning, ensure_blas

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS logic")

_PROBE = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {pre}
    from kvactor.kernels import SlowBlasWarning, ensure_blas
    info = ensure_blas()
import mlx.core as mx
a = mx.ones((64, 64))
ok = bool((a @ a)[0, 0].item() == 64.0)
warned = any(issubclass(w.category, SlowBlasWarning) for w in caught)
print(json.dumps({{"name": info.name, "path": info.path, "loaded": info.loaded,
                  "reason": info.reason, "warned": warned, "matmul_ok": ok}}))
"""


def _probe(blas: str | None, pre: str = "pass") -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "KVACTOR_BLAS"}
    if blas is not None:
        env["KVACTOR_BLAS"] = blas
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(pre=pre)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _openblas_installed() -> bool:
    if ctypes.util.find_library("openblas"):
        return True
    triple = f"/usr/lib/{os.uname().machine}-linux-gnu"
    return any(
        os.path.exists(p)
        for p in (f"{triple}/libopenblas.so.0", f"{triple}/openblas-pthread/libopenblas.so.0")
    )


def test_all_is_exported() -> None:
    assert isinstance(kvactor.kernels.__all__, tuple)
    for name in kvactor.kernels.__all__:
        assert hasattr(kvactor.kernels, name)


def test_ensure_blas_returns_a_stable_record() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowBlasWarning)
        first = ensure_blas()
        second = ensure_blas()
    assert isinstance(first, BlasInfo)
    assert first is second
    assert first.name and first.reason
    assert first.optimized == (first.name != "reference")


@linux_only
def test_off_reports_reference_and_warns() -> None:
    result = _probe("off")
    assert result["name"] == "reference"
    assert result["loaded"] is False
    assert "KVACTOR_BLAS=off" in result["reason"]
    assert result["warned"] is True
    assert result["matmul_ok"] is True


@linux_only
def test_missing_library_path_falls_back_to_reference() -> None:
    result = _probe("/nonexistent/libblas.so")
    assert result["name"] == "reference"
    assert "no such file" in result["reason"]
    assert result["warned"] is True


@linux_only
def test_too_late_after_mlx_import_is_reported() -> None:
    result = _probe(None, pre="import mlx.core")
    if result["name"] == "reference":
        assert "too late" in result["reason"]
        assert result["warned"] is True


@linux_only
@pytest.mark.skipif(not _openblas_installed(), reason="OS OpenBLAS is not installed")
def test_default_finds_openblas() -> None:
    result = _probe(None)
    assert result["name"] == "openblas", result
    assert result["loaded"] is True
    assert result["path"] and "openblas" in result["path"]
    assert result["warned"] is False
    assert result["matmul_ok"] is True
