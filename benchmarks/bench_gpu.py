"""Decode attention on a GPU: the Triton INT2 kernel against bf16 SDPA (flash), and end-to-end decode tokens/s.

    python benchmarks/bench_gpu.py                     # H200, Llama-3-8B shapes, within 10 minutes
    python benchmarks/bench_gpu.py --wheels .whl       # first install missing packages from carried wheels
    python benchmarks/bench_gpu.py --dry-run           # CPU, Triton interpreter, tiny shapes: every code path,
                                                       # timings meaningless (what CI-less machines can check)

Stages: (1) correctness of both kernels against the PyTorch references on the GPU, for both caches' layouts;
(2) a small launch-setting sweep of the decode kernel at 64k context; (3) one layer's decode attention at
32 query / 8 KV heads, head_dim 128, batch 1 and 16, context 8k..128k: the Triton kernel over the INT2 body
alone and a whole layer step (rotation, kernel, full-precision windows, merge) against
``F.scaled_dot_product_attention`` over bf16 K/V with the flash backend, with achieved bandwidth against the
H200's 4.8 TB/s; (4) end-to-end greedy decode tokens/s of a random-weight Llama-3-8B-shaped model with
``DynamicCache`` + SDPA against ``OscarCache`` + ``attn_implementation="oscar"`` at 32k and 64k context. Each
measured layer step is also set against ``benchmarks/roofline.py``'s bandwidth-bound prediction (``roofline``).
Writes ``gpu.json`` and ``gpu.png`` to $OUT when set, else to benchmarks/results/ (``--out`` overrides).
"""

from __future__ import annotations

import os
import sys

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # Triton reads this when first imported (torch may import it): set it before torch
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import glob
import importlib
import importlib.util
import subprocess
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import run_meta, write_results

# torch is imported inside the functions, so that --help prints at once.

ROOT = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = 4.8e12  # H200
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rope_theta": 500000.0}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096}


# ------------------------------------------------------------------------------------------------ environment
def ensure_packages(wheels: str | None) -> str:
    """Make ``hf_kvint2`` (and Triton) importable: installed, else from carried wheels, else from this source tree."""
    missing = [m for m in ("triton", "transformers", "hf_kvint2") if importlib.util.find_spec(m) is None]
    if missing and wheels:
        files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
        if files:
            target = "/tmp/hf_kvint2_site"
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", target, *files], check=True)
            sys.path.insert(0, target)
            importlib.invalidate_caches()
            print(f"installed {len(files)} wheels from {wheels} into {target}")
    if importlib.util.find_spec("hf_kvint2") is not None:
        import hf_kvint2.kernels

        return "installed"
    # Source tree: kernels/ is the subpackage hf_kvint2.kernels (pyproject's package-dir); register it first.
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("hf_kvint2.kernels", ROOT / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_kvint2.kernels"] = module
    spec.loader.exec_module(module)
    import hf_kvint2  # noqa: F401

    return f"source tree {ROOT}"


def timer(fn, device) -> float:
    """Mean milliseconds per call: triton's do_bench on CUDA (L2 flushed between calls), one call on CPU (the
    dry run only checks that everything runs)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="mean"))
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ layers
def make_layer(kind: str, sink: int, recent: int, seed: int = 0, head_dim: int = 128, kv_heads: int = 8):
    """An empty OscarLayer with OSCAR's layout (Hadamard-or-calibrated rotation, clipping, per-token groups,
    centring) or OScaR's (per-channel keys with token norms, per-token values)."""
    import torch

    from hf_kvint2.layers import OscarLayer
    from hf_kvint2.settings import oscar_recipe, oscar_scaled_recipe
    from hf_kvint2.transforms import spectral_rotation

    if kind == "oscar":
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
        b = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
        recipe = oscar_recipe(key_rotation=spectral_rotation(a @ a.T)[0].float(),
                              value_rotation=spectral_rotation(b @ b.T)[0].float(),
                              key_mean=0.3 * torch.randn(kv_heads, head_dim, generator=g),
                              value_mean=0.3 * torch.randn(kv_heads, head_dim, generator=g),
                              sink_tokens=sink, recent_tokens=recent)
    else:
        recipe = oscar_scaled_recipe(sink_tokens=0, recent_tokens=recent)
    layer = OscarLayer(recipe, 0)
    layer.fused_attention = True  # update() then returns cheap placeholders instead of the dequantized view
    return layer


def fill_layer(layer, batch: int, ctx: int, kv_heads: int, head_dim: int, dtype, device, chunk: int = 8192,
               seed: int = 0):
    """Append ``ctx`` random tokens (prefill in chunks, like a long prompt); on CUDA they are quantized by the
    Triton quantize-and-pack kernel. Keys get a per-head offset and an outlier channel, like real post-RoPE keys."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    offset = torch.randn(1, kv_heads, 1, head_dim, generator=g, device=device)
    for t0 in range(0, ctx, chunk):
        n = min(chunk, ctx - t0)
        k = torch.randn(batch, kv_heads, n, head_dim, generator=g, device=device) + offset
        k[..., 5] *= 4
        v = torch.randn(batch, kv_heads, n, head_dim, generator=g, device=device)
        layer.update(k.to(dtype), v.to(dtype))
        del k, v
    sync(device)
    return layer


def body_bytes(layer) -> int:
    return sum(buf.nbytes for s in (layer.key_body, layer.value_body) for buf in s.buffers())


# ------------------------------------------------------------------------------------------------ stage 1: correctness
def check_correctness(device, shapes, dry: bool) -> dict:
    import torch

    from hf_kvint2 import kernels
    from hf_kvint2.quant import dequantize_int2

    hq, hkv, d = shapes["hq"], shapes["hkv"], shapes["d"]
    out = {}
    ctx = 160 if dry else 4096
    sink, recent = (4, 16) if dry else (64, 256)
    for kind in ("oscar", "oscar_scaled"):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{kind}_{str(dtype).split('.')[-1]}"
            layer = fill_layer(make_layer(kind, sink, recent, head_dim=d, kv_heads=hkv), 2, ctx, hkv, d, dtype,
                               device)
            q = torch.randn(2, hq, 1, d, device=device, dtype=dtype)
            mask = torch.ones(2, 1, 1, layer.seq_len, dtype=torch.bool, device=device)
            mask[1, ..., : ctx // 3] = False  # left padding longer than the sink
            got = kernels.layer_decode_attention(q, layer, scaling=d ** -0.5, attention_mask=mask)
            ref = kernels.reference_layer_attention(q, layer, scaling=d ** -0.5, attention_mask=mask)
            err = (got.float() - ref.float()).abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            # Quantize-and-pack: what the kernel stored for the newest body tokens vs the reference on the same input.
            kb = layer.key_body.codec
            x = torch.randn(2, hkv, 64, d, device=device, dtype=dtype)
            lay = kb.layout
            qk, _ = kernels.quantize_stream(kb, x)
            qr, _ = kernels.reference_quantize_tokens(x, kb.rotation, kb.mean, axis=lay.axis, group_size=kb.group,
                                                      clip=lay.clip, token_scaling=lay.token_scaling,
                                                      scale_dtype=kb.scale_dtype)
            mismatch = (qk.codes != qr.codes).float().mean().item()
            deq = (dequantize_int2(qk, lay.axis, kb.group) - dequantize_int2(qr, lay.axis, kb.group)).abs().max().item()
            out[name] = {"attention_max_abs_err": err, "attention_tol": tol, "code_mismatch_fraction": mismatch,
                         "dequant_max_abs_diff": deq, "ok": err <= tol and mismatch < 0.01}
            del layer
    return out


# ------------------------------------------------------------------------------------------------ stage 2/3: attention
def sdpa_flash(q, k, v, scale):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def sdpa_runner(q, k, v, scale, device):
    """SDPA with the flash backend (GQA by enable_gqa); the backend actually used is returned with it."""
    import torch.nn.functional as F

    if device.type == "cuda":
        try:
            sdpa_flash(q, k, v, scale)
            return (lambda: sdpa_flash(q, k, v, scale)), "flash"
        except RuntimeError:
            pass
    return (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)), "default"


def bench_layer(kind, batch, ctx, shapes, device, sink, recent) -> dict:
    import torch

    from hf_kvint2 import kernels

    hq, hkv, d = shapes["hq"], shapes["hkv"], shapes["d"]
    dtype = torch.bfloat16
    layer = fill_layer(make_layer(kind, sink, recent, head_dim=d, kv_heads=hkv), batch, ctx, hkv, d, dtype, device)
    kb, vb = layer.key_body.read(), layer.value_body.read()
    q = torch.randn(batch, hq, 1, d, device=device, dtype=dtype)
    scale = d ** -0.5
    q_rot = q.float() @ kb.codec.rotation
    kml = None
    if kb.codec.mean is not None:
        kml = (q.float().reshape(batch, hkv, hq // hkv, 1, d) * kb.codec.mean[None, :, None, None]).sum(-1)
        kml = kml.reshape(batch, hq, 1)
    t_body = timer(lambda: kernels.body_attention(q_rot, kb, vb, scaling=scale, key_mean_logits=kml,
                                                  dot_dtype=dtype), device)
    t_layer = timer(lambda: kernels.layer_decode_attention(q, layer, scaling=scale), device)
    nbytes = body_bytes(layer)
    row = {"layout": kind, "batch": batch, "context": ctx, "body_tokens": layer.body_len,
           "int2_body_bytes": nbytes, "triton_body_ms": t_body, "triton_layer_ms": t_layer,
           "triton_body_GBps": nbytes / t_body / 1e6, "triton_body_hbm_fraction": nbytes / (t_body * 1e-3)
           / HBM_BYTES_PER_S}
    k = torch.randn(batch, hkv, ctx, d, device=device, dtype=dtype)
    v = torch.randn(batch, hkv, ctx, d, device=device, dtype=dtype)
    run, backend = sdpa_runner(q, k, v, scale, device)
    t_sdpa = timer(run, device)
    sdpa_bytes = 2 * k.numel() * k.element_size()
    del k, v
    row.update({"sdpa_backend": backend, "sdpa_ms": t_sdpa, "sdpa_bytes": sdpa_bytes,
                "sdpa_GBps": sdpa_bytes / t_sdpa / 1e6, "sdpa_hbm_fraction": sdpa_bytes / (t_sdpa * 1e-3)
                / HBM_BYTES_PER_S, "speedup_body_vs_sdpa": t_sdpa / t_body, "speedup_layer_vs_sdpa": t_sdpa / t_layer})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def tune(shapes, device, ctx, sink, recent, dry: bool = False) -> dict:
    """Time the decode kernel over launch settings at one shape; leave the fastest in TUNING (a dry run sweeps two
    settings and restores TUNING: interpreter timings mean nothing)."""
    import torch
    from hf_kvint2.kernels import decode_attention

    from hf_kvint2 import kernels

    hq, hkv, d = shapes["hq"], shapes["hkv"], shapes["d"]
    layer = fill_layer(make_layer("oscar", sink, recent, head_dim=d, kv_heads=hkv), 1, ctx, hkv, d,
                       torch.bfloat16, device)
    q_rot = torch.randn(1, hq, 1, d, device=device)
    results = []
    saved = dict(decode_attention.TUNING)
    grid = ((32, 64), (4,), (4,)) if dry else ((32, 64, 128), (4, 8), (2, 4, 8, 16))
    for block_n in grid[0]:
        for num_warps in grid[1]:
            for per_sm in grid[2]:
                decode_attention.TUNING.update(block_n=block_n, num_warps=num_warps, programs_per_sm=per_sm)
                try:
                    ms = timer(lambda: kernels.body_attention(q_rot, layer.key_body.read(), layer.value_body.read(), scaling=0.1,
                                                              dot_dtype=torch.bfloat16), device)
                except Exception as e:  # noqa: BLE001 - a setting the compiler rejects (e.g. out of shared memory)
                    ms = None
                    print(f"  tuning block_n={block_n} warps={num_warps}: {type(e).__name__}: {e}"[:200])
                results.append({"block_n": block_n, "num_warps": num_warps, "programs_per_sm": per_sm, "ms": ms})
    best = min((r for r in results if r["ms"] is not None), key=lambda r: r["ms"])
    decode_attention.TUNING.update(block_n=best["block_n"], num_warps=best["num_warps"],
                                   programs_per_sm=best["programs_per_sm"])
    if dry:
        decode_attention.TUNING.update(saved)
    return {"context": ctx, "batch": 1, "results": results, "best": best}


def roofline_comparison(rows, shapes, device) -> list[dict]:
    """Measured whole-layer step and SDPA times against benchmarks/roofline.py's bandwidth-bound predictions for
    the same shapes on this GPU (H200 bandwidth unless the device is an A100)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import roofline

    name = torch.cuda.get_device_name() if device.type == "cuda" else ""
    gpu = "A100" if "A100" in name else "H200"
    spec = roofline.GPUS[gpu]
    caches = {"oscar": "OscarCache", "oscar_scaled": "OscarScaledCache"}
    out = []
    for r in rows:
        if "error" in r:
            continue
        for method, ms in ((caches[r["layout"]], r["triton_layer_ms"]), ("bf16 SDPA", r["sdpa_ms"])):
            parts = roofline.step_bytes(method, r["batch"], r["context"], spec["arch"], shapes)
            predicted_us = sum(v for k, v in parts.items() if k != "num_splits") / spec["bytes_per_s"] * 1e6
            out.append({"method": method, "batch": r["batch"], "context": r["context"], "bandwidth_of": gpu,
                        "predicted_us": predicted_us, "measured_us": 1e3 * ms,
                        "measured_over_predicted": 1e3 * ms / predicted_us})
    return out


# ------------------------------------------------------------------------------------------------ stage 4: end to end
def bench_e2e(contexts, new_tokens, device, dry: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    import hf_kvint2
    from hf_kvint2 import OscarCache

    cfg = LlamaConfig(**(TINY if dry else LLAMA3_8B))
    dtype = torch.float32 if dry else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    out = {"model": "random-weight Llama-3-8B shapes" if not dry else "tiny Llama", "dtype": str(dtype),
           "new_tokens": new_tokens, "runs": []}
    oscar_ready = getattr(hf_kvint2, "ATTN_IMPLEMENTATION", None) == "oscar"
    if not oscar_ready:
        out["oscar_skipped"] = "hf_kvint2 does not register the 'oscar' attention implementation in this checkout"
    for ctx in contexts:
        for name in ("dynamic_sdpa", "oscar_fused"):
            if name == "oscar_fused" and not oscar_ready:
                continue
            try:
                model.set_attn_implementation("sdpa" if name == "dynamic_sdpa" else "oscar")
                cache = DynamicCache(config=model.config) if name == "dynamic_sdpa" else OscarCache(config=model.config)
                ids = torch.randint(0, cfg.vocab_size, (1, ctx), device=device)
                with torch.inference_mode():
                    sync(device)
                    t0 = time.perf_counter()
                    logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                    sync(device)
                    prefill_s = time.perf_counter() - t0
                    nxt = logits[:, -1:].argmax(-1)
                    warm = 2
                    for step in range(warm + new_tokens):
                        if step == warm:
                            sync(device)
                            t0 = time.perf_counter()
                        nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    sync(device)
                    decode_s = time.perf_counter() - t0
                row = {"cache": name, "context": ctx, "prefill_s": prefill_s,
                       "decode_ms_per_token": 1e3 * decode_s / new_tokens, "tokens_per_s": new_tokens / decode_s}
                if hasattr(cache, "memory_report"):
                    row["cache_bits_per_element"] = cache.memory_report()["total"]["bits_per_element"]
            except Exception as e:  # noqa: BLE001 - record, keep the other runs (e.g. out of memory at one context)
                row = {"cache": name, "context": ctx, "error": f"{type(e).__name__}: {e}"[:500]}
            out["runs"].append(row)
            print(f"  e2e {row}")
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for ctx in contexts:
        by = {r["cache"]: r for r in out["runs"] if r["context"] == ctx and "tokens_per_s" in r}
        if len(by) == 2:
            out.setdefault("oscar_over_dynamic_tokens_per_s", {})[str(ctx)] = (
                by["oscar_fused"]["tokens_per_s"] / by["dynamic_sdpa"]["tokens_per_s"])
    del model
    return out


# ------------------------------------------------------------------------------------------------ main
def plot(rows, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in sorted({r["layout"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            sel = sorted((r for r in rows if r["layout"] == kind and r["batch"] == batch), key=lambda r: r["context"])
            if len(sel) < 2:
                continue
            ctx = [r["context"] for r in sel]
            ax.plot(ctx, [r["speedup_body_vs_sdpa"] for r in sel], marker="o", label=f"{kind} body kernel, batch {batch}")
            ax.plot(ctx, [r["speedup_layer_vs_sdpa"] for r in sel], marker="x", ls="--",
                    label=f"{kind} whole layer step, batch {batch}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("speedup over bf16 SDPA (flash)")
    ax.set_title("Decode attention, 32 q / 8 kv heads, head_dim 128")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    ap.add_argument("--wheels", default=None, help="folder of wheels to install missing packages from")
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else benchmarks/results)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (default 8192,...,131072)")
    ap.add_argument("--e2e-contexts", default=None, help="end-to-end contexts (default 32768,65536)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode steps timed end to end (default 32)")
    ap.add_argument("--skip-tune", action="store_true", help="skip the kernel tuning stage")
    ap.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end decode stage")
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip remaining stages after this many seconds")
    args = ap.parse_args(argv)
    import torch

    # past_key_values= stays: transformers 5.17 (the GPU image) has no `cache=` yet.
    warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated")
    start = time.perf_counter()
    dry = args.dry_run
    source = ensure_packages(args.wheels)

    def ints(s, default):
        return [int(x) for x in s.split(",")] if s else default

    if dry:
        device = torch.device("cpu")
        shapes = {"hq": 4, "hkv": 2, "d": 64}
        batches, contexts = ints(args.batches, [1, 2]), ints(args.contexts, [96, 160])
        e2e_contexts, new_tokens, sink, recent = ints(args.e2e_contexts, [400]), args.new_tokens or 3, 4, 16
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu.py needs a CUDA GPU (use --dry-run to check the script on a CPU).")
        device = torch.device("cuda")
        shapes = {"hq": 32, "hkv": 8, "d": 128}
        batches = ints(args.batches, [1, 16])
        contexts = ints(args.contexts, [8192, 16384, 32768, 65536, 131072])
        e2e_contexts, new_tokens, sink, recent = ints(args.e2e_contexts, [32768, 65536]), args.new_tokens or 32, 64, 256
    import transformers
    import triton
    from tqdm.auto import tqdm

    meta = {**run_meta(os.getloadavg()[0]), "dry_run": dry, "triton": triton.__version__,
            "transformers": transformers.__version__, "hf_kvint2_from": source}
    result = {"dry_run": dry, "shapes": shapes, "hbm_bytes_per_s": HBM_BYTES_PER_S}
    print(f"machine: {meta['machine']}; torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}; hf_kvint2 from {source}")

    def over_budget(stage):
        if time.perf_counter() - start > args.budget_s:
            result.setdefault("skipped", []).append(f"{stage}: over the {args.budget_s:.0f} s budget")
            return True
        return False

    print("[1/4] correctness vs the PyTorch references")
    result["correctness"] = check_correctness(device, shapes, dry)
    for name, r in result["correctness"].items():
        print(f"  {name}: attention err {r['attention_max_abs_err']:.2e} (tol {r['attention_tol']:.0e}), "
              f"code mismatch {r['code_mismatch_fraction']:.2%} -> {'ok' if r['ok'] else 'FAIL'}")
    if not args.skip_tune and not over_budget("tuning"):
        print("[2/4] launch-setting sweep at 64k, batch 1")
        result["tuning"] = tune(shapes, device, 160 if dry else 65536, sink, recent, dry)
        print(f"  best: {result['tuning']['best']}")
    from hf_kvint2.kernels import decode_attention

    result["tuning_used"] = dict(decode_attention.TUNING)

    print("[3/4] decode attention, one layer")
    rows = []
    configs = [("oscar", b, c) for b in batches for c in contexts]
    configs += [("oscar_scaled", b, contexts[-2] if len(contexts) > 1 else contexts[0]) for b in batches]
    for kind, b, c in tqdm(configs, desc="attention"):
        if over_budget(f"attention {kind} batch {b} context {c}"):
            break
        try:
            rows.append(bench_layer(kind, b, c, shapes, device, sink, recent))
        except Exception as e:  # noqa: BLE001
            rows.append({"layout": kind, "batch": b, "context": c, "error": f"{type(e).__name__}: {e}"[:500]})
        r = rows[-1]
        if "error" in r:
            tqdm.write(f"  {kind} b={b} ctx={c}: {r['error']}")
        else:
            tqdm.write(f"  {kind} b={b} ctx={c}: triton body {r['triton_body_ms']:.3f} ms "
                       f"({r['triton_body_hbm_fraction']:.0%} of HBM), layer {r['triton_layer_ms']:.3f} ms, "
                       f"sdpa[{r['sdpa_backend']}] {r['sdpa_ms']:.3f} ms -> {r['speedup_body_vs_sdpa']:.2f}x body, "
                       f"{r['speedup_layer_vs_sdpa']:.2f}x layer")
    result["attention"] = rows
    result["roofline"] = roofline_comparison(rows, shapes, device)

    if not args.skip_e2e and not over_budget("end to end"):
        print("[4/4] end-to-end decode")
        try:
            result["end_to_end"] = bench_e2e(e2e_contexts, new_tokens, device, dry)
        except Exception as e:  # noqa: BLE001
            result["end_to_end"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  end to end failed: {result['end_to_end']['error']}")

    # The GPU targets: >= 3x bf16 SDPA at 64k, batch 1, and >= 50% of HBM bandwidth.
    target = [r for r in rows if r.get("layout") == "oscar" and r.get("batch") == 1 and r.get("context") == 65536
              and "error" not in r]
    if target:
        r = target[0]
        result["acceptance_64k_batch1"] = {"speedup_body_vs_sdpa": r["speedup_body_vs_sdpa"],
                                           "speedup_layer_vs_sdpa": r["speedup_layer_vs_sdpa"],
                                           "hbm_fraction": r["triton_body_hbm_fraction"],
                                           "pass": r["speedup_body_vs_sdpa"] >= 3 and r["triton_body_hbm_fraction"] >= 0.5}
        print(f"acceptance at 64k, batch 1: {result['acceptance_64k_batch1']}")
    result["wall_s"] = time.perf_counter() - start

    out_dir = Path(args.out or os.environ.get("OUT") or (ROOT / "benchmarks" / "results"))
    ok_rows = [r for r in rows if "error" not in r]
    write_results(out_dir / ("gpu_dry_run.json" if dry else "gpu.json"), meta, result,
                  (lambda _, png: plot(ok_rows, png)) if ok_rows else None)
    print(f"done in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
