"""The debug flag: expensive consistency checks run only when ``KVACTOR_DEBUG`` is set (the
test suite sets it); cheap ones are plain asserts, always on."""

from __future__ import annotations

import os

__all__ = ("DEBUG",)

#: True when the environment's ``KVACTOR_DEBUG`` is set to anything but ``""`` or ``"0"``
#: at import: the owners of state then re-check their invariants at the points that change
#: it (a recount of the hot budget, the prefix index against the caches ...).
DEBUG = os.environ.get("KVACTOR_DEBUG", "") not in ("", "0")
