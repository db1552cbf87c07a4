"""One checkpoint file: its name, and writing and reading it with the digests of its tensors.

A file is a safetensors file (the format: an 8-byte little-endian header length, a JSON header
naming every tensor's dtype, shape and byte range, then the bytes). aiosync writes and reads it
itself rather than through the ``safetensors`` package, for three reasons the package cannot
serve: the digest of every tensor is computed from the trainer's values in the same pass that
writes them (one pass over memory, no second copy of the state); a write that fails raises the
OS error itself (``ENOSPC``, ``EFBIG``), not a message; and a reader gets tensors that own their
memory (the package maps the file, so a file changed in place later would change tensors
already checked). Any safetensors reader still reads the files.

The metadata of every file holds ``version``, ``kind`` (``sync`` | ``full``), ``run`` (the run
that wrote it), ``hold`` (the token of that run's hold on the directory), ``digest`` (the
algorithm: BLAKE3, 128 bits) and ``digests`` (JSON: key → hex digest of the tensor's dtype,
shape and bytes); a shard adds ``writer`` (``rank/world``) and ``slices``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dtypes import dtype_name
from ..errors import ChecksumError, PayloadError

#: ``sync-<version>.<run>.safetensors``, or one shard of several writers:
#: ``sync-<version>.<run>.w<rank>-of-<world>.safetensors`` (``full-`` for kept checkpoints)
NAME = re.compile(r"(sync|full)-([0-9]{1,19})\.([A-Za-z0-9_-]{1,64})(?:\.w([0-9]{1,6})-of-([0-9]{1,6}))?"
                  r"\.safetensors", re.ASCII)
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)
MAX_VERSION = 2**63 - 1
DIGEST = "blake3-128"
_HEADER_MAX = 100 << 20
_CHUNK = 16 << 20
_CODES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U16", "uint16"),
    ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("C64", "complex64")) if hasattr(torch, attr)}
_CODE_OF = {dtype: name for name, dtype in _CODES.items()}


@dataclass(frozen=True)
class FileName:
    """What a checkpoint file's name says."""

    kind: str
    version: int
    run: str
    rank: int = 0
    world: int = 1
    sharded: bool = False

    @classmethod
    def parse(cls, name: str) -> FileName | None:
        m = NAME.fullmatch(name)
        if not m or int(m.group(2)) > MAX_VERSION:
            return None
        if m.group(4) is None:
            return cls(m.group(1), int(m.group(2)), m.group(3))
        rank, world = int(m.group(4)), int(m.group(5))
        return cls(m.group(1), int(m.group(2)), m.group(3), rank, world, True) if rank < world else None

    def __str__(self) -> str:
        shard = f".w{self.rank:05d}-of-{self.world:05d}" if self.sharded else ""
        return f"{self.kind}-{self.version:012d}.{self.run}{shard}.safetensors"


def _bytes(t: torch.Tensor):
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _hasher(t: torch.Tensor):
    import blake3

    h = blake3.blake3()
    h.update(f"{_CODE_OF[t.dtype]}:{list(t.shape)}:".encode())
    return h


def tensor_digest(t: torch.Tensor) -> str:
    """The digest a checkpoint file carries for ``t`` (a contiguous CPU tensor): BLAKE3 of its
    dtype, shape and bytes, 128 bits, hex."""
    h = _hasher(t)
    h.update(_bytes(t))
    return h.hexdigest(length=16)


def write_file(fd: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` as a safetensors file to ``fd`` (an empty file), with ``metadata`` and
    the digest of every tensor, computed from the values as they are written. Raises the OS
    error of a failed write; the caller removes the file."""
    prepared = {}
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise PayloadError(f"checkpoint entry {key!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _CODE_OF:
            raise PayloadError(f"checkpoint entry {key!r}: dtype {dtype_name(t.dtype)} cannot be stored")
        prepared[key] = t.contiguous()

    def header(digests: Mapping[str, str]) -> bytes:
        head: dict = {"__metadata__": dict(metadata) | {"digest": DIGEST, "digests": json.dumps(digests)}}
        offset = 0
        for key, t in prepared.items():
            size = t.numel() * t.element_size()
            head[key] = {"dtype": _CODE_OF[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(head, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw

    placeholder = header({k: "0" * 32 for k in prepared})  # the digests have a fixed width
    with os.fdopen(os.dup(fd), "wb", buffering=0) as fh:
        _write_all(fh, placeholder)
        digests = {}
        for key, t in prepared.items():
            h, raw = _hasher(t), _bytes(t)
            for start in range(0, len(raw), _CHUNK):
                chunk = raw[start:start + _CHUNK]
                h.update(chunk)  # from the values being written, before they are written
                _write_all(fh, chunk)
            digests[key] = h.hexdigest(length=16)
        final = header(digests)
        assert len(final) == len(placeholder)
        fh.seek(0)
        _write_all(fh, final)
        fh.flush()
        os.fsync(fh.fileno())


def _write_all(fh, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = fh.write(view)
        if not n:
            raise OSError(errno.EIO, "short write")
        view = view[n:]


@contextlib.contextmanager
def regular_file(path: Path):
    """Open ``path`` without following a symbolic link and make sure it is a regular file;
    yields the open file (so a link or special file swapped in after a scan is never read)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symbolic link
            raise PayloadError(f"checkpoint {path} is a symbolic link; refusing to follow it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PayloadError(f"checkpoint {path} is not a regular file; refusing it")
    with os.fdopen(fd, "rb", buffering=0) as fh:
        yield fh


def _read_exact(fh, view, what: str) -> None:
    view = memoryview(view).cast("B")
    while view:
        n = fh.readinto(view)
        if not n:
            raise PayloadError(f"{what}: the file ends early (truncated)")
        view = view[n:]


def read_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read one file: its metadata and tensors (owning their memory). Every number of the
    header is checked before anything is allocated from it; digests are not checked here
    (:func:`verify`). A malformed file is a :class:`PayloadError` naming it."""
    what = f"checkpoint {path.name}"
    with regular_file(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        head = bytearray(8)
        _read_exact(fh, head, what)
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _HEADER_MAX):
            raise PayloadError(f"{what}: header of {n} bytes in a file of {size} bytes (truncated or not safetensors)")
        raw = bytearray(n)
        _read_exact(fh, raw, what)
        try:
            header = json.loads(bytes(raw))
        except ValueError as exc:
            raise PayloadError(f"{what}: unreadable header ({exc})") from None
        meta = header.pop("__metadata__", {}) if isinstance(header, dict) else None
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise PayloadError(f"{what}: the header is not a safetensors header")
        entries, end = [], 0
        for key, e in header.items():
            dtype = _CODES.get(e.get("dtype")) if isinstance(e, dict) else None
            shape, offsets = (e.get("shape"), e.get("data_offsets")) if isinstance(e, dict) else (None, None)
            if (dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2
                    or not all(type(v) is int and v >= 0 for v in shape + offsets)):
                raise PayloadError(f"{what}: malformed entry for {key!r}")
            numel = 1
            for v in shape:
                numel *= v
            if offsets[1] - offsets[0] != numel * dtype.itemsize:
                raise PayloadError(f"{what}: {key!r} has {offsets[1] - offsets[0]} bytes for shape {shape}")
            entries.append((offsets[0], offsets[1], key, dtype, shape))
        entries.sort()
        for begin, stop, key, _, _ in entries:
            if begin != end:
                raise PayloadError(f"{what}: the byte ranges of its tensors overlap or leave gaps (at {key!r})")
            end = stop
        if 8 + n + end != size:
            raise PayloadError(f"{what}: {size} bytes, its header describes {8 + n + end} (truncated or extended)")
        tensors = {}
        for _, _, key, dtype, shape in entries:
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                _read_exact(fh, _bytes(t), what)
            tensors[key] = t
    return meta, tensors


def verify(name: str, version: int, meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Check every tensor against the digest written with it: :class:`ChecksumError` naming the
    file, the tensor and the version on a mismatch (the file was damaged after it was written)."""
    if meta.get("digest") != DIGEST:
        raise PayloadError(f"checkpoint {name} (version {version}) carries no {DIGEST} digests "
                           f"(digest {meta.get('digest')!r}): not written by this aiosync; refused")
    try:
        digests = json.loads(meta.get("digests", ""))
    except ValueError:
        digests = None
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise PayloadError(f"checkpoint {name} (version {version}): its digest table does not list its tensors")
    for key, t in tensors.items():
        if tensor_digest(t) != digests[key]:
            raise ChecksumError(f"checkpoint {name} (version {version}): tensor {key!r} does not match the digest "
                                "written with it (the file was damaged after it was written); refused, nothing "
                                "applied")


def overlap(a: tuple, b: tuple) -> bool:
    """Whether two blocks ``(offset, shape)`` share an element."""
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def assemble(files: list[tuple[str, dict[str, torch.Tensor], dict[str, list]]]) -> dict[str, torch.Tensor]:
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
        if any(overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]) or \
                sum(p[4].numel() for p in pieces) != torch.Size(shape).numel():
            raise PayloadError(f"checkpoint of {key!r}: its {len(pieces)} slices overlap or leave gaps in {shape}")
        full = torch.empty(shape, dtype=first.dtype)
        for _, offset, size, _, t in pieces:
            full[tuple(slice(o, o + n) for o, n in zip(offset, size))].copy_(t)
        whole[key] = full
    return whole
