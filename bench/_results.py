"""What every benchmark does with its results: write its ``--json``, print its table of figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_json(path: str | Path, results: Any) -> None:
    """``results`` as indented JSON at ``path``, its folder made first (``bench/results/``
    is not in a fresh clone)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def figure_table(rows: Sequence[tuple[object, object, object, object]]) -> str:
    """A markdown table of (figure, value, target, met) rows, as the benches print them."""
    lines = ["| figure | value | target | |", "|---|---:|---|---|"]
    lines += [f"| {w} | {x} | {y} | {z} |" for w, x, y, z in rows]
    return "\n".join(lines)
