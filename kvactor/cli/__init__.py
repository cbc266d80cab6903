"""The ``kvactor`` command line: demo, run, serve, fetch-model, inspect, forget, gc."""

from __future__ import annotations

from ._main import main as main

__all__ = ("main",)
