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

**Several writers** (the ranks of a sharded trainer, e.g. FSDP2) publish one version together:
each writes its own shard, ``sync-<version>.w<rank>-of-<world>.safetensors``, with
``publish(..., writer=(rank, world))``, and the version exists for readers only once all
``world`` shards are in. A shard holds whole tensors and *slices* of tensors (a DTensor's local
shard, or a :class:`TensorSlice` for other layouts) with their offset in the full tensor; the
loader puts the slices back together, refusing overlaps, gaps and a key written twice.
Superseded files are removed only below the newest complete version, so a reader always finds
one.

Readers may be anywhere: a newest file removed by a concurrent publish between discovery and
open (or a stale NFS handle) is retried with the new newest.

All methods are blocking file I/O: call them through :func:`aiosync.aio.run_sync`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from .dtypes import dtype_name
from .errors import HandshakeError, PayloadError, VersionError
from .pieces import TensorSlice, local_pieces

__all__ = ["CheckpointDir", "TensorSlice", "check_tensors_fit"]

#: ``sync-<version>.safetensors`` or, one shard of several writers, ``sync-<version>.w<rank>-of-<world>.safetensors``
_NAME = re.compile(r"(sync|full)-([0-9]{1,19})(?:\.w([0-9]{1,6})-of-([0-9]{1,6}))?\.safetensors", re.ASCII)
_TMP_PREFIX = ".tmp-"
_MAX_VERSION = 2**63 - 1


@dataclass(frozen=True)
class _Entry:
    """The file(s) of one published version: one file, or the shards of ``world`` writers."""

    version: int
    kind: str
    paths: tuple[Path, ...]
    world: int = 1


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two blocks ``(offset, shape)`` share an element."""
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def _assemble(files: list[tuple[str, dict[str, torch.Tensor], dict[str, list]]]) -> dict[str, torch.Tensor]:
    """Put the shards of one version together; every piece is checked before it is copied."""
    whole: dict[str, torch.Tensor] = {}
    parts: dict[str, list] = {}
    for name, tensors, slices in files:
        for key, t in tensors.items():
            if key in whole or (key in parts and key not in slices):
                raise PayloadError(f"checkpoint shard {name}: {key!r} is also written whole by another shard")
            if key not in slices:
                whole[key] = t
                continue
            offset, shape = slices[key]
            if (not isinstance(offset, list) or not isinstance(shape, list) or len(offset) != t.dim()
                    or len(shape) != t.dim() or not all(isinstance(v, int) and v >= 0 for v in offset + shape)
                    or any(o + n > s for o, n, s in zip(offset, t.shape, shape))):
                raise PayloadError(f"checkpoint shard {name}: the slice of {key!r} (offset {offset}, "
                                   f"{tuple(t.shape)}) does not fit its full shape {shape}")
            parts.setdefault(key, []).append((name, tuple(offset), tuple(t.shape), tuple(shape), t))
    for key, pieces in parts.items():
        name, _, _, shape, first = pieces[0]
        if key in whole or any(p[3] != shape or p[4].dtype != first.dtype for p in pieces):
            raise PayloadError(f"checkpoint shard {name}: the shards disagree on {key!r} (shape, dtype, or "
                               "written whole too)")
        boxes = [(p[1], p[2]) for p in pieces]
        if any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]) or \
                sum(p[4].numel() for p in pieces) != torch.Size(shape).numel():
            raise PayloadError(f"checkpoint of {key!r}: its {len(pieces)} slices overlap or leave gaps in {shape}")
        full = torch.empty(shape, dtype=first.dtype)
        for _, offset, size, _, t in pieces:
            full[tuple(slice(o, o + n) for o, n in zip(offset, size))].copy_(t)
        whole[key] = full
    return whole


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

    def file_for(self, version: int, keep: bool = False, writer: tuple[int, int] | None = None) -> Path:
        """The final name of ``version`` (``full-`` when ``keep``; writer ``(rank, world)``'s shard)."""
        if not 0 <= version <= _MAX_VERSION:
            raise VersionError(f"checkpoint versions are non-negative integers up to 2**63 - 1, got {version}")
        shard = "" if writer is None else f".w{writer[0]:05d}-of-{writer[1]:05d}"
        return self.path / f"{'full' if keep else 'sync'}-{version:012d}{shard}.safetensors"

    def _scan(self) -> list[_Entry]:
        """Every published version with all its files in, oldest first."""
        groups: dict[tuple[int, str], dict[int, tuple[int, Path]]] = {}
        for entry in os.scandir(self.path):
            m = _NAME.fullmatch(entry.name)
            if not m or int(m.group(2)) > _MAX_VERSION:
                continue
            try:
                if not entry.is_file(follow_symlinks=False):  # a symlink may point anywhere: never read one
                    continue
            except OSError:  # removed while scanning
                continue
            rank, world = (0, 1) if m.group(3) is None else (int(m.group(3)), int(m.group(4)))
            if rank < world:
                groups.setdefault((int(m.group(2)), m.group(1)), {})[rank] = (world, Path(entry.path))
        found = []
        for (version, kind), ranks in groups.items():
            worlds = {w for w, _ in ranks.values()}
            if len(worlds) == 1 and len(ranks) == next(iter(worlds)):
                found.append(_Entry(version, kind, tuple(ranks[r][1] for r in sorted(ranks)), len(ranks)))
        return sorted(found, key=lambda e: (e.version, e.kind))

    def versions(self, kind: str | None = None) -> list[tuple[int, Path]]:
        """``(version, path)`` of every published version, oldest first (for several writers:
        complete versions only, with the first shard's path); ``kind``: ``sync`` or ``full`` to
        list only those."""
        return [(e.version, e.paths[0]) for e in self._scan() if kind is None or e.kind == kind]

    def newest(self) -> tuple[int, Path] | None:
        """The newest published ``(version, path)``, or ``None`` when the directory is empty."""
        found = self.versions()
        return found[-1] if found else None

    def newest_version(self) -> int | None:
        """The newest published version, or ``None``."""
        newest = self.newest()
        return None if newest is None else newest[0]

    def publish(self, state: Mapping[str, Any], version: int, *, keep: bool = False,
                writer: tuple[int, int] | None = None) -> Path:
        """Write ``state`` as ``version`` atomically, then remove superseded sync files.

        ``version`` must be above every published one. Tensors are written from CPU copies;
        aliased (tied) tensors are written once per name. ``keep=True`` writes a full
        checkpoint (``full-<version>``) that is never removed. ``writer=(rank, world)``: this is
        one of ``world`` writers; it writes its shard of ``state`` (DTensors: the local shard;
        :class:`TensorSlice`: that slice; plain tensors: writer 0 only), and the version is
        published once every writer's shard is in.
        """
        if writer is not None:
            rank, world = writer
            if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world <= 99_999):
                raise ValueError(f"writer must be (rank, world) with 0 <= rank < world, got {writer!r}")
        newest = self.newest()
        if newest is not None and version <= newest[0]:
            raise VersionError(
                f"cannot publish checkpoint version {version} in {self.path}: it is not above the newest "
                f"published {newest[0]} ({newest[1].name}). The directory already holds files of another "
                f"(earlier) run. Use an empty directory, remove the old files, or attach the trainer with "
                f"version= above {newest[0]}.")
        final = self.file_for(version, keep, writer)
        if writer is None:
            tensors, meta = state, {}
        else:
            tensors, slices = local_pieces(state, writer[0])
            meta = {"writer": f"{writer[0]}/{writer[1]}", "slices": json.dumps(slices)}
        check_storable(tensors)
        tensors = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}
        meta |= {"version": str(version), "kind": "full" if keep else "sync"}
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".safetensors", dir=self.path)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.path)
        newest = self.newest_version()
        if newest is not None:
            self.remove_superseded(newest)
        return final

    def remove_superseded(self, version: int) -> int:
        """Remove sync files (and shards) of versions older than ``version``, complete or not
        (``full-`` files stay); returns how many."""
        removed = 0
        for entry in os.scandir(self.path):
            m = _NAME.fullmatch(entry.name)
            if m and m.group(1) == "sync" and int(m.group(2)) < version:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
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

        The shards of several writers are put back together. A newest file removed by a
        concurrent publish between discovery and open is retried with the new newest. A file
        whose metadata does not match its name is refused with
        :class:`aiosync.errors.PayloadError`. With ``target`` (the model's tensors by name), the
        file's tensors are checked against it with :func:`check_tensors_fit`
        (:class:`aiosync.errors.HandshakeError` naming the file and the key); nothing is written.
        """
        for _ in range(16):
            entries = self._scan()
            if version is None:
                if not entries:
                    raise FileNotFoundError(f"no published checkpoint in {self.path}")
                entry = entries[-1]
            else:
                entry = next((e for e in reversed(entries) if e.version == version), None)
                if entry is None:
                    raise FileNotFoundError(f"version {version} is not published in {self.path}")
            try:
                tensors = self._read(entry)
            except FileNotFoundError:
                if version is not None:
                    raise
                continue
            except OSError as exc:
                if exc.errno == errno.ESTALE and version is None:
                    continue  # NFS: the file was replaced under us
                raise
            if target is not None:
                check_tensors_fit(target, tensors, f"checkpoint {entry.paths[0].name}")
            return entry.version, tensors
        raise FileNotFoundError(f"checkpoints in {self.path} kept changing while loading")

    def _read(self, entry: _Entry) -> dict[str, torch.Tensor]:
        files = []
        for rank, path in enumerate(entry.paths):
            try:
                with _regular_file(path) as name:  # the file scanned, never what a link swapped in points to
                    with safe_open(name, framework="pt") as fh:
                        meta = dict(fh.metadata() or {})
                        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            except (FileNotFoundError, PayloadError):
                raise
            except OSError as exc:
                if exc.errno == errno.ESTALE:
                    raise
                raise PayloadError(f"cannot read checkpoint {path}: {exc}") from exc
            except Exception as exc:  # safetensors raises its own error types for bad files
                raise PayloadError(f"cannot read checkpoint {path}: {exc}") from exc
            if meta.get("version") != str(entry.version) or meta.get("kind", entry.kind) != entry.kind:
                raise PayloadError(f"checkpoint {path.name} holds version {meta.get('version')!r} "
                                   f"({meta.get('kind')!r}); its name says {entry.version} ({entry.kind}): refusing it")
            if entry.world == 1 and "writer" not in meta:
                return tensors
            if meta.get("writer") != f"{rank}/{entry.world}":
                raise PayloadError(f"checkpoint {path.name} says it is writer {meta.get('writer')!r}; its name says "
                                   f"{rank}/{entry.world}: refusing it")
            try:
                slices = json.loads(meta.get("slices", "{}"))
            except ValueError as exc:
                raise PayloadError(f"checkpoint {path.name}: unreadable slice table ({exc})") from None
            if not isinstance(slices, dict) or not set(slices) <= set(tensors):
                raise PayloadError(f"checkpoint {path.name}: its slice table does not match its tensors")
            files.append((path.name, tensors, slices))
        return _assemble(files)

@contextlib.contextmanager
def _regular_file(path: Path):
    """Open ``path`` without following a symbolic link and make sure it is a regular file, then
    yield a name that reads exactly the opened file (``/proc/self/fd/N`` where the platform has
    it), so a link or a special file swapped in after the directory was scanned is never read."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symbolic link
            raise PayloadError(f"checkpoint {path} is a symbolic link; refusing to follow it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PayloadError(f"checkpoint {path} is not a regular file; refusing it")
        by_fd = f"/proc/self/fd/{fd}"
        yield by_fd if os.path.exists(by_fd) else str(path)
    finally:
        os.close(fd)


@functools.cache
def _storable(dtype: torch.dtype) -> bool:
    """Whether safetensors can store ``dtype`` (probed once per dtype with an empty tensor)."""
    try:
        save({"x": torch.empty(0, dtype=dtype)})
    except (KeyError, ValueError, TypeError):
        return False
    return True


def check_storable(tensors: Mapping[str, Any]) -> None:
    """Every tensor's dtype can be written to a safetensors file, or a
    :class:`aiosync.errors.HandshakeError` names the first key that cannot (e.g. complex128),
    before anything is written."""
    for key, t in tensors.items():
        if isinstance(t, torch.Tensor) and not _storable(t.dtype):
            raise HandshakeError(f"checkpoint files cannot hold {key!r}: safetensors has no dtype {dtype_name(t.dtype)}; "
                                 "use synchronizer.method memory or nccl, or leave the key out of param_names")


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
