"""A directory of version-stamped safetensors files (the CHECKPOINT sync method, T3 in part).

Files are named ``sync-<version>.safetensors`` (zero-padded, so names sort by version). A
file is published atomically: written to a temporary name in the same directory, flushed,
then renamed over its final name with :func:`os.replace`; a reader never sees a partial file.
After a publish, superseded sync files are removed. Files written with ``keep=True`` are
named ``full-<version>.safetensors`` and never removed.

All methods are blocking file I/O: call them through :func:`aiosync.aio.run_sync`.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import PayloadError, VersionError

_NAME = re.compile(r"^(sync|full)-(\d+)\.safetensors$")


@dataclass(eq=False)
class CheckpointDir:
    """Publish and discover version-stamped weight files in ``path`` (created if missing)."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

    def file_for(self, version: int, keep: bool = False) -> Path:
        if version < 0:
            raise VersionError(f"checkpoint versions are non-negative, got {version}")
        return self.path / f"{'full' if keep else 'sync'}-{version:012d}.safetensors"

    def versions(self) -> list[tuple[int, Path]]:
        """``(version, path)`` of every published file, oldest first."""
        found = []
        for entry in os.scandir(self.path):
            m = _NAME.match(entry.name)
            if m and entry.is_file():
                found.append((int(m.group(2)), Path(entry.path)))
        return sorted(found)

    def newest(self) -> tuple[int, Path] | None:
        """The newest published ``(version, path)``, or ``None`` when the directory is empty."""
        found = self.versions()
        return found[-1] if found else None

    def publish(self, state: Mapping[str, torch.Tensor], version: int, *, keep: bool = False) -> Path:
        """Write ``state`` as ``version`` atomically, then remove superseded sync files.

        ``version`` must be above every published one. Tensors are written from CPU copies;
        aliased (tied) tensors are written once per name.
        """
        newest = self.newest()
        if newest is not None and version <= newest[0]:
            raise VersionError(f"checkpoint version {version} is not above the newest published {newest[0]}")
        tensors = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}
        final = self.file_for(version, keep)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=self.path)
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
        self.remove_superseded(version)
        return final

    def remove_superseded(self, version: int) -> int:
        """Remove sync files older than ``version`` (``full-`` files stay); returns how many."""
        removed = 0
        for v, p in self.versions():
            if v < version and p.name.startswith("sync-"):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed += 1
        return removed

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Load ``version`` (default: the newest) into memory; returns ``(version, tensors)``.

        A newest file removed by a concurrent publish between discovery and open is retried
        with the new newest.
        """
        for _ in range(8):
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
                tensors = load_file(str(path))
            except FileNotFoundError:
                if version is not None:
                    raise
                continue
            except Exception as exc:  # safetensors raises its own error types for bad files
                raise PayloadError(f"cannot read checkpoint {path}: {exc}") from exc
            return v, tensors
        raise FileNotFoundError(f"checkpoints in {self.path} kept changing while loading")
