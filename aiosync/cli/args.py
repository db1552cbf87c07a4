"""Argument types of the ``aiosync`` commands: every argument is checked when the command line is
parsed, before any work starts (an error is argparse's one line and exit status 2), and output
paths (``--json``, ``--plot``) must be writable then, not after a run whose report would be lost."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not {_range(low, high)}")
        return value
    return parse


def number(low: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite number ``>= low`` (``> low`` with ``above``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number {'>' if above else '>='} {low:g}")
        return value
    return parse


def _range(low: int, high: int | None) -> str:
    return f">= {low}" if high is None else f"in [{low}, {high}]"


def output_path(text: str) -> str:
    """A file that can be written: opened for appending (created if missing, then removed again),
    so a folder that does not exist, a read-only place or a folder in its stead is refused
    before any work (``os.access`` would not do: it says yes to root)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    existed = os.path.exists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {exc.strerror or exc}") from None
    if not existed:
        os.unlink(text)
    return text
