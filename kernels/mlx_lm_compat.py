"""Everything kvactor needs of mlx-lm beyond its documented API, in one place.

Checked against mlx-lm 0.32.x (``pyproject.toml`` pins ``mlx-lm>=0.32,<0.33``;
``tests/test_mlx_lm_compat.py`` checks each assumption against the installed version):

- ``BatchKVCache``'s state is ``(keys, values, offset, left_padding, _idx)``, its rows
  right-aligned and left-padded, ``_idx`` the columns in use; a ``KVCache``'s state is
  ``(keys, values, offset)`` with room past ``offset`` allowed. :func:`batch_of_one` and
  :func:`row_of` build one from the other over the same buffers (mlx-lm's ``merge`` and
  ``extract`` copy them).
- Attention layers call a module-level ``scaled_dot_product_attention(queries, keys,
  values, cache, scale, mask[, sinks])`` (:data:`SDPA_NAME`, :data:`SDPA_PARAMETERS`):
  ``kernels.attention`` binds that name per model, never patching mlx-lm's modules.
- Models build masks through ``cache.make_mask(n, return_array=..., window_size=...)`` and
  read ``cache.offset``: what ``kernels.qbatch.QuantizedBatchCache`` implements.
- ``RotatingKVCache`` keeps ``max_size`` tokens and ``keep`` tokens at its start.
- A recurrent layer's ``ArraysCache`` holds its state in ``cache`` (a list); the model
  replaces its entries with ``cache[i] = ...`` (each once per forward, a second write
  allowed after the layer's ``advance``) and reads ``lengths`` / ``left_padding`` (None:
  no padding); ``extend`` joins rows along the first axis. ``CacheList(*caches)`` gives a
  layer several caches as ``cache[j]`` (``kernels.recurrent``, ``kernels._turn_base``).
- Learned attention sinks reach ``scaled_dot_product_attention`` as ``sinks`` (one logit
  per query head, gpt-oss); a layer reusing another layer's K/V calls it with
  ``cache=None`` and the keys that layer's ``update_and_fetch`` returned (Gemma 4).
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .rotated import RotatedBasis, RotatedKVCache
from .rowwise import PlainKVCache

__all__ = ("CHECKED", "SDPA_NAME", "SDPA_PARAMETERS", "batch_of_one", "row_of")

#: The mlx-lm versions these assumptions were checked against.
CHECKED = ">=0.32,<0.33"
SDPA_NAME = "scaled_dot_product_attention"
SDPA_PARAMETERS = ("cache", "scale", "mask", "sinks")  # after queries, keys, values


def batch_of_one(row: KVCache) -> BatchKVCache:
    """A batch of the one row ``row`` over the row's own K/V buffers, room included
    (mlx-lm's ``merge`` copies them into a new, full buffer, which the batch's first step
    then copies again to grow). The row must not be used after this."""
    batch = type(row).merge([type(row)()])  # empty, of the class that keeps the basis
    if row.keys is not None:
        n = row.offset
        batch.state = (row.keys, row.values, mx.array([n]), mx.array([0]), n)
    return batch


def row_of(batch: BatchKVCache, row: int) -> KVCache:
    """Row ``row`` of ``batch`` alone. The only row of a batch without padding keeps the
    batch's buffers, room included (the batch must not be used after this); a row of a
    larger batch is copied out, so that it keeps no other row's memory alive."""
    if batch.keys is None or batch.keys.shape[0] != 1 or batch.left_padding.item() != 0:
        return cast(KVCache, batch.extract(row))
    one = RotatedKVCache() if isinstance(batch, RotatedBasis) else PlainKVCache()
    one.state = (batch.keys, batch.values, batch._idx)
    return one
