"""The docs teach what runs: every Python example in README.md and docs/ runs as written,
and every relative link points at a file that exists.

Each ```python block runs as a script in a fresh interpreter, in a temporary working
directory, with HOME, XDG_CACHE_HOME and KVACTOR_CACHE_DIR inside it, so an example never
writes to the user's caches. Markers in an HTML comment on the line before a block:

- ``<!-- no-test -->``: the block cannot run here (a second machine): it is skipped.
- ``<!-- test: server -->``: a client of ``kvactor serve``; the test serves a tiny model on
  a free port first and points the block's ``127.0.0.1:8000`` there (marked ``slow``: it
  starts a server process, seconds each).

A block that opens a session without ``make_tiny_model`` uses the default model: it is
marked ``slow``; one that opens a cluster (``cluster=``) is marked ``ray``. Every other
block gets no default model at all (its model folder cannot be created), so a block
that needs one and is not marked fails instead of downloading it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvactor.actors.models import default_model_path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!--\s*(no-test|test:\s*server)\s*-->\s*$")
SERVED_AT = "127.0.0.1:8000"
TIMEOUT_S = 240


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    code: str
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def default_model(self) -> bool:
        opens = "kvactor.open(" in self.code or "cluster=" in self.code
        return opens and "make_tiny_model" not in self.code

    @property
    def cluster(self) -> bool:
        return "cluster=" in self.code


def examples(page: Path) -> Iterator[Example]:
    text = page.read_text(encoding="utf-8")
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text.count("\n", 0, match.start()) + 1
        kind = re.sub(r"\s+", "", marker.group(1)) if marker else None
        yield Example(page, line, textwrap.dedent(match.group(2)), kind)


def _params() -> list[object]:
    params: list[object] = []
    for page in PAGES:
        for example in examples(page):
            marks: list[pytest.MarkDecorator] = []
            if example.marker == "no-test":
                marks.append(pytest.mark.skip(reason="marked no-test: cannot run here"))
            if example.default_model or example.marker == "test:server":
                marks.append(pytest.mark.slow)  # the default model, or a server process
            if example.cluster:
                marks.append(pytest.mark.ray)
            params.append(pytest.param(example, id=example.name, marks=marks))
    return params


def _environment(tmp_path: Path, default_model: bool) -> dict[str, str]:
    env = dict(os.environ)
    home = tmp_path / "home"
    home.mkdir()
    env["HOME"] = str(home)
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    env["KVACTOR_CACHE_DIR"] = str(home / ".cache" / "kvactor" / "agents-cache")
    if default_model:
        env["KVACTOR_MODEL_DIR"] = str(default_model_path().parent)
    else:
        blocker = tmp_path / "no-default-model"
        blocker.write_text("a tiny-model example must not fetch the default model\n")
        env["KVACTOR_MODEL_DIR"] = str(blocker / "models")
    env.pop("PYTHONPATH", None)
    return env


# Runs the example unchanged as __main__, and the interpreter exits as it would after any
# script: a crash at exit (a thread that used MLX racing the interpreter's finalization:
# "terminate called without an active exception", status 134) fails the example, as the
# README promises that every process exits cleanly (tests/test_exit.py, slow, checks it
# thirty times over).
RUNNER = """
import runpy, sys
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def _run(code: str, cwd: Path, env: dict[str, str], name: str) -> None:
    script = cwd / "example.py"
    script.write_text(code, encoding="utf-8")
    try:
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, str(script)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = [x.decode() if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr)]
        pytest.fail(f"{name} ran past {TIMEOUT_S} s:\n" + "\n".join(out))
    if done.returncode != 0:
        pytest.fail(f"{name} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")


SERVER = """
import functools, sys, anyio
from kvactor.actors import make_tiny_model
from kvactor.server import serve

def ready(port):
    print(port, flush=True)

anyio.run(lambda: serve(functools.partial(make_tiny_model, 0, head_dim=64), port=0, ready=ready))
"""


def _served(cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    """A tiny-model ``kvactor.server.serve`` on a free port, and that port."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdout is not None
    line = server.stdout.readline()  # blocks until the server listens (or exits)
    if not line.strip().isdigit():
        _stop(server)
        pytest.fail(f"the example server did not start (rc {server.returncode})")
    return server, int(line)


def _stop(server: subprocess.Popen[str]) -> None:
    server.terminate()  # SIGTERM: it finishes its turns and closes the session
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    if server.stdout is not None:
        server.stdout.close()


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("example", _params())
def test_example_runs(example: Example, tmp_path: Path) -> None:
    env = _environment(tmp_path, example.default_model)
    code = example.code
    if example.marker != "test:server":
        _run(code, tmp_path, env, example.name)
        return
    assert SERVED_AT in code, f"{example.name}: a server example talks to {SERVED_AT}"
    server, port = _served(tmp_path, env)
    try:
        _run(code.replace(SERVED_AT, f"127.0.0.1:{port}"), tmp_path, env, example.name)
    finally:
        _stop(server)


def test_every_page_has_examples_and_the_markers_are_known() -> None:
    found = {page: list(examples(page)) for page in PAGES}
    assert sum(map(len, found.values())) >= 10
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for comment in re.findall(r"<!--\s*(?:no-test|test:[^>]*)-->", text):
            assert MARKER.search(comment), f"{page.name}: unknown marker {comment}"


def test_scenario_blocks_parse() -> None:
    """The TOML in the scenarios guide is valid, and a whole scenario there is accepted."""
    from kvactor.scenario._format import parse_scenario

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    text = (ROOT / "docs" / "scenarios.md").read_text(encoding="utf-8")
    blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1) == "toml"]
    assert blocks
    for block in blocks:
        tomllib.loads(block)
        if "[[phases]]" in block:
            parse_scenario(block)


def test_the_api_reference_has_every_public_name() -> None:
    import kvactor

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    listed = re.findall(r"^::: kvactor\.(\w+)\s*$", text, re.MULTILINE)
    assert sorted(set(kvactor.__all__)) == sorted(n for n in listed if n in kvactor.__all__)
    assert len(listed) == len(set(listed))


def test_a_failing_example_fails(tmp_path: Path) -> None:
    env = _environment(tmp_path, default_model=False)
    with pytest.raises(pytest.fail.Exception, match="exited with 3"):
        _run("import sys\nsys.exit(3)\n", tmp_path, env, "exits-3")
    # A crash at the interpreter's exit, after the example's last line, fails it too.
    crash = "import atexit, os\natexit.register(os.abort)\nprint('done')\n"
    with pytest.raises(pytest.fail.Exception, match="exited with -6"):
        _run(crash, tmp_path, env, "aborts-at-exit")
    # A block not marked slow gets no default model: fetching one fails, not downloads.
    fetch = "from kvactor.actors import default_model_path\ndefault_model_path()\n"
    with pytest.raises(pytest.fail.Exception, match="exited with 1"):
        _run(fetch, tmp_path, env, "fetches")


# ----------------------------------------------------------------------------- links
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]\n]*\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> Iterator[tuple[int, str]]:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"))
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        yield text.count("\n", 0, match.start()) + 1, target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page: Path) -> None:
    missing = []
    for line, target in _relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(f"{page.relative_to(ROOT)}:{line}: {target}")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def test_a_missing_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](gone.md#x) [web](https://example.org) [here](#a)\n")
    assert [t for _, t in _relative_links(page)] == ["page.md", "gone.md#x"]
