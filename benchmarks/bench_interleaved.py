"""Batch-1 decode speed with the caches' steps interleaved in one process: the ratio that a noisy machine moves least.

``bench_decode.py`` runs each cache in its own subprocess, one after the other, so that each has its own peak memory.
On a shared machine the host's load changes between those runs, and at batch 1 / 2k (where the caches differ by a
few percent) it moves the ratio more than the gap to the target. Here every cache is filled and decoded in the same
process, and each round runs one decode step of every cache, back to back: a round's ratios compare steps taken
within a fraction of a second of each other. Reported per cache: the median CPU time per step, the median over
rounds of ``DynamicCache``'s step time divided by the cache's, and the ratio of their total CPU times over all
rounds (no peak memory: the caches share the process). The totals are the headline: a cache whose tokens leave the
recent window in blocks (``OscarCache``: 16 at a time, ``OscarScaledCache``: 32) pays for a demotion in one step of
16 or 32, which the median step leaves out; the default 64 rounds hold whole cycles of both.

The model is the synthetic Llama of ``bench_decode.py --model synthetic`` (SmolLM2-135M's shapes, random weights,
32k positions), float32, one thread; the caches are filled with random K/V as there (layer 0 in chunks of 1024
tokens, copied to every layer). ``DynamicCache`` runs with SDPA, the Oscar caches with the fused ``"oscar"``
attention (two model instances with the same weights).

    python benchmarks/bench_interleaved.py                      # 2k and 8k, 64 rounds -> results/decode_interleaved.*
    python benchmarks/bench_interleaved.py --contexts 2048 --rounds 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, ratio_summary, run_meta, write_results

CACHES = ("dynamic", "oscar", "scaled")
NAMES = {"dynamic": "DynamicCache", "oscar": "OscarCache", "scaled": "OscarScaledCache"}


def measure(context: int, rounds: int, warmup: int, seed: int) -> list[dict]:
    """Fill every cache with ``context`` tokens, run ``warmup`` untimed rounds, then ``rounds`` timed ones."""
    import torch
    from speedlib import fill_cache, interleaved_cpu_steps, load_model, make_cache

    import hf_kvint2

    models = {}
    for attn in ("sdpa", hf_kvint2.ATTN_IMPLEMENTATION):
        torch.manual_seed(seed)  # the same random weights for both instances
        models[attn] = load_model("synthetic", attn)
    config = models["sdpa"].config
    runs = {}
    for kind in CACHES:
        cache = make_cache(kind, config)
        fused = kind != "dynamic"
        fill_cache(cache, config, 1, context, fused, seed=seed)
        model = models[hf_kvint2.ATTN_IMPLEMENTATION if fused else "sdpa"]
        runs[kind] = {"model": model, "cache": cache, "tokens": torch.full((1, 1), 1 + seed, dtype=torch.long)}
    cpu = interleaved_cpu_steps(runs, rounds, warmup, f"context {context}")
    rows = []
    for kind in CACHES:
        summary = ratio_summary(cpu["dynamic"], cpu[kind])
        rows.append({"cache": kind, "context": context, "batch": 1, "rounds": rounds,
                     "cpu_ms_per_step": statistics.median(cpu[kind]) * 1e3,
                     "cpu_ms_all_steps": [t * 1e3 for t in cpu[kind]],
                     "cpu_speed_vs_dynamic": summary["median"], "cpu_speed_vs_dynamic_total": summary["total"],
                     "cpu_speed_vs_dynamic_quartiles": summary["quartiles"]})
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in results})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / 2
    for i, kind in enumerate(("oscar", "scaled")):
        rows = [next(r for r in results if r["cache"] == kind and r["context"] == c) for c in contexts]
        xs = [j + (i - 0.5) * width for j in range(len(contexts))]
        total = [r["cpu_speed_vs_dynamic_total"] for r in rows]
        lo = [max(t - r["cpu_speed_vs_dynamic_quartiles"][0], 0) for t, r in zip(total, rows)]
        hi = [max(r["cpu_speed_vs_dynamic_quartiles"][-1] - t, 0) for t, r in zip(total, rows)]
        ax.bar(xs, total, width, yerr=[lo, hi], capsize=4, label=f"{NAMES[kind]} (fused)")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(contexts)), [f"batch 1, {c // 1024}k" for c in contexts])
    ax.set_ylabel("decode speed vs DynamicCache (total CPU time)")
    ax.set_title("Interleaved decode steps, 1 thread (bars: total time; whiskers: per-round quartiles)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192],
                    help="cached tokens before the timed steps (default 2048 8192)")
    ap.add_argument("--rounds", type=int, default=64, help="timed rounds, one step of every cache each (default 64)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds before them (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the K/V fill (default 0)")
    add_shared_options(ap, out_name="decode_interleaved.json", threads_default=None)
    args = ap.parse_args()
    from speedlib import set_threads

    set_threads(1)  # torch's and, before Numba is imported, Numba's thread count
    load_start = os.getloadavg()[0]
    results = []
    for context in args.contexts:
        results += measure(context, args.rounds, args.warmup, args.seed)
    meta = {"model": "Llama with SmolLM2-135M shapes, random weights", "dtype": "float32", "threads": 1,
            "rounds": args.rounds, "warmup": args.warmup, "timing": "process CPU time per decode step",
            "cache_fill": "random K/V for layer 0 in chunks of 1024 tokens, copied to every layer", **run_meta(load_start)}
    write_results(args.out, meta, results, plot)
    for row in results:
        q = row["cpu_speed_vs_dynamic_quartiles"]
        print(f"{NAMES[row['cache']]:17s} batch 1, context {row['context']:5d}: {row['cpu_ms_per_step']:7.1f} ms CPU "
              f"per step (median), {row['cpu_speed_vs_dynamic_total']:.2f}x DynamicCache in total CPU time (per round: "
              f"median {row['cpu_speed_vs_dynamic']:.2f}x, quartiles {q[0]:.2f}-{q[-1]:.2f})")


if __name__ == "__main__":
    main()
