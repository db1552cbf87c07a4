""":class:`CheckpointDir`: a directory of version-stamped checkpoint files that one run owns.

The rules (``docs/distributed.md`` states them for users):

* **One run owns the directory.** The first publish takes the directory's hold for this run
  (:mod:`aiosync.checkpoints.hold`); a directory another live run holds is refused with
  :class:`~aiosync.errors.CheckpointHeldError` naming the holder, a stale hold is taken over.
  Every publish checks that this run still holds it (taken over, or the directory replaced:
  refused), and a file is put in place with :func:`os.link`, which never replaces an existing
  file: what is published is never overwritten.
* **Readers read the holder's files only.** A version exists once every writer's shard of the
  holding run is in (files carry the run id in their names and metadata): shards of two runs are
  never combined. Taking a hold over discards the incomplete versions of earlier runs; their
  complete sync files go once the new run published (kept ``full-`` files stay, and
  :meth:`CheckpointDir.load` of an explicit version finds them: what a resumed trainer loads).
* **Every file carries the digests of its tensors**, computed from the trainer's values as they
  are written, and every read checks them (:func:`aiosync.checkpoints.files.verify`): a
  damaged file is refused with an error naming it, the tensor and the version.
* A write that fails (``ENOSPC``, ``EFBIG``, ...) is a
  :class:`~aiosync.errors.CheckpointWriteError` naming the directory, the version and the OS
  error; nothing is left behind.

All methods are blocking file I/O: call them through :func:`aiosync.aio.run_sync`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointHeldError, CheckpointWriteError, ConfigError, PayloadError, VersionError
from ..pieces import local_pieces
from ..reclaim import drop_file_cache
from . import hold
from .fit import check_tensors_fit
from .files import MAX_VERSION, RUN_ID, FileName, assemble, read_file, verify, write_file

log = logging.getLogger("aiosync.checkpoints")

_TMP_PREFIX = ".tmp-"
_ASIDE_PREFIX = ".stranger-"
_MEMO = 64


@dataclass(frozen=True)
class _Entry:
    """The file(s) of one version of one run: one file, or the shards of ``world`` writers."""

    version: int
    kind: str
    run: str
    paths: tuple[Path, ...]
    world: int = 1


def _fsync_dir(path: Path) -> None:
    """Make a new name durable (best effort: not every platform / file system allows it)."""
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
    """Publish and discover version-stamped weight files in ``path`` (created if missing).

    ``run_id``: the run this handle publishes as (default: a fresh one at the first publish);
    the writers of one sharded trainer pass the same one (:func:`shared_run_id`).
    ``stale_after``: seconds without a publish after which a hold from another host counts as
    stale. ``join_timeout``: how long writer ``r`` > 0 waits for writer 0 to take the hold.
    """

    path: Path
    run_id: str | None = None
    stale_after: float = 1800.0
    join_timeout: float = 60.0
    #: The last files refused on reading (damaged, mislabelled): ``(file name, error)``, newest last.
    refused: list = field(default_factory=list, init=False)
    #: Files of earlier runs' incomplete versions this run removed when it took the hold.
    discarded: list = field(default_factory=list, init=False)
    _holder: hold.Holder | None = field(default=None, init=False, repr=False)
    _gen: int = field(default=0, init=False, repr=False)
    _last: int = field(default=-1, init=False, repr=False)
    _memo: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.run_id is not None and not (isinstance(self.run_id, str) and RUN_ID.fullmatch(self.run_id)):
            raise ConfigError(f"checkpoint run_id must be 1-64 letters, digits, '-' or '_', got {self.run_id!r}")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the checkpoint directory {self.path}: {exc}") from None

    # -- names and discovery -----------------------------------------------------------

    def file_for(self, version: int, keep: bool = False, writer: tuple[int, int] | None = None) -> Path:
        """The name this run gives ``version`` (``full-`` when ``keep``; writer ``(rank, world)``'s shard)."""
        if not 0 <= version <= MAX_VERSION:
            raise VersionError(f"checkpoint versions are non-negative integers up to 2**63 - 1, got {version}")
        if self.run_id is None:
            raise ValueError("this CheckpointDir has no run id yet (it takes one at its first publish)")
        rank, world = writer if writer is not None else (0, 1)
        return self.path / str(FileName("full" if keep else "sync", version, self.run_id, rank, world,
                                        writer is not None))

    def _groups(self) -> dict[tuple[int, str, str], dict[int, tuple[int, Path]]]:
        """Every checkpoint file, by ``(version, kind, run)``: ``rank -> (world, path)``."""
        groups: dict = {}
        for entry in os.scandir(self.path):
            name = FileName.parse(entry.name)
            if name is None:
                continue
            try:
                if not entry.is_file(follow_symlinks=False):  # a symlink may point anywhere: never read one
                    continue
            except OSError:  # removed while scanning
                continue
            groups.setdefault((name.version, name.kind, name.run), {})[name.rank] = (name.world, Path(entry.path))
        return groups

    @staticmethod
    def _complete(groups: dict) -> list[_Entry]:
        found = []
        for (version, kind, run), ranks in groups.items():
            worlds = {w for w, _ in ranks.values()}
            if len(worlds) == 1 and len(ranks) == next(iter(worlds)):
                found.append(_Entry(version, kind, run, tuple(ranks[r][1] for r in sorted(ranks)), len(ranks)))
        return sorted(found, key=lambda e: (e.version, e.kind))

    def holder(self) -> str | None:
        """The run id of the run holding the directory (``None``: nobody)."""
        _, holder, _ = hold.current(self.path)
        return None if holder is None else holder.run

    def _scan(self) -> list[_Entry]:
        """The holding run's complete versions, oldest first."""
        run = self.holder()
        return [e for e in self._complete(self._groups()) if e.run == run] if run is not None else []

    def versions(self, kind: str | None = None) -> list[tuple[int, Path]]:
        """``(version, path)`` of every complete version of the holding run, oldest first (the first
        shard's path); ``kind``: ``sync`` or ``full`` to list only those."""
        return [(e.version, e.paths[0]) for e in self._scan() if kind is None or e.kind == kind]

    def newest(self) -> tuple[int, Path] | None:
        """The newest published ``(version, path)``, or ``None``."""
        found = self.versions()
        return found[-1] if found else None

    def newest_version(self) -> int | None:
        """The newest published version, or ``None``."""
        newest = self.newest()
        return None if newest is None else newest[0]

    # -- the hold --------------------------------------------------------------------------

    def hold(self, writer: tuple[int, int] | None = None) -> str:
        """Hold the directory for this run (writer 0: take it, or take a stale hold over; writer
        ``r`` > 0: join writer 0's hold of this run, waiting at most ``join_timeout``); returns
        the run id. Called by the first :meth:`publish`; checked again by every later one."""
        rank, world = writer if writer is not None else (0, 1)
        if self._holder is not None and (self._holder.rank, self._holder.writers) != (rank, world):
            raise ValueError(f"this CheckpointDir publishes as writer {self._holder.rank} of {self._holder.writers}, "
                             f"not {rank} of {world}: use one CheckpointDir per writer")
        if self.run_id is None:
            if world > 1:
                raise ConfigError(f"writer {rank} of {world}: every writer of a sharded trainer publishes with the same "
                                  "run id; pass CheckpointDir(path, run_id=...) (make one with "
                                  "aiosync.checkpoints.shared_run_id() on every rank)")
            self.run_id = hold.new_run_id()
        holds = hold.scan(self.path)
        gen, cur, _ = hold.current(self.path, holds)
        if self._holder is not None:
            slot = holds.get((gen, rank))
            ours = cur is not None and cur.run == self.run_id
            if ours and slot is not None and (cur.token == self._holder.token if rank == 0 else gen == self._gen):
                hold.touch(slot)
                return self.run_id
            if cur is not None and (rank == 0 or not ours):
                raise CheckpointHeldError(
                    f"checkpoint directory {self.path} is now held by {cur.describe(holds[(gen, 0)], None)}; this run "
                    f"({self.run_id!r}) no longer holds it (it was taken over, or the directory was replaced): "
                    "nothing published", directory=str(self.path), holder=vars(cur))
            if cur is None:
                log.warning("aiosync: the hold of run %r on %s is gone (the directory was replaced or its hold "
                            "removed): holding it again", self.run_id, self.path)
            self._holder = None
        if rank == 0:
            self._take(world)
        else:
            self._join(rank, world)
        return self.run_id

    def release(self) -> None:
        """The run ended: mark its hold released. Its files stay the directory's versions for
        readers; the next run takes the directory over without waiting for this process to end.
        A later :meth:`publish` of this handle holds the directory again (if no run took it)."""
        if self._holder is None or self._holder.rank != 0:
            return
        path = self.path / hold.hold_name(self._gen)
        _, cur, _ = hold.current(self.path)
        if cur is not None and cur.token == self._holder.token:
            with contextlib.suppress(OSError):
                hold.release(path, self._holder)
        self._holder = None

    def _take(self, world: int) -> None:
        for _ in range(100):
            holds = hold.scan(self.path)
            gen, cur, beat = hold.current(self.path, holds)
            if gen and cur is None and beat is not None and time.time() - beat < 10:
                time.sleep(0.05)  # a hold file being written: read it again
                continue
            if cur is not None and not cur.gone(beat, self.stale_after):
                same = " (the same run id: two launches of one run?)" if cur.run == self.run_id else ""
                raise CheckpointHeldError(
                    f"checkpoint directory {self.path} is held by {cur.describe(holds[(gen, 0)], beat)}{same}; one "
                    f"run owns a directory: give this run ({self.run_id!r}) its own checkpoint_dir, or stop that run "
                    f"(its hold is taken over once its process is gone, or {self.stale_after:g}s after its last "
                    "publish when it runs on another host)", directory=str(self.path), holder=vars(cur))
            groups = self._groups()
            earlier = [e.version for e in self._complete(groups) if cur is None or e.run == cur.run]
            floor = max([self._last, -1 if cur is None else cur.floor] + earlier)
            me = hold.Holder.me(self.run_id, world, 0, floor)
            if hold.create(self.path, gen + 1, me):
                break
        else:
            raise CheckpointHeldError(f"checkpoint directory {self.path}: could not take its hold (it kept changing)",
                                      directory=str(self.path))
        self._holder, self._gen = me, gen + 1
        if cur is not None:
            log.warning("aiosync: run %r took over %s from run %r (%s)", self.run_id, self.path, cur.run,
                        f"pid {cur.pid} on {cur.host}, gone")
        for (g, _), path in holds.items():
            if g < self._gen:
                with contextlib.suppress(OSError):
                    path.unlink()
        for (version, kind, run), ranks in groups.items():  # earlier runs' incomplete versions
            worlds = {w for w, _ in ranks.values()}
            if run != self.run_id and not (len(worlds) == 1 and len(ranks) == next(iter(worlds))):
                for _, path in ranks.values():
                    with contextlib.suppress(OSError):
                        path.unlink()
                        self.discarded.append(path.name)
                        log.warning("aiosync: removed %s: an incomplete version of an earlier run (%r)", path, run)

    def _join(self, rank: int, world: int) -> None:
        deadline, pause = time.monotonic() + self.join_timeout, 0.01
        while True:
            holds = hold.scan(self.path)
            gen, cur, beat = hold.current(self.path, holds)
            if cur is not None and cur.run == self.run_id and cur.writers == world:
                break
            if time.monotonic() >= deadline:
                held = "nobody" if cur is None else cur.describe(holds[(gen, 0)], beat)
                raise CheckpointHeldError(
                    f"writer {rank} of {world} of run {self.run_id!r}: checkpoint directory {self.path} is held by "
                    f"{held}, not by writer 0 of this run, after {self.join_timeout:g}s; writer 0 takes the hold at "
                    "its first publish (same run_id and checkpoint_writers on every rank)", directory=str(self.path),
                    holder=None if cur is None else vars(cur))
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        me = hold.Holder.me(self.run_id, world, rank, cur.floor)
        if not hold.create(self.path, gen, me):
            slot = self.path / hold.hold_name(gen, rank)
            got = hold.read(slot)
            if got is not None and not got[0].gone(got[1], self.stale_after):
                raise CheckpointHeldError(
                    f"checkpoint directory {self.path}: writer {rank} of run {self.run_id!r} is already held by "
                    f"{got[0].describe(slot, got[1])}", directory=str(self.path), holder=vars(got[0]))
            with contextlib.suppress(FileNotFoundError):
                slot.unlink()
            if not hold.create(self.path, gen, me):
                raise CheckpointHeldError(f"checkpoint directory {self.path}: writer {rank} of run {self.run_id!r} "
                                          "was taken by another process meanwhile", directory=str(self.path))
        self._holder, self._gen = me, gen

    # -- publishing ------------------------------------------------------------------------

    def publish(self, state: Mapping[str, Any], version: int, *, keep: bool = False,
                writer: tuple[int, int] | None = None) -> Path:
        """Write ``state`` as ``version`` atomically, then remove superseded sync files.

        The first publish holds the directory for this run (:meth:`hold`). ``version`` must be
        above every version this run and the runs before it published. ``keep=True`` writes a
        full checkpoint (``full-``) that is never removed. ``writer=(rank, world)``: this is one
        of ``world`` writers; it writes its shard of ``state`` (DTensors: the local shard;
        :class:`TensorSlice`: that slice; plain tensors: writer 0 only), and the version is
        published once every writer's shard is in. Tensors are written as they are (GPU ones
        through a CPU copy): do not change them while this runs.
        """
        if writer is not None:
            rank, world = writer
            if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world <= 99_999):
                raise ValueError(f"writer must be (rank, world) with 0 <= rank < world, got {writer!r}")
        if not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
            raise VersionError(f"checkpoint versions are non-negative integers up to 2**63 - 1, got {version!r}")
        try:
            self.hold(writer)
        except OSError as exc:
            raise self._write_error(version, exc) from exc
        floor = max(self._holder.floor, self._last)
        if version <= floor:
            raise VersionError(
                f"cannot publish checkpoint version {version} in {self.path}: it is not above the newest "
                f"published {floor} (by this run or an earlier run of this directory). Use an empty directory, or "
                f"attach the trainer with version= above {floor}.")
        final = self.file_for(version, keep, writer)
        if writer is None:
            tensors, meta = dict(state), {}
        else:
            tensors, slices = local_pieces(state, writer[0])
            meta = {"writer": f"{writer[0]}/{writer[1]}", "slices": json.dumps(slices)}
        meta |= {"version": str(version), "kind": "full" if keep else "sync", "run": self.run_id,
                 "hold": self._holder.token}
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".safetensors", dir=self.path)
        except OSError as exc:
            raise self._write_error(version, exc) from exc
        try:
            try:
                write_file(fd, tensors, meta)
            finally:
                os.close(fd)
            self._link(tmp, final)
        except OSError as exc:
            raise self._write_error(version, exc) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(self.path)
        self._last = max(self._last, version)
        newest = self.newest_version()  # complete (all shards in); never above what this run published
        if newest is not None:
            self.remove_superseded(min(newest, version))
        return final

    def _write_error(self, version: int, exc: OSError) -> CheckpointWriteError:
        code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        return CheckpointWriteError(f"cannot write checkpoint version {version} to {self.path}: "
                                    f"{exc.strerror or exc}{f' ({code})' if code else ''}; nothing was published",
                                    errno=exc.errno, directory=str(self.path), version=version)

    def _link(self, tmp: str, final: Path) -> None:
        """Give the written file its final name without ever replacing a file: a name that is
        taken (this run never published it: a stranger) is moved aside first, kept, logged."""
        try:
            os.link(tmp, final)
            return
        except FileExistsError:
            pass
        aside = self.path / f"{_ASIDE_PREFIX}{final.name}.{hold.new_run_id()}"
        os.rename(final, aside)
        log.warning("aiosync: %s was there before this run published it (a file this run did not write): moved "
                    "aside to %s", final, aside.name)
        os.link(tmp, final)

    def remove_superseded(self, version: int) -> int:
        """Remove sync files (and shards) of versions older than ``version``, of this run and of
        earlier ones, complete or not (``full-`` files stay); returns how many."""
        removed = 0
        for entry in os.scandir(self.path):
            name = FileName.parse(entry.name)
            if name is not None and name.kind == "sync" and name.version < version:
                drop_file_cache(entry.path)  # in pieces: deleting frees it all in one kernel call (L1)
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

    # -- reading ---------------------------------------------------------------------------

    def metadata(self, path: Path) -> dict[str, str]:
        """The metadata stored in one file (``version``, ``kind``, ``run``, digests, ...)."""
        return read_file(Path(path))[0]

    def load(self, version: int | None = None, *, target: Mapping[str, torch.Tensor] | None = None
             ) -> tuple[int, dict[str, torch.Tensor]]:
        """Load ``version`` (default: the newest) of the holding run; returns ``(version, tensors)``.

        An explicit ``version`` the holding run does not have is looked for among the kept
        (``full-``) files of earlier runs (what a resumed trainer loads). Every file is checked
        (metadata against its name, digests; :class:`aiosync.errors.PayloadError` /
        :class:`aiosync.errors.ChecksumError` naming the file); shards are put back together.
        A newest file removed by a concurrent publish is retried with the new newest. With
        ``target`` (the model's tensors by name) they are checked with :func:`check_tensors_fit`.
        """
        for _ in range(16):
            entries = self._scan()
            if version is None:
                if not entries:
                    raise FileNotFoundError(f"no published checkpoint in {self.path}")
                entry = entries[-1]
            else:
                entry = next((e for e in reversed(entries) if e.version == version), None) or next(
                    (e for e in self._complete(self._groups()) if e.version == version and e.kind == "full"), None)
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

    def read_newest(self, above: int | None = None, *, target: Mapping[str, Any] | None = None
                    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version above ``above`` that reads and verifies, or ``None``: what a reader
        that follows the directory applies. A file that is refused (damaged, mislabelled) is
        skipped for the next newest, logged once and kept in :attr:`refused`; it is not read
        again unless it changes. A version that does not fit ``target`` raises
        :class:`~aiosync.errors.HandshakeError` (a wrong model, not a damaged file)."""
        for entry in reversed(self._scan()):
            if above is not None and entry.version <= above:
                return None
            try:
                sig = tuple((p.name, s.st_ino, s.st_size, s.st_mtime_ns) for p in entry.paths for s in [p.stat()])
            except OSError:
                continue  # removed since the scan
            if sig in self._memo:
                continue
            try:
                tensors = self._read(entry)
            except PayloadError as exc:
                self._memo[sig] = exc
                while len(self._memo) > _MEMO:
                    self._memo.pop(next(iter(self._memo)))
                self.refused = (self.refused + [(entry.paths[0].name, exc)])[-_MEMO:]
                log.warning("aiosync: %s", exc)
                continue
            except OSError:
                continue  # removed or replaced while reading (NFS: ESTALE)
            if target is not None:
                check_tensors_fit(target, tensors, f"checkpoint {entry.paths[0].name}")
            return entry.version, tensors
        return None

    def _read(self, entry: _Entry) -> dict[str, torch.Tensor]:
        files = []
        for rank, path in enumerate(entry.paths):
            try:
                meta, tensors = read_file(path)
            except (FileNotFoundError, PayloadError):
                raise
            except OSError as exc:
                if exc.errno == errno.ESTALE:
                    raise
                raise PayloadError(f"cannot read checkpoint {path}: {exc}") from exc
            said = (meta.get("version"), meta.get("kind"), meta.get("run"))
            if said != (str(entry.version), entry.kind, entry.run):
                raise PayloadError(f"checkpoint {path.name} holds version {said[0]!r} ({said[1]!r}) of run {said[2]!r}; "
                                   f"its name says {entry.version} ({entry.kind}) of run {entry.run!r}: refusing it")
            verify(path.name, entry.version, meta, tensors)
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
        return assemble(files)
