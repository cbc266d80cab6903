"""What kvactor assumes of mlx-lm's internals (kernels/mlx_lm_compat.py), checked against
the installed mlx-lm: a version that breaks one fails here, by name."""

from __future__ import annotations

import importlib.metadata
import inspect

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache
from packaging.specifiers import SpecifierSet

from kvactor.kernels.mlx_lm_compat import CHECKED, SDPA_NAME, SDPA_PARAMETERS, batch_of_one, row_of


def test_the_installed_mlx_lm_is_a_checked_version() -> None:
    assert importlib.metadata.version("mlx-lm") in SpecifierSet(CHECKED)


def test_attention_layers_call_the_module_level_sdpa_with_these_parameters() -> None:
    assert SDPA_NAME in llama.Attention.__call__.__code__.co_names
    sdpa = getattr(llama, SDPA_NAME)
    params = list(inspect.signature(sdpa).parameters)
    assert params[3 : 3 + len(SDPA_PARAMETERS)] == list(SDPA_PARAMETERS)


def test_a_row_and_a_batch_of_one_share_their_buffers_and_state_layout() -> None:
    row = KVCache()
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    row.update_and_fetch(k, k + 1)
    keys = row.keys
    batch = batch_of_one(row)
    assert batch.keys is keys and batch._idx == 3 and batch.left_padding.tolist() == [0]
    batch.update_and_fetch(k[:, :, :1], k[:, :, :1])
    back = row_of(batch, 0)
    assert back.keys is batch.keys and back.offset == 4
    assert mx.array_equal(back.state[0][:, :, :3], k).item()


def test_a_rotating_cache_says_its_window_and_its_kept_tokens() -> None:
    cache = RotatingKVCache(max_size=8, keep=0)
    assert cache.max_size == 8 and cache.keep == 0
    assert BatchKVCache.merge([KVCache()]).keys is None


def test_recurrent_layers_replace_their_arrays_cache_entries_once_a_forward() -> None:
    # What RecurrentCache relies on to take a pipelined step back (kernels.recurrent).
    from mlx_lm.models.cache import ArraysCache, CacheList

    from kvactor.actors.models import make_tiny_model
    from kvactor.kernels.recurrent import RecurrentCache

    writes: list[int] = []

    class Counting(RecurrentCache):
        def __setitem__(self, idx: int, value: mx.array) -> None:
            writes.append(idx)
            super().__setitem__(idx, value)

    for family in ("qwen3_next", "mamba2", "lfm2"):
        model = make_tiny_model(0, family).model
        writes.clear()

        caches = [
            Counting(len(c.cache)) if isinstance(c, ArraysCache) else c for c in model.make_cache()
        ]
        model(mx.array([[1, 2]]), cache=caches)
        states = [c for c in caches if isinstance(c, Counting)]
        assert states and all(c.lengths is None and c.left_padding is None for c in states)
        per_layer = len(writes) / len(states)
        assert per_layer <= len(states[0].cache) + 1  # each entry once (+ mx.depends' write)
    lst = CacheList(KVCache(), KVCache())
    assert lst[1] is lst.caches[1]
