"""A tiny model's agent cache of two stored ranges, made by real forwards (for the tests
of first forwards over the stored form: ``test_stored_first.py``, ``test_streamed_load.py``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.qcodec import DEFAULT_CODEC, KVCodec


def stored_kv(lm: Any, codec: KVCodec = DEFAULT_CODEC) -> AgentKV:
    """An agent cache of ``lm`` holding two stored ranges (40 and 25 tokens)."""
    kv = AgentKV(codec, lm.geometry)
    for n in (40, 25):
        ids = [7 + (len(kv.tokens) + i) % 50 for i in range(n)]
        lm.model(mx.array([ids]), cache=kv.activate().layers)
        kv.tokens.extend(ids)
        kv.deactivate()
    return kv
