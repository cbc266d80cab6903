"""The working K/V cache of running turns, one interface for both attention modes.

Between turns an agent's cache is stored quantized (``AgentKV`` ranges). During a turn the
model reads it through a :class:`TurnCache`: every layer's cache of one agent (a row) or of a
batch of agents decoding together. Choosing an attention mode chooses the class:

- :class:`FloatTurnCache` (``"dequantized"``): a float copy of each row's stored tokens, made
  once at the turn's start; one row is a list of mlx-lm ``KVCache``, a batch a list of
  mlx-lm ``BatchKVCache``. When the codec rotates keys and values the copy stays in its
  Hadamard basis (``kernels.rotated``: no inverse rotation to make it), and the model's
  attention is bound to that per model.
- :class:`QuantizedTurnCache` (``"quantized"``): the stored parts read as they are, plus a
  float tail of the turn's tokens (``QuantizedBatchCache`` per layer); the model's attention
  is bound to it per model (:func:`kernels.attention.bind_attention`).

Both keep the turn's new tokens in float (:meth:`TurnCache.added`), which ``AgentKV``
quantizes into a new stored range when the turn ends, or at a cut inside its prompt
(``AgentKV.store_so_far``: then the cache takes those tokens' stored values,
:meth:`TurnCache.adopt`, as if a turn had ended there and the next begun). Caches are
described per stored entry (:class:`CacheGeometry`): key and value widths may differ, a
layer may have a sliding window, and a recurrent layer keeps a state instead of K/V (a
``RecurrentCache`` in either class: ``kernels.recurrent``); the model takes the entries as
its caches, two of them in one ``CacheList`` where a layer keeps both (``slots``).

The protocol and what both classes share: ``kernels._turn_base``; the classes:
``kernels.float_turn``, ``kernels.quantized_turn``.
"""

from __future__ import annotations

from ._turn_base import Entries, TurnCache
from .float_turn import FloatTurnCache
from .quantized_turn import QuantizedTurnCache

__all__ = (
    "Entries",
    "FloatTurnCache",
    "QuantizedTurnCache",
    "TurnCache",
    "turn_cache_class",
)


def turn_cache_class(quantized: bool) -> type[FloatTurnCache] | type[QuantizedTurnCache]:
    """The TurnCache class of an attention mode."""
    return QuantizedTurnCache if quantized else FloatTurnCache
