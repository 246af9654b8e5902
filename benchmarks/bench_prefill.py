"""Prefill (time to first token) on CPU: one forward over a 2k or 8k-token prompt into a fresh cache, then the
argmax of the last position. SmolLM2-135M in fp32, batch 1, one thread (torch and Numba).

Caches: DynamicCache (attention "sdpa"), OscarCache and OscarScaledCache (attention "oscar": the prefill of a
fresh cache is SDPA on the chunk; the cache quantizes every token that leaves the recent window, vectorised over
blocks of 4096 tokens). Each (cache, prompt) runs in a fresh subprocess after an untimed 64-token forward (library
warm-up). Reported: wall and CPU time of the timed forward (median of ``--repeats``), peak RSS; ratios are
against DynamicCache in the same run.

    python benchmarks/bench_prefill.py --threads 1        # 2k and 8k -> results/prefill_cpu.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, run_meta, run_worker, worker_env, write_results

CACHES = ("dynamic", "oscar", "scaled")
LABELS = {"dynamic": "DynamicCache", "oscar": "OscarCache", "scaled": "OscarScaledCache"}


def worker(kind: str, tokens: int, repeats: int, threads: int, model_name: str) -> dict:
    import warnings

    import torch
    from speedlib import load_model, make_cache, rss_mib, set_threads

    warnings.simplefilter("ignore")
    set_threads(threads)
    model = load_model(model_name, "sdpa" if kind == "dynamic" else "oscar")
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    walls, cpus = [], []
    with torch.no_grad():
        model(input_ids=ids[:, :64], past_key_values=make_cache(kind, cfg), use_cache=True)  # warm-up
        for _ in range(repeats):
            cache = make_cache(kind, cfg)
            t, c = time.perf_counter(), time.process_time()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            logits[:, -1].argmax(-1)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            del cache, logits
    return {"cache": kind, "tokens": tokens, "wall_s": statistics.median(walls), "wall_s_all": walls,
            "cpu_s": statistics.median(cpus), "cpu_s_all": cpus, "peak_rss_mib": rss_mib(),
            "threads": torch.get_num_threads()}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["tokens"] for r in results})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(CACHES)
    for ci, kind in enumerate(CACHES):
        rows = {r["tokens"]: r for r in results if r["cache"] == kind}
        ax.bar([i + ci * width for i in range(len(lengths))], [rows[n]["cpu_s"] if n in rows else 0 for n in lengths],
               width, label=LABELS[kind])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))])
    ax.set_xticklabels([f"{n // 1024}k-token prompt" for n in lengths])
    ax.set_ylabel("time to first token, CPU s (1 thread)")
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M fp32 prefill on CPU (benchmarks/bench_prefill.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="prompt lengths (default 2048 8192)")
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES,
                    help="dynamic (DynamicCache, sdpa), oscar, scaled (attention \"oscar\"; default: all)")
    ap.add_argument("--repeats", type=int, default=1, help="timed forwards per case, median reported (default 1)")
    add_shared_options(ap, out_name="prefill_cpu.json", model_default="smollm2", threads_default=1,
                       worker_metavar=("CACHE", "TOKENS"))
    args = ap.parse_args()
    if args.worker:
        kind, tokens = args.worker
        print(json.dumps(worker(kind, int(tokens), args.repeats, args.threads, args.model)))
        return

    from tqdm import tqdm

    load = os.getloadavg()[0]
    env = worker_env(args.threads, omp=True)
    options = {"--repeats": args.repeats, "--threads": args.threads, "--model": args.model}
    results = []
    for tokens in args.tokens:
        for kind in tqdm(args.caches, desc=f"prefill {tokens}"):
            row = run_worker(__file__, [kind, tokens], options, env, f"{kind} tokens={tokens}")
            results.append(row)
            tqdm.write(f"{kind:8s} {tokens:5d} tokens: {row['wall_s']:.2f} s wall, {row['cpu_s']:.2f} s CPU")
    for row in results:
        base = next(r for r in results if r["cache"] == "dynamic" and r["tokens"] == row["tokens"])
        row["wall_vs_dynamic"] = row["wall_s"] / base["wall_s"]
        row["cpu_vs_dynamic"] = row["cpu_s"] / base["cpu_s"]
    meta = {"model": args.model, "dtype": "float32", "batch": 1, "threads": args.threads, "repeats": args.repeats,
            **run_meta(load)}
    write_results(args.out, meta, results, plot)
    for r in results:
        print(f"{LABELS[r['cache']]:18s} {r['tokens']:5d} tokens: {r['cpu_s']:6.2f} s CPU ({r['cpu_vs_dynamic']:.2f}x "
              f"DynamicCache), {r['wall_s']:6.2f} s wall ({r['wall_vs_dynamic']:.2f}x)")


if __name__ == "__main__":
    main()
