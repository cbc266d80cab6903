from __future__ import annotations

import pytest

import kvactor  # noqa: F401 - first: it loads the BLAS, which must precede mlx.core


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
