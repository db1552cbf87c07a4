"""Block masks of the numba kernels, written as LLVM vector IR.

The builders and the ``ctx`` decoder look at every element once, 64 at a time, and reduce each
block to 64-bit masks: which elements changed, which lie at or above a class threshold. Written
as a scalar loop (``m |= (a[i] != b[i]) << i``) the compiler vectorises the compare but widens
every lane to 64 bits for the shift and the OR reduction: eight lanes per AVX-512 instruction
and the mask pass runs compute-bound (measured 85 ms for 95.7 M fp32 → bf16 elements on one
core of a Xeon with AVX-512, against 55 ms here). These intrinsics load the whole block as one
``<64 x iN>`` vector, compare it, and bitcast the ``<64 x i1>`` result to an ``i64``: LLVM lowers
that to mask registers (``vpcmp`` into ``k``, ``kmovq``) on AVX-512, to ``vpmovmskb`` sequences
on AVX2 and to whatever the host has elsewhere — one portable IR, no target-specific intrinsic.

Every function reads ``a[s : s + 64]`` of 1-D contiguous unsigned-integer arrays without a
bounds check: callers pass only full blocks (``s + 64 <= len``) and keep their scalar loop for
the tail.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

LANES = 64


def _block(context, builder, aryty, ary, start):
    """Load ``ary[start : start + 64]`` as a ``<64 x iN>`` vector (unaligned)."""
    data = context.make_array(aryty)(context, builder, ary).data
    elem = ir.IntType(aryty.dtype.bitwidth)
    ptr = builder.bitcast(builder.gep(data, [start]), ir.VectorType(elem, LANES).as_pointer())
    return builder.load(ptr, align=1)


def _broadcast(builder, vty: ir.VectorType, value: ir.Value) -> ir.Value:
    """A run-time scalar in every lane (insertelement + shufflevector: one ``vpbroadcast``)."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [ir.Constant(ir.IntType(32), 0)] * vty.count)
    return builder.shuffle_vector(one, undef, zeros)


def _const(vty: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(vty, [ir.Constant(vty.element, value)] * vty.count)


def _bf16_bits(builder, u: ir.Value) -> ir.Value:
    """fp32 bits (``<64 x i32>``) → bf16 bits (``<64 x i16>``) exactly as ``_cast_bf16``: round to
    nearest even, every NaN → 0xFFFF."""
    v32 = u.type
    absu = builder.and_(u, _const(v32, 0x7FFFFFFF))
    nan = builder.icmp_unsigned(">", absu, _const(v32, 0x7F800000))
    lsb = builder.and_(builder.lshr(u, _const(v32, 16)), _const(v32, 1))
    rounded = builder.lshr(builder.add(builder.add(u, _const(v32, 0x7FFF)), lsb), _const(v32, 16))
    v16 = ir.VectorType(ir.IntType(16), LANES)
    return builder.select(nan, _const(v16, 0xFFFF), builder.trunc(rounded, v16))


def _to_mask(builder, bits: ir.Value) -> ir.Value:
    return builder.bitcast(bits, ir.IntType(64))


@intrinsic
def change_mask(typingctx, src, snap, s):
    """Bit ``i`` set where ``src[s + i]`` and ``snap[s + i]`` differ bitwise.

    Arrays of one width compare raw bits; fp32 bits against bf16 bits (the builders' fused
    cast) compare the cast of ``src`` (:func:`~aiosync.syncers.kernels.flat._cast_bf16`). Any other
    pair of widths is a typing error: the types decide, so no run-time flag can disagree.
    """
    if not (isinstance(src, types.Array) and isinstance(snap, types.Array)):
        raise TypeError("change_mask takes two arrays")
    fused = (src.dtype.bitwidth, snap.dtype.bitwidth) == (32, 16)
    if not fused and src.dtype.bitwidth != snap.dtype.bitwidth:
        raise TypeError(f"change_mask compares one width or fp32 with bf16 bits, not {src.dtype} with {snap.dtype}")
    sig = types.uint64(src, snap, types.int64)

    def codegen(context, builder, signature, args):
        a = _block(context, builder, signature.args[0], args[0], args[2])
        b = _block(context, builder, signature.args[1], args[1], args[2])
        if fused:
            a = _bf16_bits(builder, a)
        return _to_mask(builder, builder.icmp_unsigned("!=", a, b))

    return sig, codegen


@intrinsic
def ge_mask(typingctx, bits, s, magmask, thr):
    """Bit ``i`` set where ``bits[s + i] & magmask >= thr`` (unsigned; the ``ctx`` classes)."""
    if not isinstance(bits, types.Array):
        raise TypeError("ge_mask takes an array")
    sig = types.uint64(bits, types.int64, bits.dtype, bits.dtype)

    def codegen(context, builder, signature, args):
        a = _block(context, builder, signature.args[0], args[0], args[1])
        vty = a.type
        mag = builder.and_(a, _broadcast(builder, vty, args[2]))
        return _to_mask(builder, builder.icmp_unsigned(">=", mag, _broadcast(builder, vty, args[3])))

    return sig, codegen


#: Blocks ahead of the current one that :func:`prefetch_block` asks for. The mask pass is two
#: (or three) sequential streams and compute-light; the hardware prefetcher alone left it at
#: 10.6 GB/s on one core where a reduction reads 12.9 (fp32 → bf16 compare, 95.7 M elements);
#: with software prefetch 16 blocks ahead it reads 13.6 GB/s, and 24.9 GB/s on two cores
#: (torch.sum: 21.5-25.4). Measured flat between 4 and 32 blocks.
PREFETCH_BLOCKS = 16


@intrinsic
def prefetch_block(typingctx, ary, s):
    """Ask the cache for ``ary[s : s + 64]`` (one prefetch per 64-byte line; never faults, so
    ``s`` may lie past the end of the array)."""
    if not isinstance(ary, types.Array):
        raise TypeError("prefetch_block takes an array")
    lines = max(1, ary.dtype.bitwidth * LANES // 8 // 64)
    sig = types.void(ary, types.int64)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        base = builder.bitcast(builder.gep(data, [args[1]]), i8p)  # not inbounds: may point past the end
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        for line in range(lines):
            ptr = builder.gep(base, [ir.Constant(ir.IntType(64), 64 * line)])
            # read, high temporal locality (into every level), data cache
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
