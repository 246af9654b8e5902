"""The fused attention kernel: the INT2 body's partial attention (split-K), and optionally the whole decode step of a
dynamic layer around it (query rotation, full-precision windows, merge).

Data flow of one call (one compiled kernel per head_dim; layouts are run-time values of the records below):

1. (layer step) each query row is rotated into the keys' space (:func:`~.windows.rotate_query`);
2. (per-token keys) each (batch row, KV head) gets its query tables (:func:`~.keys.key_table`);
3. the body's tokens are cut into splits; one parallel task per (batch row, KV head, split) computes the split's
   scores (:mod:`.keys`), masks them, turns them into unnormalised softmax weights (:mod:`.softmax`) and sums the
   weighted values (:mod:`.values`): :func:`split_partial`;
4. one parallel item per (batch row, KV head, query row) merges the splits by log-sum-exp
   (:func:`~.softmax.merge_splits`) and either normalises (body) or merges the windows' partials
   (:func:`~.windows.window_partial`, :func:`~.windows.merge_step`).
"""

from __future__ import annotations

import functools
from collections import namedtuple

import numpy as np

from .ir import LANES
from .jit import NUMBA

# One stream (keys or values) of the body: codes [B, H, >= n, D/4] uint8; scale / lo [B, H, rows, D/G] (per-token
# groups of G channels) or [B, H, rows, D] (per-channel groups of G tokens), float16 / bfloat16 bits (int16) or
# float32 (``kind``, see bits.SCALE_KINDS); norm [B, >= n] token norms or [B, 0]; token_axis: per-token groups. Or
# an arena's pages: the same arrays with [H, blocks, page] for [B, H, tokens] (norm [blocks, page] or [1, 0]), read
# through a page table (make_kernel's ``pages``).
Stream = namedtuple("Stream", ["codes", "scale", "lo", "norm", "token_axis", "group", "kind"])
# The layer step's full-precision windows and codecs: k0 / v0 [W, H, n0, D] before the body (the sink), k1 / v1
# [W, H, >= n1, D] after it (the recent window and the current chunk: batch row b attends its first n1[b] tokens,
# n1 [B] int64, so that rows holding fewer need no mask); rot_k [D, D] and mean_k
# [H, D] or [0, D] (keys' codec), rot_v_t = R_V^T [D, D] and mean_v (values' codec); rows [B] int64: the window row
# of each batch row (0 .. B-1, or a serving engine's window slots, read where they are).
Windows = namedtuple("Windows", ["k0", "v0", "k1", "v1", "n1", "rot_k", "mean_k", "rot_v_t", "mean_v", "rows"])
# The additive mask [B, Lq or 1, columns] ([0, 0, 1]: none) of query positions 0 .. query_len - 1; the body's
# columns start at col0 (after the window before it). body_len [B] int64: the body tokens each batch row attends
# (its first ones; the kernel skips the rest, e.g. the padding of a serving engine's shorter requests).
Mask = namedtuple("Mask", ["add", "col0", "query_len", "body_len"])


def vector_width(d: int) -> int:
    """Bytes of codes per vector in the intrinsics for head_dim d: the widest of 16, 8, 4 dividing d / 4 (0: none)."""
    return next((w for w in (16, 8, 4) if d % (4 * w) == 0), 0)


def fast_group_bytes(d: int) -> tuple[int, int, int]:
    """Per-token group sizes (in bytes of codes) with unrolled, vectorized loops for head_dim d: the recipes' groups
    of min(128, d) and 32 channels and one group of all d channels (any other size runs the general loops)."""
    return (d // 4, min(128, d) // 4, 8) if vector_width(d) else (-1, -1, -1)


if NUMBA:
    import numba

    from .bits import stored_norms, stored_rows
    from .jit import njit
    from .keys import (
        channel_key_scores_split,
        group_sums,
        key_table,
        token_key_scores,
        token_key_scores_any,
        token_key_scores_plain,
    )
    from .softmax import add_mask, merge_splits, split_weights
    from .values import channel_value_sums, token_value_sums, token_value_sums_any
    from .windows import merge_step, rotate_query, window_partial

    @njit(inline="always")
    def split_key_scores(scores, part_m, q, bias, keys, codes, scale, lo, norm, tables, qsum, t0, live_rows, d4, width,
                         fast_a, fast_b, fast_c):
        """A split's scores [ns, RP] (tokens t0 .. of one (batch row, KV head)'s ``codes [tokens, D/4]``, ``scale`` /
        ``lo`` rows and ``norm [tokens]`` or empty) of query rows ``q [RP, D]`` with ``bias [RP]``; per-token keys
        also set the rows' max score ``part_m [RP]``. Returns whether they did."""
        ns = scores.shape[0]
        k_norm = stored_norms(norm, t0, ns if norm.shape[0] > 0 else 0, keys.kind)
        k_codes = codes[t0:t0 + ns]
        if keys.token_axis:
            k_scale, k_lo = stored_rows(scale, lo, t0, ns, keys.kind)
            gb = keys.group // 4
            fast = keys.group % 4 == 0 and (gb == fast_a or gb == fast_b or gb == fast_c)
            if not fast and keys.group % 4:  # groups smaller than a byte's four channels: no tables
                token_key_scores_plain(scores, part_m, q, k_codes, k_scale, k_lo, k_norm, bias, keys.group)
            elif not fast:
                token_key_scores_any(scores, part_m, tables, qsum, k_codes, k_scale, k_lo, k_norm, bias, gb)
            elif width > 0:  # (a literal: no fast loops compiled for a head_dim without vector width)
                if gb == fast_a:
                    token_key_scores(scores, part_m, tables, qsum, k_codes, k_scale, k_lo, k_norm, bias, d4, fast_a)
                elif gb == fast_b:
                    token_key_scores(scores, part_m, tables, qsum, k_codes, k_scale, k_lo, k_norm, bias, d4, fast_b)
                else:
                    token_key_scores(scores, part_m, tables, qsum, k_codes, k_scale, k_lo, k_norm, bias, d4, fast_c)
            return True
        g0 = t0 // keys.group
        k_scale, k_lo = stored_rows(scale, lo, g0, -(-ns // keys.group), keys.kind)
        norm_f = k_norm if k_norm.shape[0] > 0 else np.ones(ns, np.float32)
        channel_key_scores_split(scores, q, bias, k_codes, k_scale, k_lo, norm_f, keys.group, live_rows, d4, width)
        return False

    @njit(inline="always")
    def split_value_sums(weights, values, codes, scale, lo, norm, t0, live_rows, acc, l_out, d4, width, fast_a,
                         fast_b, fast_c):
        """A split's value sum ``acc [RP, D]`` and weight sum ``l_out [RP]`` from its weights [ns, RP] (tokens t0 ..
        of one (batch row, KV head)'s arrays, as :func:`split_key_scores` reads them)."""
        ns = weights.shape[0]
        v_norm = stored_norms(norm, t0, ns if norm.shape[0] > 0 else 0, values.kind)
        v_codes = codes[t0:t0 + ns]
        if not values.token_axis:
            channel_value_sums(weights, v_codes, scale, lo, v_norm, values.group, t0, values.kind, live_rows, acc,
                               l_out, d4, width)
            return
        v_scale, v_lo = stored_rows(scale, lo, t0, ns, values.kind)
        gb = values.group // 4
        fast = values.group % 4 == 0 and (gb == fast_a or gb == fast_b or gb == fast_c)
        if not fast:
            token_value_sums_any(weights, v_codes, v_scale, v_lo, v_norm, values.group, acc, l_out)
        elif width > 0:
            if gb == fast_a:
                token_value_sums(weights, v_codes, v_scale, v_lo, v_norm, live_rows, acc, l_out, d4, fast_a, width)
            elif gb == fast_b:
                token_value_sums(weights, v_codes, v_scale, v_lo, v_norm, live_rows, acc, l_out, d4, fast_b, width)
            else:
                token_value_sums(weights, v_codes, v_scale, v_lo, v_norm, live_rows, acc, l_out, d4, fast_c, width)

    @njit(inline="always")
    def copy_rows(out, at, rows, r0, n):
        """out[at:at + n] = rows[r0:r0 + n] (C-contiguous [rows, X] arrays), as one flat loop."""
        width = out.shape[1]
        flat_out = out.reshape(-1)[at * width:(at + n) * width]
        flat_in = rows.reshape(-1)[r0 * width:(r0 + n) * width]
        for k in range(n * width):
            flat_out[k] = flat_in[k]

    @njit(inline="always")
    def task_rows(stream, pages, b, h, t0, t1):
        """Batch row b's tokens t0 .. t1 (t0 a group boundary) of KV head h from an arena's pages (``stream``'s
        arrays [H, blocks, page, ...], page i at block ``pages[b, i]``), copied into contiguous arrays ``(codes
        [n, D/4], scale, lo [rows, ...], norm [n] or empty)`` as stored: one task's share of what a gather copies,
        made where it is read (cache-hot, no arena-sized temporaries); the task then reads it as a gathered body."""
        page, n = stream.codes.shape[2], t1 - t0
        g = 1 if stream.token_axis else stream.group
        rows = -(-n // g)
        codes = np.empty((n, stream.codes.shape[3]), stream.codes.dtype)
        scale = np.empty((rows, stream.scale.shape[3]), stream.scale.dtype)
        lo = np.empty((rows, stream.lo.shape[3]), stream.lo.dtype)
        normed = stream.norm.shape[1] > 0
        norm = np.empty(n if normed else 0, stream.norm.dtype)
        t = t0
        while t < t1:
            i = t // page
            at, stop = t - i * page, min(t1, (i + 1) * page)
            block = pages[b, i]
            copy_rows(codes, t - t0, stream.codes[h, block], at, stop - t)
            r0, r1 = (t - t0) // g, -(-(stop - t0) // g)
            copy_rows(scale, r0, stream.scale[h, block], at // g, r1 - r0)
            copy_rows(lo, r0, stream.lo[h, block], at // g, r1 - r0)
            if normed:
                norm_out, norm_in = norm[t - t0:stop - t0], stream.norm[block, at:at + stop - t]
                for k in range(stop - t):
                    norm_out[k] = norm_in[k]
            t = stop
        return codes, scale, lo, norm

    @njit(inline="always")
    def split_partial(q, bias, keys, values, mask, pages, tables, qsum, b, h, t0, t1, live_rows, part_m, part_l,
                      part_acc, d4, width, fast_a, fast_b, fast_c):
        """One parallel task: the partial attention of query rows ``q [RP, D]`` (``bias [RP]``) over body tokens
        t0 .. t1 of (batch row b, KV head h): the rows' max score ``part_m [RP]``, weight sum ``part_l [RP]`` and
        unnormalised value sum ``part_acc [RP, D]`` (rotated space). ``tables`` / ``qsum``: the key tables of
        this (b, h) (per-token keys). ``pages``: see :func:`make_kernel` (no columns: the streams' arrays are
        [B, H, tokens, ...]). ``d4``, ``width`` and ``fast_*`` (see :func:`fast_group_bytes`) are literals."""
        scores = np.empty((max(t1 - t0, 0), q.shape[0]), np.float32)
        if pages.shape[1] == 0:
            k_codes, k_scale, k_lo, k_norm = keys.codes[b, h], keys.scale[b, h], keys.lo[b, h], keys.norm[b]
            v_codes, v_scale, v_lo, v_norm = values.codes[b, h], values.scale[b, h], values.lo[b, h], values.norm[b]
            at = t0
        else:
            k_codes, k_scale, k_lo, k_norm = task_rows(keys, pages, b, h, t0, t1)
            v_codes, v_scale, v_lo, v_norm = task_rows(values, pages, b, h, t0, t1)
            at = 0
        max_taken = split_key_scores(scores, part_m, q, bias, keys, k_codes, k_scale, k_lo, k_norm, tables, qsum, at,
                                     live_rows, d4, width, fast_a, fast_b, fast_c)
        add_mask(scores, mask.add, b, mask.query_len, mask.col0 + t0)
        split_weights(scores, part_m, max_taken and mask.add.shape[1] == 0)
        split_value_sums(scores, values, v_codes, v_scale, v_lo, v_norm, at, live_rows, part_acc, part_l, d4, width,
                         fast_a, fast_b, fast_c)

    @njit(inline="always")
    def body_output(m, total, acc, out):
        """A body-only row: its value sum normalised into ``out`` [D]; returns the log-sum-exp (a row that attends
        nothing: zeros, -inf)."""
        if total > 0.0:
            inv = np.float32(1.0) / total
            for c in range(out.shape[0]):
                out[c] = acc[c] * inv
            return m + np.float32(np.log(total))
        out[:] = 0.0
        return np.float32(-np.inf)

    @njit(inline="always")
    def step_output(q, windows, mask, n, b, h, row, scaling, m, total, acc, out, d, width):
        """A layer step's row: the body's merged partial (m, total, acc) with the two windows' partials, in the
        original space, into ``out`` [D]; returns the log-sum-exp. ``d`` and ``width`` are literals."""
        parts_m, parts_l = np.empty(3, np.float32), np.empty(3, np.float32)
        parts_acc = np.empty((3, d), np.float32)
        query_row = row % mask.query_len
        w = windows.rows[b]
        parts_m[0], parts_l[0] = window_partial(q, windows.k0[w, h], windows.v0[w, h], windows.k0.shape[2], scaling,
                                                mask.add, b, query_row, 0, parts_acc[0], d, width)
        parts_m[1], parts_l[1] = window_partial(q, windows.k1[w, h], windows.v1[w, h], windows.n1[b], scaling,
                                                mask.add, b, query_row, mask.col0 + n, parts_acc[1], d, width)
        parts_m[2], parts_l[2] = m, total
        return merge_step(parts_m, parts_l, parts_acc, acc, windows.rot_v_t, windows.mean_v, h, out, d)


@functools.cache
def make_kernel(d: int):
    """The kernel for head_dim ``d`` (compiled on first call for the argument types, then cached on disk; needs
    Numba)."""
    d4, width = d // 4, vector_width(d)
    fast_a, fast_b, fast_c = fast_group_bytes(d)
    dot_width = width if width else 4  # the windows' dots: d is a multiple of 4

    # parallel loops only where the code says prange (no array expression becomes one)
    @njit(parallel={"prange": True, "comprehension": False, "reduction": False, "inplace_binop": False,
                    "setitem": False, "numpy": False, "stencil": False, "fusion": False})
    def attend(q_in, bias_in, rows, keys, values, windows, mask, pages, n, split, scaling, whole, out, lse):
        """Body (``whole`` False): ``q_in [B, H, RP, D]`` rotated and scaled (RP a multiple of LANES; padding
        rows zero), ``bias_in [B, H, RP]``; ``out [B, H, RP, D]`` / ``lse [B, H, RP]`` the normalised body
        partial. Layer step (``whole``): ``q_in [B, H, rows, D]`` in the original space, unscaled; ``out [B,
        H, rows, D]`` the step's attention output. Body tokens 0 .. n in splits of ``split`` tokens. ``pages
        [B, max pages]`` int64: the streams' arrays are an arena's pages [H, blocks, page, ...] (norms [blocks,
        page] or [1, 0]) and batch row b's body token t is row t % page of block ``pages[b, t // page]``: each task
        copies its own tokens (:func:`task_rows`), where a gather before the call would copy every row's pages into
        arena-sized temporaries for each layer. ``[B, 0]``: the arrays are [B, H, tokens, ...]."""
        b_size, h_size = q_in.shape[0], q_in.shape[1]
        nbh = b_size * h_size
        rp = -(-q_in.shape[2] // LANES) * LANES
        n_splits = max(1, -(-n // split))
        live_rows = rows if whole else rp
        if whole:  # q' = scaling * (q R_K), bias = scaling * (q . mu_K), padded to RP rows
            q = np.zeros((b_size, h_size, rp, d), np.float32)
            bias = np.zeros((b_size, h_size, rp), np.float32)
            for item in numba.prange(nbh * rows):
                b, h, r = item // (h_size * rows), (item // rows) % h_size, item % rows
                bias[b, h, r] = rotate_query(q_in[b, h, r], windows.rot_k, windows.mean_k, h, scaling, q[b, h, r],
                                             d, dot_width)
        else:
            q, bias = q_in, bias_in
        n_chunks = rp // LANES
        if keys.token_axis:
            tables = np.empty((nbh, n_chunks, d4 * 256 * LANES), np.float32)
            qsum = np.empty((nbh, d // keys.group, rp), np.float32)
            for item in numba.prange(nbh * n_chunks * d4):  # per byte position: work for every thread
                bh, rc, j = item // (n_chunks * d4), (item // d4) % n_chunks, item % d4
                key_table(q[bh // h_size, bh % h_size], rc, j, tables[bh, rc])
            for bh in range(nbh):
                group_sums(q[bh // h_size, bh % h_size], keys.group, qsum[bh])
        else:
            tables = np.empty((nbh, 0, 0), np.float32)
            qsum = np.empty((nbh, 0, 0), np.float32)
        part_m = np.empty((nbh, n_splits, rp), np.float32)
        part_l = np.empty((nbh, n_splits, rp), np.float32)
        part_acc = np.empty((nbh, n_splits, rp, d), np.float32)
        for task in numba.prange(nbh * n_splits):
            bh, s = task // n_splits, task % n_splits
            b, h = bh // h_size, bh % h_size
            t1 = min(n, mask.body_len[b], (s + 1) * split)
            if s * split >= t1:  # past this row's body: a split that attends nothing (the merge skips it)
                part_m[bh, s, :] = -np.inf
                continue
            split_partial(q[b, h], bias[b, h], keys, values, mask, pages, tables[bh], qsum[bh], b, h, s * split,
                          t1, live_rows, part_m[bh, s], part_l[bh, s], part_acc[bh, s], d4, width, fast_a, fast_b,
                          fast_c)
        rows_out = out.shape[2]
        for item in numba.prange(nbh * rows_out):  # one fork and join for the merge and what follows it
            bh, r = item // rows_out, item % rows_out
            b, h = bh // h_size, bh % h_size
            acc = np.empty(d, np.float32)
            m, total = merge_splits(part_m[bh], part_l[bh], part_acc[bh], r, acc)
            if whole:
                lse[b, h, r] = step_output(q_in[b, h, r], windows, mask, n, b, h, r, scaling, m, total, acc,
                                           out[b, h, r], d, dot_width)
            else:
                lse[b, h, r] = body_output(m, total, acc, out[b, h, r])

    return attend
