"""Hybrid models on the bundled Gemma 3 270M (15 sliding-window layers of window 512, 3 full-attention layers):
bytes held at 32k against DynamicCache, generation with quantization off against DynamicCache in every mode of the
cache contract, and torch.export of the decode step with the static cache.

    python benchmarks/hybrid_gemma3.py [--parts memory,generate,export,window_quality,window_update] [--context 32768] [--threads 1]

* **memory**: every cache built with ``config=`` is filled through ``update()`` with random K/V of each layer's
  shape ([1, 1 KV head, tokens, 256]) instead of a 32k-token forward: a prefill of ``context - 1`` tokens in chunks
  of 2048, then one decode step (so every cache is in its steady state: transformers' sliding layers let go of the
  last prefill chunk at the next update). Bytes are what the caches hold: ``memory_report()`` (codes, scales,
  norms, full-precision windows) for ours, the K/V tensors for DynamicCache; ``allocated`` adds the storage behind
  them (buffer capacity, views). In float32 (the bundled model's dtype) and bfloat16. Also measured: what the
  sliding layers would hold if their windows were quantized (an OscarLayer holding ``window - 1`` tokens), and the
  storage allocated right after a single 32k-token prefill chunk (float32), before the first decode step.
  The INT2 sizes do not depend on the values (random data keeps the Hadamard / per-token key layout; Gemma's own
  full-attention keys switch to per-channel groups, which hold the same bytes per token at head_dim 256).
* **generate**: a ~600-token prompt from Emma (longer than the window), 12 new tokens, each mode (greedy, sampling,
  beam search 3, prompt lookup, a left-padded batch of 2) on "sdpa" and "oscar", with OscarScaledCache and
  OscarCache at ``recent_tokens`` beyond the sequence (quantization off), built with and without ``config=``:
  tokens equal to DynamicCache(config=)'s.
* **export**: OscarExportableModule with ``OscarScaledCache()`` (sliding rings of 512 + INT2 full layers), a prompt
  of ``--export-prompt`` tokens prefilled eagerly, ``--export-steps`` decode steps; the exported program against the
  eager static cache at every step (from the eager state, "synced", and running freely, "free"); the eager static
  cache with quantization off against DynamicCache.
* **window_quality**: what quantizing the sliding windows would cost: chunked teacher-forced perplexity on Emma
  (``--quality-windows`` windows of 2048 tokens, prefill 512, chunks of 32) of each cache with its windows in full
  precision (``config=``) and with them quantized (the same cache without ``config=`` under SDPA quantizes every
  layer; a sliding layer's mask then shows it exactly an INT2 window with the cache's recent tokens at full
  precision), and with them stored in float16 / bfloat16 (``sliding_window_dtype``).
* **window_update**: the time of a sliding layer's decode-step ``update`` with its window full, transformers' layer
  against ``WindowLayer`` with and without 16-bit storage (what ``sliding_window_dtype`` costs per step).

Writes ``benchmarks/results/hybrid_gemma3.json`` (and ``hybrid_gemma3.png``: bytes at 32k by cache and layer kind).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
MODES = {  # the generation modes of tests/test_cache_contract.py
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 1.0},
    "beam3": {"num_beams": 3, "do_sample": False},
    "prompt_lookup": {"prompt_lookup_num_tokens": 3, "do_sample": False},
}
OFF = 1 << 20  # recent_tokens beyond any sequence here: quantization off


def _fill(cache, shape, context, dtype, chunk=2048, seed=0, decode=True):
    import torch

    g = torch.Generator().manual_seed(seed)
    pos = 0
    while pos < context - 1:
        n = min(chunk, context - 1 - pos)
        for idx in range(shape.num_layers):
            k = torch.randn(1, shape.num_key_value_heads, n, shape.head_dim, generator=g).to(dtype)
            cache.update(k, torch.randn(k.shape, generator=g).to(dtype), idx)
        pos += n
    for idx in range(shape.num_layers if decode else 0):
        k = torch.randn(1, shape.num_key_value_heads, 1, shape.head_dim, generator=g).to(dtype)
        cache.update(k, torch.randn(k.shape, generator=g).to(dtype), idx)


def memory(config, context: int) -> list[dict]:
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    from hf_kvint2 import OscarCache, OscarScaledCache
    from hf_kvint2.layers import OscarLayer
    from hf_kvint2.model_config import QUANTIZED, layer_plan, model_shape
    from hf_kvint2.window_layer import window_memory_bytes

    shape, plan = model_shape(config), layer_plan(config)
    window = next(p.window for p in plan if p.window)
    makers = {"DynamicCache": lambda: DynamicCache(config=config),
              "OscarScaledCache": lambda: OscarScaledCache(config=config),
              "OscarCache": lambda: OscarCache(config=config),
              # the sliding windows stored in 16 bits (sliding_window_dtype): only a float32 model's shrink
              "OscarScaledCache, 16-bit windows": lambda: OscarScaledCache(config=config,
                                                                          sliding_window_dtype=torch.float16),
              "OscarCache, 16-bit windows": lambda: OscarCache(config=config, sliding_window_dtype=torch.float16)}
    rows = []
    for dtype in tqdm((torch.float32, torch.bfloat16), desc=f"memory at {context} tokens"):
        base = None
        for name, make in makers.items():
            if "16-bit windows" in name and dtype != torch.float32:
                continue
            cache = make()
            _fill(cache, shape, context, dtype)
            if name == "DynamicCache":
                per_layer = [window_memory_bytes(layer) for layer in cache.layers]
                for row in per_layer:
                    row["total_bytes"] = row["full_precision"]
            else:
                per_layer = cache.memory_report()["layers"]
            quantized = [r for r, p in zip(per_layer, plan) if p.storage == QUANTIZED]
            windowed = [r for r, p in zip(per_layer, plan) if p.storage != QUANTIZED]
            row = {"cache": name, "dtype": str(dtype).replace("torch.", ""), "tokens": cache.get_seq_length(),
                   "total_bytes": sum(r["total_bytes"] for r in per_layer),
                   "allocated_bytes": sum(r["allocated"] for r in per_layer),
                   "full_attention_bytes": sum(r["total_bytes"] for r in quantized),
                   "sliding_bytes": sum(r["total_bytes"] for r in windowed),
                   "full_attention_layers": len(quantized), "sliding_layers": len(windowed)}
            if name != "DynamicCache":
                elements = sum(r["elements"] for r in quantized)
                row["full_attention_bits_per_element"] = 8 * row["full_attention_bytes"] / elements
                # the alternative: sliding windows quantized too (an OscarLayer of this cache's recipe holding
                # window - 1 tokens, the most a sliding layer needs)
                alt = OscarLayer(cache._recipe_for_layer(0), 0)
                g = torch.Generator().manual_seed(1)
                kv = torch.randn(2, 1, shape.num_key_value_heads, window - 1, shape.head_dim, generator=g).to(dtype)
                alt.update(kv[0], kv[1])
                alt_bytes = sum(v for k, v in alt.memory_bytes().items() if k in ("codes", "scales", "norms",
                                                                                  "full_precision"))
                row["sliding_bytes_if_quantized"] = alt_bytes * len(windowed)
                row["total_bytes_if_sliding_quantized"] = row["full_attention_bytes"] + row["sliding_bytes_if_quantized"]
            if base is None:
                base = row
            row["ratio_to_dynamic"] = row["total_bytes"] / base["total_bytes"]
            if "total_bytes_if_sliding_quantized" in row:
                row["ratio_to_dynamic_if_sliding_quantized"] = row["total_bytes_if_sliding_quantized"] / base["total_bytes"]
            rows.append(row)
            del cache
    return rows


def after_prefill(config, context: int) -> list[dict]:
    """Storage held right after one ``context - 1``-token prefill chunk, before any decode step (float32): a
    sliding layer of transformers keeps its window as a view into the whole chunk until its next update."""
    import torch
    from transformers import DynamicCache

    from hf_kvint2 import OscarCache, OscarScaledCache
    from hf_kvint2.model_config import model_shape
    from hf_kvint2.window_layer import window_memory_bytes

    shape = model_shape(config)
    rows = []
    for name, make in (("DynamicCache", lambda: DynamicCache(config=config)),
                       ("OscarScaledCache", lambda: OscarScaledCache(config=config)),
                       ("OscarCache", lambda: OscarCache(config=config))):
        cache = make()
        _fill(cache, shape, context, torch.float32, chunk=context, decode=False)
        per_layer = ([window_memory_bytes(layer) for layer in cache.layers] if name == "DynamicCache"
                     else cache.memory_report()["layers"])
        rows.append({"cache": name, "dtype": "float32", "tokens": cache.get_seq_length(),
                     "allocated_bytes": sum(r["allocated"] for r in per_layer)})
        del cache
    return rows


def _prompt(tokenizer, n: int, offset: int = 400):
    import torch

    from hf_kvint2.evaluation import EVAL_TEXT, encode, load_text

    ids = encode(tokenizer, load_text(EVAL_TEXT))
    return torch.tensor(ids[offset:offset + n])[None]


def generate_modes(model, tokenizer, prompt_tokens: int, new: int = 12) -> list[dict]:
    import warnings

    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    from hf_kvint2 import OscarCache, OscarScaledCache

    long = _prompt(tokenizer, prompt_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = torch.cat([long, _prompt(tokenizer, prompt_tokens, offset=5000)])
    mask = torch.ones_like(batch)
    batch[0, :40], mask[0, :40] = pad, 0  # row 0 left-padded by 40 tokens
    cases = [(m, long, None) for m in MODES] + [("left_padded", batch, mask)]
    rows = []
    jobs = [(attn, case) for attn in ("sdpa", "oscar") for case in cases]
    for attn, (mode, ids, attention_mask) in tqdm(jobs, desc="generate, quantization off"):
        model.set_attn_implementation(attn)
        gen = MODES["greedy" if mode == "left_padded" else mode]

        def run(cache, ids=ids, attention_mask=attention_mask, gen=gen):
            torch.manual_seed(0)
            kw = {} if attention_mask is None else {"attention_mask": attention_mask}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                                      pad_token_id=pad, **gen, **kw)

        t0 = time.perf_counter()
        want = run(DynamicCache(config=model.config))
        for make in (OscarScaledCache, OscarCache):
            for with_config in (True, False):
                cache = make(config=model.config if with_config else None, recent_tokens=OFF)
                got = run(cache)
                rows.append({"attn": attn, "mode": mode, "cache": make.__name__, "config": with_config,
                             "prompt_tokens": ids.shape[1], "new_tokens": new, "same_tokens": bool(torch.equal(got, want)),
                             "layer_kinds": sorted({type(layer).__name__ for layer in cache.layers})})
        rows[-1]["seconds_for_mode"] = time.perf_counter() - t0
    model.set_attn_implementation("sdpa")
    return rows


def export(model, tokenizer, prompt_tokens: int, steps: int) -> dict:
    import torch
    from transformers import DynamicCache

    from hf_kvint2 import OscarScaledCache
    from hf_kvint2.export import OscarExportableModule, export_decoder

    ids = _prompt(tokenizer, prompt_tokens + steps)
    max_len = prompt_tokens + steps
    model.set_attn_implementation("oscar")
    out = {"prompt_tokens": prompt_tokens, "steps": steps, "max_cache_len": max_len}
    # 1. the static cache with quantization off against DynamicCache (eager)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        ref = [model(ids[:, :prompt_tokens], past_key_values=dyn).logits[:, -1:]]
        ref += [model(ids[:, t:t + 1], past_key_values=dyn).logits for t in range(prompt_tokens, max_len - 1)]
        module = OscarExportableModule(model, OscarScaledCache(recent_tokens=OFF), max_cache_len=max_len)
        try:
            got = [module.prefill(ids[:, :prompt_tokens])[:, -1:]]
            got += [module(ids[:, t:t + 1], torch.tensor([t])) for t in range(prompt_tokens, max_len - 1)]
        finally:
            module.unbind()
    out["static_off_vs_dynamic_max_abs"] = max((a - b).abs().max().item() for a, b in zip(ref, got))
    # 2. the exported decode step against the eager static cache (OScaR defaults: INT2 full layers)
    module = OscarExportableModule(model, OscarScaledCache(), max_cache_len=max_len)
    try:
        out["layers"] = [type(layer).__name__ for layer in module.static_cache.layers]
        states, eager = [], []
        with torch.no_grad():
            module.prefill(ids[:, :prompt_tokens])
            for t in range(prompt_tokens, max_len):
                states.append([s.clone() for s in module.static_cache.state_tensors()])
                eager.append(module(ids[:, t:t + 1], torch.tensor([t])))
        out["body_tokens_layer5"] = module.static_cache.layers[5]._body_tokens_now()
        t0 = time.perf_counter()
        program = export_decoder(model, module=module, max_cache_len=max_len)
        out["export_seconds"] = time.perf_counter() - t0
        step = program.module()

        def load(state):
            for dst, src in zip(module.static_cache.state_tensors(), state):
                dst.copy_(src)

        synced = 0.0
        with torch.no_grad():
            for i, t in enumerate(range(prompt_tokens, max_len)):
                load(states[i])
                synced = max(synced, (step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t])) - eager[i])
                             .abs().max().item())
            load(states[0])
            free = [step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t])) for t in range(prompt_tokens, max_len)]
        out["export_vs_eager_synced_max_abs"] = synced
        out["export_vs_eager_free_max_abs"] = max((a - b).abs().max().item() for a, b in zip(free, eager))
        out["export_free_bit_identical"] = all(torch.equal(a, b) for a, b in zip(free, eager))
        out["static_memory_report_total"] = module.static_cache.memory_report()["total"]
    finally:
        module.unbind()
        model.set_attn_implementation("sdpa")
    return out


def window_quality(model, tokenizer, num_windows: int, window: int = 2048, prefill: int = 512,
                   chunk: int = 32, only: set | None = None) -> list[dict]:
    """Perplexity cost of quantizing the sliding windows: each cache built with ``config=`` (windows in full
    precision) against the same cache built without it under SDPA, which quantizes every layer's whole history;
    the sliding mask hides a sliding layer's tokens older than the window, so what those layers attend to is then
    exactly a quantized window (INT2 body + the cache's recent tokens at full precision). And the windows stored
    in 16 bits (``sliding_window_dtype``)."""
    import math
    import warnings

    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    from hf_kvint2 import OscarCache, OscarScaledCache
    from hf_kvint2.evaluation import EVAL_TEXT, encode, eval_windows, load_text

    model.set_attn_implementation("sdpa")
    windows = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), num_windows, window)
    methods = {"DynamicCache": lambda: DynamicCache(config=model.config),
               "OscarScaledCache, windows full precision": lambda: OscarScaledCache(config=model.config),
               "OscarScaledCache, windows quantized": lambda: OscarScaledCache(),
               "OscarCache, windows full precision": lambda: OscarCache(config=model.config),
               "OscarCache, windows quantized": lambda: OscarCache(),
               "OscarScaledCache, windows float16": lambda: OscarScaledCache(config=model.config,
                                                                             sliding_window_dtype=torch.float16),
               "OscarScaledCache, windows bfloat16": lambda: OscarScaledCache(config=model.config,
                                                                              sliding_window_dtype=torch.bfloat16),
               "OscarCache, windows float16": lambda: OscarCache(config=model.config,
                                                                 sliding_window_dtype=torch.float16),
               "OscarCache, windows bfloat16": lambda: OscarCache(config=model.config,
                                                                  sliding_window_dtype=torch.bfloat16)}
    if only:  # a subset by name (the full-precision baseline always runs: the ratios are against it)
        methods = {k: v for i, (k, v) in enumerate(methods.items()) if i == 0 or k in only}
    rows = []
    for name, make in tqdm(methods.items(), desc=f"perplexity, {num_windows} x {window} tokens"):
        nll, count = 0.0, 0
        for ids in windows:
            ids = ids[None]
            cache = make()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                last = model(ids[:, :prefill], past_key_values=cache, logits_to_keep=1).logits[0, -1:]
                logp = [torch.log_softmax(last.float(), -1)]
                for start in range(prefill, window, chunk):
                    out = model(ids[:, start:start + chunk], past_key_values=cache).logits[0]
                    logp.append(torch.log_softmax(out.float(), -1))
            logp = torch.cat(logp)[:-1]
            nll -= logp.gather(-1, ids[0, prefill:, None]).sum().item()
            count += window - prefill
        rows.append({"cache": name, "windows": num_windows, "window": window, "prefill": prefill, "chunk": chunk,
                     "perplexity": math.exp(nll / count)})
    base = rows[0]["perplexity"]
    for row in rows:
        row["vs_full_precision"] = row["perplexity"] / base - 1
    return rows


def window_update(config, steps: int = 2000, repeats: int = 5) -> list[dict]:
    """Time of one decode-step ``update`` of a sliding-window layer holding its full window (Gemma 3's window and
    head_dim, float32 K/V): transformers' ``DynamicSlidingWindowLayer``, ``WindowLayer`` and ``WindowLayer`` with
    16-bit storage (``sliding_window_dtype``). Interleaved repeats, median; ratios against transformers'."""
    import statistics
    import time

    import torch
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from hf_kvint2.model_config import layer_plan, model_shape
    from hf_kvint2.window_layer import WindowLayer

    shape = model_shape(config)
    window = next(p.window for p in layer_plan(config) if p.window)
    makers = {"DynamicSlidingWindowLayer": lambda: DynamicSlidingWindowLayer(sliding_window=window),
              "WindowLayer": lambda: WindowLayer(sliding_window=window),
              "WindowLayer, float16": lambda: WindowLayer(sliding_window=window, storage_dtype=torch.float16),
              "WindowLayer, bfloat16": lambda: WindowLayer(sliding_window=window, storage_dtype=torch.bfloat16)}
    g = torch.Generator().manual_seed(0)
    chunk = torch.randn(1, shape.num_key_value_heads, 2 * window, shape.head_dim, generator=g)
    token = torch.randn(1, shape.num_key_value_heads, 1, shape.head_dim, generator=g)
    layers = {}
    for name, make in makers.items():
        layers[name] = make()
        layers[name].update(chunk, chunk)
    times = {name: [] for name in makers}
    for _ in range(repeats):
        for name, layer in layers.items():
            start = time.perf_counter()
            for _ in range(steps):
                layer.update(token, token)
            times[name].append((time.perf_counter() - start) / steps)
    base = statistics.median(times["DynamicSlidingWindowLayer"])
    sliding = sum(1 for p in layer_plan(config) if p.window)
    return [{"layer": name, "window": window, "head_dim": shape.head_dim, "kv_heads": shape.num_key_value_heads,
             "us_per_update": 1e6 * statistics.median(t), "vs_transformers": statistics.median(t) / base,
             "extra_ms_per_model_step": sliding * 1e3 * (statistics.median(t) - base), "sliding_layers": sliding}
            for name, t in times.items()]


def decode_step_ms(model, tokenizer, prompt_tokens: int = 600, steps: int = 20) -> float:
    """Median time of one greedy decode step of the model with DynamicCache after a ``prompt_tokens`` prompt
    (the scale the window update cost compares with)."""
    import statistics
    import time

    import torch
    from transformers import DynamicCache

    ids = _prompt(tokenizer, prompt_tokens)
    cache = DynamicCache(config=model.config)
    times = []
    with torch.no_grad():
        nxt = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            nxt = model(nxt, past_key_values=cache).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False, gridspec_kw={"width_ratios": [5, 3]})
    for ax, dtype in zip(axes, ("float32", "bfloat16")):
        sel = [r for r in rows if r["dtype"] == dtype]
        names = [r["cache"].replace(", ", "\n") for r in sel]
        full = [r["full_attention_bytes"] / 2**20 for r in sel]
        slide = [r["sliding_bytes"] / 2**20 for r in sel]
        ax.bar(names, full, label="full-attention layers")
        ax.bar(names, slide, bottom=full, label="sliding-window layers")
        for i, r in enumerate(sel):
            ax.text(i, full[i] + slide[i], f"{100 * r['ratio_to_dynamic']:.1f}%", ha="center", va="bottom")
        ax.set_title(f"Gemma 3 270M, {sel[0]['tokens']} tokens, {dtype} K/V")
        ax.set_ylabel("MiB held")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="memory,generate,export,window_quality",
                   help="comma-separated parts to run: memory, generate, export, window_quality, window_update")
    p.add_argument("--context", type=int, default=32768, help="tokens the caches are filled with (memory)")
    p.add_argument("--prompt-tokens", type=int, default=600, help="prompt length of the generation modes")
    p.add_argument("--export-prompt", type=int, default=560, help="tokens prefilled before the exported steps")
    p.add_argument("--export-steps", type=int, default=16, help="decode steps compared with the exported program")
    p.add_argument("--quality-windows", type=int, default=2, help="2048-token windows of Emma (window_quality)")
    p.add_argument("--quality-methods", default=None,
                   help="comma-separated window_quality rows to run (default: all); results merge by name")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", default=str(OUT / "hybrid_gemma3.json"), help="result JSON (parts not run are kept)")
    args = p.parse_args()

    import torch
    import transformers

    import hf_kvint2
    from hf_kvint2.models import load_gemma3

    torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    path = Path(args.out)
    result = json.loads(path.read_text()) if path.exists() else {}
    result["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                             "hf_kvint2": hf_kvint2.__version__, "threads": args.threads,
                             "machine": platform.machine()}
    command = (f"python benchmarks/hybrid_gemma3.py --parts {args.parts} --context {args.context} --prompt-tokens "
               f"{args.prompt_tokens} --export-prompt {args.export_prompt} --export-steps {args.export_steps} "
               f"--quality-windows {args.quality_windows} --threads {args.threads}"
               + (f" --quality-methods '{args.quality_methods}'" if args.quality_methods else ""))
    result.setdefault("commands", {}).update({part: command for part in parts})
    model, tokenizer = load_gemma3(torch.float32, attn_implementation="sdpa")
    if "memory" in parts:
        result["memory"] = memory(model.config, args.context)
        for r in result["memory"]:
            print(f"{r['cache']:>17} {r['dtype']:>9}: {r['total_bytes'] / 2**20:8.2f} MiB "
                  f"({100 * r['ratio_to_dynamic']:.1f}% of DynamicCache)")
        result["memory_after_one_chunk_prefill"] = after_prefill(model.config, args.context)
        for r in result["memory_after_one_chunk_prefill"]:
            print(f"after a one-chunk prefill, {r['cache']:>17}: {r['allocated_bytes'] / 2**20:8.2f} MiB allocated")
        plot(result["memory"], path.with_suffix(".png"))
        print("wrote", path.with_suffix(".png"))
    if "generate" in parts:
        result["generate"] = generate_modes(model, tokenizer, args.prompt_tokens)
        bad = [r for r in result["generate"] if not r["same_tokens"]]
        print(f"generate: {len(result['generate']) - len(bad)}/{len(result['generate'])} runs give DynamicCache's tokens")
    if "window_quality" in parts:
        only = set(args.quality_methods.split(",")) if args.quality_methods else None
        rows = window_quality(model, tokenizer, args.quality_windows, only=only)
        if only:  # keep the earlier rows of the same protocol that were not rerun
            kept = [r for r in result.get("window_quality", []) if r["cache"] not in {x["cache"] for x in rows}
                    and r["windows"] == args.quality_windows]
            rows = rows[:1] + kept + rows[1:]
        result["window_quality"] = rows
        for r in result["window_quality"]:
            print(f"{r['cache']:>42}: perplexity {r['perplexity']:.3f} ({100 * r['vs_full_precision']:+.2f}%)")
    if "window_update" in parts:
        step = decode_step_ms(model, tokenizer)
        result["window_update"] = {"model_decode_step_ms": step, "layers": window_update(model.config)}
        print(f"model decode step (DynamicCache, sdpa): {step:.1f} ms")
        for r in result["window_update"]["layers"]:
            print(f"{r['layer']:>26}: {r['us_per_update']:6.1f} us per decode update ({r['vs_transformers']:.2f}x; "
                  f"{r['extra_ms_per_model_step']:+.2f} ms per model step)")
    if "export" in parts:
        result["export"] = export(model, tokenizer, args.export_prompt, args.export_steps)
        print({k: v for k, v in result["export"].items() if k != "layers"})
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
