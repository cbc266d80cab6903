"""Helpers of the server's tests: an app served in process on 127.0.0.1 (:func:`running`),
a real ``kvactor serve`` process (:func:`serve_process`), a raw HTTP connection that can
leave mid-request (:func:`raw_request`), /metrics as numbers (:func:`metric`), and the
tiny model as an mlx-lm folder on disk with a context of its own (:func:`tiny_model_dir`:
what a subprocess can be given, with a context so long that a turn cannot end by itself
within a test)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketStream
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _serving import served  # one in-process server for tests and benches

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.server._app import create_app

tiny = functools.partial(make_tiny_model, 0, head_dim=64)

#: A context so long that a turn of ENDLESS tokens runs for minutes on the tiny model: a
#: turn that stops within a test stopped because it was told (cancelled, drained, ended).
LONG_CONTEXT = 1 << 17
ENDLESS = 100_000


def tiny_model_dir(path: Path, context: int = LONG_CONTEXT) -> Path:
    """``path`` made an mlx-lm model folder of the tiny model (``tiny``'s weights, its byte
    tokenizer and chat template) with a context of ``context`` tokens; returns ``path``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvactor.actors.models._bpe import TINY_CHAT_TEMPLATE, tiny_byte_tokenizer, tiny_vocab
    from kvactor.actors.models._export import tokenizer_files
    from kvactor.actors.models._tiny import TINY_FAMILIES

    path.mkdir(parents=True, exist_ok=True)
    lm = make_tiny_model(0, head_dim=64, max_position_embeddings=context)
    weights: Any = dict(tree_flatten(lm.model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    config = {
        "model_type": "llama",
        **TINY_FAMILIES["llama"],
        "head_dim": 64,
        "vocab_size": lm.tokenizer.vocab_size,
        "max_position_embeddings": context,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    tokens, _, _ = tiny_vocab()
    metadata = {"tokenizer.ggml.tokens": tokens, "tokenizer.chat_template": TINY_CHAT_TEMPLATE}
    for name, text in tokenizer_files(tiny_byte_tokenizer(), metadata, context).items():
        (path / name).write_text(text)
    return path


@contextlib.asynccontextmanager
async def running(
    model: Any = tiny, app_options: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[tuple[kvactor.Session, str]]:
    """A session served on 127.0.0.1 on a free port (model id "tiny"); stops with the
    block."""
    async with kvactor.open(model, **options) as kv:
        app = create_app(kv, model_id="tiny", **(app_options or {}))
        async with served(app, start_s=10) as base:
            yield kv, base


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` in Prometheus text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def chat_request(body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    """A raw HTTP/1.1 POST of ``body`` to /v1/chat/completions."""
    data = json.dumps(body).encode()
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


@contextlib.asynccontextmanager
async def raw_request(base: str, request: bytes) -> AsyncIterator[SocketStream]:
    """A connection that sent ``request``; leaving the block closes it (the client gone)."""
    port = int(base.rsplit(":", 1)[1])
    stream = await anyio.connect_tcp("127.0.0.1", port)
    try:
        await stream.send(request)
        yield stream
    finally:
        await stream.aclose()


@dataclass
class ServeProcess:
    """A ``kvactor serve`` process: its Popen, the start line's fields, its stderr file."""

    proc: subprocess.Popen[bytes]
    start: dict[str, Any]
    stderr: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.start['port']}"

    def rss_bytes(self) -> int:
        """The process's resident memory now (``VmRSS``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")


@contextlib.contextmanager
def serve_process(
    tmp: Path,
    *args: str,
    env: dict[str, str] | None = None,
    model: str = "tiny",
    start_s: float = 60,
) -> Iterator[ServeProcess]:
    """``kvactor serve MODEL --port 0 --json ARGS`` until the block ends (then SIGKILL if
    it still runs); waits ``start_s`` for its start line."""
    stderr = tmp / f"serve-{time.monotonic_ns()}.log"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvactor", "serve", model, "--port", "0", "--json", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **(env or {})},
        )
    try:
        deadline = time.monotonic() + start_s
        start = None
        while start is None:
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, stderr.read_text()
            for line in stderr.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("event") == "serving":
                    start = json.loads(line)
            time.sleep(0.05)
        yield ServeProcess(proc, start, stderr)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
