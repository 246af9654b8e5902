"""Split-K on CPU: the batch-1 / 8k fused decode step (and the body kernel alone) with 1 and with 2 threads.

Runs ``bench_decode.py --model synthetic --cases 1x8192`` for DynamicCache, OscarCache and OscarScaledCache once
with ``--threads 1`` and once with ``--threads 2`` (wall time: CPU time sums the threads), then times the Numba
body kernel alone on one layer's body (3 KV heads x 8192 tokens, each cache's layouts) with 1 and 2 threads.
Needs a quiet machine: the load average is recorded.

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

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def kernel_worker(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from hf_kvint2 import cpu_kernels
    from hf_kvint2.recipes import GroupLayout
    from hf_kvint2.stream import QuantizedStream, StreamCodec
    from hf_kvint2.transforms import block_hadamard_matrix

    out = {}
    layouts = {"oscar": (("token", 64, False), ("token", 64, False)),
               "scaled": (("channel", 32, True), ("token", 32, False))}
    for name, pair in layouts.items():
        bodies = []
        for axis, group, scaled in pair:
            s = QuantizedStream(StreamCodec(GroupLayout(axis, group, None, scaled), group, block_hadamard_matrix(64),
                                            None, torch.float16))
            s.append(torch.randn(1, 3, 8192, 64, generator=torch.Generator().manual_seed(0)))
            bodies.append(s.read())
        q = torch.randn(1, 9, 1, 64)
        cpu_kernels.body_attention(q, *bodies, scaling=0.125)
        times = []
        for _ in range(30):
            t = time.perf_counter()
            cpu_kernels.body_attention(q, *bodies, scaling=0.125)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "threads_cpu.json",
                    help="result JSON (default results/threads_cpu.json)")
    ap.add_argument("--kernel-worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kernel_worker:
        print(json.dumps(kernel_worker(args.kernel_worker)))
        return
    load = os.getloadavg()
    rows = {}
    for threads in (1, 2):
        out = Path(f"/tmp/hf_kvint2_threads_{threads}.json")
        subprocess.run([sys.executable, str(HERE / "bench_decode.py"), "--model", "synthetic", "--cases", "1x8192",
                        "--configs", "dynamic", "oscar-fused", "scaled-fused", "--steps", "5", "--warmup", "1",
                        "--threads", str(threads), "--out", str(out)], check=True, capture_output=True)
        step = {r["config"]: r["ms_per_token"] for r in json.loads(out.read_text())["results"]}
        env = {**os.environ, "NUMBA_NUM_THREADS": str(threads)}
        proc = subprocess.run([sys.executable, __file__, "--kernel-worker", str(threads)], capture_output=True,
                              text=True, check=True, env=env)
        rows[threads] = {"step_ms": step, "kernel_ms": json.loads(proc.stdout.strip().splitlines()[-1])}
        print(threads, "threads:", rows[threads])
    speedup = {"step": {c: rows[1]["step_ms"][c] / rows[2]["step_ms"][c] for c in rows[1]["step_ms"]},
               "kernel": {c: rows[1]["kernel_ms"][c] / rows[2]["kernel_ms"][c] for c in rows[1]["kernel_ms"]}}
    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "load_average_at_start": load,
            "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "case": "batch 1, 8192-token context, synthetic SmolLM2-shaped Llama fp32; kernel: 3 KV heads x 8192"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "threads": rows, "speedup_2_vs_1": speedup}, indent=1))
    print("speed-up, 2 threads vs 1:", json.dumps(speedup))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
