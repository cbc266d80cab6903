"""A bench's own processes: a server on 127.0.0.1 (a free port, waiting until it
answers, and stopping it by itself at the end of the block), and stopping any process
within a bound."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server_process(kind: str, command: list[str], port: int, ready: str) -> Iterator[str]:
    """Run ``command`` (a server listening on ``port`` of 127.0.0.1); yield its base URL
    once ``ready`` (a path) answers 200, within 5 minutes; stop it with SIGTERM at the end
    (killed if it has not stopped within a minute). Raises RuntimeError when it exits
    before it is ready, TimeoutError when it is not ready in time."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + ready, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} server did not start")
            time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        wait_or_kill(proc, 60)


def wait_or_kill(proc: subprocess.Popen[Any], timeout: float) -> None:
    """Wait for ``proc`` to exit; killed (and waited for) if it has not within ``timeout``
    seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
