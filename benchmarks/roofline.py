"""Roofline predictions for one layer's decode attention: bytes read per step / HBM bandwidth.

PREDICTIONS, not measurements: a decode step at batch <= 8 is memory-bound, so its time cannot be below the bytes
it must move divided by the memory bandwidth. The bytes come from the caches' own layouts (the stored codes,
scales, offsets and norms of ``hf_kvint2.kernels.aot._stream`` for each recipe, on the meta device), the
full-precision sink and recent windows (bf16), the query and output (bf16), the rotations and means read once,
and the split-K partials the dispatcher would write and merge (its ``num_splits`` for that GPU). bf16 SDPA reads
16-bit K and V of every token. Shapes: Llama-3-8B (32 query heads, 8 KV heads, head_dim 128).
"""

from __future__ import annotations

GPUS = {"H200": {"bytes_per_s": 4.8e12, "arch": 90}, "A100": {"bytes_per_s": 2.0e12, "arch": 80}}
CONTEXTS = (8192, 32768, 131072)
BATCHES = (1, 8)
SHAPES = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
BF16 = 2


def _recipes():
    from hf_kvint2.settings import oscar_recipe, oscar_scaled_recipe

    return {"OscarCache": oscar_recipe(), "OscarScaledCache": oscar_scaled_recipe()}


def _split_partials(config, batch: int, context: int, arch: int) -> tuple[int, int]:
    """(num_splits the dispatcher picks on that GPU, bytes of split partials written and read back)."""
    from hf_kvint2.kernels import aot

    config = config._replace(shapes=((batch, context),))
    merges = [launch for launch in aot.capture_launches(config, aot.TARGETS[arch]["sms"], quantize=False)
              if launch.kernel == "merge_splits"]
    if not merges:
        return 1, 0
    splits = merges[0].args["num_splits"]
    rows = batch * config.kv_heads * config.gqa
    return splits, 2 * rows * splits * (config.head_dim + 1) * 4  # fp32 out + lse, written then read


def step_bytes(cache: str, batch: int, context: int, arch: int, shapes: dict | None = None) -> dict:
    """Bytes one decode step of one layer moves, by part (``shapes``: {"hq", "hkv", "d"}, default Llama-3-8B)."""
    import torch
    from hf_kvint2.kernels import aot
    from hf_kvint2.kernels.aot import KernelConfig

    shapes = shapes or {"hq": SHAPES["q_heads"], "hkv": SHAPES["kv_heads"], "d": SHAPES["head_dim"]}
    hq, hkv, d = shapes["hq"], shapes["hkv"], shapes["d"]
    io = {"query": batch * hq * d * BF16, "output": batch * hq * d * BF16}
    if cache == "bf16 SDPA":
        return {**io, "kv_bf16": 2 * batch * hkv * context * d * BF16}
    recipe = _recipes()[cache]
    window = recipe.sink_tokens + recipe.recent_tokens
    block = recipe.demotion_block
    body = max(0, (context - window) // block * block)
    meta = torch.device("meta")
    parts = dict(io)
    for name, layout, mean in (("key", recipe.key, recipe.key_mean), ("value", recipe.value, recipe.value_mean)):
        stream = aot._stream(layout, d, hkv, batch, body, recipe.scale_dtype, False, meta)
        parts[f"{name}_codes"] = stream.codes.nbytes
        parts[f"{name}_scales_offsets"] = stream.scale.nbytes + stream.lo.nbytes
        if stream.norm is not None:
            parts[f"{name}_norms"] = stream.norm.nbytes
        parts[f"{name}_rotation_mean"] = d * d * 4 + hkv * d * 4  # read once per step (mean: calibrated OSCAR)
    parts["full_precision_windows"] = 2 * batch * hkv * (context - body) * d * BF16
    config = KernelConfig(cache, recipe.key, recipe.value, False, torch.bfloat16, d, hq // hkv, hkv,
                          recipe.scale_dtype)
    splits, parts["split_partials"] = _split_partials(config, batch, context, arch)
    parts["num_splits"] = splits
    return parts


def predictions() -> list[dict]:
    rows = []
    for gpu, spec in GPUS.items():
        for batch in BATCHES:
            for context in CONTEXTS:
                sdpa = None
                for cache in ("bf16 SDPA", "OscarCache", "OscarScaledCache"):
                    parts = step_bytes(cache, batch, context, spec["arch"])
                    total = sum(v for k, v in parts.items() if k != "num_splits")
                    row = {"gpu": gpu, "bandwidth_bytes_per_s": spec["bytes_per_s"], "batch": batch,
                           "context": context, "method": cache, "bytes": total, "bytes_by_part": parts,
                           "predicted_us": total / spec["bytes_per_s"] * 1e6}
                    if cache == "bf16 SDPA":
                        sdpa = row["predicted_us"]
                    row["predicted_speedup_vs_sdpa"] = sdpa / row["predicted_us"]
                    rows.append(row)
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BATCHES), figsize=(11, 4.2), sharey=True)
    colors = {"bf16 SDPA": "tab:gray", "OscarCache": "tab:blue", "OscarScaledCache": "tab:orange"}
    for ax, batch in zip(axes, BATCHES):
        for gpu, style in zip(GPUS, ("-", "--")):
            for method, color in colors.items():
                sel = [r for r in rows if r["gpu"] == gpu and r["batch"] == batch and r["method"] == method]
                ax.plot([r["context"] for r in sel], [r["predicted_us"] for r in sel], style, color=color,
                        marker="o", label=f"{method}, {gpu}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted µs per layer step (bandwidth bound)")
    axes[0].legend(fontsize=7)
    fig.suptitle("PREDICTED decode attention time, one Llama-3-8B layer (32 q / 8 kv heads, d=128): bytes / HBM "
                 "bandwidth", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="also write the predictions as JSON and a PNG plot "
                    "(PATH.json, PATH.png); benchmarks/triton_aot.py stores them in triton_aot.json")
    args = ap.parse_args(argv)
    rows = predictions()
    for r in rows:
        print(f"{r['gpu']:5s} batch {r['batch']} {r['context'] // 1024:4d}k {r['method']:17s} "
              f"{r['predicted_us']:9.1f} µs (predicted)")
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        plot(rows, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
