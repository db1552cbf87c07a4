"""A directory of version-stamped safetensors files (the CHECKPOINT sync method, T3).

Files are named ``sync-<version>.safetensors`` (zero-padded, so names sort by version). A
file is published atomically: written to a temporary name (``.tmp-*``) in the same
directory, flushed and fsync'ed, then renamed over its final name with :func:`os.replace`,
and the directory entry is fsync'ed too. Readers only ever look at final names, so a reader —
in this process, another process, or on another node sharing the directory — never sees a
partial file. After a publish, superseded sync files are removed. Files written with
``keep=True`` are full checkpoints, named ``full-<version>.safetensors``, marked
``kind=full`` in their metadata, and never removed.

Every file's metadata records its ``version`` and ``kind``; :meth:`CheckpointDir.load` checks
them against the name, so a mislabelled or foreign file is refused, never applied. It is the
one checkpoint loader: given the model's tensors (``target=``) it also checks with
:func:`check_tensors_fit` that every key, shape and dtype fits them before returning anything.

Several writers must not publish into one directory. Readers may be anywhere: a newest file
removed by a concurrent publish between discovery and open (or a stale NFS handle) is
retried with the new newest.

All methods are blocking file I/O: call them through :func:`aiosync.aio.run_sync`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .dtypes import dtype_name
from .errors import HandshakeError, PayloadError, VersionError

__all__ = ["CheckpointDir", "check_tensors_fit"]

_NAME = re.compile(r"^(sync|full)-(\d+)\.safetensors$")
_TMP_PREFIX = ".tmp-"


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (best effort: not every platform / file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(eq=False)
class CheckpointDir:
    """Publish and discover version-stamped weight files in ``path`` (created if missing)."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

    def file_for(self, version: int, keep: bool = False) -> Path:
        """The final name of ``version`` (``full-`` when ``keep``)."""
        if version < 0:
            raise VersionError(f"checkpoint versions are non-negative, got {version}")
        return self.path / f"{'full' if keep else 'sync'}-{version:012d}.safetensors"

    def versions(self, kind: str | None = None) -> list[tuple[int, Path]]:
        """``(version, path)`` of every published file, oldest first; ``kind``: ``sync`` or
        ``full`` to list only those."""
        found = []
        for entry in os.scandir(self.path):
            m = _NAME.match(entry.name)
            if m and (kind is None or m.group(1) == kind):
                try:
                    if not entry.is_file():
                        continue
                except OSError:  # removed while scanning
                    continue
                found.append((int(m.group(2)), Path(entry.path)))
        return sorted(found)

    def newest(self) -> tuple[int, Path] | None:
        """The newest published ``(version, path)``, or ``None`` when the directory is empty."""
        found = self.versions()
        return found[-1] if found else None

    def newest_version(self) -> int | None:
        """The newest published version, or ``None``."""
        newest = self.newest()
        return None if newest is None else newest[0]

    def publish(self, state: Mapping[str, torch.Tensor], version: int, *, keep: bool = False) -> Path:
        """Write ``state`` as ``version`` atomically, then remove superseded sync files.

        ``version`` must be above every published one. Tensors are written from CPU copies;
        aliased (tied) tensors are written once per name. ``keep=True`` writes a full
        checkpoint (``full-<version>``) that is never removed.
        """
        newest = self.newest()
        if newest is not None and version <= newest[0]:
            raise VersionError(
                f"cannot publish checkpoint version {version} in {self.path}: it is not above the newest "
                f"published {newest[0]} ({newest[1].name}). The directory already holds files of another "
                f"(earlier) run. Use an empty directory, remove the old files, or attach the trainer with "
                f"version= above {newest[0]}.")
        tensors = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}
        final = self.file_for(version, keep)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".safetensors", dir=self.path)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"version": str(version), "kind": "full" if keep else "sync"})
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.path)
        self.remove_superseded(version)
        return final

    def remove_superseded(self, version: int) -> int:
        """Remove sync files older than ``version`` (``full-`` files stay); returns how many."""
        removed = 0
        for v, p in self.versions("sync"):
            if v < version:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed += 1
        return removed

    def remove_stale_temporaries(self, older_than: float = 3600.0) -> int:
        """Remove temporary files a crashed writer left behind (older than ``older_than``
        seconds, so a publish in progress is never touched); returns how many."""
        removed, now = 0, time.time()
        for entry in os.scandir(self.path):
            if entry.name.startswith(_TMP_PREFIX):
                try:
                    if now - entry.stat().st_mtime > older_than:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def metadata(self, path: Path) -> dict[str, str]:
        """The metadata stored in one file (``version``, ``kind``)."""
        with safe_open(str(path), framework="pt") as fh:
            return dict(fh.metadata() or {})

    def load(self, version: int | None = None, *, target: Mapping[str, torch.Tensor] | None = None
             ) -> tuple[int, dict[str, torch.Tensor]]:
        """Load ``version`` (default: the newest) into memory; returns ``(version, tensors)``.

        A newest file removed by a concurrent publish between discovery and open is retried
        with the new newest. A file whose metadata does not match its name is refused with
        :class:`aiosync.errors.PayloadError`. With ``target`` (the model's tensors by name), the
        file's tensors are checked against it with :func:`check_tensors_fit`
        (:class:`aiosync.errors.HandshakeError` naming the file and the key); nothing is written.
        """
        for _ in range(16):
            if version is None:
                newest = self.newest()
                if newest is None:
                    raise FileNotFoundError(f"no published checkpoint in {self.path}")
                v, path = newest
            else:
                v = version
                path = next((p for pv, p in self.versions() if pv == version), None)
                if path is None:
                    raise FileNotFoundError(f"version {version} is not published in {self.path}")
            try:
                meta = self.metadata(path)
                tensors = load_file(str(path))
            except FileNotFoundError:
                if version is not None:
                    raise
                continue
            except OSError as exc:
                if exc.errno == errno.ESTALE and version is None:
                    continue  # NFS: the file was replaced under us
                raise
            except Exception as exc:  # safetensors raises its own error types for bad files
                raise PayloadError(f"cannot read checkpoint {path}: {exc}") from exc
            kind = "full" if path.name.startswith("full-") else "sync"
            if meta.get("version") != str(v) or meta.get("kind", kind) != kind:
                raise PayloadError(f"checkpoint {path.name} holds version {meta.get('version')!r} "
                                   f"({meta.get('kind')!r}); its name says {v} ({kind}): refusing it")
            if target is not None:
                check_tensors_fit(target, tensors, f"checkpoint {path.name}")
            return v, tensors
        raise FileNotFoundError(f"checkpoints in {self.path} kept changing while loading")


def check_tensors_fit(target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Check that ``tensors`` can be written into ``target`` before anything is written.

    Every key of ``tensors`` must exist in ``target`` with the same shape; a floating-point
    tensor may arrive in another floating-point dtype (it is cast), an integer, bool or complex
    tensor must arrive in exactly the target's dtype. Keys of ``target`` that ``tensors`` lacks
    are fine (they are left alone). ``what`` names the source in the error (e.g. ``"checkpoint
    sync-000000000003.safetensors"``). Raises :class:`aiosync.errors.HandshakeError` naming the
    first key that does not fit (:class:`aiosync.errors.PayloadError` for a value that is not a
    tensor).
    """
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"{what}: {key!r} is a {type(value).__name__}, not a tensor")
        held = target.get(key)
        if held is None:
            raise HandshakeError(f"{what}: key {key!r} does not exist in the model")
        if tuple(held.shape) != tuple(value.shape):
            raise HandshakeError(f"{what}: {key!r} has shape {tuple(value.shape)}, the model has {tuple(held.shape)}")
        if value.dtype != held.dtype and not (value.dtype.is_floating_point and held.dtype.is_floating_point):
            raise HandshakeError(f"{what}: {key!r} is {dtype_name(value.dtype)}, the model holds "
                                 f"{dtype_name(held.dtype)} (only floating-point tensors may change dtype)")
