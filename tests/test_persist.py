"""Persistence faults reach the caller: one session per cache directory (a second one gets
CacheDirLocked at ``open()``), and a turn whose warm write fails says so (or raises), the
agent goes on, and the next write that succeeds repairs the warm copy. Real processes, a
real file-size limit, a tiny random model."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvactor
from kvactor.actors.enums import Tier
from kvactor.actors.models import LoadedModel, make_tiny_model

SYSTEM = "You are agent seven."
LOCKS = pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows")


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


# ----------------------------------------------------------- fault 7: one dir, two users
OPEN_ELSEWHERE = textwrap.dedent(
    """
    import anyio, functools, json, sys, kvactor
    from kvactor.actors.models import make_tiny_model
    async def main():
        try:
            model = functools.partial(make_tiny_model, 0, head_dim=64)
            async with kvactor.open(model, cache_dir=sys.argv[1]) as kv:
                await (await kv.spawn_agent("seven")).generate("mine now", max_tokens=4)
        except kvactor.KvactorError as exc:
            print(json.dumps([type(exc).__name__, str(exc)]))
        else:
            print(json.dumps(["opened", ""]))
    anyio.run(main)
    """
)


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
@LOCKS
def test_a_second_process_cannot_open_a_cache_dir_in_use(tmp_path: Path) -> None:
    async def main() -> None:
        async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
            agent = await kv.spawn_agent("seven", system=SYSTEM)
            await agent.generate("hello", max_tokens=4)
            other = await anyio.run_process(
                [sys.executable, "-c", OPEN_ELSEWHERE, str(tmp_path)], check=False
            )
            kind, message = json.loads(other.stdout.decode().strip().splitlines()[-1])
            assert kind == "CacheDirLocked", other.stderr.decode()[-2000:]
            assert str(tmp_path) in message and f"process {os.getpid()}" in message
            # The CLI's forget waits its turn too; inspect only reads.
            cli = [sys.executable, "-m", "kvactor"]
            forget = await anyio.run_process(
                [*cli, "forget", "seven", "--dir", str(tmp_path)], check=False
            )
            assert forget.returncode == 3 and b"in use by process" in forget.stderr
            shown = await anyio.run_process([*cli, "inspect", str(tmp_path)])
            assert b"seven" in shown.stdout
            # This session goes on writing as before.
            assert (await agent.generate("still here?", max_tokens=4)).saved

    anyio.run(main)
    # Closed: the directory is free again; the other process's turn is saved and loads here.
    again = subprocess.run(
        [sys.executable, "-c", OPEN_ELSEWHERE, str(tmp_path)], capture_output=True, text=True
    )
    assert json.loads(again.stdout.strip().splitlines()[-1]) == ["opened", ""], again.stderr
    gone = subprocess.run(
        [sys.executable, "-m", "kvactor", "forget", "seven", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert gone.returncode == 0 and "bytes deleted" in gone.stdout


@LOCKS
async def test_a_second_session_of_this_process_is_refused_before_loading(
    tmp_path: Path,
) -> None:
    loaded: list[int] = []

    def model() -> LoadedModel:
        loaded.append(1)
        return make_tiny_model(0, head_dim=64)

    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        with pytest.raises(kvactor.CacheDirLocked, match="another session of this process"):
            async with kvactor.open(model, cache_dir=tmp_path):
                pass
        assert not loaded  # refused at once, not after loading a model
        agent = await kv.spawn_agent("seven")
        assert (await agent.generate("hello", max_tokens=4)).saved
    async with kvactor.open(model, cache_dir=tmp_path) as kv:  # released on close
        assert [w.agent for w in await kv.warm_agents()] == ["seven"]
    assert loaded == [1]


# ------------------------------------------------------------------ fault 8: disk full
# A real failing write: the child lowers its file-size limit (RLIMIT_FSIZE) to 0 around
# some turns, so the kernel refuses every write to a file with EFBIG (SIGXFSZ ignored),
# as a full disk refuses them with ENOSPC. Unprivileged, on Linux and macOS alike.
FULL_DISK = textwrap.dedent(
    """
    import anyio, functools, json, resource, signal, sys, kvactor
    from kvactor.actors.models import make_tiny_model

    root, mode, system = sys.argv[1], sys.argv[2], sys.argv[3]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, do not kill the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def disk_full(full):
        resource.setrlimit(resource.RLIMIT_FSIZE, (0 if full else soft, hard))

    def seen(c):
        return {"text": c.text, "saved": c.saved, "save_error": c.save_error}

    async def main():
        out = {}
        model = functools.partial(make_tiny_model, 0, head_dim=64)
        options = {} if mode == "report" else {"on_save_error": mode}  # report: the default
        async with kvactor.open(model, cache_dir=root, **options) as kv:
            agent = await kv.spawn_agent("seven", system=system)
            out["first"] = seen(await agent.generate("first question", max_tokens=6))
            disk_full(True)
            try:
                out["failed"] = seen(await agent.generate("second question", max_tokens=6))
            except kvactor.StoreWriteError as exc:
                out["failed"] = {**seen(exc.completion), "raised": str(exc)}
            pieces = []
            stream = agent.stream("third question", max_tokens=6)
            try:
                async for piece in stream:
                    pieces.append(piece)
            except kvactor.StoreWriteError as exc:
                out["stream_raised"] = exc.completion is stream.completion
            out["streamed"] = {**seen(stream.completion), "pieces": "".join(pieces)}
            out["tokens_unsaved"] = (await agent.state()).tokens
            disk_full(False)
            out["last"] = seen(await agent.generate("last question", max_tokens=6))
            state, stats = await agent.state(), await kv.stats()
            out["state"] = [state.tokens, state.persisted, state.turns]
            out["stats"] = [stats.warm_writes, stats.warm_write_failures]
        print(json.dumps(out))

    anyio.run(main)
    """
)


def run_with_a_full_disk(root: Path, mode: str) -> dict[str, Any]:
    pytest.importorskip("resource", reason="needs RLIMIT_FSIZE (POSIX)")
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(root), mode, SYSTEM],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_failed_turns(out: dict[str, Any]) -> None:
    assert out["first"]["saved"] and out["first"]["save_error"] is None
    for turn in (out["failed"], out["streamed"]):
        assert not turn["saved"] and turn["text"]
        assert "StoreWriteError" in turn["save_error"] and "EFBIG" in turn["save_error"]
    assert out["streamed"]["pieces"] == out["streamed"]["text"]  # streamed as before
    assert out["last"]["saved"] and out["last"]["save_error"] is None
    tokens, persisted, turns = out["state"]
    assert turns == 4 and persisted == tokens  # the last write saved what two missed
    assert out["stats"] == [2, 2]  # warm writes, failed warm writes


async def resume(root: Path) -> tuple[kvactor.Completion, list[dict[str, str]], int]:
    async with kvactor.open(tiny(), cache_dir=root) as kv:
        agent = await kv.spawn_agent("seven", system=SYSTEM)
        state = await agent.state()
        assert state.restored
        done = await agent.generate("what did I ask?", max_tokens=4)
        return done, state.messages, state.tokens


def test_a_failed_warm_write_is_reported_and_the_next_one_repairs_it(tmp_path: Path) -> None:
    out = run_with_a_full_disk(tmp_path, "report")
    check_failed_turns(out)
    assert "stream_raised" not in out and "raised" not in out["failed"]
    # A new process resumes the whole conversation from disk, the failed turns included.
    done, messages, tokens = anyio.run(resume, tmp_path)
    assert tokens == out["state"][0]
    asked = [m["content"] for m in messages if m["role"] == "user"]
    assert asked == ["first question", "second question", "third question", "last question"]
    assert done.path == Tier.WARM and done.timings.reused_tokens >= out["tokens_unsaved"]


def test_on_save_error_raise_keeps_the_answer_and_the_agent(tmp_path: Path) -> None:
    out = run_with_a_full_disk(tmp_path, "raise")
    check_failed_turns(out)
    assert "not saved" in out["failed"]["raised"] and "EFBIG" in out["failed"]["raised"]
    assert out["stream_raised"] is True
    done, messages, _ = anyio.run(resume, tmp_path)
    assert len(messages) == 1 + 2 * 4 and done.path == Tier.WARM


def test_completion_says_whether_the_turn_was_saved() -> None:
    with pytest.raises(ValueError, match="on_save_error"):
        kvactor.open(tiny(), on_save_error="ignore")  # type: ignore[call-overload]

    async def no_warm_tier() -> kvactor.Completion:
        async with kvactor.open(tiny()) as kv:
            return await (await kv.spawn_agent("a")).generate("hi", max_tokens=2)

    done = anyio.run(no_warm_tier)
    assert not done.saved and done.save_error is None  # nothing to save to, nothing failed
