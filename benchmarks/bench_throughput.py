"""Throughput at equal KV memory on CPU: for a KV-cache budget (default 1 GiB), the largest batch of 8k-token
sequences each cache holds, and the tokens per second it decodes at that batch.

Caches: transformers' DynamicCache and QuantizedCache(backend="hqq", nbits=2) (attention "sdpa"), OscarCache and
OscarScaledCache (attention "oscar", the fused INT2 path). Model: a Llama with SmolLM2-135M's shapes and random
weights in fp32 (``--model smollm2`` for the real one; decode speed does not depend on the weights' values).

Method, per cache, each in a fresh subprocess: (1) bytes per sequence: a batch-1 cache filled with ``--context``
tokens of random K/V, measured by walking the cache's tensors (every storage once, whole allocations: the same
measure for every class; for the Oscar caches it equals ``memory_report()["total"]["allocated"]``); (2) the largest
batch ``floor(budget / bytes per sequence)``; (3) that batch is allocated and filled (random K/V by ``update()``
for layer 0 in chunks of 1024 tokens, copied to every layer: a real 8k x batch prefill takes hours on 2 cores), its
bytes are measured again and must fit the budget; (4) ``--warmup`` untimed decode steps, then ``--steps`` timed
ones: tokens per second = batch / median step time, in CPU time of the process (one thread; the headline, since a
shared machine inflates wall time unevenly) and in wall time. Ratios are against DynamicCache in the same run.

    python benchmarks/bench_throughput.py --threads 1                      # 1 GiB -> results/throughput_cpu.*
    python benchmarks/bench_throughput.py --budgets-gib 1 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import CACHES, add_shared_options, add_step_options, run_meta, run_worker, worker_env, write_results

# The headline: tokens per second of the process's CPU time (one thread), which a shared machine disturbs far less
# than wall time; both are in the JSON.
METRIC = "cpu_tokens_per_s"
LABELS = {"dynamic": "DynamicCache", "hqq": "QuantizedCache hqq 2-bit", "oscar": "OscarCache",
          "scaled": "OscarScaledCache"}


def worker(kind: str, budget: int, context: int, steps: int, warmup: int, threads: int, model_name: str) -> dict:
    import warnings

    import torch
    from speedlib import cache_bytes, fill_cache, load_model, make_cache, rss_mib, set_threads, time_decode_steps

    warnings.simplefilter("ignore")
    set_threads(threads)
    fused = kind in ("oscar", "scaled")
    model = load_model(model_name, "oscar" if fused else "sdpa")
    cfg = model.config
    probe = make_cache(kind, cfg)
    fill_cache(probe, cfg, 1, context, fused)
    per_seq = cache_bytes(probe)
    report = probe.memory_report()["total"] if hasattr(probe, "memory_report") else None
    del probe
    batch = budget // per_seq
    row = {"cache": kind, "budget_bytes": budget, "context": context, "bytes_per_sequence": per_seq,
           "memory_report_total": report, "batch": batch}
    if batch < 1:
        return {**row, "tokens_per_s": 0.0, "note": "one sequence does not fit the budget"}
    cache = make_cache(kind, cfg)
    row["fill_s"] = fill_cache(cache, cfg, batch, context, fused)
    row["allocated_bytes"] = cache_bytes(cache)
    if row["allocated_bytes"] > budget:
        raise RuntimeError(f"{kind}: batch {batch} holds {row['allocated_bytes']} bytes > budget {budget}")
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    times, cpu_times = time_decode_steps(model, cache, tokens, warmup, steps)
    step = statistics.median(times)
    return {**row, "step_s": step, "step_s_all": times, "cpu_s_all": cpu_times, "tokens_per_s": batch / step,
            "cpu_tokens_per_s": batch / statistics.median(cpu_times), "peak_rss_mib": rss_mib(),
            "threads": torch.get_num_threads()}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget_bytes"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(CACHES)
    for ci, kind in enumerate(CACHES):
        rows = {r["budget_bytes"]: r for r in results if r["cache"] == kind}
        xs = [i + ci * width for i in range(len(budgets))]
        axes[0].bar(xs, [rows[b]["batch"] if b in rows else 0 for b in budgets], width, label=LABELS[kind])
        axes[1].bar(xs, [rows[b][METRIC] if b in rows else 0 for b in budgets], width, label=LABELS[kind])
    for ax, title in zip(axes, ("largest batch of 8k-token sequences", "decode tokens / CPU-second at that batch")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(budgets))])
        ax.set_xticklabels([f"{b / 2**30:g} GiB KV budget" for b in budgets])
        ax.set_title(title)
    axes[1].legend(fontsize=8)
    fig.suptitle("Throughput at equal KV memory, CPU, 1 thread (hf_kvint2 benchmarks/bench_throughput.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets-gib", type=float, nargs="+", default=[1.0], help="KV budgets in GiB (default 1)")
    ap.add_argument("--context", type=int, default=8192, help="tokens per sequence (default 8192)")
    ap.add_argument("--caches", nargs="+", default=["dynamic", "oscar", "scaled", "hqq"], choices=CACHES,
                    help="caches compared: dynamic, hqq (QuantizedCache, 2 bits; needs pip install hqq), oscar, "
                         "scaled (default: all, hqq last)")
    # 5 timed steps: DynamicCache's first decode steps page-fault a fresh copy of its history (2-3x slower than its
    # steady state), which a 2-step median catches (docs/results.md, seventh run)
    add_step_options(ap, steps=5, warmup=1)
    add_shared_options(ap, out_name="throughput_cpu.json", model_default="synthetic", threads_default=1,
                       worker_metavar=("CACHE", "BUDGET"))
    args = ap.parse_args()
    if args.worker:
        kind, budget = args.worker
        print(json.dumps(worker(kind, int(budget), args.context, args.steps, args.warmup, args.threads, args.model)))
        return

    from tqdm import tqdm

    load = os.getloadavg()[0]
    jobs = [(c, int(b * 2**30)) for b in args.budgets_gib for c in args.caches]
    results = []
    env = worker_env(args.threads, omp=True)
    options = {"--context": args.context, "--steps": args.steps, "--warmup": args.warmup, "--threads": args.threads,
               "--model": args.model}
    for kind, budget in tqdm(jobs, desc="throughput benchmark"):
        row = run_worker(__file__, [kind, budget], options, env, f"{kind} budget={budget}")
        results.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps(results, indent=1))  # kept if a later case fails
        tqdm.write(f"{kind:8s} {budget / 2**30:g} GiB: batch {row['batch']:3d} "
                   f"({row['bytes_per_sequence'] / 2**20:.1f} MiB/seq), {row['tokens_per_s']:.2f} tokens/s")
    for row in results:
        base = next((r for r in results if r["cache"] == "dynamic" and r["budget_bytes"] == row["budget_bytes"]),
                    None)
        if base is not None and base["tokens_per_s"]:
            row["throughput_vs_dynamic"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["batch_vs_dynamic"] = row["batch"] / base["batch"]
            if "cpu_tokens_per_s" in row and "cpu_tokens_per_s" in base:
                row["cpu_throughput_vs_dynamic"] = row["cpu_tokens_per_s"] / base["cpu_tokens_per_s"]
    meta = {"model": f"{args.model} (SmolLM2-135M shapes), fp32", "context": args.context, "steps": args.steps,
            "warmup": args.warmup, "threads": args.threads, **run_meta(load),
            "cache_fill": "random K/V by update() for layer 0 in chunks of 1024, copied to every layer",
            "memory": "bytes of every tensor storage the cache object holds (whole allocations, each once)"}
    write_results(args.out, meta, results, plot)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    for r in results:
        print(f"{LABELS[r['cache']]:26s} {r['budget_bytes'] / 2**30:g} GiB: batch {r['batch']:3d}, "
              f"{r['cpu_tokens_per_s']:7.2f} tokens/CPU-s ({r.get('cpu_throughput_vs_dynamic', float('nan')):.2f}x "
              f"DynamicCache), {r['tokens_per_s']:7.2f} tokens/s wall "
              f"({r.get('throughput_vs_dynamic', float('nan')):.2f}x)")


if __name__ == "__main__":
    main()
