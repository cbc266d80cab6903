from __future__ import annotations

import os

# The owners of state re-check their invariants (kvactor.runtime.DEBUG): set before kvactor
# is imported, here and in every process a test starts.
os.environ.setdefault("KVACTOR_DEBUG", "1")

import pytest

import kvactor  # noqa: F401 - first: it loads the BLAS, which must precede mlx.core

# The event loops every anyio test runs on: both in the whole suite; ./dev test --fast sets
# KVACTOR_TEST_BACKENDS=asyncio (trio's runs are the whole suite's).
BACKENDS = os.environ.get("KVACTOR_TEST_BACKENDS", "asyncio,trio").split(",")


@pytest.fixture(params=[b.strip() for b in BACKENDS if b.strip()])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
