"""The command line as a newcomer meets it: real subprocesses on a fresh cache root, the
tiny model, and the commands it prints pasted into a shell."""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.cli._inspect import codec_short
from kvactor.cli._main import build_parser
from kvactor.kernels.qcodec import DEFAULT_CODEC, FP16_CODEC, KVCodec
from kvactor.scenario._format import load_scenario, parse_scenario, resolve_model
from kvactor.scenario._shipped import shipped_names
from kvactor.text import age

BIN = Path(sys.executable).parent  # where the kvactor script a pasted command runs lives

TEAM = """
name = "tiny-team"
task = "a tiny task"
model = "tiny"
[sampling]
max_tokens = 4
[[agents]]
name = "alpha"
system = "You plan."
[[agents]]
name = "beta"
system = "You build."
[[phases]]
name = "start"
prompt = "Task: {task}. You are {agent}."
[[phases]]
name = "answer"
prompt = "Others said: {outputs}. Reply."
"""


def _env(root: Path) -> dict[str, str]:
    # A fresh default cache root (KVACTOR_CACHE_DIR wins over XDG_CACHE_HOME and HOME).
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "KVACTOR_CACHE_DIR": str(root), "PATH": path}


def kvactor_cli(*args: str, root: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvactor", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(root),
        timeout=240,
    )


def pasted(line: str, *, root: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``line`` run by a shell, as a user who pasted it would."""
    assert shutil.which("kvactor", path=_env(root)["PATH"]), "the kvactor script is installed"
    return subprocess.run(
        line, shell=True, capture_output=True, text=True, cwd=cwd, env=_env(root), timeout=120
    )


def commands(text: str) -> dict[str, list[str]]:
    """The commands after "see them:" and "delete them:" in what a run printed."""
    found: dict[str, list[str]] = {"see": [], "delete": []}
    for kind, line in re.findall(r"^  (see|delete) them: +(kvactor .+)$", text, re.M):
        found[kind].append(line)
    return found


# ------------------------------------------------------------------------ help, version
def test_version_prints_the_package_version(tmp_path: Path) -> None:
    done = kvactor_cli("--version", root=tmp_path, cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"kvactor {importlib.metadata.version('kvactor')}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_help_is_plain_words_and_ends_with_an_example() -> None:
    parser = build_parser()
    helps = {"kvactor": parser.format_help()}
    helps.update({name: p.format_help() for name, p in _subcommands(parser).items()})
    assert set(helps) >= {"demo", "run", "scenarios", "serve", "inspect", "forget", "gc"}
    for name, text in helps.items():
        assert "``" not in text and ":func:" not in text, name
        *_, label, example = text.rstrip().splitlines()
        assert label == "example:", name
        assert example.startswith("  kvactor "), name
        if name != "kvactor":
            assert example.startswith(f"  kvactor {name}"), name
    assert "kvactor demo" in helps["kvactor"].split("positional arguments")[0]


def test_serve_takes_json_for_its_start_line() -> None:
    assert build_parser().parse_args(["serve", "--json"]).json is True
    assert build_parser().parse_args(["serve"]).json is False


# ---------------------------------------------------------------------------- codecs
def test_the_codec_column_is_short() -> None:
    assert codec_short(DEFAULT_CODEC.describe()) == "K5/V3 g64 +rot +4 sinks"
    assert codec_short(KVCodec(bits=4).describe()) == "Q4 g64"
    assert codec_short(KVCodec(bits=8, group_size=32).describe()) == "Q8 g32"
    assert codec_short(FP16_CODEC.describe()) == "fp16"
    mixed = KVCodec(bits=3, key_bits=5, key_group_size=32, sink_tokens=1)
    assert codec_short(mixed.describe()) == "K5 g32/V3 g64 +1 sink"
    assert codec_short({"kind": "affine", "bits": 4}) == "bits=4,kind=affine"  # another form


def test_ages_read_as_words() -> None:
    now = 1_000_000_000.0
    assert age(now - 5, now) == "just now"
    assert age(now - 300, now) == "5 min ago"
    assert age(now - 3 * 3600, now) == "3 h ago"
    assert age(now - 86400, now) == "1 day ago"
    assert age(now - 5 * 86400, now) == "5 days ago"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", age(now - 90 * 86400, now))


# ------------------------------------------------------------------------- scenarios
@pytest.mark.slow  # a subprocess or a long load: the whole suite's
def test_scenarios_lists_the_shipped_ones_and_shows_one(tmp_path: Path) -> None:
    names = shipped_names()
    assert names == ["code_review", "debate", "demo", "shared_doc"]
    listed = kvactor_cli("scenarios", root=tmp_path, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = [line for line in listed.stdout.splitlines() if line and line.split()[0] in names]
    assert [line.split()[0] for line in lines] == names  # one line each
    assert all(len(line.split()) > 6 for line in lines)  # with what it is
    assert "A code review: an author, two reviewers and a maintainer" in listed.stdout

    shown = kvactor_cli("scenarios", "show", "demo", root=tmp_path, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "mine.toml").write_text(shown.stdout)  # a file to start from
    assert load_scenario(tmp_path / "mine.toml") == parse_scenario(shown.stdout)
    assert load_scenario(tmp_path / "mine.toml").name == "demo"

    shared = kvactor_cli("scenarios", "show", "shared_doc", root=tmp_path, cwd=tmp_path)
    assert shared.returncode == 0 and "kvactor scenarios show shared_doc.md" in shared.stderr
    document = kvactor_cli("scenarios", "show", "shared_doc.md", root=tmp_path, cwd=tmp_path)
    assert document.returncode == 0 and len(document.stdout) > 6000

    unknown = kvactor_cli("scenarios", "show", "nope", root=tmp_path, cwd=tmp_path)
    assert unknown.returncode == 2 and "code_review, debate, demo, shared_doc" in unknown.stderr


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
def test_run_takes_a_shipped_scenario_by_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    done = kvactor_cli("run", "code_review", "--model", "tiny", "--json", root=root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)  # stdout is the JSON; the live view went to stderr
    assert summary["scenario"] == "code-review" and summary["turns"] > 0
    assert summary["cache_dir"] == str(root / "scenarios" / "code-review" / "tiny")
    assert (tmp_path / summary["results_file"]).is_file()
    assert "TTFT by path" in done.stderr

    unknown = kvactor_cli("run", "nope", root=root, cwd=tmp_path)
    assert unknown.returncode == 2
    assert "no shipped scenario of that name" in unknown.stderr
    assert "code_review, debate, demo, shared_doc" in unknown.stderr


# ---------------------------------------------------------------- run, then inspect
@pytest.mark.slow  # a subprocess or a long load: the whole suite's
def test_runs_closing_commands_work_when_pasted(tmp_path: Path) -> None:
    root = tmp_path / "cache root"  # a space: the printed paths must be quoted
    (tmp_path / "team.toml").write_text(TEAM)
    done = kvactor_cli("run", "team.toml", root=root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    folder = root / "scenarios" / "tiny-team" / "tiny"
    assert f"warm caches: 2 agents in {folder}" in done.stdout
    [see], [delete] = commands(done.stdout).values()

    shown = pasted(see, root=root, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    head, *rows = shown.stdout.splitlines()
    assert head.split()[:3] == ["AGENT", "TIER", "TOKENS"]
    assert [row.split()[0] for row in rows] == ["alpha", "beta"]
    # The model by name with a short fingerprint, the codec short, the age in words.
    assert all("tiny-llama-seed0 (" in row and "K5/V3 g64 +rot +4 sinks" in row for row in rows)
    assert all(row.rstrip().endswith("just now  ok") for row in rows)

    everywhere = kvactor_cli("inspect", root=root, cwd=tmp_path)  # no DIR: found under the root
    assert everywhere.returncode == 0, everywhere.stderr
    assert everywhere.stdout.startswith(f"{folder}: 2 agents, ")
    verbose = kvactor_cli("inspect", "--verbose", root=root, cwd=tmp_path)
    assert "key_bits=5" in verbose.stdout

    gone = pasted(delete, root=root, cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout.count("bytes deleted") == 2
    assert not any(folder.glob("agents/*"))
    assert "no warm caches under" in kvactor_cli("inspect", root=root, cwd=tmp_path).stdout
    again = pasted(delete, root=root, cwd=tmp_path)  # nothing left: says so per agent
    assert again.returncode == 1 and again.stderr.count("no warm cache for") == 2


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
def test_the_demos_caches_are_found_and_its_commands_work(tmp_path: Path) -> None:
    # The random tiny model's replies are long in bytes: a budget in MB (see test_scenario).
    root = tmp_path / "root"
    args = ("demo", "--model", "tiny", "--budget-mb", "40", "--json")
    done = kvactor_cli(*args, root=root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]  # stdout: the JSON summary alone
    folders = [root / "scenarios" / name / "tiny" for name in ("demo", "shared-doc")]
    assert [r["cache_dir"] for r in runs] == [str(f) for f in folders]
    assert runs[1]["caches"]["agents"][-1] == "shared"  # the shared context's cache too
    assert "demo done in" in done.stderr
    assert "every cache directory under the default root: kvactor inspect" in done.stderr
    found = commands(done.stderr)
    assert found["see"] == [r["caches"]["inspect"] for r in runs]
    assert found["delete"] == [r["caches"]["forget"] for r in runs]

    shown = kvactor_cli("inspect", root=root, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    headings = [line for line in shown.stdout.splitlines() if line.startswith(str(root))]
    assert [h.split(":")[0] for h in headings] == [str(f) for f in folders]
    assert headings[0].startswith(f"{folders[0]}: 6 agents, ")
    assert "the agents share files" in headings[1]  # hard-linked, counted once
    listed = json.loads(kvactor_cli("inspect", "--json", root=root, cwd=tmp_path).stdout)
    assert listed["root"] == str(root)
    assert [d["path"] for d in listed["directories"]] == [str(f) for f in folders]
    names = [[row["agent"] for row in d["agents"]] for d in listed["directories"]]
    assert [sorted(n) for n in names] == [sorted(r["caches"]["agents"]) for r in runs]
    assert all(row["status"] == "ok" for d in listed["directories"] for row in d["agents"])

    for line in found["delete"]:
        gone = pasted(line, root=root, cwd=tmp_path)
        assert gone.returncode == 0, gone.stderr
    assert "no warm caches under" in kvactor_cli("inspect", root=root, cwd=tmp_path).stdout


def test_inspect_shows_the_readable_directories_and_names_the_bad_one(tmp_path: Path) -> None:
    root = tmp_path / "root"
    good = root / "scenarios" / "a" / "tiny"

    async def make() -> None:
        async with kvactor.open(resolve_model("tiny"), cache_dir=good) as kv:
            await (await kv.spawn_agent("kept")).generate("hi", max_tokens=2)

    anyio.run(make)
    bad = root / "scenarios" / "b" / "tiny"
    bad.mkdir(parents=True)
    (bad / "agents").symlink_to(good / "agents", target_is_directory=True)
    shown = kvactor_cli("inspect", root=root, cwd=tmp_path)
    assert shown.returncode == 2
    assert f"{good}: 1 agent, " in shown.stdout and "kept" in shown.stdout
    assert "kvactor inspect: agents under" in shown.stderr and "symlink" in shown.stderr
    listed = kvactor_cli("inspect", "--json", root=root, cwd=tmp_path)
    directories = json.loads(listed.stdout)["directories"]
    assert [d["path"] for d in directories] == [str(good), str(bad)]
    assert "symlink" in directories[1]["error"]
    # The model's name is known only where a run recorded it: here, the fingerprint.
    assert directories[0]["agents"][0]["model_name"] == ""


@pytest.mark.slow
def test_a_run_on_the_default_model_shows_its_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (tmp_path / "team.toml").write_text(TEAM.replace('model = "tiny"', 'model = "default"'))
    done = kvactor_cli("run", "team.toml", root=root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = kvactor_cli("inspect", root=root, cwd=tmp_path)
    assert shown.stdout.startswith(f"{root / 'scenarios' / 'tiny-team' / 'default'}: 2 agents")
    assert "SmolLM2-135M-Instruct" in shown.stdout and "K5/V3 g64 +rot +4 sinks" in shown.stdout


async def test_gc_and_forget_exit_3_on_a_directory_a_session_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md: ``gc`` (and ``forget``) exit with 3 while a session uses the cache
    directory, touching nothing; once it closes they run (0)."""
    from kvactor.cli import main

    root = tmp_path / "cache"
    tiny = functools.partial(make_tiny_model, 0, head_dim=64)
    async with kvactor.open(tiny, cache_dir=root) as kv:
        await (await kv.spawn_agent("a")).generate("hello", max_tokens=2)
        assert main(["gc", "--dir", str(root)]) == 3
        assert main(["forget", "a", "--dir", str(root)]) == 3
        err = capsys.readouterr().err
        assert "kvactor gc: " in err and "kvactor forget: " in err
        assert [w.agent for w in await kv.warm_agents()] == ["a"]  # nothing was touched
    assert main(["gc", "--dir", str(root)]) == 0
    assert "0 unreferenced files removed" in capsys.readouterr().out
    assert main(["forget", "a", "--dir", str(root)]) == 0
