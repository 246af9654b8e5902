"""Throughput at equal KV memory on CPU: for a KV-cache budget (default 1 GiB), the largest batch of 8k-token
sequences each cache holds, and the tokens per second it decodes at that batch.

Caches: transformers' DynamicCache and QuantizedCache(backend="hqq", nbits=2) (attention "sdpa"), OscarCache and
OscarScaledCache (attention "oscar", the fused INT2 path). Model: a Llama with SmolLM2-135M's shapes and random
weights in fp32 (``--model smollm2`` for the real one; decode speed does not depend on the weights' values).

Method, per cache, each in a fresh subprocess: (1) bytes per sequence: a batch-1 cache filled with ``--context``
tokens of random K/V, measured by walking the cache's tensors (every storage once, whole allocations: the same
measure for every class; for the Oscar caches it equals ``memory_report()["total"]["allocated"]``), the most it
holds over the next demotion cycle of one-token updates (a window grows until its tokens leave it); (2) the largest
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

from speedlib import (
    CACHES,
    RESULTS,
    add_shared_options,
    add_step_options,
    ratio_summary,
    run_meta,
    run_worker,
    worker_env,
    write_results,
)

# The headline: tokens per second of the process's CPU time (one thread), which a shared machine disturbs far less
# than wall time; both are in the JSON.
METRIC = "cpu_tokens_per_s"
LABELS = {"dynamic": "DynamicCache", "hqq": "QuantizedCache hqq 2-bit", "oscar": "OscarCache",
          "scaled": "OscarScaledCache"}


def demotion_cycle(cache) -> int:
    """Decode steps after which a cache's layout repeats: tokens leave an Oscar layer's recent window in blocks of
    ``recipe.demotion_block`` (``OscarCache``: ``demotion_tokens``; ``OscarScaledCache``: a key group), and
    transformers' ``QuantizedCache`` quantizes its residual every ``residual_length`` tokens, so their bytes grow
    for that many steps; 1 for ``DynamicCache``."""
    return max([getattr(getattr(layer, "recipe", None), "demotion_block", None) or getattr(layer, "residual_length", 1)
                for layer in cache.layers] + [1])


def most_bytes_over_updates(cache, cfg, steps: int, measure) -> list[int]:
    """``measure(cache)`` after each of ``steps`` one-token updates of every layer (random K/V): a sequence's bytes
    are the most it holds over a demotion cycle, not what it holds right after the fill, where a window may be at its
    smallest (``OscarCache``'s holds up to ``demotion_tokens - 1`` more tokens before they leave it)."""
    import torch

    g = torch.Generator().manual_seed(1)
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = []
    with torch.no_grad():
        for _ in range(steps):
            for idx in range(len(cache.layers)):
                cache.update(torch.randn(1, kv_heads, 1, head_dim, generator=g),
                             torch.randn(1, kv_heads, 1, head_dim, generator=g), idx)
            sizes.append(measure(cache))
    return sizes


def sequence_bytes(kind: str, cfg, context: int, fused: bool) -> dict:
    """Bytes one sequence of ``context`` tokens takes in a ``kind`` cache: a batch-1 cache filled and then updated over
    a demotion cycle (:func:`most_bytes_over_updates`); the most it held is ``bytes_per_sequence``."""
    from speedlib import cache_bytes, fill_cache, make_cache

    probe = make_cache(kind, cfg)
    fill_cache(probe, cfg, 1, context, fused)
    after_fill = cache_bytes(probe)
    report = probe.memory_report()["total"] if hasattr(probe, "memory_report") else None
    cycle = demotion_cycle(probe)
    return {"bytes_per_sequence": max([after_fill] + most_bytes_over_updates(probe, cfg, cycle, cache_bytes)),
            "bytes_per_sequence_after_fill": after_fill, "demotion_cycle_tokens": cycle, "memory_report_total": report}


def fill_batch(kind: str, cfg, budget: int, context: int, fused: bool) -> tuple[dict, object]:
    """The row's sizing (:func:`sequence_bytes`, the largest batch within ``budget``) and that batch's filled cache
    (None if not even one sequence fits); raises if the filled cache holds more than the budget."""
    from speedlib import cache_bytes, fill_cache, make_cache

    row = {"cache": kind, "budget_bytes": budget, "context": context, **sequence_bytes(kind, cfg, context, fused)}
    row["batch"] = budget // row["bytes_per_sequence"]
    if row["batch"] < 1:
        return {**row, "tokens_per_s": 0.0, "note": "one sequence does not fit the budget"}, None
    cache = make_cache(kind, cfg)
    row["fill_s"] = fill_cache(cache, cfg, row["batch"], context, fused)
    row["allocated_bytes"] = cache_bytes(cache)
    if row["allocated_bytes"] > budget:
        raise RuntimeError(f"{kind}: batch {row['batch']} holds {row['allocated_bytes']} bytes > budget {budget}")
    return row, cache


def worker(kind: str, budget: int, context: int, steps: int, warmup: int, threads: int, model_name: str) -> dict:
    import warnings

    import torch
    from speedlib import cache_bytes, load_model, rss_mib, set_threads, time_decode_steps

    warnings.simplefilter("ignore")
    set_threads(threads)
    fused = kind in ("oscar", "scaled")
    model = load_model(model_name, "oscar" if fused else "sdpa")
    cfg = model.config
    row, cache = fill_batch(kind, cfg, budget, context, fused)
    if cache is None:
        return row
    batch = row["batch"]
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    times, cpu_times = time_decode_steps(model, cache, tokens, warmup, steps)
    row["allocated_bytes_after_steps"] = cache_bytes(cache)
    step = statistics.median(times)
    return {**row, "step_s": step, "step_s_all": times, "cpu_s_all": cpu_times, "tokens_per_s": batch / step,
            "cpu_tokens_per_s": batch / statistics.median(cpu_times), "peak_rss_mib": rss_mib(),
            "threads": torch.get_num_threads()}


def interleaved_worker(caches: list[str], budget: int, context: int, rounds: int, warmup: int, threads: int,
                       model_name: str) -> dict:
    """Every cache at its largest batch in one process, one decode step of each per round (``--interleaved``):
    tokens per CPU-second from the median step, and the throughput ratio to ``DynamicCache`` per round (median,
    quartiles) and over all rounds (total CPU times: the headline, as in bench_interleaved.py)."""
    import warnings

    import torch
    from speedlib import cache_bytes, interleaved_cpu_steps, load_model, set_threads

    import hf_kvint2

    warnings.simplefilter("ignore")
    set_threads(threads)
    models = {}
    for attn in ("sdpa", hf_kvint2.ATTN_IMPLEMENTATION):
        torch.manual_seed(0)  # the same random weights for both instances
        models[attn] = load_model(model_name, attn)
    cfg = models["sdpa"].config
    rows, runs = {}, {}
    for kind in caches:
        fused = kind in ("oscar", "scaled")
        rows[kind], cache = fill_batch(kind, cfg, budget, context, fused)
        if cache is not None:
            tokens = torch.randint(0, cfg.vocab_size, (rows[kind]["batch"], 1),
                                   generator=torch.Generator().manual_seed(0))
            runs[kind] = {"model": models[hf_kvint2.ATTN_IMPLEMENTATION if fused else "sdpa"], "cache": cache,
                          "tokens": tokens}
    cpu = interleaved_cpu_steps(runs, rounds, warmup, f"{budget / 2**30:g} GiB, interleaved")
    base = rows.get("dynamic")
    for kind, run in runs.items():
        row, batch = rows[kind], rows[kind]["batch"]
        row.update({"allocated_bytes_after_steps": cache_bytes(run["cache"]), "rounds": rounds, "cpu_s_all": cpu[kind],
                    "cpu_tokens_per_s": batch / statistics.median(cpu[kind]), "threads": torch.get_num_threads()})
        if "dynamic" in runs:
            summary = ratio_summary(cpu["dynamic"], cpu[kind], work=batch, baseline_work=base["batch"])
            row["cpu_throughput_vs_dynamic"] = summary["median"]
            row["cpu_throughput_vs_dynamic_quartiles"] = summary["quartiles"]
            row["cpu_throughput_vs_dynamic_total"] = summary["total"]
            row["batch_vs_dynamic"] = batch / base["batch"]
    return {"rows": [rows[kind] for kind in caches]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget_bytes"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    kinds = [kind for kind in CACHES if any(r["cache"] == kind for r in results)]  # the caches this run measured
    width = 0.8 / len(kinds)
    for ci, kind in enumerate(kinds):
        rows = {r["budget_bytes"]: r for r in results if r["cache"] == kind}
        xs = [i + ci * width for i in range(len(budgets))]
        axes[0].bar(xs, [rows[b]["batch"] if b in rows else 0 for b in budgets], width, label=LABELS[kind])
        axes[1].bar(xs, [rows[b].get(METRIC, 0.0) if b in rows else 0 for b in budgets], width, label=LABELS[kind])
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
    # steady state), which a 2-step median would catch
    add_step_options(ap, steps=5, warmup=1)
    add_shared_options(ap, out_name="throughput_cpu.json", model_default="synthetic", threads_default=1,
                       worker_metavar=("CACHE", "BUDGET"))
    ap.add_argument("--interleaved", action="store_true",
                    help="all caches in one process, one decode step of each per round (--steps rounds after "
                         "--warmup), ratios per round and in total (default out: results/throughput_interleaved.json)")
    args = ap.parse_args()
    if args.worker:
        kind, budget = args.worker
        if kind == "interleaved":
            print(json.dumps(interleaved_worker(args.caches, int(budget), args.context, args.steps, args.warmup,
                                                args.threads, args.model)))
        else:
            print(json.dumps(worker(kind, int(budget), args.context, args.steps, args.warmup, args.threads,
                                    args.model)))
        return
    if args.interleaved:
        interleaved_main(args)
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
              f"{r.get('cpu_tokens_per_s', 0.0):7.2f} tokens/CPU-s ({r.get('cpu_throughput_vs_dynamic', float('nan')):.2f}x "
              f"DynamicCache), {r['tokens_per_s']:7.2f} tokens/s wall "
              f"({r.get('throughput_vs_dynamic', float('nan')):.2f}x)")


def interleaved_main(args) -> None:
    load = os.getloadavg()[0]
    out = args.out if args.out != RESULTS / "throughput_cpu.json" else RESULTS / "throughput_interleaved.json"
    env = worker_env(args.threads, omp=True)
    options = {"--context": args.context, "--steps": args.steps, "--warmup": args.warmup, "--threads": args.threads,
               "--model": args.model, "--caches": args.caches}
    results = []
    for gib in args.budgets_gib:
        budget = int(gib * 2**30)
        results += run_worker(__file__, ["interleaved", budget], options, env, f"interleaved budget={budget}")["rows"]
    meta = {"model": f"{args.model} (SmolLM2-135M shapes), fp32", "context": args.context, "rounds": args.steps,
            "warmup": args.warmup, "threads": args.threads, **run_meta(load),
            "timing": "process CPU time per decode step; every cache in one process, one step of each per round",
            "cache_fill": "random K/V by update() for layer 0 in chunks of 1024, copied to every layer",
            "memory": "bytes of every tensor storage the cache object holds (whole allocations, each once), the most "
                      "a sequence holds over a demotion cycle"}
    write_results(out, meta, results, plot)
    for r in results:
        q = r.get("cpu_throughput_vs_dynamic_quartiles", [float("nan")])
        print(f"{LABELS[r['cache']]:26s} {r['budget_bytes'] / 2**30:g} GiB: batch {r['batch']:3d} "
              f"({r['bytes_per_sequence'] / 2**20:.1f} MiB/seq), {r.get('cpu_tokens_per_s', 0.0):7.2f} tokens/CPU-s, "
              f"{r.get('cpu_throughput_vs_dynamic_total', float('nan')):.2f}x DynamicCache in total CPU time "
              f"(per round: median {r.get('cpu_throughput_vs_dynamic', float('nan')):.2f}x, "
              f"quartiles {q[0]:.2f}-{q[-1]:.2f})")


if __name__ == "__main__":
    main()
