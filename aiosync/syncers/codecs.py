"""Lossless compression of patches (W12, B1): ``none``, ``zstd`` (CPU) and nvCOMP (GPU).

Index streams are byte-shuffled by their element width before compression (all first bytes,
then all second bytes, …): the high bytes of small gaps are almost all zero and vanish, the
low bytes go to the entropy coder. Values are grouped by element width, then shuffled the
same way. nvCOMP codecs compress each stream as is on the GPU, as the seed does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..dtypes import dtype_from_name, dtype_name
from ..errors import CodecUnavailableError, PayloadError
from .payloads import CompressedWeightPatch, WeightPatch

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

    try:
        raw = zstandard.ZstdDecompressor().decompress(_np_u8(blob).tobytes(), max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise PayloadError(f"compressed patch stream {name!r} is corrupt: {exc}") from exc
    if len(raw) != size:
        raise PayloadError(f"compressed patch stream {name!r} decompressed to {len(raw)} bytes, expected {size}")
    return np.frombuffer(raw, dtype=np.uint8)


# ---------------------------------------------------------------------- nvCOMP
def _nvcomp_codec(name: str):
    from nvidia import nvcomp

    stream = torch.cuda.current_stream()
    return nvcomp, nvcomp.Codec(algorithm=NVCOMP_ALGORITHMS[name], cuda_stream=stream.cuda_stream,
                                device_id=stream.device.index or 0)


def _nvcomp_compress(t: torch.Tensor, name: str) -> torch.Tensor:
    nvcomp, codec = _nvcomp_codec(name)
    data = t.detach().reshape(-1).contiguous().view(torch.uint8)
    if not data.is_cuda:
        data = data.cuda()
    enc = codec.encode(nvcomp.as_array(data))
    return torch.as_tensor(enc, device=data.device).view(torch.uint8).clone()


def _nvcomp_decompress(blob: torch.Tensor, size: int, name: str) -> torch.Tensor:
    nvcomp, codec = _nvcomp_codec(name)
    data = blob.reshape(-1).contiguous()
    if not data.is_cuda:
        data = data.cuda()
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


def decompress_patch(cp: CompressedWeightPatch, elem_sizes: dict[int, int]) -> WeightPatch:
    """Invert :func:`compress_patch`. Corrupt or truncated streams raise :class:`PayloadError`."""
    if not isinstance(cp.blobs, dict) or not isinstance(cp.sizes, dict) or not isinstance(cp.dtypes, dict):
        raise PayloadError("compressed patch has malformed stream tables")
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
    nvcomp = cp.codec in NVCOMP_ALGORITHMS
    if cp.codec != "zstd" and not nvcomp:
        raise PayloadError(f"unknown patch codec {cp.codec!r}")

    def stream(name: str):
        if nvcomp:
            _check_size(name)
            if name not in cp.blobs:
                raise PayloadError(f"compressed patch lacks stream {name!r}")
            return _nvcomp_decompress(cp.blobs[name], cp.sizes[name], name)
        frames = sorted((k for k in cp.blobs if k.split("#")[0] == name), key=_frame_index)
        if not frames or [_frame_index(k) for k in frames] != list(range(len(frames))):
            raise PayloadError(f"compressed patch lacks stream {name!r} (or some of its frames)")
        for k in frames:
            _check_size(k)
        if len(frames) == 1:
            raw = _zstd_decompress(cp.blobs[frames[0]], cp.sizes[frames[0]], frames[0])
        else:
            futs = [_pool().submit(_zstd_decompress, cp.blobs[k], cp.sizes[k], k) for k in frames]
            raw = np.concatenate([f.result() for f in futs])
        if name in cp.sizes and cp.sizes[name] != raw.size:
            raise PayloadError(f"compressed patch stream {name!r} holds {raw.size} bytes, expected {cp.sizes[name]}")
        return raw

    def _check_size(name: str) -> None:
        size = cp.sizes.get(name)
        if not isinstance(size, int) or size < 0 or size > (1 << 40):
            raise PayloadError(f"compressed patch stream {name!r} has an invalid size {size!r}")

    def _frame_index(key: str) -> int:
        _, _, idx = key.partition("#")
        if not idx.isdigit():
            raise PayloadError(f"compressed patch has a malformed frame name {key!r}")
        return int(idx)

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

    names = ["cols"] + (["rows"] if cp.encoding == "coo" else [])
    futures = {k: _pool().submit(index_stream, k) for k in names}
    if nvcomp or cp.encoding in ("flat", "ctx"):
        values = stream("values")
        values = values if isinstance(values, torch.Tensor) else torch.from_numpy(values.copy())
    else:
        widths: dict[int, int] = {}
        for o, n in zip(ordinals, counts):
            widths[elem_sizes[o]] = widths.get(elem_sizes[o], 0) + n * elem_sizes[o]
        groups = {}
        for w, nbytes in widths.items():
            raw = stream(f"values.{w}")
            if raw.size != nbytes:
                raise PayloadError(f"compressed patch values of width {w} hold {raw.size} bytes, expected {nbytes}")
            groups[w] = unshuffle_bytes(raw, w)
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
