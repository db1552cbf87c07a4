"""Entry point of the ``aiosync`` console script.

Each sub-command lives in its own module of this package with ``add_parser(subparsers)``
registering its arguments and ``run(args) -> int`` doing the work.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": "aiosync.cli.demo",
    "bench": "aiosync.cli.bench",
    "simulate": "aiosync.cli.simulate",
    "warm-up": "aiosync.cli.warmup",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiosync", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
