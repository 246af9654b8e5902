"""Scalar building blocks of the kernels: a fused multiply-add, bit casts, the 2-bit code of a byte, and the stored
scales, offsets and norms (float16 / bfloat16 bits, or float32) widened to float32.

Each intrinsic is one LLVM instruction or two; its meaning is the Python expression in its docstring.
"""

from __future__ import annotations

import numpy as np

from .jit import NUMBA

# How a stream's scales, offsets and norms are stored, as the kernels read them: the int16 bits of float16 (0) or
# bfloat16 (1) values, or float32 values (2).
SCALE_KINDS = {"float16": 0, "bfloat16": 1, "float32": 2}


if NUMBA:
    import llvmlite.binding as llvm_binding
    import numba

    _FEATURES = llvm_binding.get_host_cpu_features().flatten().split(",")
    # The CPU Numba compiles for (the host, unless NUMBA_CPU_NAME names another) has F16C / FMA instructions
    HAS_F16C = numba.config.CPU_NAME is None and "+f16c" in _FEATURES
    HAS_FMA = numba.config.CPU_NAME is None and "+fma" in _FEATURES
else:
    HAS_F16C = HAS_FMA = False


def fma_reference(a, b, c):
    """What :func:`fma` computes, in NumPy (float32 arrays or scalars): ``a * b + c`` rounded once (through float64,
    exact for the operands the tests use) where the CPU has FMA, else rounded after the product and after the sum."""
    if HAS_FMA:
        return (np.float64(1.0) * a * b + c).astype(np.float32)
    return (np.float32(a) * np.float32(b)).astype(np.float32) + np.float32(c)


def stored_value(x, kind: int) -> np.float32:
    """A stored scale, offset or norm as float32, exactly: ``x`` holds the int16 bits of a float16 (``kind`` 0) or
    bfloat16 (1) value, or a float32 value (2). Compiled code gets the same function (an overload by ``x``'s type)."""
    if kind == 2:
        return np.float32(x)
    bits = np.array([x], np.int16)
    if kind == 0:
        return bits.view(np.float16).astype(np.float32)[0]
    return (bits.astype(np.int32) << 16).view(np.float32)[0]


if NUMBA:
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic, overload

    from .jit import njit

    def low_bits(builder, v, width: int):
        """The integer value v cut or zero-extended to ``width`` bits (LLVM IR)."""
        if v.type.width > width:
            return builder.trunc(v, ir.IntType(width))
        return builder.zext(v, ir.IntType(width)) if v.type.width < width else v

    def fused(builder, a, b, c):
        """a * b + c (LLVM IR, scalars or vectors): one rounding where the CPU has FMA, else two; never left to
        the optimizer's choice."""
        if not HAS_FMA:
            return builder.fadd(builder.fmul(a, b), c)
        ty = a.type
        name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
        module = builder.module
        fma_ = module.globals.get(name) or ir.Function(module, ir.FunctionType(ty, [ty] * 3), name)
        return builder.call(fma_, [a, b, c])

    @intrinsic
    def fma(typingctx, a, b, c):
        """``a * b + c`` for float32 values, rounded once (``np.float32(np.float64(a) * b + c)`` up to double
        rounding) where the CPU has FMA instructions, else ``a * b`` rounded, then ``+ c`` rounded. It vectorizes."""
        if not all(x == types.float32 for x in (a, b, c)):
            return None

        def codegen(context, builder, signature, args):
            return fused(builder, *args)

        return types.float32(a, b, c), codegen

    @intrinsic
    def float32_from_bits(typingctx, bits):
        """The float32 whose IEEE bits are the low 32 bits of the integer ``bits``: ``np.uint32(bits).view(
        np.float32)`` (a register bit cast)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(low_bits(builder, args[0], 32), ir.FloatType())

        return types.float32(bits), codegen

    @intrinsic
    def float32_bits(typingctx, x):
        """The IEEE bits of the float32 ``x`` as an unsigned 32-bit integer: ``np.float32(x).view(np.uint32)``."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(x), codegen

    @intrinsic
    def float32_from_half_bits(typingctx, bits):
        """The float16 whose bits are the low 16 bits of the integer ``bits``, widened to float32: ``np.uint16(bits)
        .view(np.float16).astype(np.float32)`` (exact; one instruction with F16C, and it vectorizes)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            half = builder.bitcast(low_bits(builder, args[0], 16), ir.HalfType())
            return builder.fpext(half, ir.FloatType())

        return types.float32(bits), codegen

    @intrinsic
    def two_bit_code(typingctx, byte, shift):
        """``float((byte >> shift) & 3)`` in 32-bit integer arithmetic: Numba widens integer operations to 64 bits,
        and a loop of 64-bit lanes unpacks half as many codes per vector instruction."""
        if not isinstance(byte, types.Integer) or not isinstance(shift, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            word = low_bits(builder, args[0], 32)
            code = builder.and_(builder.lshr(word, low_bits(builder, args[1], 32)), ir.Constant(ir.IntType(32), 3))
            return builder.uitofp(code, ir.FloatType())

        return types.float32(byte, shift), codegen

    _TWO_POW_112 = np.float32(2.0 ** 112)

    @njit
    def float32_from_half_bits_portable(x):
        """:func:`float32_from_half_bits` without F16C (where LLVM would call a runtime helper for the widening):
        exponent and mantissa moved to float32's positions and scaled by 2^112 (the exponent bias difference;
        exact, subnormals included), for finite values (what the write path stores)."""
        h = np.int64(x) & 0xFFFF
        f = float32_from_bits((h & 0x7FFF) << 13) * _TWO_POW_112
        return -f if h & 0x8000 else f

    _widen_half = float32_from_half_bits if HAS_F16C else float32_from_half_bits_portable

    @overload(stored_value, jit_options={"nogil": True})
    def _stored_value_compiled(x, kind):
        if isinstance(x, types.Float):
            return lambda x, kind: np.float32(x)
        if isinstance(x, types.Integer):
            def widen(x, kind):
                if kind == 1:
                    return float32_from_bits((np.int32(x) & 0xFFFF) << 16)
                return _widen_half(x)

            return widen
        return None

    @njit
    def widen(src, dst, kind):
        """dst[k] = stored_value(src[k], kind) for every k of the flat ``dst``: one loop per kind, each vectorized
        (read from offset 0: indices provably non-negative, no wraparound check per element)."""
        if kind == 0:
            for k in range(dst.shape[0]):
                dst[k] = stored_value(src[k], 0)
        elif kind == 1:
            for k in range(dst.shape[0]):
                dst[k] = stored_value(src[k], 1)
        else:
            for k in range(dst.shape[0]):
                dst[k] = stored_value(src[k], 2)

    @njit
    def stored_rows(scale, lo, t0, n, kind):
        """Rows ``t0 .. t0 + n`` of a stream's scales and offsets ``[rows, X]`` as float32 arrays ``[n, X]``, made
        once per split so that the loops that read them read float32."""
        width = scale.shape[1]
        scale_f = np.empty((n, width), np.float32)
        lo_f = np.empty((n, width), np.float32)
        widen(scale[t0:t0 + n].reshape(-1), scale_f.reshape(-1), kind)
        widen(lo[t0:t0 + n].reshape(-1), lo_f.reshape(-1), kind)
        return scale_f, lo_f

    @njit
    def stored_norms(norm, t0, n, kind):
        """Entries ``t0 .. t0 + n`` of a stream's token norms as float32 (an empty array for ``n`` = 0)."""
        out = np.empty(n, np.float32)
        widen(norm[t0:t0 + n], out, kind)
        return out
