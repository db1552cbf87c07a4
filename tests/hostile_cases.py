"""Genuine payloads, hostile variants of them, and the subprocess entry points of the hostile-input
tests (``test_hostile.py``, ``test_fuzz_crash.py``).

Run as a script it is the child process those tests start, so that a crash (a segfault in a
kernel, an abort) or a memory blow-up shows in the child and is reported, never taking pytest
down with it::

    python tests/hostile_cases.py memory bombs       # peak-memory probe: JSON on stdout
    python tests/hostile_cases.py memory declared
    python tests/hostile_cases.py fuzz patch 200 0    # fuzz target, examples, seed: JSON summary

``NUMBA_BOUNDSCHECK=1`` in the child's environment compiles every numba kernel with bounds
checks, so an out-of-range index in a kernel raises instead of reading or writing past an array.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import sys
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aiosync.errors import AiosyncError  # noqa: E402
from aiosync.syncers import BucketWeightSyncer, PatchWeightSyncer  # noqa: E402
from aiosync.syncers.common.payloads import CompressedWeightPatch, WeightPatch  # noqa: E402
from aiosync.transports.inproc import inproc_pair  # noqa: E402
from helpers import recv_from  # noqa: E402,F401 - also used by test_fuzz through this module

#: Documented in docs/guarantees.md: a payload can raise a receiver's peak memory by at most
#: PER_CHANGE bytes per changed element it declares, plus FIXED.
PER_CHANGE = 160
FIXED = 48 << 20

PATCH_FORMATS = [(e, c) for e in ("coo", "flat", "ctx") for c in ("none", "zstd")]


def state(v: int, big: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = {"w": torch.randn(12, 20, generator=g), "b": torch.randn(20, generator=g),
            "c": torch.randn(3, 4, 5, generator=g), "s": torch.randn((), generator=g)}
    out = {k: t + 0.5 * v * (torch.arange(t.numel()).reshape(t.shape) % 3 == v % 3) for k, t in base.items()}
    if big:  # a large tensor of which a genuine patch changes a few elements
        out["big"] = torch.randn(big, generator=g) + 0.5 * v * (torch.arange(big) % 65537 == v)
    out["n"] = torch.tensor([v, 2 * v, -v], dtype=torch.int64)
    out["m"] = torch.tensor([v % 2 == 0, True, v % 3 == 0])
    return out


def receiver_model(v: int = 0, big: int = 0) -> dict[str, torch.Tensor]:
    return {k: (t.to(torch.bfloat16) if k == "w" else t.clone()) for k, t in state(v, big).items()}


def prepared_patch(encoding: str, compression: str, big: int = 0, checksums: bool = False):
    """A receiver at version 1, its model, the genuine patch to version 2 and the model it gives
    (``checksums``: patches carry them and the receiver requires them)."""

    async def run():
        kw = dict(encoding=encoding, compression=compression, init_sync_enabled=True, recv_timeout=5,
                  verify_checksums=checksums)
        s, r = PatchWeightSyncer(**kw), PatchWeightSyncer(**kw)
        a, b = inproc_pair(timeout=5)
        dst = receiver_model(0, big)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.init_sender, state(0, big), None, a.send, a.recv)
            await r.init_receiver(dst, b.recv, b.send)
        await s.sync(state(1, big), a.send, 1)
        await r.apply(dst, b.recv)
        await s.sync(state(2, big), a.send, 2)
        patch = await b.recv()
        after = {k: v.clone() for k, v in dst.items()}
        await r.apply_payload(after, patch)
        r.version = 1
        return r, dst, patch, after

    return anyio.run(run)


def genuine_buckets(checksums: bool = True) -> list:
    async def run():
        s = BucketWeightSyncer(bucket_size=300, verify_checksums=checksums)
        await s.init_sender(state(1), None, None)
        sent = []

        async def collect(p):
            sent.append(p)

        await s.sync(state(1), collect, 1)
        return sent

    return anyio.run(run)


def genuine_handshake(checksums: bool = False):
    """The messages of one genuine patch handshake with a bootstrap: metadata, answer, buckets
    (``checksums``: with ``verify_checksums``, so a tampered bucket is detectable)."""

    async def run():
        kw = dict(encoding="flat", init_sync_enabled=True, init_sync_bucket_size=400, recv_timeout=5,
                  verify_checksums=checksums)
        s, r = PatchWeightSyncer(**kw), PatchWeightSyncer(**kw)
        a, b = inproc_pair(timeout=5)
        to_sender, to_receiver = [], []

        async def send_a(p):
            to_receiver.append(p)
            await a.send(p)

        async def send_b(p):
            to_sender.append(p)
            await b.send(p)

        async with anyio.create_task_group() as tg:
            tg.start_soon(s.init_sender, state(1), None, send_a, a.recv)
            await r.init_receiver(receiver_model(), b.recv, send_b)
        return to_sender, to_receiver

    return anyio.run(run)


# ------------------------------------------------------------------ decompression bombs

def zstd_zeros(nbytes: int, content_size: bool) -> torch.Tensor:
    """A zstd frame of ``nbytes`` zero bytes, a few KiB long, made without holding them."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    obj = comp.compressobj(size=nbytes if content_size else -1)
    chunk, out = bytes(1 << 20), []
    for _ in range(nbytes >> 20):
        out.append(obj.compress(chunk))
    out.append(obj.flush())
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8)


def bombs(patch: CompressedWeightPatch, nbytes: int = 512 << 20) -> dict[str, CompressedWeightPatch]:
    """Variants of a genuine zstd patch whose streams would decompress to ``nbytes`` each."""
    with_size, without_size = zstd_zeros(nbytes, True), zstd_zeros(nbytes, False)
    sizes = dict(patch.sizes)
    values = [k for k in patch.blobs if k.startswith("values")][0]
    stream = values.split("#")[0]
    out = {}
    # the frame states a huge content size, the patch its genuine one (zstd trusts the frame)
    out["frame content size"] = dataclasses.replace(patch, blobs={**patch.blobs, values: with_size})
    # the patch declares the huge size too
    big = {**sizes, values: nbytes, stream: nbytes}
    out["declared size"] = dataclasses.replace(patch, blobs={**patch.blobs, values: without_size}, sizes=big)
    out["declared size, sized frame"] = dataclasses.replace(patch, blobs={**patch.blobs, values: with_size}, sizes=big)
    # two such frames of one stream
    two = {k: v for k, v in patch.blobs.items() if not k.startswith(stream)}
    two.update({f"{stream}#0": with_size, f"{stream}#1": with_size})
    out["two frames"] = dataclasses.replace(patch, blobs=two, sizes={**sizes, f"{stream}#0": nbytes,
                                                                   f"{stream}#1": nbytes, stream: 2 * nbytes})
    # many frames (the format allows at most 8 per stream)
    many = {k: v for k, v in patch.blobs.items() if not k.startswith(stream)}
    many.update({f"{stream}#{i}": without_size for i in range(64)})
    out["64 frames"] = dataclasses.replace(patch, blobs=many, sizes={**sizes, **{f"{stream}#{i}": nbytes >> 4
                                                                               for i in range(64)}})
    return out


def declared_maximum(encoding: str, n: int, session: int | None) -> CompressedWeightPatch:
    """A small zstd patch that declares ``n`` changes of the receiver's ``big`` tensor (ordinal of
    ``big`` in :func:`receiver_model`) with streams of exactly the sizes such a patch has, all
    zero bytes: the decoder must allocate for ``n`` changes before it can find the patch wrong."""
    ordinal = list(receiver_model(0, 1)).index("big")
    if encoding == "coo":
        streams = {"cols": 8 * n, "rows": 8 * n, "values.4": 4 * n}
        dtypes = {"cols": "int64", "rows": "int64"}
    else:
        streams = {"cols": n, "values": (n + 1) // 2}  # n gaps of 0, n zero codes: decodes whole
        dtypes = {"cols": "uint8"}
    blobs, sizes = {}, {}
    for name, nbytes in streams.items():
        blobs[f"{name}#0"] = zstd_zeros_exact(nbytes)
        sizes[f"{name}#0"] = sizes[name] = nbytes
    return CompressedWeightPatch(
        version=2, base_version=1, encoding=encoding, delta_encoded=False, codec="zstd",
        ordinals=torch.tensor([ordinal]), nnz_per_tensor=torch.tensor([n]), blobs=blobs, dtypes=dtypes, sizes=sizes,
        gap_bytes=torch.tensor([n]) if encoding != "coo" else None, old_hashes=torch.tensor([0]), session=session)


def zstd_zeros_exact(nbytes: int) -> torch.Tensor:
    import zstandard

    obj = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=nbytes)
    out, left = [], nbytes
    while left:
        step = min(left, 1 << 20)
        out.append(obj.compress(bytes(step)))
        left -= step
    out.append(obj.flush())
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8)


def _peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory(mode: str) -> dict:
    """Apply hostile payloads to a receiver; report the rise of its peak resident memory."""
    big = 1 << 21
    out = {"mode": mode, "cases": {}}
    if mode == "bombs":
        r, dst, patch, _ = prepared_patch("flat", "zstd", big)
        cases = bombs(patch)
        declared = patch.nnz
    else:
        r, dst, patch, _ = prepared_patch("flat", "zstd", big)
        n = big  # every element of ``big``
        cases = {f"{e} declaring {n} changes": declared_maximum(e, n, patch.session) for e in ("coo", "flat")}
        declared = n
    # warm up the decode path with the genuine patch (numba, pools, allocator arenas); the bound
    # is the numba decoders' (a fresh process takes the torch paths until its kernels load)
    from aiosync.syncers.kernels.warmup import warm_up

    warm_up(ctx=False)
    for _ in range(2):
        anyio.run(r.apply_payload, {k: v.clone() for k, v in dst.items()}, patch)
        r.version = 1
    target = {k: v.clone() for k, v in dst.items()}
    base = _peak_kb()
    for name, payload in cases.items():
        out["cases"][name] = {"bytes": int(sum(b.numel() for b in payload.blobs.values()))}
        try:
            anyio.run(r.apply_payload, target, payload)
            out["cases"][name]["outcome"] = "accepted"
        except AiosyncError as exc:
            out["cases"][name]["outcome"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        r.version = 1
    out["peak_rise_bytes"] = (_peak_kb() - base) * 1024
    out["declared_changes"] = declared
    out["bound_bytes"] = PER_CHANGE * declared + FIXED
    out["unchanged"] = all(torch.equal(target[k].view(torch.uint8) if target[k].dtype == torch.bool else target[k],
                                       dst[k].view(torch.uint8) if dst[k].dtype == torch.bool else dst[k])
                           for k in dst)
    return out


# ------------------------------------------------------------------ mutation fuzzing

def mutate_bytes(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    raw = bytearray(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    how = rng.choice(["flip", "set", "truncate", "extend", "zero"])
    if how == "truncate" and raw:
        raw = raw[:rng.randrange(len(raw))]
    elif how == "extend":
        raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif how == "zero" and raw:
        i = rng.randrange(len(raw))
        raw[i:i + rng.randint(1, 8)] = bytes(len(raw[i:i + 8]))
    elif raw:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(raw))
            raw[i] = raw[i] ^ (1 << rng.randrange(8)) if how == "flip" else rng.randrange(256)
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def mutate_patch(patch, rng: random.Random):
    """One hostile variant: bytes of a stream or a blob flipped, a count, size or ordinal changed."""
    fields = {}
    if isinstance(patch, CompressedWeightPatch):
        what = rng.choice(["blob", "blob", "size", "count", "ordinal", "gap_bytes"])
        if what == "blob":
            k = rng.choice(list(patch.blobs))
            fields["blobs"] = {**patch.blobs, k: mutate_bytes(patch.blobs[k], rng)}
        elif what == "size":
            k = rng.choice(list(patch.sizes))
            fields["sizes"] = {**patch.sizes, k: rng.choice([0, 1, patch.sizes[k] + 1, patch.sizes[k] * 7, 1 << 40,
                                                             -1, max(0, patch.sizes[k] - 1)])}
    else:
        what = rng.choice(["cols", "values", "count", "ordinal", "gap_bytes", "rows"])
        if what in ("cols", "values", "rows") and isinstance(getattr(patch, what), torch.Tensor):
            t = getattr(patch, what)
            m = mutate_bytes(t, rng)
            fields[what] = m if t.dtype == torch.uint8 or m.numel() % t.element_size() else m.view(t.dtype)
    if what == "count":
        nnz = patch.nnz_per_tensor.to(torch.int64).clone()
        if nnz.numel():
            i = rng.randrange(nnz.numel())
            nnz[i] = rng.choice([0, 1, int(nnz[i]) + 1, int(nnz[i]) - 1, 2**40, 2**62])
        fields["nnz_per_tensor"] = nnz
    elif what == "ordinal":
        o = patch.ordinals.to(torch.int64).clone()
        if o.numel():
            o[rng.randrange(o.numel())] = rng.choice([0, 1, 5, 99, -1])
        fields["ordinals"] = o
    elif what == "gap_bytes" and patch.gap_bytes is not None:
        g = patch.gap_bytes.to(torch.int64).clone()
        if g.numel():
            i = rng.randrange(g.numel())
            g[i] = max(0, int(g[i]) + rng.choice([-3, -1, 1, 2, 1000]))
        fields["gap_bytes"] = g
    return dataclasses.replace(patch, **fields) if fields else patch


def fuzz_patches(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    # with checksums an accepted payload must give exactly the genuine weights (a coo patch carries
    # new values: without them, a changed value byte would be written as sent, by design)
    prepared = {fmt: prepared_patch(*fmt, checksums=True) for fmt in PATCH_FORMATS}
    counts = {"refused": 0, "accepted": 0, "bad": []}
    for i in range(n):
        fmt = PATCH_FORMATS[i % len(PATCH_FORMATS)]
        r, dst0, patch, after = prepared[fmt]
        bad = patch
        for _ in range(rng.randint(1, 3)):
            bad = mutate_patch(bad, rng)
        dst = {k: v.clone() for k, v in dst0.items()}
        r.version = 1
        try:
            anyio.run(r.apply_payload, dst, bad)
            accepted = True
        except AiosyncError:
            accepted = False
        except Exception as exc:  # noqa: BLE001 - what the harness looks for
            counts["bad"].append(f"{fmt} raised {type(exc).__name__}: {exc}"[:300])
            continue
        finally:
            r.version = 1
        ref = after if accepted else dst0
        wrong = [k for k in dst if not _same(dst[k], ref[k])]
        if wrong:
            counts["bad"].append(f"{fmt} {'accepted' if accepted else 'refused'} payload left {wrong} wrong")
        counts["accepted" if accepted else "refused"] += 1
    return counts


def fuzz_buckets(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    sent = genuine_buckets(True)
    genuine = receiver_model(1)
    counts = {"refused": 0, "accepted": 0, "bad": []}
    for _ in range(n):
        buckets = [dict(b) for b in sent]
        i = rng.randrange(len(buckets))
        key = rng.choice(list(buckets[i]))
        t = buckets[i][key]
        m = mutate_bytes(t, rng)
        buckets[i][key] = m.view(t.dtype).reshape(-1) if m.numel() % t.element_size() == 0 and m.numel() else m
        dst0 = receiver_model()
        dst = {k: v.clone() for k, v in dst0.items()}
        r = BucketWeightSyncer(bucket_size=300, load_instant=False, verify_checksums=True, recv_timeout=1)
        r.version = 0
        try:
            anyio.run(r.apply, dst, recv_from(buckets))
            ok = all(_same(dst[k], genuine[k]) for k in dst)
            counts["accepted"] += 1
        except AiosyncError:
            ok = all(_same(dst[k], dst0[k]) for k in dst)
            counts["refused"] += 1
        except Exception as exc:  # noqa: BLE001
            counts["bad"].append(f"bucket raised {type(exc).__name__}: {exc}"[:300])
            continue
        if not ok:
            counts["bad"].append("a bucket stream left wrong weights")
    return counts


def fuzz_frames(n: int, seed: int) -> dict:
    """Mutated frames of the distributed wire codec: headers and bodies."""
    from aiosync.coordination.protocol import Ack, Hello, Packet, Welcome
    from aiosync.transports.distributed.wire import MAX_DEPTH, decode_message, encode_message

    rng = random.Random(seed)
    _, _, patch, _ = prepared_patch("flat", "zstd")
    payloads = [Packet(2, [patch]), Ack(3, 2, None), Hello("e0", 1), Welcome({"sync_timeout": 5}, None, 1, None),
                genuine_buckets(True)[0]]
    frames = [encode_message(p) for p in payloads]
    counts = {"refused": 0, "accepted": 0, "bad": []}
    specials = [b"[" * 100000 + b"]" * 100000, b'{"v":1,"tensors":[],"tree":' + b"9" * 5000 + b"}",
                b'{"v":1,"tensors":[],"tree":' + b'{"$tuple":[' * (MAX_DEPTH + 5) + b"1" + b"]}" * (MAX_DEPTH + 5) + b"}"]
    for i in range(n):
        frame = frames[i % len(frames)]
        header, host = bytearray(frame.header), frame.host
        if i < len(specials):
            header = bytearray(specials[i])
        elif rng.random() < 0.6 and header:
            for _ in range(rng.randint(1, 4)):
                j = rng.randrange(len(header))
                header[j] = rng.choice(b'{}[]",:0123456789-e$tfnx ') if rng.random() < 0.7 else rng.randrange(256)
        elif host is not None:
            host = mutate_bytes(host, rng)
        try:
            decode_message(bytes(header), host, None)
            counts["accepted"] += 1
        except AiosyncError:
            counts["refused"] += 1
        except Exception as exc:  # noqa: BLE001
            counts["bad"].append(f"frame raised {type(exc).__name__}: {exc}"[:300])
    return counts


def fuzz_handshakes(n: int, seed: int) -> dict:
    """Receiver metadata with fields of the wrong type or out of range, against a sender."""
    from aiosync.syncers.common.payloads import ReceiverMetadata, SenderHello

    rng = random.Random(seed)
    meta = genuine_handshake()[0][0]
    odd = [2**70, -1, 2**63, torch.tensor(3), torch.tensor([1, 2]), "7", None, 1.5, [1], True]
    counts = {"refused": 0, "accepted": 0, "bad": []}
    for _ in range(n):
        fields = {}
        for _ in range(rng.randint(1, 2)):
            f = rng.choice(["session", "original_shapes", "dtypes", "ordered_keys", "viewable", "aliases"])
            value = getattr(meta, f)
            if f == "session" or not isinstance(value, list) or not value or rng.random() < 0.2:
                fields[f] = rng.choice(odd)
            else:
                value = list(value)
                i = rng.randrange(len(value))
                value[i] = rng.choice(odd + [[2**70, 3], [-1], (1, torch.tensor(2))])
                fields[f] = value
        bad = dataclasses.replace(meta, **fields)
        sent = []

        async def send(p):
            sent.append(p)

        s = PatchWeightSyncer(init_sync_enabled=True, recv_timeout=1)
        try:
            anyio.run(s.init_sender, state(1), None, send, recv_from([bad]))
            counts["accepted"] += 1
        except AiosyncError:
            if not (sent and isinstance(sent[0], SenderHello) and sent[0].ok is False):
                counts["bad"].append(f"refused {fields} but told the receiver {sent[:1]}"[:300])
            counts["refused"] += 1
        except Exception as exc:  # noqa: BLE001
            ok = [p for p in sent if isinstance(p, SenderHello) and p.ok]
            counts["bad"].append(f"{fields} raised {type(exc).__name__}: {exc} (told ok: {bool(ok)})"[:300])
    assert isinstance(meta, ReceiverMetadata)
    return counts


def fuzz_checkpoints(n: int, seed: int) -> dict:
    """Mutated safetensors files in a checkpoint directory, read by the one loader."""
    import tempfile

    from aiosync.checkpoints import CheckpointDir

    rng = random.Random(seed)
    counts = {"refused": 0, "accepted": 0, "bad": []}
    with tempfile.TemporaryDirectory() as tmp:
        d = CheckpointDir(tmp)
        path = d.publish(state(1), 1)
        good = path.read_bytes()
        target = receiver_model()
        for _ in range(n):
            raw = bytearray(good)
            how = rng.choice(["flip", "truncate", "header"])
            if how == "truncate":
                raw = raw[:rng.randrange(len(raw))]
            else:
                lo, hi = (8, min(len(raw), 8 + int.from_bytes(good[:8], "little"))) if how == "header" else (0, len(raw))
                for _ in range(rng.randint(1, 4)):
                    j = rng.randrange(lo, hi)
                    raw[j] = rng.randrange(256)
            path.write_bytes(bytes(raw))
            try:
                d.load(target=target)
                counts["accepted"] += 1
            except (AiosyncError, FileNotFoundError):
                counts["refused"] += 1
            except Exception as exc:  # noqa: BLE001
                counts["bad"].append(f"checkpoint raised {type(exc).__name__}: {exc}"[:300])
    return counts


FUZZ = {"patch": fuzz_patches, "bucket": fuzz_buckets, "frame": fuzz_frames, "handshake": fuzz_handshakes,
        "checkpoint": fuzz_checkpoints}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def main(argv: list[str]) -> int:
    if argv[0] == "memory":
        print(json.dumps(memory(argv[1])))
    elif argv[0] == "fuzz":
        targets = list(FUZZ) if argv[1] == "all" else argv[1].split(",")
        result = {t: FUZZ[t](int(argv[2]), int(argv[3])) for t in targets}
        import numba

        result["boundscheck"] = numba.config.BOUNDSCHECK == 1  # every kernel compiled with bounds checks
        print(json.dumps(result))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
