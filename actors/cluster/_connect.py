"""Connecting to a Ray cluster for :mod:`kvactor.actors.cluster`, and keeping a local
one it starts on 127.0.0.1. Ray is imported inside these functions only."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

log = logging.getLogger("kvactor.cluster")

# Ray gives a local node this machine's network address even when told 127.0.0.1, and its
# GCS, raylet, workers and agents listen there or on every interface. Unless this is set
# when Ray is imported: then the node's address is the loopback one, and every server of
# the local cluster listens on 127.0.0.1 only (checked with Ray 2.40 and 2.60:
# tests/test_cluster_loopback.py).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_before_import(cluster: str) -> None:
    """Before Ray is imported for ``cluster``: a cluster that may start here ("auto",
    "local") will listen on 127.0.0.1 only (an explicit setting of LOOPBACK_ENV stays)."""
    if cluster in ("auto", "local") and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")


def loopback_in_effect() -> bool:
    """Whether a local node started now takes 127.0.0.1 (LOOPBACK_ENV was set when Ray
    was imported); read from Ray, which reads the variable once."""
    from ray._private import ray_constants

    return not ray_constants.ENABLE_RAY_CLUSTER


def connect(cluster: str, options: dict[str, Any]) -> bool:
    """Connect to the Ray cluster ``cluster`` ("auto": a running one, else a new local one;
    "local": a new local one; else an address or ``ray://host:port``). Returns whether a
    local cluster was started here: it listens on 127.0.0.1 only (its dashboard off) and
    stops with the session. A local cluster started after Ray was imported without
    LOOPBACK_ENV listens on the machine's address: said in a warning."""
    import ray

    local = {
        "include_dashboard": False,
        "log_to_driver": False,
        "_node_ip_address": "127.0.0.1",
        **options,
    }

    def start_local() -> bool:
        if not loopback_in_effect():
            log.warning(
                "Ray was imported before kvactor started a local cluster, without %s=0: "
                "the cluster listens on this machine's network address, not only 127.0.0.1",
                LOOPBACK_ENV,
            )
        ray.init(**local)
        return True

    if cluster == "auto":
        try:
            ray.init(address="auto", log_to_driver=False)
            return False
        except ConnectionError:
            return start_local()
    if cluster == "local":
        return start_local()
    ray.init(address=cluster, log_to_driver=False)
    return False
