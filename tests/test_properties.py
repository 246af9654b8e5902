"""Property-based tests (hypothesis) of the INT2 quantizer and the cache layer contract.

Random shapes, dtypes and magnitudes (1e-30..1e30 in fp32, the full fp16 / bf16 ranges), constant and zero rows:
whatever is stored is finite and every stored token's error is bounded, or the input is refused with a
ValueError that says so and the cache is left as it was. Sequences of update / crop / reorder / select run
against transformers' ``DynamicCache``: with windows covering every token the outputs are identical, otherwise
close within the bound. Derandomized with a fixed example budget, so CI runs the same cases in about a minute.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from hf_kvint2 import GroupLayout, OscarCache, OscarScaledCache, cpu_kernels
from hf_kvint2.quant import QuantizedGroups, dequantize_int2, quantize_int2
from hf_kvint2.static_cache import StaticOscarCache
from hf_kvint2.transforms import clip_rows

CI = settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# log10 of the magnitudes each K/V dtype is tested at (up to its largest finite values)
EXPONENTS = {torch.float32: (-30, 30), torch.float16: (-4, 4.5), torch.bfloat16: (-30, 37)}
SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# Tiny tensors: thread start-up dominates, and on a loaded 2-core machine extra threads make it 50x slower.
pytestmark = pytest.mark.usefixtures("module_single_thread")


@st.composite
def tensors(draw, shape, dtype):
    """Gaussian rows at a random magnitude, with some rows constant and some zero."""
    lo, hi = EXPONENTS[dtype]
    magnitude = 10.0 ** draw(st.floats(lo, hi))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * magnitude
    rows = x.reshape(-1, shape[-1])
    for i in range(rows.shape[0]):
        kind = draw(st.sampled_from(["random"] * 4 + ["constant", "zero"]))
        if kind == "constant":
            rows[i] = rows[i, 0]
        elif kind == "zero":
            rows[i] = 0.0
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


# ---------------------------------------------------------------------------------------------- quantizer
@st.composite
def quantizer_case(draw):
    axis = draw(st.sampled_from(["token", "channel"]))
    d = draw(st.sampled_from([4, 8, 16, 32]))
    group = draw(st.sampled_from([g for g in (2, 4, 8, 16, 32) if axis == "channel" or d % g == 0]))
    t = group * draw(st.integers(1, 3)) if axis == "channel" else draw(st.integers(1, 6))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), t, d)
    dtype = draw(st.sampled_from(list(EXPONENTS)))
    return axis, group, draw(st.sampled_from(SCALE_DTYPES)), draw(tensors(shape, dtype))


@CI
@given(quantizer_case())
def test_quantizer_stores_finite_values_with_bounded_error_or_refuses(case):
    axis, group, scale_dtype, x = case
    xf = x.double()
    top = xf.abs().max().item()
    try:
        q = quantize_int2(x, axis, group, scale_dtype)
    except ValueError as e:
        assert "do not fit" in str(e) and "scale" in str(e)
        # refused only when the group range or offset does not fit the scale dtype
        assert 2 * top > torch.finfo(scale_dtype).max / 2
        return
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.lo).all()
    err = (dequantize_int2(q, axis, group).double() - xf).abs()
    # per group: half a step (range / 6) plus the rounding of lo and scale to scale_dtype, plus underflow
    dim = -1 if axis == "token" else -2
    grouped = xf.unflatten(dim, (-1, group))
    gdim = -1 if axis == "token" else -2  # the within-group axis after unflatten
    g_range = (grouped.amax(dim=gdim, keepdim=True) - grouped.amin(dim=gdim, keepdim=True))
    g_top = grouped.abs().amax(dim=gdim, keepdim=True)
    eps, tiny = torch.finfo(scale_dtype).eps, torch.finfo(scale_dtype).tiny
    bound = g_range / 6 + 4 * eps * (g_top + g_range) + 4 * tiny
    assert (err.unflatten(dim, (-1, group)) <= bound * (1 + 1e-9)).all()


def int2_bound(x: torch.Tensor, group: int, scale_dtype) -> torch.Tensor:
    """:func:`quantize_int2`'s error bound for each element of x [..., D] in ``"token"`` groups: half a step
    (range / 6) plus the rounding of lo and scale to ``scale_dtype``, plus underflow."""
    grouped = x.double().unflatten(-1, (-1, group))
    g_range = grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)
    g_top = grouped.abs().amax(-1, keepdim=True)
    eps, tiny = torch.finfo(scale_dtype).eps, torch.finfo(scale_dtype).tiny
    return (g_range / 6 + 4 * eps * (g_top + g_range) + 4 * tiny).expand_as(grouped).flatten(-2)


@st.composite
def concentrated_rows(draw):
    """Rotated rows [1, 2, n, D] whose energy sits in one channel: a spike of random channel, sign and magnitude
    over zeros, or over noise up to 1e-3 of it; with a clip ratio, group and scale dtype."""
    d = draw(st.sampled_from([16, 32, 64]))
    n = draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    magnitude = 10.0 ** draw(st.floats(-3, 4))
    noise = draw(st.sampled_from([0.0, 1e-6, 1e-3]))
    x = torch.randn(1, 2, n, d, generator=g) * noise * magnitude
    spike = torch.randint(0, d, (1, 2, n, 1), generator=g)
    signs = torch.where(torch.rand(1, 2, n, 1, generator=g) < 0.5, -1.0, 1.0)
    x.scatter_(-1, spike, signs * magnitude)
    clip = draw(st.sampled_from([0.96, 0.92, 0.8, 0.5]))
    group = draw(st.sampled_from([g for g in (4, 8, 16, 32, 64) if d % g == 0]))
    return x, clip, group, draw(st.sampled_from(SCALE_DTYPES))


@CI
@given(concentrated_rows())
def test_a_row_with_its_energy_in_one_channel_comes_back_within_the_int2_bound(case):
    """Row clipping never goes below the largest minus the second largest |x|: a row whose energy sits in one
    channel loses at most its second largest |x| to the clip, and comes back within quantize_int2's bound of the
    unclipped row (it came back at half its magnitude when the clip's only floor was half the largest |x|). The
    compiled CPU quantizer stores the same codes."""
    x, clip, group, scale_dtype = case
    q = quantize_int2(clip_rows(x.clone(), clip), "token", group, scale_dtype)
    err = (dequantize_int2(q, "token", group).double() - x.double()).abs()
    assert (err <= int2_bound(x, group, scale_dtype) * (1 + 1e-9)).all(), err.max()
    if cpu_kernels.available():
        compiled = cpu_kernels.quantize_token_groups(x.clone(), clip, group, scale_dtype)
        # equal values (a group of zeros may start at -0.0 in one and 0.0 in the other: the same dequantization)
        assert all(torch.equal(a, b) for a, b in zip(q, compiled))


@pytest.mark.parametrize("value", [0.5, -3.0, 1e-3])
def test_a_token_with_equal_channels_comes_back_whole(value):
    """All channels equal: the Hadamard rotation puts the whole token in one channel, and OSCAR's clipped keys and
    values come back within the INT2 bound of that rotated row, element by element (not at half their magnitude:
    0.5 -> 0.2499), in the dynamic layer and the static one."""
    d, group = 64, 32
    x = torch.full((1, 2, 40, d), value)
    x[:, :, ::3] *= -2.0
    cache = OscarCache(sink_tokens=0, recent_tokens=4, group_size=group)
    cache.update(x, x, 0)
    layer = cache.layers[0]
    n = layer.body_len
    static = StaticOscarCache.from_cache(OscarCache(sink_tokens=0, recent_tokens=4, group_size=group),
                                         _one_layer(d), 64).layers[0]
    static.update(x, x)
    assert n == static._body_tokens_now() > 0
    stored = list(zip(layer.dequantized_body(), (layer.key_body.codec, layer.value_body.codec)))
    for prefix in ("key", "value"):
        codec = getattr(static, f"{prefix}_codec")
        codes = [getattr(static, f"{prefix}_{name}") for name in ("codes", "scale", "lo")]
        stored.append((codec.dequantize_groups(QuantizedGroups(*codes), None)[:, :, :n], codec))
    for got, codec in stored:  # compared in the rotated space, where the quantizer's bound holds
        rotation = codec.rotation.double()
        want = x[:, :, :n].double() @ rotation
        slack = 1e-5 * want.abs().amax()  # the float32 rotations' rounding
        assert ((got.double() @ rotation - want).abs() <= int2_bound(want, group, torch.float16) + slack).all()


def _one_layer(head_dim: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=2 * head_dim,
                       head_dim=head_dim)


# ---------------------------------------------------------------------------------------------- layer contract
def make_cache(kind: str, covering: bool, scale_dtype):
    window = 10_000 if covering else 3
    if kind == "oscar":
        return OscarCache(sink_tokens=0 if covering else 1, recent_tokens=window, group_size=8,
                          scale_dtype=scale_dtype)
    return OscarScaledCache(sink_tokens=0 if covering else 1, recent_tokens=window, group_size=4,
                            scale_dtype=scale_dtype)


@st.composite
def contract_case(draw):
    dtype = draw(st.sampled_from(list(EXPONENTS)))
    batch, heads, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([8, 16]))
    ops = []
    for _ in range(draw(st.integers(2, 7))):
        op = draw(st.sampled_from(["update", "update", "update", "crop", "reorder", "select"]))
        if op == "update":
            ops.append(("update", draw(tensors((batch, heads, draw(st.integers(1, 9)), d), dtype)),
                        draw(st.floats(0.25, 4.0))))
        elif op == "crop":
            ops.append(("crop", draw(st.integers(-6, -1))))
        elif op == "reorder":
            ops.append(("reorder", draw(st.permutations(range(batch)))))
        elif batch > 1:  # select a subset of the batch rows (assisted decoding / contrastive search)
            keep = draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True))
            ops.append(("select", sorted(keep)))
            batch = len(keep)  # later updates are cut to the batch the cache holds then (_fit_batch)
    return draw(st.sampled_from(["oscar", "oscar_scaled"])), draw(st.booleans()), \
        draw(st.sampled_from(SCALE_DTYPES)), dtype, d, ops


def _fit_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    return x[:batch] if x.shape[0] >= batch else torch.cat([x] + [x[:1]] * (batch - x.shape[0]))


@CI
@given(contract_case())
def test_layer_follows_dynamic_cache_through_update_crop_reorder_select(case):
    kind, covering, scale_dtype, dtype, d, ops = case
    cache = make_cache(kind, covering, scale_dtype)
    reference = DynamicLayer()
    batch = None
    for op in ops:
        name, *args = op
        if name == "update":
            x, value_factor = args
            batch = batch or x.shape[0]
            k = _fit_batch(x, batch)
            v = (k.double() * value_factor).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
            seq_before = cache.get_seq_length()
            try:
                keys, values = cache.update(k, v, 0)
            except ValueError as e:
                assert "scale" in str(e) or "norm" in str(e), e
                assert cache.get_seq_length() == seq_before  # refused: the cache is as it was
                continue
            ref_k, ref_v = reference.update(k, v)
            assert keys.shape == ref_k.shape and keys.dtype == ref_k.dtype
            for got, want in ((keys, ref_k), (values, ref_v)):
                assert torch.isfinite(got).all()
                if covering:
                    assert torch.equal(got, want)
                else:  # every stored token (all its heads: OScaR scales by that norm) within sqrt(d) x its norm,
                    # doubled for tokens re-quantized after a crop
                    err = (got.double() - want.double()).norm(dim=(1, 3))
                    bound = 2 * math.sqrt(d) * want.double().norm(dim=(1, 3)) + 1e-6
                    assert (err <= bound).all(), (err - bound).max()
        elif name == "crop" and cache.layers and -args[0] < reference.get_seq_length():
            # (DynamicLayer cannot batch-select after a crop to zero tokens; crops keep at least one here)
            cache.crop(args[0])
            reference.crop(args[0])
            assert cache.get_seq_length() == reference.get_seq_length()
        elif name == "reorder" and cache.layers and batch:
            idx = torch.tensor([i for i in args[0] if i < batch] or [0])
            if len(idx) == batch:
                cache.reorder_cache(idx)
                reference.reorder_cache(idx)
        elif name == "select" and cache.layers and batch:
            idx = torch.tensor([i for i in args[0] if i < batch] or [0])
            cache.batch_select_indices(idx)
            reference.batch_select_indices(idx)
            batch = len(idx)
    for layer in cache.layers:  # whatever is stored is finite
        if layer.is_initialized and layer.body_len:
            k, v = layer.dequantized_body()
            assert torch.isfinite(k).all() and torch.isfinite(v).all()


# ---------------------------------------------------------------------------------------------- layout fields
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=5)
LAYOUT_FIELDS = ["axis", "group_size", "clip", "token_scaling", "range_clip"]


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.sampled_from(LAYOUT_FIELDS), JSON_VALUES | st.sampled_from(["token", "channel", 1, 8, 0.5, 1.0, True]))
def test_a_layout_field_of_any_json_value_is_refused_or_has_its_declared_type(name, value):
    """Any JSON value in any GroupLayout field (what config.json can hold): a ValueError, or a layout whose fields
    all have their declared types and ranges and that reads back from the artifact format as itself."""
    from hf_kvint2.hub.artifact import _layout_from_json, _layout_to_json
    from hf_kvint2.quant import AXES
    from hf_kvint2.settings import SETTING_BOUNDS

    axis = {"axis": value} if name == "axis" else {"axis": "channel" if name == "range_clip" else "token"}
    try:
        layout = GroupLayout(**{**axis, name: value})
    except ValueError as e:
        assert name in str(e) and repr(value)[:20] in str(e)
        return
    assert type(layout.axis) is str and layout.axis in AXES
    assert type(layout.group_size) is int and layout.group_size > 0
    for ratio in (layout.clip, layout.range_clip):
        assert ratio is None or (type(ratio) in (int, float) and 0 < ratio <= 1)
    assert type(layout.token_scaling) is bool
    stored = json.loads(json.dumps(_layout_to_json(layout)))
    if layout.group_size <= SETTING_BOUNDS["group_size"]:
        assert _layout_from_json(stored, "test") == layout
    else:  # Python settings are not bounded; an artifact's are (the static caches allocate a group's tokens)
        with pytest.raises(ValueError, match="group_size must be an integer in"):
            _layout_from_json(stored, "test")
