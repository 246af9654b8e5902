"""First-call cost of the fused CPU step: the Numba body kernel compiles on first use and is cached on disk.

For each cache (OscarCache, OscarScaledCache), in a fresh subprocess with ``NUMBA_CACHE_DIR`` pointing at a new
empty directory ("cold"), then again in a fresh subprocess with the same, now filled, directory ("warm"): SmolLM2
with attention "oscar" prefills 400 tokens (past both caches' windows), then decodes; reported are the first
decode step that reads INT2 codes (it compiles or loads the kernel), the steady step, and the difference (the
first-call cost), in wall and CPU time (CPU time is less disturbed by a shared machine). One thread.

    python benchmarks/bench_jit.py                 # -> results/jit_cpu.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, run_meta, run_worker, worker_env, write_results

KINDS = ("oscar", "scaled")
NAMES = {"oscar": "OscarCache", "scaled": "OscarScaledCache"}


def worker(kind: str) -> dict:
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    t_import = time.perf_counter()
    import hf_kvint2
    from hf_kvint2.models import load_smollm2

    model, _ = load_smollm2(torch.float32, attn_implementation=hf_kvint2.ATTN_IMPLEMENTATION)
    load_s = time.perf_counter() - t_import
    cache = hf_kvint2.OscarCache() if kind == "oscar" else hf_kvint2.OscarScaledCache()
    ids = torch.randint(3, model.config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(0))
    steps, cpu = [], []
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = ids[:, -1:]
        for _ in range(4):
            t, c = time.perf_counter(), time.process_time()
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    return {"cache": kind, "load_s": load_s, "step_s": steps, "cpu_step_s": cpu}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, state in enumerate(("cold", "warm")):
        rows = {r["cache"]: r for r in results if r["state"] == state}
        ax.bar([k + (i - 0.5) * 0.4 for k in range(len(KINDS))], [rows[k]["first_call_cost_cpu_s"] for k in KINDS],
               0.4, label=f"{state} Numba cache")
    ax.set_xticks(range(len(KINDS)), [NAMES[k] for k in KINDS])
    ax.set_ylabel("first fused step minus a steady one, CPU s")
    ax.set_title("First-call cost of the CPU kernel (benchmarks/bench_jit.py)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_options(ap, out_name="jit_cpu.json", threads_default=None, worker_metavar=("CACHE",))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0])))
        return
    results = []
    load = os.getloadavg()[0]
    for kind in KINDS:
        with tempfile.TemporaryDirectory() as cache_dir:  # "cold": an empty Numba cache; "warm": the same, filled
            env = worker_env(1, omp=True, NUMBA_CACHE_DIR=cache_dir)
            for state in ("cold", "warm"):
                row = run_worker(__file__, [kind], {}, env, f"{kind} {state}")
                # the prefill switched the layers to "oscar" (it ran SDPA on the chunk): decode step 0 is the first
                # that runs the kernel; steps 1-3 are steady.
                steady = min(row["step_s"][1:])
                cpu_steady = min(row["cpu_step_s"][1:])
                row.update(state=state, first_fused_step_s=row["step_s"][0], steady_step_s=steady,
                           first_call_cost_s=row["step_s"][0] - steady,
                           first_call_cost_cpu_s=row["cpu_step_s"][0] - cpu_steady)
                results.append(row)
                print(f"{kind:6s} {state}: first fused step {row['first_fused_step_s']:.2f} s, steady "
                      f"{steady:.3f} s -> first-call cost {row['first_call_cost_s']:.2f} s wall, "
                      f"{row['first_call_cost_cpu_s']:.2f} s CPU")
    import numba

    meta = {"model": "SmolLM2-135M-Instruct fp32", "threads": 1, "numba": numba.__version__, **run_meta(load)}
    write_results(args.out, meta, results, plot)


if __name__ == "__main__":
    main()
