"""The hot tier: one byte budget over the caches in memory (``CachePool`` and its parts: the
ledger, demotion, warm traffic, ready copies, the shared-prefix index), whom to demote
(the policies) and the application's hints."""

from __future__ import annotations

from ._entry import HotEntry as HotEntry
from ._hints import make_hint as make_hint
from ._hints import split_hint as split_hint
from ._policy import Candidate as Candidate
from ._policy import EvictionPolicy as EvictionPolicy
from ._policy import LRUPolicy as LRUPolicy
from ._policy import WorkflowPolicy as WorkflowPolicy
from ._pool import CachePool as CachePool

__all__ = (
    "CachePool",
    "Candidate",
    "EvictionPolicy",
    "HotEntry",
    "LRUPolicy",
    "WorkflowPolicy",
    "make_hint",
    "split_hint",
)
