"""Properties of the INT2 quantization core: error bound, exact cases, packing, bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hf_kvint2 import OscarCache, OscarScaledCache, cpu_kernels
from hf_kvint2.layers import OscarLayer
from hf_kvint2.quant import dequantize_int2, pack_int2, quantize_int2, unpack_int2
from hf_kvint2.settings import oscar_recipe
from hf_kvint2.transforms import clip_rows

SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FP32_EPS = torch.finfo(torch.float32).eps


@st.composite
def grouped_tensors(draw, max_abs=1e4):
    """A [B, H, T, D] float32 tensor with a group axis and a group size that tiles it."""
    axis = draw(st.sampled_from(["token", "channel"]))
    group = draw(st.sampled_from([4, 8, 16]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    d = draw(st.sampled_from([4, 8, 16, 32])) if axis == "channel" else group * draw(st.integers(1, 3))
    t = draw(st.integers(1, 5)) if axis == "token" else group * draw(st.integers(1, 3))
    elements = st.floats(-max_abs, max_abs, allow_nan=False, allow_infinity=False, width=32)
    x = draw(arrays(np.float32, (b, h, t, d), elements=elements))
    return torch.from_numpy(x), axis, group


def _group_stats(x, axis, group):
    """Reference lo/scale per element (float32, unrounded), computed independently of the library."""
    b, h, t, d = x.shape
    if axis == "token":
        g = x.reshape(b, h, t, d // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    else:
        g = x.reshape(b, h, t // group, group, d)
        lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    return lo.expand_as(g).reshape(x.shape), ((hi - lo) / 3).expand_as(g).reshape(x.shape)


def _expand_stored(q, x, axis, group, which):
    """Broadcast a stored per-group tensor (q.scale or q.lo) back to x's shape, as float32."""
    s = getattr(q, which).float()
    if axis == "token":
        return s.repeat_interleave(group, dim=-1)
    return s.repeat_interleave(group, dim=-2)


@settings(max_examples=150, deadline=None)
@given(grouped_tensors(), st.sampled_from(SCALE_DTYPES))
def test_error_bounded_by_half_scale_plus_storage_rounding(case, scale_dtype):
    x, axis, group = case
    if scale_dtype is torch.float16 and x.abs().max() > 6e4:
        return  # covered by test_fp16_scale_overflow_is_an_error
    q = quantize_int2(x, axis, group, scale_dtype)
    xhat = dequantize_int2(q, axis, group)
    assert xhat.shape == x.shape and torch.isfinite(xhat).all()
    lo, scale = _group_stats(x, axis, group)
    lo_s, scale_s = _expand_stored(q, x, axis, group, "lo"), _expand_stored(q, x, axis, group, "scale")
    # Storage rounding: codes are chosen against the stored lo/scale; clamping at code 0 or 3 can add the
    # rounding of lo and 3x the rounding of scale (both are zero with fp32 scales, up to float arithmetic).
    rounding = (lo - lo_s).abs() + 3 * (scale - scale_s).abs()
    # Float32 arithmetic: relative rounding, plus an absolute floor because a group whose range is subnormal
    # (e.g. [0, 1e-45]) underflows (hi - lo) / 3 to zero and comes back as lo.
    arithmetic = 8 * FP32_EPS * (x.abs() + lo.abs() + 3 * scale) + 4 * torch.finfo(torch.float32).tiny
    err = (x - xhat).abs()
    assert (err <= scale_s / 2 + rounding + arithmetic).all(), (err - scale_s / 2 - rounding).max()
    if scale_dtype is torch.float32:
        assert (err <= scale / 2 + arithmetic).all()


@settings(max_examples=100, deadline=None)
@given(grouped_tensors(max_abs=1e3), st.data())
def test_groups_on_the_four_level_grid_are_exact(case, data):
    """Values lo + k*scale (k in 0..3, with both ends present) come back bit-exactly with fp32 scales.

    lo and scale are dyadic (multiples of 1/64, bounded), so every step of the arithmetic is exact; four arbitrary
    distinct values are not on any uniform 4-level grid, so exactness is a property of grid values only."""
    shape_ref, axis, group = case
    n_groups = shape_ref.numel() // group
    lo = torch.tensor(data.draw(st.lists(st.integers(-4096, 4096), min_size=n_groups, max_size=n_groups))) / 64
    step = torch.tensor(data.draw(st.lists(st.integers(0, 512), min_size=n_groups, max_size=n_groups))) / 64
    k = torch.randint(0, 4, (n_groups, group), generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    k[:, 0], k[:, -1] = 0, 3  # the grid's ends define lo and scale
    vals = lo[:, None] + k * step[:, None]
    b, h, t, d = shape_ref.shape
    if axis == "token":
        x = vals.reshape(b, h, t, d)
    else:
        x = vals.reshape(b, h, t // group, d, group).transpose(-1, -2).reshape(b, h, t, d)
    q = quantize_int2(x, axis, group, torch.float32)
    assert torch.equal(dequantize_int2(q, axis, group), x)


@settings(max_examples=100, deadline=None)
@given(grouped_tensors(), st.data())
def test_groups_with_at_most_two_distinct_values(case, data):
    """With fp32 scales, a group holding only its min and max maps them to codes 0 and 3 and reconstructs the min
    exactly and the max up to float32 rounding of ``lo + 3 * ((hi - lo) / 3)``. (With fp16/bf16 scales a rounded
    ``lo`` can move both to one code when the range is tiny against ``|lo|``; the error bound test covers that.)"""
    x, axis, group = case
    pick = torch.rand(x.shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))) < 0.5
    lo_ref, scale_ref = _group_stats(x, axis, group)
    two = torch.where(pick, lo_ref, lo_ref + 3 * scale_ref)  # every group holds only its min and/or its max
    q = quantize_int2(two, axis, group, torch.float32)
    codes = unpack_int2(q.codes)
    lo2, scale2 = _group_stats(two, axis, group)
    at_min = two == lo2
    assert (codes[at_min] == 0).all()
    assert (codes[(~at_min) & (scale2 > 0)] == 3).all()
    xhat = dequantize_int2(q, axis, group)
    assert torch.equal(xhat[at_min], two[at_min])
    assert ((xhat - two).abs() <= 4 * FP32_EPS * (two.abs() + lo2.abs())).all()


@settings(max_examples=100, deadline=None)
@given(grouped_tensors(max_abs=1e3), st.sampled_from([0.5, 0.7, 0.85, 0.95]))
def test_narrowed_group_range(case, range_clip):
    """Per-channel groups with ``range_clip``: the levels span that fraction of each group's [min, max] about its
    centre (fp32 scales: exactly the reference arithmetic); values inside come back within half a step, values
    outside at the nearer end level; ``range_clip=1`` is the full range bit for bit."""
    x, _, group = case
    if x.shape[-2] % group:
        return
    b, h, t, d = x.shape
    g = x.reshape(b, h, t // group, group, d)
    lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    shrink = (hi - lo) / (2.0 / (1.0 - range_clip))
    lo2, hi2 = lo + shrink, hi - shrink
    q = quantize_int2(x, "channel", group, torch.float32, range_clip=range_clip)
    assert torch.equal(q.lo, lo2.squeeze(-2)) and torch.equal(q.scale, ((hi2 - lo2) / 3).squeeze(-2))
    xhat = dequantize_int2(q, "channel", group).reshape(g.shape)
    step = (hi2 - lo2) / 3
    tol = 8 * FP32_EPS * (g.abs() + lo.abs() + hi.abs()) + 4 * torch.finfo(torch.float32).tiny
    inside = (g >= lo2) & (g <= hi2)
    assert ((xhat - g).abs() <= step / 2 + tol)[inside].all()
    assert ((xhat - lo2).abs() <= tol)[g < lo2].all() and ((xhat - (lo2 + 3 * step)).abs() <= tol)[g > hi2].all()
    full = quantize_int2(x, "channel", group, torch.float16)
    same = quantize_int2(x, "channel", group, torch.float16, range_clip=1.0)
    assert all(torch.equal(u, v) for u, v in zip(full, same))


def test_narrowed_range_is_for_channel_groups_only():
    from hf_kvint2.recipes import GroupLayout

    with pytest.raises(ValueError, match="'channel' groups only"):
        quantize_int2(torch.randn(1, 1, 4, 8), "token", 4, range_clip=0.8)
    with pytest.raises(ValueError, match="per-token groups"):
        GroupLayout("token", 32, range_clip=0.8)
    for bad in (0.0, 1.5, -0.2, True, "0.8"):
        with pytest.raises(ValueError, match="range_clip must be a fraction"):
            GroupLayout("channel", 32, range_clip=bad)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_constant_groups_are_exact_without_division_by_zero(axis, scale_dtype):
    values = torch.tensor([0.0, 1.0, -2.5, 0.375, 1024.0, -3e-5])
    x = values[:, None, None, None].expand(6, 2, 8, 16).contiguous()
    q = quantize_int2(x, axis, 8, scale_dtype)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.lo).all()
    assert (q.scale == 0).all() and (unpack_int2(q.codes) == 0).all()
    xhat = dequantize_int2(q, axis, 8)
    assert torch.equal(xhat, x.to(scale_dtype).float())  # lo is stored in scale_dtype: exact when representable
    if scale_dtype is torch.float32:
        assert torch.equal(xhat, x)


def test_pack_unpack_bijective_on_all_bytes():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = unpack_int2(every_byte)
    assert codes.shape == (4, 256) and codes.dtype == torch.uint8 and int(codes.max()) == 3
    assert torch.equal(pack_int2(codes), every_byte)
    # every 4-code combination, and the documented order: channel 4j in the two least significant bits
    combos = torch.cartesian_prod(*[torch.arange(4)] * 4).to(torch.uint8)  # [256, 4]
    packed = pack_int2(combos)
    assert packed.shape == (256, 1)
    assert sorted(packed.flatten().tolist()) == list(range(256))
    expected = combos[:, 0] | combos[:, 1] << 2 | combos[:, 2] << 4 | combos[:, 3] << 6
    assert torch.equal(packed[:, 0], expected)
    assert torch.equal(unpack_int2(packed), combos)


def test_pack_needs_multiple_of_four():
    with pytest.raises(ValueError, match="divisible by 4"):
        pack_int2(torch.zeros(2, 6, dtype=torch.uint8))


def test_bad_group_settings_are_rejected():
    x = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_int2(x, "token", 12)
    with pytest.raises(ValueError, match="token count"):
        quantize_int2(x, "channel", 3)
    with pytest.raises(ValueError, match="Unknown group axis"):
        quantize_int2(x, "head", 8)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_int2(x, "token", 8, torch.float64)


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_fp16_scale_overflow_is_an_error(axis):
    x = torch.randn(1, 1, 8, 16)
    x[0, 0, 3, 5] = 1e5
    with pytest.raises(ValueError, match="fp16 scales.*bfloat16"):
        quantize_int2(x, axis, 8, torch.float16)
    q = quantize_int2(x, axis, 8, torch.bfloat16)  # the suggested fix works
    assert torch.isfinite(dequantize_int2(q, axis, 8)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_to_a_layer_names_the_layer(bad):
    k = torch.randn(1, 2, 5, 16)
    v = torch.randn(1, 2, 5, 16)
    v[0, 1, 2, 3] = bad
    layer = OscarLayer(oscar_recipe(), layer_idx=7)
    with pytest.raises(ValueError, match="layer 7.*NaN or Inf"):
        layer.update(k, v)
    cache = OscarScaledCache()
    cache.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), 0)
    with pytest.raises(ValueError, match="layer 1.*NaN or Inf"):
        cache.update(v, k, 1)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_finite_check_agrees_with_torch(dtype):
    """The update's compiled NaN/Inf check (float bits) == torch.isfinite, on strided and contiguous K/V, at the
    dtype's largest finite value and its subnormals."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 7, 3, 8, generator=g).to(dtype).transpose(1, 2)  # [B, H, T, D] as attention makes it
    v = k.contiguous()
    assert cpu_kernels.finite_check_supports(k) and cpu_kernels.all_finite(k, v)
    info = torch.finfo(dtype)
    for special in (info.max, -info.max, info.tiny / 4, 0.0):
        assert cpu_kernels.all_finite(torch.full_like(v, special), k)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in [(0, 0, 0, 0), (1, 2, 6, 7)]:
            x = k.clone()
            x[at] = bad
            assert not cpu_kernels.all_finite(v, x) and not cpu_kernels.all_finite(x, v)
    assert not cpu_kernels.finite_check_supports(k.double()) and not cpu_kernels.finite_check_supports(k[0])


@pytest.mark.parametrize("make", [lambda **kw: OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=8, **kw),
                                  lambda **kw: OscarCache(sink_tokens=4, recent_tokens=8, **kw)])
def test_fp16_scale_overflow_in_a_cache_names_the_layer_and_rejects_the_update(make):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g)
    cache = make()
    cache.update(k, v, 0)
    held = {k: n for k, n in cache.memory_report()["total"].items() if k != "allocated"}  # capacity may grow
    big = v[:, :, :16] * 1e5  # fits the bf16 model dtype, not fp16 scales
    with pytest.raises(ValueError, match="layer 0: .*fp16 scales.*scale_dtype=torch.bfloat16"):
        cache.update(k[:, :, :16], big, 0)
    after = {k: n for k, n in cache.memory_report()["total"].items() if k != "allocated"}
    assert cache.get_seq_length() == 24 and after == held  # nothing half-written
    wide = make(scale_dtype=torch.bfloat16)
    wide.update(k, v, 0)
    _keys, values = wide.update(k[:, :, :16], big, 0)
    assert torch.isfinite(values).all() and wide.get_seq_length() == 40


@pytest.mark.parametrize("make", [lambda: OscarScaledCache(sink_tokens=0, recent_tokens=16, group_size=8),
                                  lambda: OscarCache(sink_tokens=4, recent_tokens=16)])
def test_memory_held_after_prefill_and_decode_stays_near_the_data(make):
    """A prefill's full-precision chunk must not stay alive behind the recent window (a slice of it would keep
    all of it), and the body's growable buffers must not hold far more than their rows."""
    g = torch.Generator().manual_seed(0)
    cache = make()
    k, v = torch.randn(2, 2, 1000, 16, generator=g), torch.randn(2, 2, 1000, 16, generator=g)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    for t in (layer.sink_k, layer.sink_v):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    for t in (layer.recent_k, layer.recent_v):  # the window, with room for one demotion block of decode steps
        room = layer.recipe.recent_tokens + layer.recipe.demotion_block
        assert t.untyped_storage().nbytes() == room * t.numel() // t.shape[-2] * t.element_size()
    for _ in range(300):  # decode appends grow the body buffers step by step
        cache.update(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g), 0)
    report = cache.memory_report()["total"]
    for t in (layer.recent_k, layer.recent_v):
        assert t.untyped_storage().nbytes() <= 2 * t.numel() * t.element_size()
    body = report["codes"] + report["scales"] + report["norms"]
    assert report["allocated"] - report["full_precision"] <= 1.125 * body + 6 * 256 * 2 * 2 * 16


def _random_float_bits(n: int, gen: torch.Generator, ties: bool) -> torch.Tensor:
    """n float32 values over fp16's subnormals .. 2e4 (random bit patterns), or midpoints of adjacent fp16 values
    (where rounding to the scale dtype is a tie), random signs."""
    if ties:
        h = torch.randint(0, 0x7BFF, (n,), generator=gen).to(torch.int16)
        lo, hi = h.view(torch.float16).float(), (h + 1).view(torch.float16).float()
        x = (lo + hi) / 2
    else:
        e = torch.randint(127 - 30, 127 + 15, (n,), generator=gen)
        m = torch.randint(0, 1 << 23, (n,), generator=gen)
        x = ((e << 23) | m).to(torch.int32).view(torch.float32)
    return (x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)).clamp(-2e4, 2e4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compiled_token_quantizer_is_bit_identical_to_the_torch_ops(scale_dtype):
    """cpu_kernels.quantize_token_groups (the write path's one-call clip + quantize on CPU) stores exactly what
    clip_rows + quantize_int2 store: codes, scale bits and offset bits, over many random tokens of every
    magnitude (fp16 subnormal scales, rounding ties of the scale dtype), with and without clipping (quantiles
    near 1, taken from the row's few largest |x|, and lower ones, from the sorted row), constant groups included,
    groups of fewer channels than a byte holds."""
    gen = torch.Generator().manual_seed(7)
    for d, group in ((64, 64), (64, 32), (128, 128), (16, 16), (16, 2)):  # 2: groups within a byte
        for ties in (False, True):
            x = _random_float_bits(2 * 3 * 200 * d, gen, ties).reshape(2, 3, 200, d)
            x[0, 0, :3] = 1.25  # constant groups: scale 0, code 0
            x[1, 2, 5] = 0.0
            for clip in (None, 0.96, 0.92, 0.5, 1.0):
                ref = quantize_int2(clip_rows(x.clone(), clip), "token", group, scale_dtype)
                got = cpu_kernels.quantize_token_groups(x.clone(), clip, group, scale_dtype)
                for name, a, b in zip(("codes", "scale", "lo"), ref, got):
                    assert a.dtype == b.dtype and a.shape == b.shape, name
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, d, group, clip, ties)
    big = torch.full((1, 1, 1, 16), 3e38)
    big[..., ::2] = -3e38  # a range past float32's largest value: no scale dtype holds it
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.quantize_token_groups(big, None, 16, scale_dtype)
    nan = torch.randn(1, 1, 2, 16)
    nan[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.quantize_token_groups(nan, 0.9, 16, scale_dtype)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_reads_every_stored_16_bit_value_exactly(dtype):
    """The body kernel widens stored scales/offsets/norms from their 16-bit bits in registers: every one of the
    65536 bit patterns reads back as torch's float32 value of it, bit for bit (signed zeros, subnormals, the
    largest values; NaN as NaN)."""
    from hf_kvint2.cpu_kernels import bits as kernel_bits

    bits = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)
    want = torch.from_numpy(bits.copy()).view(dtype).float().numpy()
    kind = kernel_bits.SCALE_KINDS[str(dtype).removeprefix("torch.")]
    got = np.empty(len(bits), np.float32)
    kernel_bits.widen(bits, got, kind)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite].view(np.int32), want[finite].view(np.int32))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    if dtype == torch.float16:  # the variant for CPUs without F16C, on the finite values the write path stores
        portable = np.array([kernel_bits.float32_from_half_bits_portable(b) for b in bits[finite]], np.float32)
        assert np.array_equal(portable.view(np.int32), want[finite].view(np.int32))
