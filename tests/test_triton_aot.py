"""GPU readiness without a GPU.

* The kernels at the tile sizes a GPU launch uses (``BLOCK_N``/``num_warps`` of ``decode_attention.TUNING``, the
  wrappers' ``BLOCK_M``/``BLOCK_T``/``CHUNK_S``), head_dim 128, GQA 4, several tiles plus a ragged tail, under the
  Triton interpreter against the PyTorch references.
* Every dispatcher configuration compiled ahead of time for sm_80 and sm_90 (``benchmarks/triton_aot.py`` in a
  subprocess: compiling needs Triton imported without ``TRITON_INTERPRET``).
* ``benchmarks/bench_gpu.py --dry-run`` end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # conftest.py sets it before Triton is first imported; this covers running the file alone
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from hf_kvint2.kernels import aot

from hf_kvint2 import GroupLayout, OscarCache, OscarScaledCache, kernels
from hf_kvint2.read_path import reference_body_partial
from hf_kvint2.transforms import spectral_rotation

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "results" / "triton_aot.json"
D, HKV, GQA = 128, 2, 4


def _tuning():
    from hf_kvint2.kernels import decode_attention

    return decode_attention.TUNING


def rotation(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(D, D, generator=g, dtype=torch.float64)
    return spectral_rotation(a @ a.T)[0].float()


def layer_with_body(make_cache, body_tokens: int, dtype=torch.float32):
    """A layer of ``make_cache()`` whose INT2 body holds at least ``body_tokens`` tokens."""
    cache = make_cache()
    recipe_window = 16 + 8
    g = torch.Generator().manual_seed(3)
    n = body_tokens + recipe_window + 32
    k = torch.randn(1, HKV, n, D, generator=g) * (0.3 + torch.rand(1, 1, n, 1, generator=g)) + 0.5
    v = torch.randn(1, HKV, n, D, generator=g)
    cache.update(k.to(DEVICE, dtype), v.to(DEVICE, dtype), 0)
    layer = cache.layers[0]
    assert layer.body_len >= body_tokens
    return layer


CACHES = {
    "oscar_centred": lambda: OscarCache(k_rotations=[rotation(1)], v_rotations=[rotation(2)], sink_tokens=16,
                                        recent_tokens=8, key_means=[torch.randn(HKV, D) * 0.5],
                                        value_means=[torch.randn(HKV, D) * 0.5]),
    "oscar_scaled": lambda: OscarScaledCache(recent_tokens=16),
    "calibrated_channel": lambda: OscarCache(sink_tokens=0, recent_tokens=8, layer_layouts=[
        (GroupLayout("channel", 32, None, True), GroupLayout("token", 32, 0.9))]),
}


@pytest.mark.parametrize("name", sorted(CACHES))
def test_decode_kernel_at_tuned_tiles(name):
    """Three BLOCK_N tiles plus a ragged tail in one split, GQA 4 (BLOCK_M 16), head_dim 128, vs the reference."""
    block_n = _tuning()["block_n"]
    n = 3 * block_n + 21
    layer = layer_with_body(CACHES[name], n)
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, HKV * GQA, 1, D, generator=g).to(DEVICE)
    q_rot = q @ kb.codec.rotation
    kml = kb.codec.mean_logits(q, GQA)
    args = {"scaling": D ** -0.5, "key_mean_logits": kml}
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=1, **args)
    ref_out, ref_lse = reference_body_partial(q_rot, kb, vb, **args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_kernel_over_more_splits_than_one_chunk():
    """Ten splits of one tile each (the last ragged): the merge kernel walks two CHUNK_S=8 chunks of them."""
    block_n = _tuning()["block_n"]
    n = 9 * block_n + 13
    layer = layer_with_body(CACHES["oscar_scaled"], n)
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    q_rot = torch.randn(1, HKV * GQA, 1, D, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    args = {"scaling": D ** -0.5}
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=10, **args)
    ref_out, ref_lse = reference_body_partial(q_rot, kb, vb, **args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_layer_step_at_tuned_tiles_fp16():
    """A whole decode step with fp16 dot operands (what a GPU runs for a 16-bit model), several tiles, GQA 4."""
    layer = layer_with_body(CACHES["oscar_centred"], 3 * _tuning()["block_n"] + 5, dtype=torch.float16)
    q = torch.randn(1, HKV * GQA, 1, D, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.float16)
    out = kernels.layer_decode_attention(q, layer, scaling=D ** -0.5, num_splits=2)
    ref = kernels.reference_layer_attention(q, layer, scaling=D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("axis,group,clip,token_scaling,n", [
    ("token", 128, 0.96, False, 3 * 16 + 5),  # BLOCK_T = 16: three tiles and a ragged tail, one group per token
    ("token", 32, None, False, 3 * 16 + 5),  # four groups per token
    ("channel", 32, None, True, 3 * 32),  # BLOCK_T = group: three token groups, with the omni-token norm
])
def test_quantize_kernel_at_tuned_tiles(axis, group, clip, token_scaling, n):
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(1, HKV, n, D, generator=g) + 0.3).to(DEVICE)
    rot, mean = rotation(3).to(DEVICE), torch.randn(HKV, D, generator=g).to(DEVICE)
    args = {"axis": axis, "group_size": group, "clip": clip, "token_scaling": token_scaling,
            "scale_dtype": torch.float16}
    (q, norm), (qr, norm_r) = kernels.quantize_tokens(x, rot, mean, **args), \
        kernels.reference_quantize_tokens(x, rot, mean, **args)
    assert (q.codes != qr.codes).float().mean().item() < 0.01  # near-ties only (another summation order)
    torch.testing.assert_close(q.scale.float(), qr.scale.float(), rtol=2e-3, atol=1e-6)
    torch.testing.assert_close(q.lo.float(), qr.lo.float(), rtol=2e-3, atol=1e-6)
    if token_scaling:
        torch.testing.assert_close(norm.float(), norm_r.float(), rtol=2e-3, atol=0)


# ------------------------------------------------------------------------------------------------ ahead of time
# What the committed reports cover (benchmarks/results/triton_aot*.json; see the README's GPU section for what is
# not covered and why): the decode kernels in every configuration of a 16-bit model, the quantize kernel at
# head_dim 128 with GQA 4 (every layout and K/V dtype).
AOT_SCOPES = {"decode": (REPORT, ("body_attention", "merge_splits"), "float16"),
              "quantize": (REPORT.with_name("triton_aot_quantize.json"), ("quantize_pack",), "_d128_gqa4")}


@pytest.mark.slow
@pytest.mark.parametrize("scope", sorted(AOT_SCOPES))
def test_dispatcher_configurations_compile_for_sm80_and_sm90(scope, tmp_path):
    """benchmarks/triton_aot.py over aot.dispatch_configurations(): results of the committed report are reused
    where kernel source, Triton version and target are unchanged (everything else is compiled now, with a fresh
    Triton cache), the quickest of them per kernel and target recompiled to check they still hold; any compile
    error, or shared memory over a target's limit, fails."""
    report_path, kernel_names, name_filter = AOT_SCOPES[scope]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # compile for real, not from an earlier run's cache
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot.py"), "--kernels",
                          ",".join(kernel_names), "--filter", name_filter, "--verify", "1", "--reuse",
                          str(report_path), "--out", str(tmp_path), "--no-roofline"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=3000, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "triton_aot.json").read_text())
    wanted = {c.name for c in aot.dispatch_configurations() if name_filter in c.name}
    assert wanted and {c["name"] for c in report["configurations"]} == wanted
    specs = {s["key"]: s for s in report["specialisations"]}
    for config in report["configurations"]:
        for arch in ("sm_80", "sm_90"):
            keys = config["specialisations"][arch]
            assert {specs[k]["kernel"] for k in keys} >= set(kernel_names) - {"merge_splits"}
            assert all(specs[k]["targets"][arch]["ok"] for k in keys), config["name"]
    if scope == "decode":  # bf16 models, head_dim 64 and 128: the decode kernel keeps everything in registers
        decode_bf16 = [s for s in specs.values() if s["kernel"] == "body_attention"
                       and s["constexprs"]["D"] in (64, 128) and s["constexprs"]["DOT_DTYPE"] in ("bf16", "bfloat16")]
        assert decode_bf16
        for spec in decode_bf16:
            for arch, res in spec["targets"].items():
                # ptxas's spill counts; a few bytes of stack frame without spill stores are not spills
                assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0, (spec["constexprs"], arch, res)


def test_bench_gpu_dry_run_end_to_end(tmp_path):
    """Every stage of the GPU benchmark on CPU (interpreter, tiny shapes), JSON written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_dry", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--dry-run", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_dry_run.json").read_text())
    assert saved["dry_run"] and all(r["ok"] for r in saved["correctness"].values())
    assert saved["attention"] and not [r for r in saved["attention"] if "error" in r]
    assert "tuning" in saved and saved["end_to_end"]["runs"] and "roofline" in saved
    assert not [r for r in saved["end_to_end"]["runs"] if "error" in r]
    assert result["wall_s"] > 0
