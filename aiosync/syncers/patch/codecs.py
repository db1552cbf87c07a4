"""Lossless compression of patches (W12, B1): ``none``, ``zstd`` (CPU) and nvCOMP (GPU).

Index streams are byte-shuffled by their element width before compression (all first bytes,
then all second bytes, …): the high bytes of small gaps are almost all zero and vanish, the
low bytes go to the entropy coder. Values are grouped by element width, then shuffled the
same way. nvCOMP codecs compress each stream as is on the GPU, as the seed does.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...aio import bind_cuda, resolve_device
from ...dtypes import dtype_from_name, dtype_name
from ...errors import CodecUnavailableError, PayloadError
from ..common.payloads import CompressedWeightPatch, WeightPatch

NVCOMP_ALGORITHMS = {"nvcomp_lz4": "LZ4", "nvcomp_zstd": "Zstd"}
_POOL: ThreadPoolExecutor | None = None
_FRAME_BYTES = 1 << 19  # a zstd frame per 512 KiB of stream, at most _MAX_FRAMES per stream
_MAX_FRAMES = 8


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(4, thread_name_prefix="aiosync-codec")
    return _POOL


def check_codec_available(name: str) -> None:
    """Raise :class:`CodecUnavailableError` now if codec ``name`` cannot run here."""
    if name in ("none", "zstd"):
        if name == "zstd":
            try:
                import zstandard  # noqa: F401
            except ImportError as exc:  # pragma: no cover - a dependency
                raise CodecUnavailableError("compression: zstd needs the zstandard package (pip install zstandard)") from exc
        return
    if name not in NVCOMP_ALGORITHMS:
        raise CodecUnavailableError(f"unknown compression {name!r}; valid: none, zstd, {', '.join(NVCOMP_ALGORITHMS)}")
    if not torch.cuda.is_available():
        raise CodecUnavailableError(f"compression: {name} runs on a CUDA GPU and none is available; use compression: zstd")
    try:
        from nvidia import nvcomp
    except ImportError as exc:
        raise CodecUnavailableError(f"compression: {name} needs nvidia-nvcomp-cu12 (pip install nvidia-nvcomp-cu12)") from exc
    try:
        nvcomp.Codec(algorithm=NVCOMP_ALGORITHMS[name])
    except Exception as exc:  # driver/runtime mismatch and similar
        raise CodecUnavailableError(f"compression: {name} could not create an nvCOMP codec: {exc}") from exc


# --------------------------------------------------------------- byte shuffling
def shuffle_bytes(data: np.ndarray, width: int) -> np.ndarray:
    """Byte-plane transpose of a uint8 array made of ``width``-byte elements."""
    if width == 1:
        return data
    return np.ascontiguousarray(data.reshape(-1, width).T).reshape(-1)


def unshuffle_bytes(data: np.ndarray, width: int) -> np.ndarray:
    if width == 1:
        return data
    return np.ascontiguousarray(data.reshape(width, -1).T).reshape(-1)


def _np_u8(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()


# ------------------------------------------------------------------------ zstd
def _zstd_compress(data: np.ndarray, level: int) -> np.ndarray:
    import zstandard

    out = zstandard.ZstdCompressor(level=level).compress(data.data)
    return np.frombuffer(out, dtype=np.uint8)


def _zstd_decompress(blob: torch.Tensor, size: int, name: str) -> np.ndarray:
    import zstandard

    data = _np_u8(blob).tobytes()
    try:
        # A frame that states its content size is decompressed into a buffer of that size,
        # whatever ``max_output_size`` says: check it against the size the patch allows first.
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, size):
            raise PayloadError(f"compressed patch stream {name!r} is a zstd frame of {declared} bytes, but the "
                               f"patch declares {size} (a corrupt or hostile frame); refused before decompressing")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise PayloadError(f"compressed patch stream {name!r} is corrupt: {exc}") from exc
    if len(raw) != size:
        raise PayloadError(f"compressed patch stream {name!r} decompressed to {len(raw)} bytes, expected {size}")
    return np.frombuffer(raw, dtype=np.uint8)


# ---------------------------------------------------------------------- nvCOMP
_CODECS: dict[tuple, Any] = {}  # (algorithm, device, stream, thread) -> nvcomp.Codec


def _nvcomp_codec(name: str, device: torch.device):
    """The nvCOMP codec of ``name`` on ``device`` running on the *current* stream of that device
    (the caller's, carried into worker threads by :func:`aiosync.aio.run_sync`): built once per
    (device, stream) and thread, since an nvCOMP codec is thread-local and costly to make."""
    from nvidia import nvcomp

    stream = torch.cuda.current_stream(device)
    key = (name, device.index, stream.cuda_stream, threading.get_ident())
    codec = _CODECS.get(key)
    if codec is None:
        codec = _CODECS[key] = nvcomp.Codec(algorithm=NVCOMP_ALGORITHMS[name], cuda_stream=stream.cuda_stream,
                                            device_id=device.index)
    return nvcomp, codec


def _on_gpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on a CUDA device: where it is, or the caller's current device (never a bare ``cuda``,
    which means device 0 in a worker thread)."""
    return t if t.is_cuda else t.to(resolve_device("cuda"))


def _nvcomp_compress(t: torch.Tensor, name: str) -> torch.Tensor:
    data = _on_gpu(t.detach().reshape(-1).contiguous().view(torch.uint8))
    nvcomp, codec = _nvcomp_codec(name, data.device)
    enc = codec.encode(nvcomp.as_array(data))
    # nvCOMP wrote ``enc`` on the current stream of data.device (the codec's): the clone below
    # is queued on that same stream, so it is ordered after the encode without a host sync
    # (torch ignores the stream field of the CUDA array interface; the shared stream makes it moot).
    return torch.as_tensor(enc, device=data.device).view(torch.uint8).clone()


def _nvcomp_decompress(blob: torch.Tensor, size: int, name: str) -> torch.Tensor:
    data = _on_gpu(blob.reshape(-1).contiguous())
    nvcomp, codec = _nvcomp_codec(name, data.device)
    try:
        dec = codec.decode(nvcomp.as_array(data))
        out = torch.as_tensor(dec, device=data.device).reshape(-1).view(torch.uint8).clone()
    except Exception as exc:
        raise PayloadError(f"compressed patch stream {name!r} is corrupt: {exc}") from exc
    if out.numel() != size:
        raise PayloadError(f"compressed patch stream {name!r} decompressed to {out.numel()} bytes, expected {size}")
    return out


# ----------------------------------------------------------------- the codec API
def _value_groups(patch: WeightPatch, elem_sizes: dict[int, int]) -> dict[int, list[tuple[int, int]]]:
    """Byte ranges of ``patch.values`` grouped by element width."""
    groups: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for o, n in zip(patch.ordinals.tolist(), patch.nnz_per_tensor.tolist()):
        w = elem_sizes[int(o)]
        groups.setdefault(w, []).append((start, start + n * w))
        start += n * w
    return groups


def compress_patch(patch: WeightPatch, codec: str, elem_sizes: dict[int, int], level: int = 3) -> CompressedWeightPatch:
    """Compress ``patch``'s streams with ``codec`` (``zstd`` or an ``nvcomp_*`` name).

    ``elem_sizes`` maps each ordinal to its element width in bytes.
    """
    streams: dict[str, torch.Tensor] = {"cols": patch.cols}
    if patch.rows is not None:
        streams["rows"] = patch.rows
    dtypes = {k: dtype_name(v.dtype) for k, v in streams.items()}
    sizes = {k: v.numel() * v.element_size() for k, v in streams.items()}
    if codec == "zstd":
        jobs = {k: shuffle_bytes(_np_u8(v), v.element_size()) for k, v in streams.items()}
        values = _np_u8(patch.values)
        if patch.encoding in ("flat", "ctx"):  # flat: nibbles, then exception byte planes; ctx: its model
            jobs["values"] = values
            sizes["values"] = values.size
        else:
            for w, ranges in _value_groups(patch, elem_sizes).items():
                grouped = np.concatenate([values[a:b] for a, b in ranges]) if len(ranges) > 1 else values[ranges[0][0]:ranges[0][1]]
                jobs[f"values.{w}"] = shuffle_bytes(grouped, w)
                sizes[f"values.{w}"] = grouped.size
        # Large streams are cut into frames compressed in parallel (named ``<stream>#<i>``).
        parts = {}
        for k, v in jobs.items():
            n = max(1, min(_MAX_FRAMES, v.size // _FRAME_BYTES))
            bounds = [v.size * i // n for i in range(n + 1)]
            for i in range(n):
                parts[f"{k}#{i}"] = v[bounds[i]:bounds[i + 1]]
        futures = {k: _pool().submit(_zstd_compress, v, level) for k, v in parts.items()}
        blobs = {k: torch.from_numpy(f.result().copy()) for k, f in futures.items()}
        sizes.update({k: v.size for k, v in parts.items()})
    elif codec in NVCOMP_ALGORITHMS:
        streams["values"] = patch.values
        sizes["values"] = patch.values.numel()
        blobs = {k: _nvcomp_compress(v, codec) for k, v in streams.items()}
    else:
        raise ValueError(f"unknown compression {codec!r}")
    return CompressedWeightPatch(
        version=patch.version, base_version=patch.base_version, encoding=patch.encoding,
        delta_encoded=patch.delta_encoded, codec=codec, ordinals=patch.ordinals,
        nnz_per_tensor=patch.nnz_per_tensor, blobs=blobs, dtypes=dtypes, sizes=sizes, gap_bytes=patch.gap_bytes,
        session=patch.session, checksums=patch.checksums, old_hashes=patch.old_hashes,
    )


_INDEX_DTYPES = (torch.uint8, torch.int32, torch.int64)


def _declared_size(cp: CompressedWeightPatch, key: str) -> int:
    size = cp.sizes.get(key)
    if type(size) is not int or size < 0:
        raise PayloadError(f"compressed patch stream {key!r} has an invalid size {size!r}")
    return size


def _stream_plan(cp: CompressedWeightPatch, names: list[str], bounds: dict[str, tuple[int, int]],
                 nvcomp: bool) -> dict[str, list[str]]:
    """The blobs (frames) of each stream, every declared size checked against what the patch's
    own counts allow (``bounds``) before anything is decompressed: a payload can make this
    receiver allocate only what a genuine patch of its declared changes needs."""
    plan: dict[str, list[str]] = {}
    for name in names:
        lo, hi = bounds[name]
        if nvcomp:
            keys = [name] if name in cp.blobs else []
        else:
            keys = sorted((k for k in cp.blobs if isinstance(k, str) and k.split("#")[0] == name), key=_frame_index)
            if [_frame_index(k) for k in keys] != list(range(len(keys))):
                raise PayloadError(f"compressed patch lacks some frames of stream {name!r}")
            if len(keys) > _MAX_FRAMES:
                raise PayloadError(f"compressed patch stream {name!r} has {len(keys)} frames; at most {_MAX_FRAMES}")
        if not keys:
            raise PayloadError(f"compressed patch lacks stream {name!r}")
        total = sum(_declared_size(cp, k) for k in keys)
        if name in cp.sizes and _declared_size(cp, name) != total:
            raise PayloadError(f"compressed patch stream {name!r} declares {cp.sizes[name]} bytes, its frames {total}")
        if not lo <= total <= hi:
            raise PayloadError(f"compressed patch stream {name!r} declares {total} bytes, but its "
                               f"{'changes' if lo == hi else 'declared changes'} need "
                               + (f"exactly {lo}" if lo == hi else f"{lo} to {hi}") + " (a corrupt or hostile header); "
                               "refused before decompressing")
        for k in keys:
            blob = cp.blobs[k]
            if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
                raise PayloadError(f"compressed patch blob {k!r} must be a uint8 tensor")
        plan[name] = keys
    known = {k for keys in plan.values() for k in keys}
    stray = [k for k in cp.blobs if k not in known]
    if stray:
        raise PayloadError(f"compressed patch carries a stream this receiver does not expect: {str(stray[0])[:40]!r}")
    return plan


def _frame_index(key: str) -> int:
    _, _, idx = key.partition("#")
    if not (idx.isascii() and idx.isdigit()) or len(idx) > 3:
        raise PayloadError(f"compressed patch has a malformed frame name {key[:40]!r}")
    return int(idx)


def decompress_patch(cp: CompressedWeightPatch, layouts) -> WeightPatch:
    """Invert :func:`compress_patch`. Corrupt or truncated streams raise :class:`PayloadError`.

    ``layouts`` maps each ordinal the receiver syncs to its
    :class:`~aiosync.syncers.patch.format.TensorLayout` (or just its element width in bytes):
    every stream's declared size is checked against what the patch's counts need before
    anything is decompressed (see :func:`~aiosync.syncers.patch.format.stream_bounds`)."""
    from .bounds import stream_bounds

    if not isinstance(cp.blobs, dict) or not isinstance(cp.sizes, dict) or not isinstance(cp.dtypes, dict):
        raise PayloadError("compressed patch has malformed stream tables")
    elem_sizes = {o: (lay if isinstance(lay, int) else lay.elem_size) for o, lay in layouts.items()}
    try:
        ordinals = cp.ordinals.reshape(-1).to(torch.int64).tolist()
        counts = cp.nnz_per_tensor.reshape(-1).to(torch.int64).tolist()
    except Exception as exc:
        raise PayloadError(f"compressed patch has malformed ordinals or counts: {exc}") from exc
    if len(ordinals) != len(counts) or any(n < 0 for n in counts):
        raise PayloadError("compressed patch ordinals and nnz_per_tensor disagree")
    unknown = [o for o in ordinals if o not in elem_sizes]
    if unknown:
        raise PayloadError(f"compressed patch names tensor ordinal {unknown[0]}, which the receiver does not sync")
    if len(set(ordinals)) != len(ordinals):
        raise PayloadError("compressed patch names a tensor ordinal twice")
    for o, n in zip(ordinals, counts):
        lay = layouts[o]
        if not isinstance(lay, int) and n > lay.numel:
            raise PayloadError(f"compressed patch claims {n} changes in tensor ordinal {o}, which has {lay.numel} "
                               "elements")
    nvcomp = cp.codec in NVCOMP_ALGORITHMS
    if cp.codec != "zstd" and not nvcomp:
        raise PayloadError(f"unknown patch codec {cp.codec!r}")
    if cp.encoding not in ("coo", "flat", "ctx"):
        raise PayloadError(f"unknown patch encoding {cp.encoding!r}")
    bounds = stream_bounds(cp.encoding, ordinals, counts, layouts)
    index_names = ["cols"] + (["rows"] if cp.encoding == "coo" else [])
    for name in index_names:  # element counts → bytes of the declared index dtype
        dtype = dtype_from_name(cp.dtypes.get(name))
        if dtype not in _INDEX_DTYPES or (cp.encoding != "coo" and dtype != torch.uint8):
            raise PayloadError(f"compressed patch stream {name!r} has unknown dtype {cp.dtypes.get(name)!r}")
        if cp.encoding == "coo":
            bounds[name] = (bounds[name][0] * dtype.itemsize, bounds[name][1] * dtype.itemsize)
    if nvcomp or cp.encoding in ("flat", "ctx"):
        value_names = ["values"]
    else:
        value_names = sorted((k for k in bounds if k.startswith("values.")), key=lambda k: int(k.split(".")[1]))
    plan = _stream_plan(cp, index_names + value_names, bounds, nvcomp)

    def stream(name: str):
        if nvcomp:
            return _nvcomp_decompress(cp.blobs[name], cp.sizes[name], name)
        frames = plan[name]
        if len(frames) == 1:
            raw = _zstd_decompress(cp.blobs[frames[0]], cp.sizes[frames[0]], frames[0])
        else:
            futs = [_pool().submit(_zstd_decompress, cp.blobs[k], cp.sizes[k], k) for k in frames]
            raw = np.concatenate([f.result() for f in futs])
        return raw

    def index_stream(name: str) -> torch.Tensor:
        dtype = dtype_from_name(cp.dtypes.get(name))
        if dtype not in _INDEX_DTYPES:
            raise PayloadError(f"compressed patch stream {name!r} has unknown dtype {cp.dtypes.get(name)!r}")
        raw = stream(name)
        width = dtype.itemsize
        if (raw.numel() if isinstance(raw, torch.Tensor) else raw.size) % width:
            raise PayloadError(f"compressed patch stream {name!r} is not a whole number of {dtype} elements")
        if isinstance(raw, torch.Tensor):
            return raw.view(dtype)
        return torch.from_numpy(unshuffle_bytes(raw, width).copy()).view(dtype)

    futures = {k: _pool().submit(bind_cuda(index_stream), k) for k in index_names}
    if nvcomp or cp.encoding in ("flat", "ctx"):
        values = stream("values")
        values = values if isinstance(values, torch.Tensor) else torch.from_numpy(values.copy())
    else:
        groups = {}
        for name in value_names:
            w = int(name.split(".")[1])
            groups[w] = unshuffle_bytes(stream(name), w)
        offsets = {w: 0 for w in groups}
        parts = []
        for o, n in zip(ordinals, counts):
            w = elem_sizes[o]
            parts.append(groups[w][offsets[w]:offsets[w] + n * w])
            offsets[w] += n * w
        values = torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, np.uint8))
    cols = futures["cols"].result()
    rows = futures["rows"].result() if "rows" in futures else None
    return WeightPatch(
        version=cp.version, base_version=cp.base_version, encoding=cp.encoding,
        delta_encoded=cp.delta_encoded, ordinals=cp.ordinals, nnz_per_tensor=cp.nnz_per_tensor,
        rows=rows, cols=cols, values=values, gap_bytes=cp.gap_bytes, session=cp.session, checksums=cp.checksums,
        old_hashes=cp.old_hashes,
    )
