"""Plain-text pieces the command line prints: sizes, ages, aligned tables, safe names."""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence

__all__ = ("age", "command", "printable", "size", "table")


def size(nbytes: float) -> str:
    """``nbytes`` in powers of 1000, one decimal: ``512 B``, ``13.4 kB``, ``1.2 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def age(when: float, now: float | None = None) -> str:
    """How long ago ``when`` (unix time) was: ``just now``, ``5 min ago``, ``3 h ago``,
    ``2 days ago``; past a month, the date."""
    now = time.time() if now is None else now
    seconds = max(0.0, now - when)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    days = seconds // 86400
    if days < 31:
        return "1 day ago" if days == 1 else f"{days:.0f} days ago"
    return time.strftime("%Y-%m-%d", time.localtime(when))


def table(head: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned columns; the columns in ``right`` (numbers) align right."""
    lines = [list(head), *[list(r) for r in rows]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    ]


def printable(text: str) -> str:
    """``text`` safe for a terminal line: control characters (escape sequences, newlines)
    and other unprintable ones are shown as Python escapes, never passed through."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def command(*words: str) -> str:
    """A command line to paste into a shell: each word quoted where it needs to be."""
    return " ".join(shlex.quote(word) for word in words)
