"""First-call cost of the fused CPU step: the Numba body kernel compiles on first use and is cached on disk.

For each cache (OscarCache, OscarScaledCache), in a fresh subprocess with ``NUMBA_CACHE_DIR`` pointing at a new
empty directory ("cold"), then again in a fresh subprocess with the same, now filled, directory ("warm"): SmolLM2
with attention "oscar" prefills 400 tokens (past both caches' windows), then decodes; reported are the first
decode step that reads INT2 codes (it compiles or loads the kernel), the steady step, and the difference (the
first-call cost), in wall and CPU time (CPU time is less disturbed by a shared machine). One thread.

    python benchmarks/bench_jit.py                 # -> results/jit_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "jit_cpu.json",
                    help="result JSON (default results/jit_cpu.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    results = []
    load = os.getloadavg()[0]
    for kind in ("oscar", "scaled"):
        with tempfile.TemporaryDirectory() as cache_dir:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            for state in ("cold", "warm"):
                proc = subprocess.run([sys.executable, __file__, "--worker", kind], capture_output=True, text=True,
                                      check=False, env=env)
                if proc.returncode:
                    raise RuntimeError(f"{kind} {state} failed:\n{proc.stderr[-3000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
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
    import torch

    meta = {"model": "SmolLM2-135M-Instruct fp32", "threads": 1, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "numba": numba.__version__,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "load_average_at_start": load,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
