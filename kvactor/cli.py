"""The ``kvactor`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ("main",)


def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(args)


def _fetch_model(args: argparse.Namespace) -> int:
    from .actors.model import fetch_default_model

    print(fetch_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvactor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the multi-agent demo")
    demo.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    demo.set_defaults(func=_demo)
    fetch = sub.add_parser(
        "fetch-model", help="download and verify the default model now (else on first use)"
    )
    fetch.set_defaults(func=_fetch_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
