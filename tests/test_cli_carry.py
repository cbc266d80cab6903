"""``kvactor export`` and ``kvactor import`` (docs/cli.md), run in process through the
command line's ``main`` on the tiny random model: a round trip into another cache
directory resumes the agent warm with the same greedy tokens; refusals exit with 2 and
say why; ``-`` is stdout and stdin; export works beside a session, import says to use the
server's route."""

from __future__ import annotations

import functools
import io
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import read_header
from kvactor.cli import main

tiny = functools.partial(make_tiny_model, 0, head_dim=64)  # what --model tiny opens
SYSTEM = "You read documents."
FIRST = "here is a long document about rye bread " * 8
NEXT = "summarize it"


def make_agent(root: Path, name: str = "doc", prompt: str = FIRST) -> None:
    """A session on ``root`` whose agent ``name`` took one turn, closed again."""

    async def run() -> None:
        async with kvactor.open(tiny, cache_dir=root) as kv:
            agent = await kv.spawn_agent(name, system=SYSTEM)
            await agent.generate(prompt, max_tokens=5)

    anyio.run(run)


def next_turn(root: Path, name: str = "doc") -> Any:
    """Agent ``name`` of ``root`` resumed, and its next greedy turn (a Completion)."""

    async def run() -> Any:
        async with kvactor.open(tiny, cache_dir=root) as kv:
            agent = await kv.spawn_agent(name)
            return await agent.generate(NEXT, max_tokens=8)

    return anyio.run(run)


def warm_tokens(root: Path) -> dict[str, int]:
    async def run() -> dict[str, int]:
        async with kvactor.open(tiny, cache_dir=root) as kv:
            return {w.agent: w.tokens for w in await kv.warm_agents()}

    return anyio.run(run)


def kvactor_import(*args: str) -> int:
    return main(["import", *args, "--model", "tiny"])


def test_export_then_import_elsewhere_resumes_warm_with_the_same_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst, file = tmp_path / "src", tmp_path / "dst", tmp_path / "doc.kvagent"
    make_agent(src)
    assert main(["export", "doc", "-o", str(file), "--cache-dir", str(src)]) == 0
    err = capsys.readouterr().err
    tokens = warm_tokens(src)["doc"]
    assert f"exported 'doc': {tokens} tokens" in err and str(file) in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp
    assert kvactor_import(str(file), "--cache-dir", str(dst)) == 0
    err = capsys.readouterr().err
    assert f"imported 'doc': {tokens} tokens" in err and str(dst) in err
    there, here = next_turn(dst), next_turn(src)
    assert there.path == "warm" and there.timings.reused_tokens > 0
    assert there.token_ids == here.token_ids and there.text == here.text
    assert there.timings.reused_tokens == here.timings.reused_tokens


def test_refusals_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst, file = tmp_path / "src", tmp_path / "dst", tmp_path / "doc.kvagent"
    make_agent(src)
    make_agent(dst, prompt="another conversation")
    assert main(["export", "doc", "-o", str(file), "--cache-dir", str(src)]) == 0
    capsys.readouterr()
    refusals: dict[tuple[str, ...], str] = {
        ("export", "nobody", "-o", str(tmp_path / "x"), "--cache-dir", str(src)): "no warm cache",
        ("export", "../doc", "-o", str(tmp_path / "x"), "--cache-dir", str(src)): "agent id",
        ("export", "doc", "-o", str(tmp_path / "x"), "--cache-dir", str(tmp_path / "no")): "no",
    }
    data = file.read_bytes()
    cut, flipped = tmp_path / "cut.kvagent", tmp_path / "flipped.kvagent"
    cut.write_bytes(data[: len(data) // 2])
    altered = bytearray(data)
    altered[len(data) // 2] ^= 1
    flipped.write_bytes(bytes(altered))
    imports: dict[tuple[str, ...], str] = {
        (str(cut), "--as", "c"): "truncated",
        (str(flipped), "--as", "f"): "the file is refused: ",
        (str(tmp_path / "missing.kvagent"),): "no such file",
        (str(file),): "give --replace to replace the agent, or --as NAME",  # dst has a 'doc'
    }
    for argv, said in refusals.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kvactor export: ") and said in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
    for argv, said in imports.items():
        assert kvactor_import(*argv, "--cache-dir", str(dst)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kvactor import: ") and said in err, err
        assert len(err.strip().splitlines()) == 1, err
    # Nothing of the refused ones stayed; --as and --replace take it.
    assert sorted(warm_tokens(dst)) == ["doc"]
    assert kvactor_import(str(file), "--as", "copy", "--cache-dir", str(dst)) == 0
    assert kvactor_import(str(file), "--replace", "--cache-dir", str(dst)) == 0
    assert warm_tokens(dst) == {"doc": warm_tokens(src)["doc"], "copy": warm_tokens(src)["doc"]}


def test_dash_is_stdout_and_stdin_and_a_terminal_gets_a_file(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_agent(src)
    assert main(["export", "doc", "-o", "-", "--cache-dir", str(src)]) == 0
    dashed = capsysbinary.readouterr()
    assert b"to stdout" in dashed.err
    assert main(["export", "doc", "--cache-dir", str(src)]) == 0  # stdout is no terminal
    piped = capsysbinary.readouterr().out
    one, two = read_header(dashed.out), read_header(piped)  # the same but for the time
    assert msgspec.structs.replace(one, exported=0) == msgspec.structs.replace(two, exported=0)
    assert one.agent == "doc" and one.tokens == warm_tokens(src)["doc"] > 0
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(piped)))
    assert kvactor_import("-", "--cache-dir", str(dst)) == 0
    assert b"from stdin" in capsysbinary.readouterr().err
    assert next_turn(dst).token_ids == next_turn(src).token_ids

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert main(["export", "doc", "--cache-dir", str(src)]) == 0
    written = read_header((tmp_path / "doc.kvagent").read_bytes())
    assert written.agent == "doc" and written.tokens == warm_tokens(src)["doc"] > one.tokens


async def test_export_works_beside_a_session_and_import_points_at_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, file = tmp_path / "src", tmp_path / "doc.kvagent"
    async with kvactor.open(tiny, cache_dir=src) as kv:
        agent = await kv.spawn_agent("doc", system=SYSTEM)
        await agent.generate(FIRST, max_tokens=5)
        argv = ["export", "doc", "-o", str(file), "--cache-dir", str(src)]
        assert await anyio.to_thread.run_sync(main, argv) == 0
        argv = ["import", str(file), "--as", "again", "--cache-dir", str(src), "--model", "tiny"]
        assert await anyio.to_thread.run_sync(main, argv) == 3
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith("kvactor import: ") and "PUT /v1/agents/ID/cache" in err
        assert [w.agent for w in await kv.warm_agents()] == ["doc"]
        # What it exported beside the session imports here, through the session.
        copy = await kv.import_agent(file, "copy")
        assert (await copy.generate(NEXT, max_tokens=4)).path == "warm"
