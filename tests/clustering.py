"""What the cluster tests share: the tiny model their hosts run, and a local Ray cluster of
two one-CPU hosts on 127.0.0.1 (started and stopped by the ``kvactor.open`` it returns)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import kvactor
from kvactor.actors.models import make_tiny_model

tiny = functools.partial(make_tiny_model, 0, head_dim=64)


def local_cluster(tmp_path: Path, **options: Any) -> Any:
    """``kvactor.open`` of the tiny model on a new local cluster of hosts h0 and h1."""
    return kvactor.open(
        tiny,
        cluster="local",
        cache_dir=tmp_path,
        hosts_per_node=2,
        ray_options={"num_cpus": 2},
        **options,
    )
