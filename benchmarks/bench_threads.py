"""Split-K on CPU: the batch-1 / 8k decode step and the fused layer step with 1 and with 2 threads.

Decode step: ``bench_decode.py --model synthetic --cases 1x8192`` for DynamicCache, OscarCache and OscarScaledCache
with ``--threads 1`` and ``--threads 2``, alternated for ``--rounds`` rounds (wall time: CPU time sums the threads);
the median over rounds. Fused layer step: one layer's cache update and fused attention (what the ``"oscar"``
attention runs per layer and decode step: the write path, then the Numba whole-layer kernel with its split-K body),
each cache's default recipe on an 8192-token layer, 1 and 2 threads interleaved in one process, in ``--layer-runs``
processes (the median ratio over them: one process's ratio moves by up to ~0.2 on a shared host). The decode step
also holds the model's linear layers and the per-layer Python, which a second thread speeds up less. Needs a quiet
machine: the load average is recorded. Per run, the step is split into the update, the attention and the compiled
kernel within it (``fused_layer_step_parts_us``): the kernel's own 2-thread speed-up against the serial rest, which
one thread runs whatever the thread count, shows what bounds the step's ratio.

    python benchmarks/bench_threads.py          # -> results/threads_cpu.{json,png}
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

HERE = Path(__file__).resolve().parent
DECODE_CONFIGS = ("dynamic", "oscar-fused", "scaled-fused")
KINDS = ("oscar", "scaled")
NAMES = {"oscar": "OscarCache", "scaled": "OscarScaledCache"}
WARMUP_STEPS = 2  # the first steps compile or load the kernel and switch the layer to its fused path


def layer_worker(steps: int) -> dict:
    """The fused decode step of one layer (its cache update and its attention, as a decode step runs them) of each
    cache on an 8192-token batch-1 layer, with 1 and 2 threads interleaved in one process (NUMBA_NUM_THREADS=2 is
    set by the parent). Each thread count updates its own copy of the layer, so that both see every step of a
    demotion cycle (a demotion's cost falls on one step in 16 or 32). Mean microseconds per step (the amortized
    cost: the headline), the median, and the mean of the step's parts (update, attention, the kernel within it)."""
    import copy

    import torch
    from speedlib import fill_cache, interleaved_rounds, make_cache, synthetic_config

    from hf_kvint2.cpu_kernels import calls

    cfg = synthetic_config(num_hidden_layers=1)  # one layer of the synthetic model
    kv_heads, heads, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    # the compiled kernel's own time inside the attention (the rest of the step is serial Python and torch)
    kernel_us = []
    run_kernel = calls._run

    def timed_kernel(*args):
        t = time.perf_counter()
        run_kernel(*args)
        kernel_us.append((time.perf_counter() - t) * 1e6)

    calls._run = timed_kernel
    out = {}
    for kind in KINDS:
        cache = make_cache(kind, cfg)
        fill_cache(cache, cfg, 1, 8192, True, generator=g)
        layers = {1: cache.layers[0], 2: copy.deepcopy(cache.layers[0])}
        parts = {t: {"update": [], "attention": [], "kernel": []} for t in (1, 2)}
        token = {}

        def before(threads, token=token):
            if threads == 1:  # each round stores one new token, the same for both thread counts
                token["kvq"] = (torch.randn(1, kv_heads, 1, d, generator=g), torch.randn(1, kv_heads, 1, d, generator=g),
                                torch.randn(1, heads, 1, d, generator=g))
            torch.set_num_threads(threads)
            kernel_us.clear()

        def step(threads, layers=layers, parts=parts, token=token):
            def call():
                k, v, q = token["kvq"]
                t = time.perf_counter()
                key, _ = layers[threads].update(k, v)
                t1 = time.perf_counter()
                key.step.attend(q, None, d ** -0.5, True)
                t2 = time.perf_counter()
                parts[threads]["update"].append((t1 - t) * 1e6)
                parts[threads]["attention"].append((t2 - t1) * 1e6)
                parts[threads]["kernel"].append(sum(kernel_us))
            return call

        times = interleaved_rounds({1: step(1), 2: step(2)}, steps, WARMUP_STEPS, clock=time.perf_counter,
                                   before=before)
        times = {t: [x * 1e6 for x in v] for t, v in times.items()}
        out[kind] = {str(t): statistics.mean(v) for t, v in times.items()}
        out[f"{kind}_median"] = {str(t): statistics.median(v) for t, v in times.items()}
        out[f"{kind}_parts"] = {str(t): {p: statistics.mean(v[WARMUP_STEPS:]) for p, v in ps.items()}
                                for t, ps in parts.items()}
    calls._run = run_kernel
    return out


def decode_steps(rounds: int) -> dict[int, list[dict]]:
    """bench_decode's worker (synthetic model, batch 1, 8192 tokens, 5 steps after 1) for every configuration, with
    1 and 2 threads alternated over ``rounds`` (so that the machine's drift reaches both): per thread count and
    round, each configuration's median wall ms per step (CPU time would sum the threads)."""
    from tqdm import tqdm

    steps = {1: [], 2: []}
    for _ in tqdm(range(rounds), desc="decode rounds"):
        for threads in (1, 2):
            options = {"--steps": 5, "--warmup": 1, "--seed": 0, "--threads": threads, "--model": "synthetic"}
            steps[threads].append({c: run_worker(str(HERE / "bench_decode.py"), [c, 1, 8192], options,
                                                 worker_env(threads, omp=False), f"{c} {threads} threads")
                                   ["ms_per_token"] for c in DECODE_CONFIGS})
    return steps


def summarize(steps: dict[int, list[dict]], layer_runs: list[dict]) -> dict:
    """The ratios the docs quote: per run of the layer worker, 1-thread over 2-thread time of each cache (mean and
    median step), reported as the median over runs; the decode step's median over rounds; and what bounds the layer
    step's ratio: per run, the kernel's own 2-thread speed-up against the serial rest of the step (update +
    attention outside the kernel), which one thread runs whatever the thread count."""
    step_keys = [k for k in layer_runs[0] if not k.endswith("_parts")]
    run_ratios = [{k: run[k]["1"] / run[k]["2"] for k in step_keys} for run in layer_runs]
    layer_us = {k: {t: statistics.median(run[k][t] for run in layer_runs) for t in ("1", "2")} for k in step_keys}
    step_parts = {kind: [{t: {**run[f"{kind}_parts"][t],
                              "serial": run[f"{kind}_parts"][t]["update"] + run[f"{kind}_parts"][t]["attention"]
                              - run[f"{kind}_parts"][t]["kernel"]} for t in ("1", "2")}
                         for run in layer_runs] for kind in KINDS}
    kernel_ratios = {kind: [p["1"]["kernel"] / p["2"]["kernel"] for p in runs] for kind, runs in step_parts.items()}
    rows = {str(t): {"step_ms": {c: statistics.median(r[c] for r in steps[t]) for c in DECODE_CONFIGS},
                     "step_ms_rounds": steps[t],
                     "fused_layer_step_us": {k: layer_us[k][str(t)] for k in layer_us}} for t in (1, 2)}
    speedup = {"step": {c: rows["1"]["step_ms"][c] / rows["2"]["step_ms"][c] for c in DECODE_CONFIGS},
               "fused_layer_step": {k: statistics.median(r[k] for r in run_ratios) for k in layer_us},
               "fused_layer_step_runs": run_ratios, "kernel_alone_runs": kernel_ratios}
    return {"threads": rows, "speedup_2_vs_1": speedup, "fused_layer_step_parts_us": step_parts}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speedup = results["speedup_2_vs_1"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, kind in enumerate(KINDS):
        runs = [r[kind] for r in speedup["fused_layer_step_runs"]]
        kernel = speedup["kernel_alone_runs"][kind]
        ax.bar(i - 0.2, speedup["fused_layer_step"][kind], 0.35, color="C0", label="layer step (median of runs)"
               if i == 0 else None)
        ax.scatter([i - 0.2] * len(runs), runs, color="k", s=10, zorder=3, label="one run" if i == 0 else None)
        ax.bar(i + 0.2, statistics.median(kernel), 0.35, color="C1", label="kernel alone" if i == 0 else None)
        ax.scatter([i + 0.2] * len(kernel), kernel, color="k", s=10, zorder=3)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(KINDS)), [NAMES[k] for k in KINDS])
    ax.set_ylabel("2 threads vs 1 (speed-up)")
    ax.set_title("Fused layer step, batch 1 / 8k, 2 threads vs 1 (benchmarks/bench_threads.py)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2,
                    help="decode-step runs per thread count, 1 and 2 threads alternated (default 2)")
    ap.add_argument("--layer-steps", type=int, default=256,
                    help="timed fused layer steps per thread count (default 256: whole demotion cycles)")
    ap.add_argument("--layer-runs", type=int, default=3,
                    help="fused layer step: runs of its worker process, the median ratio reported (default 3: one "
                         "process's ratio moves by up to ~0.2 on a shared host)")
    add_shared_options(ap, out_name="threads_cpu.json", threads_default=None, worker_metavar=("LAYER_STEPS",))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(layer_worker(int(args.worker[0]))))
        return
    from tqdm import tqdm

    load = os.getloadavg()[0]
    steps = decode_steps(args.rounds)
    layer_runs = [run_worker(__file__, [args.layer_steps], {}, worker_env(2, omp=False), "fused layer step")
                  for _ in tqdm(range(args.layer_runs), desc="fused layer step runs")]
    results = summarize(steps, layer_runs)
    meta = {**run_meta(load), "case": "batch 1, 8192-token context, synthetic SmolLM2-shaped Llama fp32 (decode step: "
            "median over rounds of bench_decode's median step); fused layer step: one layer's update + attention, 3 "
            "KV heads, 9 query heads, 1 and 2 threads interleaved in one process, each on its own copy of the layer "
            "(mean over steps, demotions included; '<cache>_median': the median step); the median over "
            f"{args.layer_runs} worker processes of each ratio (each run's ratios: fused_layer_step_runs)"}
    write_results(args.out, meta, results, plot)
    for t in ("1", "2"):
        print(t, "thread(s):", json.dumps(results["threads"][t]["step_ms"]),
              json.dumps(results["threads"][t]["fused_layer_step_us"]))
    print("speed-up, 2 threads vs 1:", json.dumps(results["speedup_2_vs_1"]))
    for kind, runs in results["fused_layer_step_parts_us"].items():
        for i, p in enumerate(runs):
            print(f"{kind} run {i}: " + ", ".join(
                f"{t} thread(s) update {p[t]['update']:.0f} attention {p[t]['attention']:.0f} (kernel "
                f"{p[t]['kernel']:.0f}) serial {p[t]['serial']:.0f} us" for t in ("1", "2"))
                + f"; kernel 2 vs 1 {results['speedup_2_vs_1']['kernel_alone_runs'][kind][i]:.2f}x")


if __name__ == "__main__":
    main()
