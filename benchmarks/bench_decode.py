"""CPU decode benchmark: ms per generated token and peak process memory, SmolLM2-135M in fp32 (or, with
``--model synthetic``, a Llama with SmolLM2-135M's shapes, random weights and 32k positions, for a 32k context).

Caches: transformers' DynamicCache and QuantizedCache(backend="hqq", nbits=2), and OscarCache / OscarScaledCache
on the portable path (model with attn_implementation="sdpa") and on the fused path ("oscar").

Every (cache, batch, context) runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own: model load,
cache fill and decode. The cache is filled with random K/V for every layer (decode time does not depend on the
values, and a real 8k-token prefill at batch 8 takes many minutes on a 2-core CPU): layer 0 in chunks of 1024
tokens, copied to every layer; then
``--warmup`` decode steps (untimed: the first compiles the Numba kernel and switches the layers to the fused path)
and ``--steps`` timed ones; the median step time is reported (wall clock, and the process's CPU time, which a
shared machine disturbs less: one thread). Ratios are against DynamicCache from the same run.

    python benchmarks/bench_decode.py                       # batch 1, 8 x context 2k, 8k -> results/decode_cpu.*
    python benchmarks/bench_decode.py --batches 8 --contexts 8192 --steps 5
    python benchmarks/bench_decode.py --model synthetic --cases 1x2048 1x8192 1x32768 8x8192 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, add_step_options, run_meta, run_worker, worker_env, write_results

CONFIGS = ("dynamic", "hqq", "oscar-portable", "oscar-fused", "scaled-portable", "scaled-fused")


def worker(config: str, batch: int, context: int, steps: int, warmup: int, seed: int, threads: int,
           model_name: str = "smollm2") -> dict:
    import warnings

    import torch
    from speedlib import fill_cache, load_model, make_cache, rss_mib, set_threads, time_decode_steps

    import hf_kvint2

    warnings.simplefilter("ignore")  # the portable-path warning is expected here
    set_threads(threads)
    torch.manual_seed(seed)
    fused = config.endswith("-fused")
    model = load_model(model_name, hf_kvint2.ATTN_IMPLEMENTATION if fused else "sdpa")
    cfg = model.config
    rss_model = rss_mib()
    cache = make_cache(config.split("-")[0], cfg)  # "oscar-fused" -> "oscar"
    fill_s = fill_cache(cache, cfg, batch, context, fused, generator=torch.default_generator)
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1))
    times, cpu_times = time_decode_steps(model, cache, tokens, warmup, steps)
    times, cpu_times = [t * 1e3 for t in times], [t * 1e3 for t in cpu_times]
    return {"config": config, "batch": batch, "context": context, "ms_per_token": statistics.median(times),
            "ms_all_steps": times, "cpu_ms_per_token": statistics.median(cpu_times), "cpu_ms_all_steps": cpu_times,
            "peak_rss_mib": rss_mib(), "rss_after_model_load_mib": rss_model, "fill_s": fill_s,
            "threads": torch.get_num_threads(), "model": model_name}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["batch"], r["context"]) for r in results})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in results)]
    # one thread: the process's CPU time per step (a shared machine inflates wall time unevenly); else wall time
    key = "cpu_ms_per_token" if all(r.get("threads") == 1 and "cpu_ms_per_token" in r for r in results) \
        else "ms_per_token"
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(configs)
    for ci, config in enumerate(configs):
        rows = {(r["batch"], r["context"]): r for r in results if r["config"] == config}
        xs = [i + ci * width for i in range(len(cases))]
        axes[0].bar(xs, [rows[c][key] if c in rows else 0 for c in cases], width, label=config)
        axes[1].bar(xs, [rows[c]["peak_rss_mib"] if c in rows else 0 for c in cases], width, label=config)
    unit = "CPU ms" if key == "cpu_ms_per_token" else "ms"
    for ax, title in zip(axes, (f"decode {unit} / token (lower is better)", "peak process memory, MiB")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"batch {b}\n{c // 1024}k ctx" for b, c in cases])
        ax.set_title(title)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{results[0].get('model', 'smollm2')} (SmolLM2-135M shapes) fp32 decode on CPU "
                 "(hf_kvint2 benchmarks/bench_decode.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192],
                    help="cached tokens before the timed steps (default 2048 8192)")
    ap.add_argument("--cases", nargs="+", metavar="BATCHxCONTEXT",
                    help="explicit (batch, context) cases instead of --batches x --contexts, e.g. 1x2048 8x8192")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                    help="cache and attention path: dynamic = DynamicCache, hqq = QuantizedCache(hqq, 2 bits), "
                         "oscar-* = OscarCache, scaled-* = OscarScaledCache; -portable with sdpa, -fused with "
                         "\"oscar\" (default: all)")
    add_step_options(ap, steps=5, warmup=2)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random K/V fill (default 0)")
    add_shared_options(ap, out_name="decode_cpu.json", model_default="smollm2", threads_default=0,
                       worker_metavar=("CONFIG", "BATCH", "CONTEXT"))
    args = ap.parse_args()
    if args.worker:
        config, batch, context = args.worker
        print(json.dumps(worker(config, int(batch), int(context), args.steps, args.warmup, args.seed,
                                args.threads, args.model)))
        return

    from tqdm import tqdm

    load_start = os.getloadavg()[0]
    cases = ([tuple(int(x) for x in case.lower().split("x")) for case in args.cases] if args.cases else
             [(b, t) for b in args.batches for t in args.contexts])
    jobs = [(c, b, t) for b, t in cases for c in args.configs]
    results = []
    env = worker_env(args.threads, omp=False)
    options = {"--steps": args.steps, "--warmup": args.warmup, "--seed": args.seed, "--threads": args.threads,
               "--model": args.model}
    for config, batch, context in tqdm(jobs, desc="decode benchmark"):
        row = run_worker(__file__, [config, batch, context], options, env,
                         f"{config} batch={batch} context={context}")
        results.append(row)
        tqdm.write(f"{config:16s} b={batch} ctx={context:5d}: {row['ms_per_token']:9.1f} ms/token, "
                   f"peak {row['peak_rss_mib']:7.0f} MiB")
    for row in results:
        base = next((r for r in results if r["config"] == "dynamic" and r["batch"] == row["batch"]
                     and r["context"] == row["context"]), None)
        if base is not None:
            row["speed_vs_dynamic"] = base["ms_per_token"] / row["ms_per_token"]
            row["cpu_speed_vs_dynamic"] = base["cpu_ms_per_token"] / row["cpu_ms_per_token"]
            row["memory_vs_dynamic"] = row["peak_rss_mib"] / base["peak_rss_mib"]
        hqq = next((r for r in results if r["config"] == "hqq" and r["batch"] == row["batch"]
                    and r["context"] == row["context"]), None)
        if hqq is not None:
            row["speed_vs_hqq"] = hqq["ms_per_token"] / row["ms_per_token"]
    model = {"smollm2": "SmolLM2-135M-Instruct", "synthetic": "Llama with SmolLM2-135M shapes, random weights"}
    meta = {"model": model[args.model], "dtype": "float32", "steps": args.steps, "warmup": args.warmup,
            "cache_fill": "random K/V for layer 0 in chunks of 1024 tokens, copied to every layer",
            "threads": args.threads or "torch default", **run_meta(load_start)}
    write_results(args.out, meta, results, plot)
    for row in results:
        extra = "".join(f", {k} {row[k]:.2f}" for k in ("speed_vs_dynamic", "cpu_speed_vs_dynamic",
                                                          "memory_vs_dynamic", "speed_vs_hqq")
                        if k in row)
        print(f"{row['config']:16s} b={row['batch']} ctx={row['context']:5d}: {row['ms_per_token']:8.1f} ms/token, "
              f"peak {row['peak_rss_mib']:6.0f} MiB{extra}")


if __name__ == "__main__":
    main()
