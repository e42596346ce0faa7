"""The `tomlens` command: a thin layer over the Python API, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

from tomlens.cli.options import check_choices
from tomlens.errors import TomlensError

# Subcommands: each module defines `register(subparsers)` and sets `func` on its parser.
COMMANDS: tuple[str, ...] = ("models", "stimuli", "audit", "behave", "cache", "probe", "pairs", "patch", "steer", "run", "demo", "validate", "organism", "study", "export", "compare", "freetext", "runs", "store")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tomlens", description="Theory-of-mind interpretability for open-weight LMs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"tomlens.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_choices(args)
        result = args.func(args)
    except TomlensError as e:
        print(f"tomlens {args.command}: error: {e.problem}", file=sys.stderr)
        if e.fix:
            print(f"  fix: {e.fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tomlens {args.command}: interrupted; finished work is kept", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
