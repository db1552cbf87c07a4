"""What a patch's streams may weigh, from its header and the receiver's own layouts: the bounds
every decoder checks a declared size against before it allocates or decompresses anything."""

from __future__ import annotations

from ...errors import PayloadError

#: bytes of one gap varint at most (:func:`~aiosync.syncers.kernels.flat.decode_gaps` refuses a tenth byte)
MAX_VARINT_BYTES = 9


def stream_bounds(encoding: str, ords: list[int], counts: list[int], layouts) -> dict[str, tuple[int, int]]:
    """The smallest and largest uncompressed byte size of each stream of a patch of ``encoding``
    whose header (already checked) names ``ords`` with ``counts`` changes, from the receiver's
    own ``layouts`` (``TensorLayout``, or bare element widths: then the ``ctx`` bounds assume
    one segment per change). Streams: ``rows`` / ``cols`` per element (the index dtype's width
    is applied by the caller: ``(lo, hi)`` count elements for ``coo``), ``values`` or
    ``values.<width>`` in bytes. What a decoder may allocate for a patch follows from these.
    """
    width = {o: (lay if isinstance(lay, int) else lay.elem_size) for o, lay in layouts.items()}
    total = sum(counts)
    value_bytes = sum(n * width[o] for o, n in zip(ords, counts))
    if encoding == "coo":
        out = {"cols": (total, total), "rows": (total, total)}
        for w in sorted({width[o] for o in ords}):
            nbytes = sum(n * w for o, n in zip(ords, counts) if width[o] == w)
            out[f"values.{w}"] = (nbytes, nbytes)
        out["values"] = (value_bytes, value_bytes)
        return out
    packed = (total + 1) // 2
    if encoding == "flat":
        return {"cols": (total, MAX_VARINT_BYTES * total), "values": (packed, packed + value_bytes)}
    if encoding == "ctx":
        from ..kernels.ctx import N_CONTEXTS, SEGMENT
        from ..kernels.rans import NSYM

        segs = sum(max(1, -(-layouts[o].numel // SEGMENT)) if not isinstance(layouts[o], int) else max(1, n)
                   for o, n in zip(ords, counts))
        from ..kernels.ctx_coder import MAX_LANES

        busy = min(segs, total)  # segments with a change: at most 2 MAX_LANES streams (stream_bound bytes each)
        header_ints = 1 + N_CONTEXTS * (2 + NSYM) + 4 * len(ords) + (4 + 2 * MAX_LANES - 1) * segs
        return {"cols": (0, 40 * total + 2 * MAX_LANES * 88 * busy), "values": (1, MAX_VARINT_BYTES * header_ints)}
    raise PayloadError(f"unknown patch encoding {encoding!r}")
