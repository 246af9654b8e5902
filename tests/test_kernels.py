"""Triton kernels against their PyTorch references, on real stored state of both caches.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernel modules are
imported), so shapes stay tiny.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # conftest.py sets it before Triton is first imported; this covers running the file alone
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
if DEVICE == "cpu" and knobs is not None and not knobs.runtime.interpret:
    raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1.")

from hf_kvint2 import (
    GroupLayout,
    OscarCache,
    OscarScaledCache,
    kernels,
)
from hf_kvint2.quant import dequantize_int2, quantize_int2
from hf_kvint2.read_path import reference_body_partial
from hf_kvint2.transforms import hadamard_matrix, spectral_rotation

B, HKV, REP, D = 2, 2, 2, 64


def random_rotation(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    if d & (d - 1):  # not a power of two: any orthogonal matrix (a calibrated rotation need not be U H P)
        return torch.linalg.qr(a)[0].float()
    return spectral_rotation(a @ a.T)[0].float()


def kv(n: int, seed: int, d: int = D, dtype=torch.float32):
    """Random K/V with per-token norm spread, an outlier channel and a per-head offset (what centring removes)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, n, d, generator=g) * (0.2 + 2 * torch.rand(1, 1, n, 1, generator=g))
    k[..., 3] *= 6
    k = k + torch.randn(1, HKV, 1, d, generator=g)
    v = torch.randn(B, HKV, n, d, generator=g)
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def oscar_calibrated(d: int = D):
    """OscarCache with calibrated-style rotations and means, clipping, per-token groups of the whole head."""
    return OscarCache(k_rotations=[random_rotation(d, 1)], v_rotations=[random_rotation(d, 2)],
                      key_means=[torch.randn(HKV, d) * 0.5], value_means=[torch.randn(HKV, d) * 0.5],
                      sink_tokens=4, recent_tokens=8, group_size=128)


def oscar_per_layer_layouts(d: int = D):
    """OscarCache with a calibration-chosen layout: keys per channel over 16 tokens with token norms, centring and
    a narrowed group range, values per token in 4 groups of 16 channels with clipping."""
    return OscarCache(key_means=[torch.randn(HKV, d) * 0.5], sink_tokens=4, recent_tokens=8,
                      layer_layouts=[(GroupLayout("channel", 16, None, True, range_clip=0.85),
                                      GroupLayout("token", 16, 0.9))])


def oscar_scaled(d: int = D, scale_dtype=torch.float16):
    return OscarScaledCache(sink_tokens=0, recent_tokens=16, group_size=16, hadamard_block=16, scale_dtype=scale_dtype)


def oscar_token_norms(d: int = D):
    """Spectral rotation with omni-token scaling on per-token groups of keys and values (a valid combination)."""
    return OscarCache(k_rotations=[random_rotation(d, 3)], sink_tokens=0, recent_tokens=8,
                      layer_layouts=[(GroupLayout("token", 128, 0.96, True), GroupLayout("token", 128, None, True))])


CACHES = {"oscar": oscar_calibrated, "oscar_layouts": oscar_per_layer_layouts, "oscar_scaled": oscar_scaled,
          "oscar_token_norms": oscar_token_norms}


def filled_layer(make_cache, n_prefill: int = 90, n_decode: int = 3, dtype=torch.float32, d: int = D):
    cache = make_cache(d)
    k, v = kv(n_prefill + n_decode, seed=7, d=d, dtype=dtype)
    cache.update(k[:, :, :n_prefill], v[:, :, :n_prefill], 0)
    for t in range(n_prefill, n_prefill + n_decode):
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
    layer = cache.layers[0]
    assert layer.body_len >= 16
    return layer


# ------------------------------------------------------------------------------------------------ quantize-and-pack
def assert_quantized_match(got, want, axis, group, xt):
    (q, norm), (qr, norm_r) = got, want
    assert q.codes.shape == qr.codes.shape and q.scale.shape == qr.scale.shape and q.lo.shape == qr.lo.shape
    assert q.scale.dtype == qr.scale.dtype
    # The rotation sums in another order: codes may only differ at near-ties, so almost never here.
    assert (q.codes != qr.codes).float().mean().item() < 0.01
    tol = 2 * torch.finfo(q.scale.dtype).eps
    torch.testing.assert_close(q.scale.float(), qr.scale.float(), rtol=tol, atol=1e-6)
    torch.testing.assert_close(q.lo.float(), qr.lo.float(), rtol=tol, atol=1e-6)
    if norm_r is None:
        assert norm is None
    else:
        torch.testing.assert_close(norm.float(), norm_r.float(), rtol=tol, atol=0)
    # The dequantized kernel output is within half a step of the transformed input, like the reference's.
    deq = dequantize_int2(q, axis, group)
    step = dequantize_int2(q._replace(codes=torch.full_like(q.codes, 0x55), lo=torch.zeros_like(q.lo)), axis, group)
    assert ((deq - xt).abs() <= step / 2 + 1e-3 * xt.abs().amax()).all()


@pytest.mark.parametrize("name", sorted(CACHES))
def test_quantize_stream_matches_layer_transform(name):
    """The fused kernel stores what QuantizedStream.append stores, for K and V of every cache layout."""
    layer = filled_layer(CACHES[name], n_prefill=40, n_decode=0)
    x_k, x_v = kv(16, seed=11)
    for stream, x in ((layer.key_body, x_k), (layer.value_body, x_v)):
        codec = stream.codec
        xt, norm = codec.transform(x)
        want = (quantize_int2(xt, codec.layout.axis, codec.group, codec.scale_dtype, codec.layout.range_clip), norm)
        got = kernels.quantize_stream(codec, x)
        assert_quantized_match(got, want, codec.layout.axis, codec.group, xt)


@pytest.mark.parametrize("axis,group,clip,token_scaling,scale_dtype,d,n,range_clip", [
    ("token", 16, 0.92, False, torch.bfloat16, 64, 5, None),   # several groups per token, bf16 scales, odd count
    ("channel", 8, 0.9, True, torch.float32, 32, 16, None),    # clip + norms on per-channel groups, two groups
    ("token", 96, None, True, torch.float16, 96, 3, None),     # head_dim that is not a power of two
    # norms stored in bf16 and read back; 32-token groups at head_dim 256 taken as two SUB_T = 16 sub-tiles
    ("channel", 32, None, True, torch.bfloat16, 256, 64, None),
    ("token", 32, 0.9, True, torch.bfloat16, 64, 21, None),    # bf16 norms on per-token groups with a clip
    ("channel", 8, None, False, torch.float16, 32, 16, 0.8),   # per-channel groups on a narrowed range
    ("channel", 32, None, True, torch.bfloat16, 256, 64, 0.75),  # narrowed, with norms, in two sub-tiles
])
def test_quantize_tokens_settings(axis, group, clip, token_scaling, scale_dtype, d, n, range_clip):
    x, _ = kv(n, seed=3, d=d)
    rot, mean = random_rotation(d, 5).to(DEVICE), torch.randn(HKV, d, device=DEVICE)
    args = {"axis": axis, "group_size": group, "clip": clip, "token_scaling": token_scaling,
            "scale_dtype": scale_dtype, "range_clip": range_clip}
    got = kernels.quantize_tokens(x, rot, mean, **args)
    want = kernels.reference_quantize_tokens(x, rot, mean, **args)
    from hf_kvint2.stream import StreamCodec

    layout = GroupLayout(axis, group, clip, token_scaling, range_clip)
    xt, _ = StreamCodec(layout, group, rot, mean, scale_dtype).transform(x)
    if range_clip is None:
        assert_quantized_match(got, want, axis, group, xt)
    else:  # values past the narrowed range saturate: no half-step bound there, codes and scales as the reference
        assert (got[0].codes != want[0].codes).float().mean().item() < 0.01
        tol = 2 * torch.finfo(scale_dtype).eps
        torch.testing.assert_close(got[0].scale.float(), want[0].scale.float(), rtol=tol, atol=1e-6)
        torch.testing.assert_close(got[0].lo.float(), want[0].lo.float(), rtol=tol, atol=1e-6)


@pytest.mark.parametrize("clip,token_scaling", [(0.96, False), (0.92, True), (0.5, False)])
def test_quantize_tokens_keeps_a_token_whose_energy_sits_in_one_channel(clip, token_scaling):
    """The kernel's row clip is transforms.clip_rows (never below the largest minus the second largest |x|):
    tokens whose channels are all equal, which a Hadamard rotation sends to one channel, come back whole, as the
    reference stores them, instead of at half their magnitude."""
    d = D
    x = torch.tensor([0.5, -3.0, 1e-3, 7.0, 0.25], device=DEVICE)[None, None, :, None].expand(B, HKV, 5, d)
    rot = hadamard_matrix(d).to(DEVICE)
    args = {"axis": "token", "group_size": 32, "clip": clip, "token_scaling": token_scaling,
            "scale_dtype": torch.float16}
    got = kernels.quantize_tokens(x, rot, None, **args)
    want = kernels.reference_quantize_tokens(x, rot, None, **args)
    xr = (x.float() @ rot) / (1 if not token_scaling else want[1].float()[:, None, :, None])
    assert_quantized_match(got, want, "token", 32, xr)
    deq = dequantize_int2(got[0], "token", 32)
    if token_scaling:
        deq = deq * got[1].float()[:, None, :, None]
    assert ((deq @ rot.T - x).abs() <= 0.01 * x.abs()).all()  # (it was off by half: 0.5 -> 0.25)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter warns about the inf it casts
def test_quantize_rejects_bad_input():
    x, _ = kv(5, seed=0)
    rot = torch.eye(D, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        kernels.quantize_tokens(x, rot, None, axis="channel", group_size=4, clip=None, token_scaling=False,
                                scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="rotation must be"):
        kernels.quantize_tokens(x, rot[:8, :8], None, axis="token", group_size=64, clip=None, token_scaling=False,
                                scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="fit fp16"):
        kernels.quantize_tokens(x * 1e5, rot, None, axis="token", group_size=64, clip=None, token_scaling=False,
                                scale_dtype=torch.float16)


def test_cache_uses_kernel_when_enabled(monkeypatch):
    """With dispatch on (as for CUDA tensors), a cache stores the same body as the PyTorch path."""
    plain = filled_layer(oscar_scaled, n_prefill=48, n_decode=0)
    monkeypatch.setattr(kernels, "kernels_enabled_for", lambda t: True)
    fused = filled_layer(oscar_scaled, n_prefill=48, n_decode=0)
    for a, b in ((plain.key_body, fused.key_body), (plain.value_body, fused.value_body)):
        assert torch.equal(a.codes.view(), b.codes.view())
        assert torch.equal(a.scale.view(), b.scale.view()) and torch.equal(a.lo.view(), b.lo.view())
    assert torch.equal(plain.key_body.norm.view(), fused.key_body.norm.view())


# ------------------------------------------------------------------------------------------------ decode attention
def masks(lq: int, n: int):
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(B, 1, lq, n, generator=g) > 0.3
    keep[1] = False  # a batch row whose body is fully masked (left padding longer than the body)
    additive = torch.where(torch.rand(B, 1, lq, n, generator=g) > 0.2, -torch.rand(B, 1, lq, n, generator=g),
                           torch.tensor(float("-inf")))
    return {"none": None, "bool": keep.to(DEVICE), "additive": additive.to(DEVICE)}


@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("lq,splits,mask_kind", [(1, 3, "bool"), (2, 1, "additive")])  # no mask: layer tests
def test_body_attention_matches_reference(name, lq, splits, mask_kind):
    layer = filled_layer(CACHES[name])
    n = layer.body_len - 5  # a prefix, as when the newest body tokens belong to the current chunk
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, HKV * REP, lq, D, generator=g).to(DEVICE)
    q_rot = q @ kb.codec.rotation
    mean = kb.codec.mean
    kml = None if mean is None else (q.reshape(B, HKV, REP, lq, D) * mean[None, :, None, None]).sum(-1)
    kml = None if kml is None else kml.reshape(B, HKV * REP, lq)
    mask = masks(lq, n)[mask_kind]
    args = {"scaling": D ** -0.5, "key_mean_logits": kml, "mask": mask}
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=splits, **args)
    ref_out, ref_lse = reference_body_partial(q_rot, kb, vb, **args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if mask_kind == "bool":  # the fully masked row: nothing attended
        assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


@pytest.mark.parametrize("name,dtype", [("oscar", torch.float32), ("oscar_layouts", torch.float32),
                                        ("oscar_scaled", torch.float16)])  # fp16: products in 16 bits
def test_layer_decode_attention_matches_reference(name, dtype):
    """A whole decode step (rotated query, INT2 body, full-precision sink/recent, LSE merge, de-rotation) equals
    SDPA over the layer's dequantized cache."""
    layer = filled_layer(CACHES[name], dtype=dtype)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, HKV * REP, 1, D, generator=g).to(DEVICE, dtype)
    scaling = D ** -0.5
    out = kernels.layer_decode_attention(q, layer, scaling=scaling, num_splits=2)
    ref = kernels.reference_layer_attention(q, layer, scaling=scaling)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    # Left padding: batch row 1 starts 6 tokens late (its first sink tokens are masked).
    mask = torch.ones(B, 1, 1, layer.seq_len, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :6] = False
    out = kernels.layer_decode_attention(q, layer, scaling=scaling, attention_mask=mask, num_splits=2)
    ref = kernels.reference_layer_attention(q, layer, scaling=scaling, attention_mask=mask)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    ref_sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float(), *[torch.cat(p, dim=2).float().repeat_interleave(REP, dim=1) for p in (
            (layer.sink_k.float(), layer.key_body.dequantize(), layer.recent_k.float()),
            (layer.sink_v.float(), layer.value_body.dequantize(), layer.recent_v.float()))],
        attn_mask=mask, scale=scaling)
    torch.testing.assert_close(out.float(), ref_sdpa, rtol=tol, atol=tol)


def test_body_attention_small_head_dim_and_empty_body():
    layer = filled_layer(oscar_scaled, d=32)  # head_dim 32: byte tiles padded to the 16-wide dot minimum
    q_rot = torch.randn(B, HKV * REP, 1, 32, device=DEVICE)
    args = {"scaling": 0.2}
    kb, vb = layer.key_body.read(), layer.value_body.read()
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=2, **args)
    ref_out, ref_lse = reference_body_partial(q_rot, kb, vb, **args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    out, lse = kernels.body_attention(q_rot, layer.key_body.read(0), layer.value_body.read(0), **args)
    assert (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="outside the body"):
        kernels.body_attention(q_rot, layer.key_body.read(10_000), layer.value_body.read(10_000), **args)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.body_attention(q_rot[:, :3], kb, vb, **args)


def test_bench_gpu_script_runs_one_tiny_config(tmp_path):
    """benchmarks/bench_gpu.py (run on GPU machines only) keeps working: one tiny layer benchmark on this device."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.bench_layer("oscar_scaled", 1, 96, {"hq": 4, "hkv": 2, "d": 64}, torch.device(DEVICE), 4, 16)
    assert row["body_tokens"] == 64 and row["triton_body_ms"] > 0 and row["speedup_body_vs_sdpa"] > 0
