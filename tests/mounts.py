"""A real small file system for a test: a tmpfs mounted on a folder (root only)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(folder: Path, nbytes: int) -> Iterator[Path]:
    """``folder`` (made if missing) as a tmpfs of ``nbytes`` (rounded up to pages) while
    the block runs: a file system of its own, which fills. Skips the test where this
    process may not mount (not root)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-nbytes // 4096) * 4096
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "kvactor-test", str(folder)]
    done = subprocess.run(mount, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)
