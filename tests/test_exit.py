"""A process that used kvactor always exits cleanly: with its session closed, or with the
interpreter exiting while the session is still open (the engine thread and MLX shut down
in order: runtime.stop_threads, kernels.memory.release_thread). Real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import functools, sys
    import anyio
    import kvactor
    from kvactor.actors.models import make_tiny_model

    async def main(cache_dir, close):
        tiny = functools.partial(make_tiny_model, 0, head_dim=64)
        opening = kvactor.open(tiny, cache_dir=cache_dir, max_batch=4)
        session = await opening
        agents = [await session.spawn_agent(f"a{i}") for i in range(4)]
        async with anyio.create_task_group() as tg:
            for i, agent in enumerate(agents):
                tg.start_soon(functools.partial(agent.generate, f"turn of {i}", max_tokens=6))
        if close:
            await session.aclose()
        print("ok", flush=True)

    anyio.run(main, sys.argv[1], sys.argv[2] == "close", backend=sys.argv[3])
    """
)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_thirty_short_processes_over_warm_caches_all_exit_with_code_0(tmp_path: Path) -> None:
    first = _run([str(tmp_path / "cache"), "close", "asyncio"], tmp_path)  # the warm caches
    assert first.returncode == 0, first.stderr
    runs = []
    for i in range(30):  # each over a copy of the warm caches (one session locks a folder)
        shutil.copytree(tmp_path / "cache", tmp_path / f"cache-{i}")
        # Half exit with the session still open (asyncio: trio never lets a task group
        # outlive its run), some of the others on trio.
        close = "close" if i % 2 else "open"
        backend = "trio" if i % 4 == 1 else "asyncio"
        runs.append([str(tmp_path / f"cache-{i}"), close, backend])
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda a: _run(a, tmp_path), runs))
    bad = [
        (r.returncode, r.stderr[-400:]) for r in done if r.returncode != 0 or "ok" not in r.stdout
    ]
    assert not bad, bad
    assert not any("terminate called" in r.stderr for r in done)
