"""Which run holds a checkpoint directory: the hold files.

A run holds a directory through a **hold file**, ``.hold-<gen>.json``, created with
``O_CREAT | O_EXCL`` — of two processes creating the same name, exactly one succeeds, on a local
file system and on NFS (v3 and later) alike. The hold of highest ``gen`` is the current one. It
records the run id, a random token (what makes this hold this process's, even if another launch
uses the same run id), the holder's host, boot id, pid and process start time, the number of
writers, and ``floor``: the newest version the directory held from earlier runs (the run must
publish above it). Writer ``r`` > 0 of a run holds its rank with ``.hold-<gen>.w<r>.json``, also
created with ``O_EXCL``. A holder touches its file at every publish (the heartbeat).

A hold is **stale** when its holder is gone: on the same host (same host name and boot id) when
its process no longer exists (or its pid now belongs to a process started later); on another
host when it has not published for ``stale_after`` seconds. A new run takes a stale hold over by
creating the next ``gen``; a live one refuses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HOLD = re.compile(r"\.hold-([0-9]{6})(?:\.w([0-9]{1,6}))?\.json", re.ASCII)


def new_run_id() -> str:
    """A fresh run id (16 hex digits)."""
    return secrets.token_hex(8)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot), '' where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return raw.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not start or _start_time(pid) in ("", start)


@dataclass(frozen=True)
class Holder:
    """What a hold file says about the process holding it."""

    run: str
    token: str
    host: str
    boot: str
    pid: int
    start: str
    writers: int = 1
    rank: int = 0
    floor: int = -1
    created: float = 0.0
    #: The run ended and handed the directory on: its files stay readable, any run may take it over.
    released: bool = False

    @classmethod
    def me(cls, run: str, writers: int, rank: int, floor: int) -> Holder:
        pid = os.getpid()
        return cls(run, secrets.token_hex(8), socket.gethostname(), _boot_id(), pid, _start_time(pid), writers,
                   rank, floor, time.time())

    def describe(self, path: Path, heartbeat: float | None) -> str:
        age = "" if heartbeat is None else f", last published {time.time() - heartbeat:.0f}s ago"
        return (f"run {self.run!r} (pid {self.pid} on {self.host}{age}; writer {self.rank} of {self.writers}; "
                f"hold file {path})")

    def gone(self, heartbeat: float | None, stale_after: float) -> bool:
        """Whether the holder is gone (the documented rule above)."""
        if self.released:
            return True
        if self.host == socket.gethostname() and self.boot == _boot_id():
            return not _alive(self.pid, self.start)
        if self.host == socket.gethostname() and self.boot and _boot_id() and self.boot != _boot_id():
            return True  # this host rebooted since
        return heartbeat is not None and time.time() - heartbeat > stale_after


def hold_name(gen: int, rank: int = 0) -> str:
    return f".hold-{gen:06d}.json" if rank == 0 else f".hold-{gen:06d}.w{rank}.json"


def create(directory: Path, gen: int, holder: Holder) -> bool:
    """Create the hold file of ``gen`` (``holder.rank``'s) atomically; False if it exists."""
    path = directory / hold_name(gen, holder.rank)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(asdict(holder)).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return True


def read(path: Path) -> tuple[Holder, float] | None:
    """The holder a hold file names and its heartbeat (mtime); ``None`` if it is gone or unreadable
    (a hold file is written whole before anyone can see... a crash mid-write leaves it empty)."""
    try:
        raw, mtime = path.read_bytes(), path.stat().st_mtime
        fields = json.loads(raw)
        return Holder(**fields), mtime
    except (OSError, ValueError, TypeError):
        return None


def scan(directory: Path) -> dict[tuple[int, int], Path]:
    """Every hold file: ``(gen, rank) -> path``."""
    found = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            m = HOLD.fullmatch(entry.name)
            if m:
                found[(int(m.group(1)), int(m.group(2) or 0))] = Path(entry.path)
    return found


def current(directory: Path, holds: dict[tuple[int, int], Path] | None = None
            ) -> tuple[int, Holder | None, float | None]:
    """The current hold: ``(gen, holder, heartbeat)``; gen 0 and ``None`` when nobody holds the
    directory. A hold file that cannot be read (being written, or damaged) is a holder of
    unknown identity: ``(gen, None, mtime)``."""
    holds = scan(directory) if holds is None else holds
    gens = [g for g, r in holds if r == 0]
    if not gens:
        return 0, None, None
    gen = max(gens)
    got = read(holds[(gen, 0)])
    if got is None:
        with contextlib.suppress(OSError):
            return gen, None, holds[(gen, 0)].stat().st_mtime
        return gen, None, None
    return gen, got[0], got[1]


def release(path: Path, holder: Holder) -> None:
    """Mark ``holder``'s hold file released (rewritten whole under a temporary name, then renamed
    over its own file)."""
    tmp = path.with_name(f".release-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(asdict(holder) | {"released": True}))
    os.replace(tmp, path)


def touch(path: Path) -> None:
    """The heartbeat: the holder published."""
    with contextlib.suppress(OSError):
        os.utime(path)
