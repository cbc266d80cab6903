"""Type-check with mypy, every file under its one import name (what ``./dev test`` runs).

pyproject.toml installs the top-level folders runtime/, actors/ and kernels/ as
kvactor.runtime, kvactor.actors and kvactor.kernels (setuptools package-dir). mypy names a
file by its folders (runtime/_actor.py would be ``runtime._actor``) and does not run
setuptools' editable-install import hook, so this script takes the files and settings of
pyproject's [tool.mypy] (and any mypy arguments given), renames the modules under those
folders to their ``kvactor.`` names and runs mypy's build on them. Output and exit status
are mypy's: 0 clean, 1 errors, 2 a blocking error. Imports of kvactor.runtime & co resolve
only to these sources, so file arguments must include the three folders.

    python tools/typecheck.py [MYPY ARGS]
"""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import build, util
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent
# top-level folder -> its import name (keep in step with [tool.setuptools.package-dir])
MAPPED = {"runtime": "kvactor.runtime", "actors": "kvactor.actors", "kernels": "kvactor.kernels"}


def import_name(source: BuildSource) -> str:
    """The module name of a source: mypy's own, except under a mapped folder."""
    head, _, rest = source.module.partition(".")
    path = Path(source.path or "").resolve()
    if head in MAPPED and path.is_relative_to(ROOT / head):
        return MAPPED[head] + ("." + rest if rest else "")
    return source.module


def main(args: list[str]) -> int:
    fscache = FileSystemCache()
    sources, options = process_options(args, fscache=fscache)
    sources = [BuildSource(s.path, import_name(s), s.text, s.base_dir, s.followed) for s in sources]
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    messages: list[str] = []

    def flush_errors(filename: str | None, new_messages: list[str], serious: bool) -> None:
        messages.extend(new_messages)
        out = sys.stderr if serious else sys.stdout
        for message in new_messages:
            out.write((formatter.colorize(message) if options.color_output else message) + "\n")
        out.flush()

    blockers = False
    try:
        build.build(sources, options, flush_errors=flush_errors, fscache=fscache)
    except CompileError:
        blockers = True  # its messages went through flush_errors
    n_errors, n_notes, n_files = util.count_stats(messages)
    color = options.color_output
    if n_errors or blockers:
        summary = formatter.format_error(
            n_errors, n_files, len(sources), blockers=blockers, use_color=color
        )
    else:
        summary = formatter.format_success(len(sources), color)
    print(summary)
    if blockers:
        return 2
    return 1 if n_notes < len(messages) else 0  # anything but notes fails, as with mypy


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
