"""Cost of OScaR's omni-token norm all-reduce under tensor parallelism (CPU, gloo, 2 ranks).

Under ``tp_plan="auto"`` each rank holds half the KV heads; the key norm over all heads of a layer becomes an
all-reduce of per-token squared norms (float64 [batch, tokens]) each time a layer quantizes keys. Measured here:

1. the collective itself, for the tensor sizes the cache sends;
2. one decode step through ``L`` cache layers (``OscarLayer.update``, store only) with the exact all-reduce vs
   the same layers with rank-local norms (not exact: the ablation that isolates the collective), for OScaR's
   default per-channel keys (a collective per layer every 32 steps, when a 32-token block is flushed) and for a
   per-token scaled key layout (a collective per layer every step);
3. greedy decoding of a tiny Llama loaded with ``tp_plan="auto"`` and the fused ``"oscar"`` attention: DynamicCache vs OscarScaledCache (exact
   all-reduce) vs OscarScaledCache with rank-local norms, ms per generated token.

    python benchmarks/bench_tp_allreduce.py            # writes benchmarks/results/tp_allreduce.{json,png}

Numbers from a shared, loaded machine are noisy: variants are interleaved, each timing is repeated, and both the
best (least disturbed) and the median run are reported, with the 1-minute load average. The overhead a step can
expect is also derived from counts: collectives per step x the best all-reduce latency.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, run_meta, write_results

# torch is imported inside the functions, so that --help prints at once.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _times_ms(fn, repeats: int) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def bench_collective(repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    rows = []
    for batch, tokens in ((1, 1), (8, 1), (1, 32), (8, 32)):
        x = torch.rand(batch, tokens, dtype=torch.float64)
        times = [t / 20 for t in _times_ms(lambda x=x: [dist.all_reduce(x) for _ in range(20)], 3 * repeats)]
        rows.append({"batch": batch, "tokens": tokens, "bytes": x.numel() * 8, "all_reduce_us_best": 1e3 * min(times),
                     "all_reduce_us_median": 1e3 * statistics.median(times)})
    return rows


def _layers(recipe, n_layers: int, shard):
    from hf_kvint2.layers import OscarLayer

    layers = [OscarLayer(recipe, idx, shard) for idx in range(n_layers)]
    for layer in layers:  # store only, as under the fused "oscar" attention (no full-precision view per step)
        layer.fused_attention = True
    return layers


def bench_layers(shard, args, collective: list[dict]) -> list[dict]:
    import torch
    import torch.distributed as dist

    from hf_kvint2.recipes import GroupLayout
    from hf_kvint2.settings import oscar_scaled_recipe

    layouts = {  # name: (recipe, decode steps per collective of a layer)
        "oscar_scaled_default (per-channel keys, G_t=32)": (oscar_scaled_recipe(), 32),
        "per-token scaled keys (collective every step)": (oscar_scaled_recipe().with_overrides(
            key=GroupLayout("token", 32, None, token_scaling=True)), 1),
    }
    rows = []
    g = torch.Generator().manual_seed(shard.rank)
    for name, (recipe, steps_per_collective) in layouts.items():
        for batch in args.batches:
            shape = (batch, shard.local_kv_heads, args.context, args.head_dim)
            prefill = torch.randn(*shape, generator=g)
            steps = [torch.randn(batch, shard.local_kv_heads, 1, args.head_dim, generator=g)
                     for _ in range(args.steps)]
            timings = {"all_reduce": [], "local_norm": []}
            for _ in range(args.repeats):
                for variant, s in (("all_reduce", shard), ("local_norm", None)):
                    layers = _layers(recipe, args.layers, s)
                    for layer in layers:
                        layer.update(prefill, prefill)
                    dist.barrier()
                    t = time.perf_counter()
                    for kv in steps:
                        for layer in layers:
                            layer.update(kv, kv)
                    timings[variant].append((time.perf_counter() - t) * 1e3 / args.steps)
            ar, local = min(timings["all_reduce"]), min(timings["local_norm"])
            tokens = 32 if steps_per_collective > 1 else 1
            latency_us = next(r["all_reduce_us_best"] for r in collective if (r["batch"], r["tokens"]) == (batch, tokens))
            per_step = args.layers / steps_per_collective
            rows.append({"layout": name, "batch": batch, "layers": args.layers, "kv_heads_per_rank": shard.local_kv_heads,
                         "head_dim": args.head_dim, "context": args.context, "step_ms_all_reduce": ar,
                         "step_ms_local_norm": local,
                         "step_ms_all_reduce_median": statistics.median(timings["all_reduce"]),
                         "step_ms_local_norm_median": statistics.median(timings["local_norm"]),
                         "measured_overhead_ms_per_step": ar - local, "measured_overhead_ratio": ar / local,
                         "collectives_per_step": per_step, "collective_bytes": batch * tokens * 8,
                         "estimated_overhead_ms_per_step": per_step * latency_us / 1e3})
    return rows


def bench_model(model_dir: str, args) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DynamicCache

    from hf_kvint2 import OscarScaledCache
    try:
        from transformers.distributed import DistributedConfig
        kw = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:
        kw = {"tp_plan": "auto"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="oscar",
                                                 **kw).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))

    def local_norm_cache():
        cache = OscarScaledCache(model.config)
        for layer in cache.layers:
            layer.shard = None  # ablation: rank-local norms, no collective (not what a single process computes)
        return cache

    caches = {"DynamicCache": lambda: DynamicCache(config=model.config),
              "OscarScaledCache (exact all-reduce)": lambda: OscarScaledCache(model.config),
              "OscarScaledCache (local norms, ablation)": local_norm_cache}
    times = {name: [] for name in caches}
    new = args.new_tokens
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, make in caches.items():
                dist.barrier()
                t = time.perf_counter()
                model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               past_key_values=make())
                t_full = time.perf_counter() - t
                dist.barrier()
                t = time.perf_counter()  # prefill + 1 token, subtracted to leave decode steps only
                model.generate(prompt, max_new_tokens=1, do_sample=False, past_key_values=make())
                times[name].append((t_full - (time.perf_counter() - t)) * 1e3 / (new - 1))
    out = {name: min(v) for name, v in times.items()}
    base = out["DynamicCache"]
    return {"layers": model.config.num_hidden_layers, "kv_heads": model.config.num_key_value_heads,
            "context": args.context, "new_tokens": new, "ms_per_token": out,
            "ms_per_token_median": {name: statistics.median(v) for name, v in times.items()},
            "ratio_vs_dynamic": {k: v / base for k, v in out.items()}}


def _worker(rank: int, world: int, port: int, model_dir: str, args, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tqdm import tqdm

    from hf_kvint2.distributed import TensorParallelShard

    shard = TensorParallelShard(dist.group.WORLD, rank, world, args.kv_heads)
    result = {}
    parts = [("collective", lambda: bench_collective(args.repeats)),
             ("layers", lambda: bench_layers(shard, args, result["collective"])),
             ("model", lambda: bench_model(model_dir, args))]
    for name, fn in tqdm(parts, desc="bench_tp_allreduce", disable=rank != 0):
        result[name] = fn()
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["layers"]
    labels = [f"{r['layout'].split(' (')[0]}\nbatch {r['batch']}" for r in rows]
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["step_ms_local_norm"] for r in rows], 0.4, label="rank-local norms (ablation)")
    ax1.bar([i + 0.2 for i in x], [r["step_ms_all_reduce"] for r in rows], 0.4, label="exact all-reduce")
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set_ylabel(f"ms per decode step ({rows[0]['layers']} layers, cache only, best of runs)")
    ax1.set_title("Cache update per decode step, 2 ranks (gloo, CPU)")
    ax1.legend(fontsize=8)
    model = result["model"]
    names = list(model["ms_per_token"])
    ax2.bar(range(len(names)), [model["ms_per_token"][n] for n in names], color=["gray", "tab:orange", "tab:blue"])
    ax2.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
    for i, n in enumerate(names):
        ax2.text(i, model["ms_per_token"][n], f"{model['ratio_vs_dynamic'][n]:.2f}x", ha="center", va="bottom")
    ax2.set_ylabel("ms per generated token (best of runs)")
    ax2.set_title(f"Tiny Llama, tp_plan='auto', 2 ranks, context {model['context']}")
    fig.suptitle("OScaR norm all-reduce under tensor parallelism (benchmarks/bench_tp_allreduce.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="cache layers in the store-only step (default 8)")
    parser.add_argument("--kv-heads", type=int, default=8, help="global KV heads (each of 2 ranks holds half)")
    parser.add_argument("--head-dim", type=int, default=64, help="head_dim of the synthetic layers (default 64)")
    parser.add_argument("--context", type=int, default=256, help="tokens prefilled before the timed steps "
                        "(layers and model; default 256)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (two 32-token flushes)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--new-tokens", type=int, default=33,
                        help="tokens generated per timed run of the tiny model (default 33)")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of each timing; best and median "
                        "are reported (default 7)")
    add_shared_options(parser, out_name="tp_allreduce.json", threads_default=None)
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    load = os.getloadavg()[0]
    world = 2
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                             max_position_embeddings=4096)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        raw = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, _free_port(), tmp, args, raw), nprocs=world, join=True)
        result = json.loads(Path(raw).read_text())
    setup = {"world_size": world, "backend": "gloo", "device": "cpu", "threads_per_rank": 1,
             **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    write_results(args.out, {**run_meta(load), **setup}, result, _plot)
    print(json.dumps({k: result[k] for k in ("collective", "model")}, indent=2))
    for r in result["layers"]:
        print(f"{r['layout']:<50} batch {r['batch']}: {r['step_ms_local_norm']:.2f} -> {r['step_ms_all_reduce']:.2f} "
              f"ms/step (measured {r['measured_overhead_ms_per_step']:+.2f} ms; {r['collectives_per_step']:g} "
              f"collectives/step x best latency = {r['estimated_overhead_ms_per_step']:.3f} ms)")


if __name__ == "__main__":
    main()
