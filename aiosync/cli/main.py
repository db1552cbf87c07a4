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
    """Parse (every argument is checked here, before any work), run; a configuration error is one
    line on stderr and exit status 2, not a traceback."""
    from ..errors import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"aiosync {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
