"""``aiosync warm-up``: compile aiosync's numba kernels into numba's cache ahead of use.

For container images and CI: run it once after installing, and no process of that installation
compiles again (syncers load the cached kernels in the background in a few tenths of a second;
until they are loaded they take their torch paths, so nothing ever waits for a compile). The
kernels are cached next to the package when its directory is writable, else in
``NUMBA_CACHE_DIR`` or numba's user-wide cache directory (``~/.cache/numba``): run it as the user
(and with the environment) that will run the training.

    aiosync warm-up                         # every element width and the ctx encoding
    aiosync warm-up --dtypes bfloat16,float32 --no-ctx
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

def warm(widths: tuple[int, ...], ctx: bool) -> dict[str, Any]:
    """Compile (or load) the kernels here; returns what was done and where they are cached."""
    from ..syncers.kernels import warmup

    t0 = time.perf_counter()
    warmup.warm_up(widths, ctx)
    return {"widths": list(widths), "ctx": ctx, "seconds": round(time.perf_counter() - t0, 2),
            "cache": sorted(set(warmup.cache_locations().values()))}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("warm-up", help="compile aiosync's numba kernels into numba's cache (images, CI)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default=None,
                   help="comma-separated torch dtypes the models hold, e.g. bfloat16,float32 (the receivers' "
                        "dtypes; default: every element width)")
    p.add_argument("--ctx", dest="ctx", action="store_true", default=True,
                   help="the ctx encoding's kernels too (default; encoding: auto or ctx use them)")
    p.add_argument("--no-ctx", dest="ctx", action="store_false", help="leave the ctx encoding's kernels out")
    p.add_argument("--json", metavar="PATH", default=None, help="write what was done here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    widths: tuple[int, ...] = (1, 2, 4, 8)
    if args.dtypes:
        from ..dtypes import dtype_from_name, element_size

        names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        unknown = [d for d in names if dtype_from_name(d) is None]
        if unknown or not names:
            print(f"aiosync warm-up: {unknown or args.dtypes!r} do not name torch dtypes; use names such as "
                  "bfloat16,float32,int64", file=sys.stderr)
            return 2
        widths = tuple(sorted({element_size(dtype_from_name(d)) for d in names} & {1, 2, 4, 8}))
    report = warm(widths, args.ctx)
    print(f"kernels for element widths {report['widths']}{' and the ctx encoding' if report['ctx'] else ''} ready "
          f"in {report['seconds']:.1f} s; cached in {', '.join(report['cache'])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0
