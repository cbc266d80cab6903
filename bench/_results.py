"""What every benchmark does with its ``--json`` results: write them, making the folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, results: Any) -> None:
    """``results`` as indented JSON at ``path``, its folder made first (``bench/results/``
    is not in a fresh clone)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
