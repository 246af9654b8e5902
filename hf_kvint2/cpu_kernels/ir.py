"""LLVM IR pieces that the vector intrinsics (:mod:`.lanes`, :mod:`.key_scores`, :mod:`.value_sums`) are built
from: typed vector loads, a value in every lane, 2-bit code planes, a counted loop carrying values in registers,
pairwise folds, and a copy of the code per query-row count.

Numba's own loops keep running sums in memory whenever two arrays might overlap; these intrinsics keep them in
vector registers, which is why they exist. Every function here takes an ``llvmlite.ir.IRBuilder`` and emits code at
its position.
"""

from __future__ import annotations

from .jit import NUMBA

LANES = 4  # query rows per pass of the kernels: four rows' sums side by side in registers

if NUMBA:
    from llvmlite import ir
    from numba.core import types

    I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def i64(x: int):
        return ir.Constant(I64, x)

    def undef(ty):
        return ir.Constant(ty, ir.Undefined)

    def lane_list(lanes: list[int]):
        """A constant vector of int32 lane indices (a shuffle mask)."""
        return ir.Constant(ir.VectorType(I32, len(lanes)), lanes)

    def as_i64(context, builder, value, numba_type):
        """An integer argument of an intrinsic as int64."""
        return context.cast(builder, value, numba_type, types.int64)

    def array_data(context, builder, array_type, value):
        """The data pointer of a Numba array argument."""
        return context.make_array(array_type)(context, builder, value).data

    def vector_at(builder, p, offset, ty):
        """The element pointer ``p + offset`` as a pointer to ``ty`` (a vector load or store there)."""
        return builder.bitcast(builder.gep(p, [offset]), ty.as_pointer())

    def load_vector(builder, p, offset, count):
        """``count`` float32 values at ``p + offset`` as one vector."""
        return builder.load(vector_at(builder, p, offset, ir.VectorType(F32, count)), align=4)

    def splat(builder, x, count):
        """The float32 ``x`` in each of ``count`` lanes."""
        vector = ir.VectorType(F32, count)
        v = builder.insert_element(undef(vector), x, ir.Constant(I32, 0))
        return builder.shuffle_vector(v, undef(vector), lane_list([0] * count))

    def code_planes(builder, codes_p, byte_at, width):
        """The 2-bit codes of the ``width`` bytes at ``codes_p + byte_at`` as four float32 vectors: plane i holds
        bits 2i, 2i+1 of every byte (channel 4j + i of byte j)."""
        vi, vf = ir.VectorType(I32, width), ir.VectorType(F32, width)
        raw = builder.load(vector_at(builder, codes_p, byte_at, ir.VectorType(ir.IntType(8), width)), align=1)
        word = builder.zext(raw, vi)
        return [builder.sitofp(builder.and_(builder.lshr(word, ir.Constant(vi, [2 * i] * width)),
                                            ir.Constant(vi, [3] * width)), vf) for i in range(4)]

    def loop_start(builder, name, n, carried=()):
        """A loop over t = 0, step, ... while t < n carrying the values ``carried``: returns (t, their phis, the
        header and exit blocks) with the builder in the body; :func:`loop_end` closes it."""
        entry = builder.basic_block
        header = builder.append_basic_block(f"{name}_header")
        body = builder.append_basic_block(f"{name}_body")
        done = builder.append_basic_block(f"{name}_done")
        builder.branch(header)
        builder.position_at_end(header)
        t = builder.phi(I64)
        t.add_incoming(i64(0), entry)
        phis = []
        for v in carried:
            phi = builder.phi(v.type)
            phi.add_incoming(v, entry)
            phis.append(phi)
        builder.cbranch(builder.icmp_signed("<", t, n), body, done)
        builder.position_at_end(body)
        return t, phis, header, done

    def loop_end(builder, loop, step, carried=()):
        """Closes a :func:`loop_start` loop: t advances by ``step`` and its phis take ``carried``; the builder moves
        to the exit, where the phis hold the loop's results."""
        t, phis, header, done = loop
        end = builder.basic_block
        t.add_incoming(builder.add(t, i64(step)), end)
        for phi, v in zip(phis, carried):
            phi.add_incoming(v, end)
        builder.branch(header)
        builder.position_at_end(done)

    def fold_pairs(builder, a, b, segment):
        """a, b: vectors whose lanes hold tokens' partial sums in contiguous segments of ``segment`` lanes (b may be
        a itself). Returns the vector of a's then b's tokens (b's only when b is not a) with each segment halved:
        lane u of a half segment + lane u of the other half."""
        width = a.type.count
        tokens = width // segment
        sources = [(0, j) for j in range(tokens)] + ([(width, j) for j in range(tokens)] if b is not a else [])
        half = segment // 2
        low = [base + j * segment + u for base, j in sources for u in range(half)]
        high = [x + half for x in low]
        return builder.fadd(builder.shuffle_vector(a, b, lane_list(low)), builder.shuffle_vector(a, b, lane_list(high)))

    def fold_to_scalar(builder, v):
        """The sum of a vector's lanes, folded in halves: (lanes 0..w/2 + lanes w/2..w), and so on to one lane."""
        segment = v.type.count
        while segment > 1:
            v, segment = fold_pairs(builder, v, v, segment), segment // 2
        return builder.extract_element(v, ir.Constant(I32, 0))

    def per_row_count(builder, rows, emit):
        """Calls emit(count) for the runtime row count ``rows`` (1 .. LANES) as a compile-time one: a copy of the
        code per count, chosen by a switch (the vector loops keep every row's sums in registers, and a padding row
        would cost as much as a query row)."""
        done = builder.append_basic_block("rows_done")
        switch = builder.switch(rows, done)
        for count in range(1, LANES + 1):
            case = builder.append_basic_block(f"rows_{count}")
            switch.add_case(ir.Constant(rows.type, count), case)
            builder.position_at_end(case)
            emit(count)
            builder.branch(done)
        builder.position_at_end(done)
