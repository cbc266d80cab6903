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


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The default model's tests (``slow``) and those marked ``one_backend`` (a model
    # family, a budget's or a policy's arithmetic) check what the event loop does not
    # change: they run on the first backend alone. Trio's runs are the runtime's, the
    # tiers', the store's faults and cancels, the engine's, the scenarios' and the
    # server's; this keeps the whole suite within CI's time.
    definition = metafunc.definition
    if "anyio_backend" not in metafunc.fixturenames or not (
        definition.get_closest_marker("slow") or definition.get_closest_marker("one_backend")
    ):
        return
    for mark in definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "anyio_backend" in (
            names.replace(" ", "").split(",") if isinstance(names, str) else names
        ):
            return  # the test names its backends itself
    metafunc.parametrize("anyio_backend", [BACKENDS[0].strip()])
