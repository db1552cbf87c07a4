"""Integrity checks of the syncers (B3, SPEC §7): checksums, bucket manifests, sessions.

* :func:`tensor_checksum` — CRC-32 of a tensor's raw bytes in row-major order. Used only when
  ``verify_checksums`` is on: the sender checksums the tensors a patch touches (from its
  snapshot, i.e. the result the receiver must hold), the receiver checksums them after
  writing and rolls back on a mismatch.
* :func:`bucket_checksum` — CRC-32 over every entry of a bucket (names, dtypes, shapes, bytes,
  metadata included), verified before the bucket is loaded.
* :func:`encode_manifest` / :func:`decode_manifest` — the names, shapes and dtypes of every
  bucket of one sync, carried by the first bucket so that the receiver can validate the
  whole sync before it loads anything.
* :func:`new_session` — a random id that ties a receiver's handshake, its bootstrap buckets
  and its patches together, so that a stale or duplicated payload of another handshake is
  refused instead of being applied to the wrong weights.
* :func:`drift_hash` — the drift check of ``flat`` patches (always on): a 64-bit hash of the
  old bits at a tensor's changed positions, O(changes). The numba kernels compute the same
  value (:func:`aiosync.syncers.kernels.flat.mix64`); see docs/wire-format.md.
* :func:`state_digest` / :func:`state_digests` — whole-state verification: a 64-bit digest of
  a tensor's values as a given dtype holds them (any device, any layout), a few GB/s per core
  off the GIL; per tensor, so a mismatch names the tensors, and additive over parts.

Checksums run on the patch hot path only when ``verify_checksums`` is on.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ...dtypes import dtype_name
from ...errors import PayloadError

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw_bytes(t: torch.Tensor):
    """A numpy byte view of ``t``'s elements in row-major order (copied to CPU if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    size = t.element_size()
    if size not in _BITS:
        raise PayloadError(f"cannot checksum a tensor of dtype {t.dtype}")
    return t.reshape(-1).view(_BITS[size]).numpy().view("uint8")


def tensor_checksum(t: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of ``t``'s raw bytes (row-major, any device, any layout), continuing ``value``."""
    return zlib.crc32(_raw_bytes(t), value)


def bucket_checksum(bucket: Mapping[str, torch.Tensor], skip: str) -> int:
    """CRC-32 over every entry of ``bucket`` but ``skip``, in sorted key order: each key, its
    dtype and shape, then its bytes. Independent of the dict's order (a transport may sort)."""
    crc = 0
    for key in sorted(k for k in bucket if k != skip):
        t = bucket[key]
        if not isinstance(t, torch.Tensor):
            raise PayloadError(f"bucket entry {key!r} is a {type(t).__name__}, not a tensor")
        head = f"{key}\x00{dtype_name(t.dtype)}\x00{tuple(t.shape)}\x00".encode()
        crc = zlib.crc32(head, crc)
        crc = tensor_checksum(t, crc)
    return crc


def checksum_tensor(values: list[int]) -> torch.Tensor:
    """Checksums as they travel: an int64 tensor."""
    return torch.tensor(values, dtype=torch.int64)


def read_checksums(t: Any, n: int, what: str, field: str = "checksums") -> list[int]:
    """Validate a received per-tensor int64 tensor (``checksums``, ``old_hashes``) of ``n``
    entries and return it as ints."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
        raise PayloadError(f"{what} {field} must be an int64 tensor")
    if t.numel() != n:
        raise PayloadError(f"{what} carries {t.numel()} {field} for {n} tensors (truncated or malformed)")
    return t.reshape(-1).tolist()


# ------------------------------------------------------------------ drift check
_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 math)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_torch(pos: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of ``pos × 0x9E3779B97F4A7C15 XOR bits`` on int64 tensors (the
    torch twin of :func:`aiosync.syncers.kernels.flat.mix64`)."""
    x = pos * _s64(GOLDEN) ^ bits
    x = x ^ _lsr(x, 30)
    x = x * _s64(MIX1)
    x = x ^ _lsr(x, 27)
    x = x * _s64(MIX2)
    return x ^ _lsr(x, 31)


def _sum64(x: torch.Tensor) -> int:
    """``Σ x mod 2**64`` of int64 bits, as a Python int in [0, 2**64)."""
    # sum the 32-bit halves separately: each sum fits an int64 (no signed overflow in the sum)
    lo = int((x & 0xFFFFFFFF).sum())
    hi = int(_lsr(x, 32).sum())
    return (lo + (hi << 32)) & _MASK64


def _mix_int(pos: int, bits: int) -> int:
    """:func:`_mix_torch` of one pair of Python ints (unsigned 64-bit)."""
    x = ((pos * GOLDEN) ^ bits) & _MASK64
    x ^= x >> 30
    x = (x * MIX1) & _MASK64
    x ^= x >> 27
    x = (x * MIX2) & _MASK64
    return x ^ (x >> 31)


def drift_hash(positions: torch.Tensor, old_bits: torch.Tensor) -> int:
    """``Σ mix(p, old) mod 2**64`` over a tensor's changes, as a signed int64 (how it travels).

    ``positions`` are row-major positions, ``old_bits`` the bit patterns (any integer dtype of
    the element's width, read unsigned) at them. ``mix`` is splitmix64's finaliser of
    ``p × 0x9E3779B97F4A7C15 XOR old``. Any device; O(len(positions)).
    """
    if positions.numel() == 0:
        return 0
    width = old_bits.element_size()
    old = old_bits.reshape(-1).to(torch.int64)
    if width < 8:
        old = old & ((1 << (8 * width)) - 1)
    return _s64(_sum64(_mix_torch(positions.reshape(-1).to(device=old.device, dtype=torch.int64), old)))


# ------------------------------------------------------------------ state digests
#: Elements digested per step (a multiple of 8, so every step starts on a whole 64-bit word).
DIGEST_CHUNK = 1 << 22


def state_digest(t: torch.Tensor, dtype: torch.dtype | None = None, *, via: torch.dtype | None = None) -> int:
    """A 64-bit digest of ``t``'s values as ``dtype`` (default: its own) holds them, as a signed
    int64 (how it travels).

    Definition: the values' raw bytes in row-major order (little-endian elements; complex as
    real and imaginary parts) are read as 64-bit little-endian words ``w_i``, the last one
    zero-padded; ``S = Σ mix(i, w_i) mod 2**64`` with ``mix`` the drift hash's splitmix64
    finaliser of ``i × 0x9E3779B97F4A7C15 XOR w_i``; the digest is ``mix(nbytes, S)``. Equal
    bits give equal digests whatever the device or layout; a single flipped bit changes it. ``S``
    is additive: parts of a tensor (chunks, shards at 8-byte boundaries) digest separately and
    add up.

    ``dtype``: cast first (floating tensors; the cast the syncers use: torch's, fp32 → bf16 fused
    on CPU with the same rounding and NaN rule). ``via``: a floating tensor travels in this dtype
    first (a bucket's ``bucket_dtype``), then is cast to ``dtype``. Conjugate and negative views
    are read by value. CPU tensors are digested by a numba kernel (several GB/s, GIL released),
    other devices with torch ops, a chunk at a time (bounded scratch memory).
    """
    from ..kernels.warmup import digest_ready

    kernels = digest_ready()  # until they load (cold start), the torch path: the same digests
    t = t.detach().resolve_conj().resolve_neg()
    dtype = t.dtype if dtype is None else dtype
    chain = [d for d in (via if t.is_floating_point() else None, dtype) if d is not None]
    flat = t.contiguous().view(-1) if t.dim() else t.reshape(1)
    width = torch.empty(0, dtype=dtype).element_size()
    total, n = 0, flat.numel()
    for a in range(0, n, DIGEST_CHUNK):
        c, start = flat[a:a + DIGEST_CHUNK], a * width // 8
        if (kernels and c.is_cpu and c.dtype == torch.float32 and all(d == torch.bfloat16 for d in chain)
                and dtype != c.dtype):
            from ..kernels.digest import digest_fp32_as_bf16

            bits = c.view(torch.int32).numpy().view(np.uint32)
            bulk = bits.shape[0] - bits.shape[0] % 4  # the last few elements: padded apart (no copy of the chunk)
            total += int(digest_fp32_as_bf16(bits[:bulk], start))
            if bulk < bits.shape[0]:
                tail = np.zeros(4, np.uint32)
                tail[:bits.shape[0] - bulk] = bits[bulk:]
                total += int(digest_fp32_as_bf16(tail, start + bulk // 4))  # zeros cast to zero bits: the padding
            continue
        for d in chain:
            if c.dtype != d:
                c = c.to(d)
        c = torch.view_as_real(c) if c.is_complex() else c
        total += _digest_bytes(c.contiguous().reshape(-1).view(torch.uint8), start, kernels)
    return _s64(_mix_int(n * width, total & _MASK64))


def _digest_bytes(raw: torch.Tensor, start: int, kernels: bool) -> int:
    """``Σ mix(start + i, w_i)`` (not reduced) over the 64-bit words of a 1-D uint8 tensor, its
    last word zero-padded: the bulk in place (a copy only when it is not 8-byte aligned), the
    tail apart. CPU words by the numba kernel when ``kernels`` (loaded), else torch ops."""

    def words_sum(words: torch.Tensor, first: int) -> int:
        if words.is_cpu and kernels:
            from ..kernels.digest import digest_words

            return int(digest_words(words.numpy().view(np.uint64), first))
        pos = torch.arange(first, first + words.numel(), device=words.device, dtype=torch.int64)
        return _sum64(_mix_torch(pos, words))

    n = raw.numel()
    bulk, total = n - n % 8, 0
    if bulk:
        body = raw[:bulk] if raw.data_ptr() % 8 == 0 else raw[:bulk].clone()
        total += words_sum(body.view(torch.int64), start)
    if bulk < n:
        tail = raw.new_zeros(8)
        tail[:n - bulk] = raw[bulk:]
        total += words_sum(tail.view(torch.int64), start + bulk // 8)
    return total


def state_digests(state: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None,
                  dtypes: Mapping[str, torch.dtype] | None = None,
                  via: Mapping[str, torch.dtype | None] | None = None) -> dict[str, int]:
    """:func:`state_digest` of every key of ``keys`` (default: all), each in its ``dtypes[key]``
    (default: its own) and ``via[key]``. Reads only; run it in a worker thread."""
    dtypes, via = dtypes or {}, via or {}
    return {k: state_digest(state[k], dtypes.get(k), via=via.get(k)) for k in (state if keys is None else keys)}


# ------------------------------------------------------------------ manifests
def encode_manifest(buckets: list[list[tuple[str, torch.Size | tuple, torch.dtype]]]) -> torch.Tensor:
    """``[[(name, shape, dtype), ...] per bucket]`` → a uint8 tensor of UTF-8 JSON."""
    doc = [[[name, list(shape), dtype_name(dtype)] for name, shape, dtype in bucket]
           for bucket in buckets]
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_manifest(t: Any) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Invert :func:`encode_manifest`; anything malformed is a :class:`PayloadError`."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise PayloadError("the bucket manifest must be a uint8 tensor of JSON")
    try:
        doc = json.loads(t.reshape(-1).cpu().numpy().tobytes().decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise PayloadError(f"the bucket manifest is not valid JSON (corrupted or truncated): {exc}") from None
    out = []
    if not isinstance(doc, list) or not doc:
        raise PayloadError("the bucket manifest must list at least one bucket")
    seen: set[str] = set()
    for bucket in doc:
        if not isinstance(bucket, list):
            raise PayloadError("the bucket manifest is malformed: a bucket is not a list")
        entries = []
        for entry in bucket:
            ok = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                  and isinstance(entry[1], list) and isinstance(entry[2], str)
                  and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1]))
            if not ok:
                raise PayloadError(f"the bucket manifest has a malformed entry {str(entry)[:80]}")
            if entry[0] in seen:
                raise PayloadError(f"the bucket manifest names {entry[0]!r} twice")
            seen.add(entry[0])
            entries.append((entry[0], tuple(entry[1]), entry[2]))
        out.append(entries)
    return out


def new_session() -> int:
    """A random, non-zero 62-bit id for one handshake."""
    return (int.from_bytes(os.urandom(8), "little") >> 2) or 1
