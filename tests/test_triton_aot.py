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


def rotation(seed: int, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    return spectral_rotation(a @ a.T)[0].float()


def layer_with_body(make_cache, body_tokens: int, dtype=torch.float32, d: int = D):
    """A layer of ``make_cache()`` whose INT2 body holds at least ``body_tokens`` tokens."""
    cache = make_cache()
    recipe_window = 16 + 8
    g = torch.Generator().manual_seed(3)
    n = body_tokens + recipe_window + 32
    k = torch.randn(1, HKV, n, d, generator=g) * (0.3 + torch.rand(1, 1, n, 1, generator=g)) + 0.5
    v = torch.randn(1, HKV, n, d, generator=g)
    cache.update(k.to(DEVICE, dtype), v.to(DEVICE, dtype), 0)
    layer = cache.layers[0]
    assert layer.body_len >= body_tokens
    return layer


CACHES = {
    "oscar_centred": lambda: OscarCache(k_rotations=[rotation(1)], v_rotations=[rotation(2)], sink_tokens=16,
                                        recent_tokens=8, key_means=[torch.randn(HKV, D) * 0.5],
                                        value_means=[torch.randn(HKV, D) * 0.5]),
    "oscar_scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=16),
    "calibrated_channel": lambda: OscarCache(sink_tokens=0, recent_tokens=8, layer_layouts=[
        (GroupLayout("channel", 32, None, True), GroupLayout("token", 32, 0.9))]),
}


@pytest.mark.parametrize("dot", ["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(CACHES))
def test_decode_kernel_at_tuned_tiles(name, dot):
    """Three BLOCK_N tiles plus a ragged tail in one split, GQA 4 (BLOCK_M 16), head_dim 128, vs the reference: the
    tile of a 16-bit model (BLOCK_N 64; the interpreter computes its bf16 dots in fp32) and of an fp32 one (16)."""
    dot_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dot]
    block_n = _tuning()["block_n" if dot == "bf16" else "block_n_small"]
    n = 3 * block_n + 21
    layer = layer_with_body(CACHES[name], n)
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, HKV * GQA, 1, D, generator=g).to(DEVICE)
    q_rot = q @ kb.codec.rotation
    kml = kb.codec.mean_logits(q, GQA)
    args = {"scaling": D ** -0.5, "key_mean_logits": kml}
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=1, dot_dtype=dot_dtype, **args)
    ref_out, ref_lse = reference_body_partial(q_rot, kb, vb, **args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["oscar_scaled", "calibrated_channel"])
def test_decode_kernel_at_tuned_tiles_head_dim_256(name):
    """head_dim 256 takes its own tile (TUNING["block_n_small"]): three tiles plus a ragged tail, GQA 4."""
    d = 256
    block_n = _tuning()["block_n_small"]
    assert block_n < _tuning()["block_n"]
    n = 3 * block_n + 5
    make = {"oscar_scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=16),
            "calibrated_channel": lambda: OscarCache(sink_tokens=0, recent_tokens=8, k_rotations=[rotation(4, d)],
                                                     v_rotations=[rotation(5, d)], layer_layouts=[
                (GroupLayout("channel", 32, None, True), GroupLayout("token", 128, 0.9))])}[name]
    layer = layer_with_body(make, n, d=d)
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    q_rot = torch.randn(1, HKV * GQA, 1, d, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    args = {"scaling": d ** -0.5}
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=1, **args)
    ref_out, ref_lse = reference_body_partial(q_rot, kb, vb, **args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_kernel_over_more_splits_than_one_chunk():
    """Ten splits of one 64-token tile each (the last ragged): the merge kernel walks two CHUNK_S=8 chunks."""
    block_n = _tuning()["block_n"]
    n = 9 * block_n + 13
    layer = layer_with_body(CACHES["oscar_scaled"], n)
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    q_rot = torch.randn(1, HKV * GQA, 1, D, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    args = {"scaling": D ** -0.5}
    out, lse = kernels.body_attention(q_rot, kb, vb, num_splits=10, dot_dtype=torch.bfloat16, **args)
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
    ("channel", 128, None, False, 2 * 128),  # two 128-token groups, each taken as four SUB_T = 32 sub-tiles
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
# The committed reports: the full matrix with the Triton of this venv, and with Triton 3.6 (the GPU machine's).
REPORTS = (REPORT, REPORT.with_name("triton_aot_triton3.6.0.json"))
KERNELS = ("body_attention", "merge_splits", "quantize_pack")


def _aot_script():
    """benchmarks/triton_aot.py as a module (its import pops TRITON_INTERPRET: restored for the tests after)."""
    import importlib.util

    saved = os.environ.get("TRITON_INTERPRET")
    spec = importlib.util.spec_from_file_location("triton_aot_script", ROOT / "benchmarks" / "triton_aot.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return module


@pytest.mark.slow
def test_every_dispatcher_configuration_compiled_for_sm80_and_sm90(tmp_path):
    """``benchmarks/triton_aot.py --check``: each committed report holds a successful compile of every
    specialisation of every ``aot.dispatch_configurations()`` entry on sm_80 and sm_90 for the kernels' current
    source, and a sample (two per kernel and target) is recompiled now with the installed Triton in a fresh cache:
    compared with the committed numbers when this Triton made a report, else compiled and checked to fit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # compile for real, not from an earlier run's cache
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot.py"), "--check", *map(str, REPORTS),
                          "--sample", "2", "--out", str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1800, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "triton_aot_check.json").read_text())
    assert summary["configurations_count"] == len(aot.dispatch_configurations()) > 200
    assert len(summary["reports"]) == len(REPORTS) and all(r["gaps"] == 0 for r in summary["reports"].values())
    sampled = {(r["kernel"], r["target"]) for r in summary["sample"]}
    assert sampled == {(k, t) for k in KERNELS for t in ("sm_80", "sm_90")}
    assert all(r["ok"] and r["registers"] for r in summary["sample"])


def test_coverage_check_finds_missing_stale_and_failed_compiles():
    """The logic of ``--check`` on a made-up matrix: a result for other kernel source, a missing target and a
    failed compile are each a gap; a complete report has none."""
    from types import SimpleNamespace

    script = _aot_script()
    unique = {80: {"a": (SimpleNamespace(kernel="k"), None)}, 90: {"a": (SimpleNamespace(kernel="k"), None)}}
    by_config = {"config": {"sm_80": ["a"], "sm_90": ["a"]}}
    ok = {"ok": True, "registers": 40}

    def report(source_hash, targets):
        return {"by_key": {("a", source_hash): {"key": "a", "kernel": "k", "source_hash": source_hash,
                                                "targets": targets}}}

    assert script.coverage(unique, {"k": "h1"}, by_config, report("h1", {"sm_80": ok, "sm_90": ok})) == []
    assert len(script.coverage(unique, {"k": "h2"}, by_config, report("h1", {"sm_80": ok, "sm_90": ok}))) == 2
    gaps = script.coverage(unique, {"k": "h1"}, by_config, report("h1", {"sm_80": ok}))
    assert len(gaps) == 1 and "sm_90" in gaps[0]
    failed = script.coverage(unique, {"k": "h1"}, by_config,
                             report("h1", {"sm_80": ok, "sm_90": {"ok": False, "error": "OutOfResources"}}))
    assert len(failed) == 1 and "OutOfResources" in failed[0]


def test_source_hash_ignores_position_comments_and_docstrings(tmp_path, monkeypatch):
    """``aot.kernel_source_hash`` follows the code of a kernel and the jit functions it calls, not where it sits."""
    import importlib

    body = ("import triton\nimport triton.language as tl\n{pad}\n@triton.jit\ndef _inc(x):\n    return x + {c}{comment}"
            "\n\n\n@triton.jit\ndef kernel(p, N: tl.constexpr):\n    {doc}\n    tl.store(p, _inc(tl.load(p)))\n")
    variants = {"a": {"pad": "", "c": 1, "comment": "", "doc": '"""one"""'},
                "b": {"pad": "\n\n# moved down\n\n", "c": 1, "comment": "  # note", "doc": '"""two"""'},
                "c": {"pad": "", "c": 2, "comment": "", "doc": '"""one"""'}}
    for name, fields in variants.items():
        (tmp_path / f"aot_hash_{name}.py").write_text(body.format(**fields))
    monkeypatch.syspath_prepend(str(tmp_path))
    h = {name: aot.kernel_source_hash(importlib.import_module(f"aot_hash_{name}").kernel) for name in variants}
    assert h["a"] == h["b"]  # moved, commented, other docstring
    assert h["a"] != h["c"]  # a callee's code changed


def test_committed_report_lists_resources_and_bf16_decode_does_not_spill():
    """The committed report has registers, spills and shared memory for every specialisation and target; the
    decode kernel for bf16 models at head_dim 64 and 128 keeps everything in registers (ptxas's spill counts)."""
    report = json.loads(REPORT.read_text())
    assert report["configurations_count"] == len(aot.dispatch_configurations()) and not report["failed"]
    assert all(set(c["specialisations"]) == {"sm_80", "sm_90"} for c in report["configurations"])
    for spec in report["specialisations"]:
        # a merge specialisation may exist for one target only (its split count follows the SM count)
        assert spec["targets"] and set(spec["targets"]) <= {"sm_80", "sm_90"}, spec["key"]
        for res in spec["targets"].values():
            assert res["ok"] and res["registers"] > 0 and res["shared_bytes"] >= 0
            assert res["spill_store_bytes"] >= 0 and 0 < res["occupancy"] <= 1
    decode_bf16 = [s for s in report["specialisations"] if s["kernel"] == "body_attention"
                   and s["constexprs"]["D"] in (64, 128) and s["constexprs"]["DOT_DTYPE"] in ("bf16", "bfloat16")]
    assert decode_bf16
    for spec in decode_bf16:
        for arch, res in spec["targets"].items():
            assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0, (spec["constexprs"], arch, res)


def test_bench_gpu_dry_run_end_to_end(tmp_path):
    """Every stage of the GPU benchmark on CPU (interpreter, tiny shapes), JSON written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_dry", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--dry-run", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_dry_run.json").read_text())
    assert saved["meta"]["dry_run"] and saved["meta"]["machine"]
    saved = saved["results"]
    assert saved["dry_run"] and all(r["ok"] for r in saved["correctness"].values())
    assert saved["attention"] and not [r for r in saved["attention"] if "error" in r]
    assert "tuning" in saved and saved["end_to_end"]["runs"] and "roofline" in saved
    assert not [r for r in saved["end_to_end"]["runs"] if "error" in r]
    assert result["wall_s"] > 0
