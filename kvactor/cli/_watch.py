"""``kvactor run --dashboard [PORT]``: the run served live on 127.0.0.1 (the same page and
``/v1/status`` as ``kvactor serve``'s ``/dashboard``), then its final state until Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import IO, TypeVar

import anyio

from ..actors.enums import Tier
from ..actors.session import Session
from ..scenario import Event, Results, Scenario, TurnFinished, run_scenario
from ..server import TurnSeen, new_board, serve_dashboard

__all__ = ("dashboard_backend", "port_taken", "run_watched")

T = TypeVar("T")


async def run_watched(
    scenario: Scenario,
    on_event: Callable[[Event], None],
    port: int,
    out: IO[str],
    finish: Callable[[Results], T],
    *,
    wait_after: bool = True,
) -> T:
    """Run ``scenario`` with its dashboard served on 127.0.0.1:``port``; ``finish(results)``
    once it ran (its summary), then (``wait_after``) serve the final state until SIGINT
    or SIGTERM. Returns what ``finish`` returns. Raises OSError when the port is taken,
    what ``run_scenario`` raises."""
    board = new_board()
    stop = anyio.Event()
    listening = anyio.Event()
    url: list[str] = []

    def ready(bound: int) -> None:
        url.append(f"http://127.0.0.1:{bound}/dashboard")
        print(f"dashboard: {url[0]}", file=out, flush=True)
        listening.set()

    def seen(event: Event) -> None:
        on_event(event)
        if isinstance(event, TurnFinished):
            r = event.record
            path = "prefetched" if r.prefetched and r.path is Tier.HOT else str(r.path)
            turn = TurnSeen(
                r.agent,
                path,
                r.ttft_s,
                r.decode_tok_s,
                r.prompt_tokens,
                r.reused_tokens,
                r.generated_tokens,
            )
            board.activity.turn(turn)

    @contextlib.asynccontextmanager
    async def watch(session: Session) -> AsyncIterator[None]:
        board.attach(session)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await board.freeze()  # the final state, read before the session closes

    failed: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve_dashboard(board, port=port, ready=ready, stop=stop))
        try:
            await listening.wait()
            results = await run_scenario(scenario, on_event=seen, watch=watch)
            done = finish(results)
            if wait_after:
                print(f"the run is over: {url[0]} shows its final state; Ctrl-C stops", file=out)
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
        except Exception as exc:  # raised as itself below, not in a group
            failed.append(exc)
        finally:
            stop.set()
    if failed:
        raise failed[0]
    return done


def dashboard_backend(backend: str) -> str | None:
    """Why ``--dashboard`` cannot run on ``backend`` (None: it can): uvicorn needs asyncio."""
    if backend != "asyncio":
        return "--dashboard runs on asyncio (its server is uvicorn): drop --backend trio"
    return None


def port_taken(port: int, exc: OSError) -> int:
    """Say the dashboard's port could not be bound; the exit code."""
    print(f"kvactor run: the dashboard cannot listen on port {port}: {exc}", file=sys.stderr)
    return 2
