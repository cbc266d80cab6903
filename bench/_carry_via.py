"""The CLI and HTTP legs of ``bench/portable.py``: an agent carried by ``kvactor export`` /
``kvactor import``, and by ``GET`` / ``PUT /v1/agents/{id}/cache`` between two servers on
127.0.0.1 (free ports, stopped at the end); each says whether the carried agent's greedy
turn equals the source's (None: not run, the CLI cannot load a test model by name)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
from _serving import served  # bench/ is the script's folder: on sys.path

import kvactor
from kvactor.server._app import create_app

#: The prompt of the next turn, its greedy tokens, and the source's answer to it.
Turn = tuple[str, int, list[int] | None]


async def _answer(spec: Any, root: Path, name: str, turn: Turn) -> bool:
    prompt, tokens, expected = turn
    async with kvactor.open(spec, cache_dir=root) as kv:
        agent = await kv.spawn_agent(name)
        done = await agent.complete(prompt, max_tokens=tokens)
    return done.path == kvactor.Tier.WARM and done.token_ids == expected


async def via_cli(spec: Any, source: Path, root: Path, name: str, turn: Turn) -> bool | None:
    """``kvactor export`` out of ``source`` (no model loaded), ``kvactor import`` into
    ``root``; then the carried agent's turn."""
    if spec is not None:
        return None
    file = root.with_suffix(".kvagent")
    kvactor_cli = [sys.executable, "-m", "kvactor"]
    export = [*kvactor_cli, "export", name, "-o", str(file), "--cache-dir", str(source)]
    imported = [*kvactor_cli, "import", str(file), "--cache-dir", str(root)]
    for command in (export, imported):
        done = await anyio.to_thread.run_sync(
            functools.partial(subprocess.run, command, capture_output=True, text=True)
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[2:4])} failed: {done.stderr.strip()}")
    return await _answer(spec, root, name, turn)


async def via_http(spec: Any, source: Path, root: Path, name: str, turn: Turn) -> bool | None:
    """The agent streamed from a server over ``source`` (``GET``) into one over ``root``
    (``PUT``), piece by piece; then the carried agent's turn."""
    async with (
        kvactor.open(spec, cache_dir=source) as a,
        kvactor.open(spec, cache_dir=root) as b,
        served(create_app(a)) as here,
        served(create_app(b)) as there,
        httpx.AsyncClient(timeout=120) as client,
        client.stream("GET", f"{here}/v1/agents/{name}/cache") as got,
    ):
        got.raise_for_status()
        put = await client.put(f"{there}/v1/agents/{name}/cache", content=got.aiter_bytes())
        put.raise_for_status()
    return await _answer(spec, root, name, turn)
