"""Packaging: runtime/, actors/, kernels/ are kvactor.runtime, kvactor.actors, kvactor.kernels
(setuptools package-dir, no symlinks), each file under one import name, in the editable
install and in a wheel built offline."""

from __future__ import annotations

import collections
import importlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAPPED = ("runtime", "actors", "kernels")  # top-level folder X is the package kvactor.X


def _layout() -> dict[Path, str]:
    """Every .py file of the package in the repository, and its path in an installed one."""
    roots = {REPO / "kvactor": "kvactor", **{REPO / f: f"kvactor/{f}" for f in MAPPED}}
    return {
        path: f"{dest}/{path.relative_to(root).as_posix()}"
        for root, dest in roots.items()
        for path in sorted(root.rglob("*.py"))
    }


def _import_names() -> dict[Path, str]:
    """Every .py file of the package and its one import name."""
    return {
        path: entry.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for path, entry in _layout().items()
    }


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_no_symlinks_left() -> None:
    links = [p for p in REPO.joinpath("kvactor").rglob("*") if p.is_symlink()]
    assert not links


@pytest.mark.parametrize("folder", MAPPED)
def test_subpackage_is_the_repository_folder(folder: str) -> None:
    package = importlib.import_module(f"kvactor.{folder}")
    assert Path(package.__file__ or "") == REPO / folder / "__init__.py"


def test_every_file_imports_under_its_one_name() -> None:
    names = _import_names()
    assert "kvactor.runtime._actor" in names.values()
    for path, name in names.items():
        if not name.endswith("__main__"):  # that one runs the CLI
            assert Path(importlib.import_module(name).__file__ or "") == path
    seen = collections.defaultdict(list)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() in names:
            seen[Path(file).resolve()].append(name)
    assert {path: [names[path]] for path in seen} == dict(seen)
    assert not [n for n in sys.modules if n.partition(".")[0] in MAPPED]


def test_editable_install_maps_the_folders(tmp_path: Path) -> None:
    # from outside the repository: only the installed package can resolve these names
    probe = (
        "import json, kvactor.runtime._actor, kvactor.actors.engine._runner\n"
        "import kvactor.kernels.qcodec as q\n"
        "print(json.dumps([kvactor.runtime._actor.__file__, kvactor.actors.engine._runner.__file__,"
        " q.__file__]))"
    )
    done = _run([sys.executable, "-c", probe], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = [Path(f) for f in json.loads(done.stdout.splitlines()[-1])]
    assert files == [
        REPO / "runtime/_actor.py",
        REPO / "actors/engine/_runner.py",
        REPO / "kernels/qcodec.py",
    ]


@pytest.mark.parametrize("folder", MAPPED)
def test_plain_folder_import_is_refused(folder: str) -> None:
    done = _run([sys.executable, "-c", f"import {folder}"], cwd=REPO)
    assert done.returncode != 0
    assert f"ImportError: import kvactor.{folder}, not {folder}:" in done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built offline from a copy of the repository (a build in place would reuse
    build/, where setuptools keeps files that were since deleted)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    ignore = shutil.ignore_patterns(".*", "__pycache__", "build", "dist", "*.egg-info", "results")
    shutil.copytree(REPO, source, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = _run([*pip, "-v", "-w", str(tmp / "out"), str(source)], cwd=tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    # Every folder the wheel ships is a package it names (setuptools warns of one it
    # finds only by its files, as the dashboard's folder was).
    assert "absent from the `packages` configuration" not in done.stdout + done.stderr
    (built,) = (tmp / "out").glob("kvactor-*.whl")
    return built


@pytest.mark.wheel
def test_wheel_holds_each_file_once(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        entries = archive.namelist()
    modules = collections.Counter(e for e in entries if e.endswith(".py"))
    assert "kvactor/runtime/_actor.py" in modules
    assert set(modules) == set(_layout().values())
    assert set(modules.values()) == {1}
    scenarios = {p.name for p in (REPO / "kvactor/scenarios").glob("*.toml")}
    documents = {p.name for p in (REPO / "kvactor/scenarios").glob("*.md")}  # they read
    assert scenarios and documents
    assert {f"kvactor/scenarios/{s}" for s in scenarios | documents} <= set(entries)
    page = {p.name for p in (REPO / "kvactor/server/dashboard").iterdir()}
    assert {f"kvactor/server/dashboard/{name}" for name in page} <= set(entries)
    assert not [e for e in entries if e.partition("/")[0] in MAPPED]


@pytest.mark.wheel
def test_wheel_installs_and_imports(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q"]
    done = _run([*pip, "--target", str(target), str(wheel)], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    probe = (
        "import json, sys, importlib.resources, kvactor\n"
        "demo = importlib.resources.files('kvactor').joinpath('scenarios/demo.toml')\n"
        "from kvactor.scenario._shipped import shipped_names, shipped_scenario\n"
        "shipped = {n: shipped_scenario(n).name for n in shipped_names()}\n"  # kvactor scenarios
        "files = {n: m.__file__ for n, m in sys.modules.items() if n.startswith('kvactor')}\n"
        "print(json.dumps({'open': callable(kvactor.open), 'demo': str(demo), 'files': files,\n"
        "                  'shipped': shipped}))"
    )
    done = _run([sys.executable, "-c", probe], cwd=tmp_path, PYTHONPATH=str(target))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["open"]
    assert found["shipped"]["shared_doc"] == "shared-doc"  # its document read beside it
    assert Path(found["demo"]).is_file()
    assert Path(found["files"]["kvactor.runtime"]) == target / "kvactor/runtime/__init__.py"
    assert {"kvactor.actors.engine._runner", "kvactor.kernels.qcodec"} <= set(found["files"])
    assert all(Path(f).is_relative_to(target) for f in [found["demo"], *found["files"].values()])
