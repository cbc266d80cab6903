"""The hot tier: one byte budget over the caches in memory. A ``CachePool`` is composed of
parts, each the only writer of its state: ``Residents`` (entries, busy agents, scopes, the
shared-prefix index), the ``Ledger`` (the budget's counts), ``ReadyCopies``, ``Demotion``
(whom to demote, through a policy), ``WarmTraffic`` (stagings in, exports out) and, under
an SSD write budget, ``WriteBack`` (what is written as it leaves); the
two log each demotion and install in a ``MoveLog``. The policies and the application's
hints (``HintBook``) live here too."""

from __future__ import annotations

from ._demotion import Demotion as Demotion
from ._demotion import cold_candidates as cold_candidates
from ._demotion import early_victims as early_victims
from ._demotion import unloaded_victims as unloaded_victims
from ._entry import HotEntry as HotEntry
from ._hints import PRIORITY_LIMIT as PRIORITY_LIMIT
from ._hints import HintBook as HintBook
from ._hints import make_hint as make_hint
from ._hints import split_hint as split_hint
from ._ledger import Ledger as Ledger
from ._moves import MAX_MOVES as MAX_MOVES
from ._moves import MoveLog as MoveLog
from ._policy import POLICIES as POLICIES
from ._policy import Candidate as Candidate
from ._policy import EvictionPolicy as EvictionPolicy
from ._policy import LRUPolicy as LRUPolicy
from ._policy import Rates as Rates
from ._policy import WorkflowPolicy as WorkflowPolicy
from ._policy import make_policy as make_policy
from ._pool import CachePool as CachePool
from ._ready import ReadyCopies as ReadyCopies
from ._residents import Residents as Residents
from ._traffic import WarmTraffic as WarmTraffic
from ._write_back import PostWrite as PostWrite
from ._write_back import WriteBack as WriteBack
from ._write_back import WriteBudget as WriteBudget

__all__ = (
    "MAX_MOVES",
    "POLICIES",
    "PRIORITY_LIMIT",
    "CachePool",
    "Candidate",
    "Demotion",
    "EvictionPolicy",
    "HintBook",
    "HotEntry",
    "LRUPolicy",
    "Ledger",
    "MoveLog",
    "Rates",
    "ReadyCopies",
    "Residents",
    "PostWrite",
    "WarmTraffic",
    "WorkflowPolicy",
    "WriteBack",
    "WriteBudget",
    "cold_candidates",
    "early_victims",
    "unloaded_victims",
    "make_hint",
    "make_policy",
    "split_hint",
)
