"""MkDocs hook: the sources of ``kvactor`` laid out under their import names, for griffe.

pyproject.toml installs the folders runtime/, actors/ and kernels/ as kvactor.runtime,
kvactor.actors and kvactor.kernels (setuptools package-dir). griffe, which mkdocstrings
uses to read docstrings, finds modules by their folders and would see ``runtime`` and
``actors`` as top-level packages. This hook copies the sources into a temporary folder
laid out as ``kvactor/{runtime,actors,kernels}`` and points the Python handler there, so
the API reference names everything as users import it. Nothing is written to the tree.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
# top-level folder -> its folder under kvactor/ (keep in step with [tool.setuptools.package-dir])
MAPPED = {"runtime": "runtime", "actors": "actors", "kernels": "kernels"}


def _stage() -> Path:
    """A temporary folder holding ``kvactor/`` with the mapped folders inside it."""
    staged = Path(tempfile.mkdtemp(prefix="kvactor-api-"))
    atexit.register(shutil.rmtree, staged, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "kvactor", staged / "kvactor", ignore=skip)
    for folder, name in MAPPED.items():
        shutil.copytree(ROOT / folder, staged / "kvactor" / name, ignore=skip)
    return staged


@event_priority(100)  # before mkdocstrings' own on_config, which creates the handler
def on_config(config: Any) -> Any:
    """Point mkdocstrings' Python handler at the staged sources (its ``paths`` option)."""
    handlers = config.plugins["mkdocstrings"].config["handlers"]
    python = handlers.setdefault("python", {})
    python["paths"] = [str(_stage())]
    return config
