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

    python benchmarks/bench_threads.py          # -> results/threads_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def layer_worker(steps: int) -> dict:
    """The fused decode step of one layer (its cache update and its attention, as a decode step runs them) of each
    cache on an 8192-token batch-1 layer, with 1 and 2 threads in turn in one process (interleaved, so that the
    machine's drift hits both thread counts alike; NUMBA_NUM_THREADS=2 is set by the parent). Each thread count
    updates its own copy of the layer, so that both see every step of a demotion cycle (a demotion's cost falls on
    one step in 16 or 32). Mean microseconds per step (the amortized cost: the headline) and the median."""
    import copy

    import torch
    from speedlib import fill_cache, make_cache, synthetic_config

    from hf_kvint2 import cpu_kernels

    cfg = synthetic_config(num_hidden_layers=1)  # one layer of the synthetic model
    kv_heads, heads, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    # the compiled kernel's own time inside the attention (the rest of the step is serial Python and torch)
    kernel_us = []
    run_kernel = cpu_kernels._run_kernel

    def timed_kernel(*args):
        t = time.perf_counter()
        run_kernel(*args)
        kernel_us.append((time.perf_counter() - t) * 1e6)

    cpu_kernels._run_kernel = timed_kernel
    out = {}
    for kind in ("oscar", "scaled"):
        cache = make_cache(kind, cfg)
        fill_cache(cache, cfg, 1, 8192, True, generator=g)
        layers = {1: cache.layers[0], 2: copy.deepcopy(cache.layers[0])}
        times = {1: [], 2: []}
        parts = {t: {"update": [], "attention": [], "kernel": []} for t in (1, 2)}
        for i in range(steps + 2):
            k, v, q = (torch.randn(1, kv_heads, 1, d, generator=g), torch.randn(1, kv_heads, 1, d, generator=g),
                       torch.randn(1, heads, 1, d, generator=g))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                kernel_us.clear()
                t = time.perf_counter()
                key, _ = layers[threads].update(k, v)
                t1 = time.perf_counter()
                key.step.attend(q, None, d ** -0.5, True)
                t2 = time.perf_counter()
                if i >= 2:  # the first steps compile or load the kernel and switch the layer to its fused path
                    times[threads].append((t2 - t) * 1e6)
                    parts[threads]["update"].append((t1 - t) * 1e6)
                    parts[threads]["attention"].append((t2 - t1) * 1e6)
                    parts[threads]["kernel"].append(sum(kernel_us))
        out[kind] = {str(t): statistics.mean(v) for t, v in times.items()}
        out[f"{kind}_median"] = {str(t): statistics.median(v) for t, v in times.items()}
        # mean microseconds of the step's parts: the update, the attention, the kernel within it
        out[f"{kind}_parts"] = {str(t): {p: statistics.mean(v) for p, v in ps.items()} for t, ps in parts.items()}
    cpu_kernels._run_kernel = run_kernel
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "threads_cpu.json",
                    help="result JSON (default results/threads_cpu.json)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="decode-step runs per thread count, 1 and 2 threads alternated (default 2)")
    ap.add_argument("--layer-steps", type=int, default=256,
                    help="timed fused layer steps per thread count (default 256: whole demotion cycles)")
    ap.add_argument("--layer-runs", type=int, default=3,
                    help="fused layer step: runs of its worker process, the median ratio reported (default 3: one "
                         "process's ratio moves by up to ~0.2 on this shared host)")
    ap.add_argument("--layer-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layer_worker:
        print(json.dumps(layer_worker(args.layer_steps)))
        return
    load = os.getloadavg()
    steps = {1: [], 2: []}  # per round: {config: ms per step}
    for _ in tqdm(range(args.rounds), desc="decode rounds"):
        for threads in (1, 2):  # alternated, so that the machine's drift reaches both thread counts
            out = Path(f"/tmp/hf_kvint2_threads_{threads}.json")
            subprocess.run([sys.executable, str(HERE / "bench_decode.py"), "--model", "synthetic", "--cases",
                            "1x8192", "--configs", "dynamic", "oscar-fused", "scaled-fused", "--steps", "5",
                            "--warmup", "1", "--threads", str(threads), "--out", str(out)], check=True,
                            capture_output=True)
            steps[threads].append({r["config"]: r["ms_per_token"] for r in json.loads(out.read_text())["results"]})
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    layer_runs = []
    for _ in tqdm(range(args.layer_runs), desc="fused layer step runs"):
        proc = subprocess.run([sys.executable, __file__, "--layer-worker", "--layer-steps", str(args.layer_steps)],
                              capture_output=True, text=True, check=True, env=env)
        layer_runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    # per run: 1-thread / 2-thread time of each cache (mean and median step); reported: the median over runs
    step_keys = [k for k in layer_runs[0] if not k.endswith("_parts")]
    run_ratios = [{k: run[k]["1"] / run[k]["2"] for k in step_keys} for run in layer_runs]
    layer_us = {k: {t: statistics.median(run[k][t] for run in layer_runs) for t in ("1", "2")} for k in step_keys}
    # what bounds the step's ratio: per run, the kernel's own 2-thread speed-up and the serial rest of the step
    # (update + attention outside the kernel), mean microseconds
    step_parts = {kind: [{t: {**run[f"{kind}_parts"][t],
                              "serial": run[f"{kind}_parts"][t]["update"] + run[f"{kind}_parts"][t]["attention"]
                              - run[f"{kind}_parts"][t]["kernel"]} for t in ("1", "2")}
                         for run in layer_runs] for kind in ("oscar", "scaled")}
    kernel_ratios = {kind: [p["1"]["kernel"] / p["2"]["kernel"] for p in runs] for kind, runs in step_parts.items()}
    configs = steps[1][0]
    rows = {str(t): {"step_ms": {c: statistics.median(r[c] for r in steps[t]) for c in configs},
                     "step_ms_rounds": steps[t],
                     "fused_layer_step_us": {k: layer_us[k][str(t)] for k in layer_us}} for t in (1, 2)}
    speedup = {"step": {c: rows["1"]["step_ms"][c] / rows["2"]["step_ms"][c] for c in configs},
               "fused_layer_step": {k: statistics.median(r[k] for r in run_ratios) for k in layer_us},
               "fused_layer_step_runs": run_ratios, "kernel_alone_runs": kernel_ratios}
    for t in ("1", "2"):
        print(t, "thread(s):", json.dumps(rows[t]["step_ms"]), json.dumps(rows[t]["fused_layer_step_us"]))
    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "load_average_at_start": load,
            "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "case": "batch 1, 8192-token context, synthetic SmolLM2-shaped Llama fp32 (decode step: median over "
                    "rounds of bench_decode's median step); fused layer step: one layer's update + attention, "
                    "3 KV heads, 9 query heads, 1 and 2 threads interleaved in one process, each on its own copy of "
                    "the layer (mean over steps, demotions included; '<cache>_median': the median step); the median over "
                    f"{args.layer_runs} worker processes of each ratio (each run's ratios: fused_layer_step_runs)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "threads": rows, "speedup_2_vs_1": speedup,
                                    "fused_layer_step_parts_us": step_parts}, indent=1))
    print("speed-up, 2 threads vs 1:", json.dumps(speedup))
    for kind, runs in step_parts.items():
        for i, p in enumerate(runs):
            print(f"{kind} run {i}: " + ", ".join(
                f"{t} thread(s) update {p[t]['update']:.0f} attention {p[t]['attention']:.0f} (kernel "
                f"{p[t]['kernel']:.0f}) serial {p[t]['serial']:.0f} us" for t in ("1", "2"))
                  + f"; kernel 2 vs 1 {kernel_ratios[kind][i]:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
