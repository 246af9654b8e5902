"""Bits per cached K/V element against context length: what the caches hold, not how fast they are.

Each cache keeps a fixed number of tokens in full precision (a 64-token sink and a recent window: 128 tokens for
OscarScaledCache, 256-271 for OscarCache) and the rest as INT2 codes with 16-bit scales. At a few hundred tokens
the full-precision tokens are most of what is stored; the bits per element fall towards the INT2 body's as the
context grows. Measured from ``memory_report()`` after filling the caches with random K/V by ``update()`` (the
sizes do not depend on the values) and read at every length on the way:

* ``smollm2``: SmolLM2-135M's shapes (30 layers, 3 KV heads, head_dim 64), K/V in float32 (the bundled model on
  CPU, as ``make demo`` and the README's examples run it) and in bfloat16; ``OscarScaledCache()`` and the
  ``OscarCache`` calibration shipped for SmolLM2 (its per-layer layouts), up to the model's 8192 positions.
* ``head_dim128``: one layer of 8 KV heads of 128 (a Llama-3-8B layer), bfloat16, default settings of both
  caches (``OscarCache`` uncalibrated), up to 131072 tokens.

    python benchmarks/bits_per_element.py      # -> results/bits_per_element.{json,png}
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, run_meta, write_results

SMOLLM2_LENGTHS = (512, 1024, 2048, 4096, 8192)
LONG_LENGTHS = (2048, 8192, 32768, 131072)
NAMES = {"scaled": "OscarScaledCache", "oscar": "OscarCache"}


def bits_by_length(cache, layers: int, kv_heads: int, head_dim: int, dtype, lengths, chunk: int = 4096) -> dict:
    """Fill every layer of ``cache`` with random K/V up to ``max(lengths)`` tokens, one chunk of every layer at a
    time, and return ``{length: bits per element}`` read at each length."""
    import torch

    from hf_kvint2.layers import OscarLayer

    for layer in cache.layers:  # update() then skips the dequantized view it would hand to another attention
        if isinstance(layer, OscarLayer):
            layer.fused_attention = True
    g = torch.Generator().manual_seed(0)
    bits, filled = {}, 0
    with torch.no_grad():
        for length in sorted(lengths):
            while filled < length:
                n = min(chunk, length - filled)
                for idx in range(layers):
                    kv = torch.randn(2, 1, kv_heads, n, head_dim, generator=g).to(dtype)
                    cache.update(kv[0], kv[1], idx)
                filled += n
            bits[length] = cache.bits_per_element()
    return bits


def measure() -> list[dict]:
    import torch
    from speedlib import synthetic_config

    from hf_kvint2 import OscarCache, OscarScaledCache
    from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID

    rows = []
    config = synthetic_config(max_position_embeddings=8192)  # SmolLM2-135M's shapes
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("scaled", "oscar"):
            cache = OscarScaledCache(config=config) if kind == "scaled" else \
                OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=config)
            bits = bits_by_length(cache, config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                  dtype, SMOLLM2_LENGTHS)
            rows.append({"shapes": "smollm2", "cache": kind, "calibrated": kind == "oscar", "dtype": str(dtype),
                         "bits_per_element": bits})
            print(f"SmolLM2 shapes, {dtype}, {NAMES[kind]}: " + ", ".join(f"{n}: {b:.2f}" for n, b in bits.items()))
    layer = synthetic_config(num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             hidden_size=4096)
    for kind in ("scaled", "oscar"):
        cache = OscarScaledCache(config=layer) if kind == "scaled" else OscarCache(config=layer)
        bits = bits_by_length(cache, 1, 8, 128, torch.bfloat16, LONG_LENGTHS)
        rows.append({"shapes": "head_dim128", "cache": kind, "calibrated": False, "dtype": "torch.bfloat16",
                     "bits_per_element": bits})
        print(f"8 KV heads of 128, bfloat16, {NAMES[kind]}: " + ", ".join(f"{n}: {b:.2f}" for n, b in bits.items()))
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row in results:
        lengths = [int(n) for n in row["bits_per_element"]]
        shape = "SmolLM2 shapes" if row["shapes"] == "smollm2" else "head_dim 128"
        label = f"{NAMES[row['cache']]}{' (calibrated)' if row['calibrated'] else ''}, {shape}, " \
                f"{row['dtype'].removeprefix('torch.')}"
        ax.plot(lengths, list(row["bits_per_element"].values()), marker="o", label=label,
                ls="-" if row["dtype"] == "torch.float32" else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("bits per cached K/V element")
    ax.set_title("Stored bits per element vs context length (benchmarks/bits_per_element.py)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_options(ap, out_name="bits_per_element.json", threads_default=1)
    args = ap.parse_args()
    from speedlib import set_threads

    set_threads(args.threads)
    load = os.getloadavg()[0]
    results = measure()
    write_results(args.out, run_meta(load), results, plot)


if __name__ == "__main__":
    main()
