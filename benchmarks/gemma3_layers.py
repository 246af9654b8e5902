"""Gemma 3 270M: where the 2-bit caches lose quality, layer by layer and keys vs values.

Protocol (the quality benchmark's chunked protocol on one window): the first 1536 tokens of Emma, prefill 512
tokens, then chunks of 64 through the same cache; fp32, SDPA attention; the perplexity of the 1024 tokens
predicted after the prefill. One cache per run, batch 1.

Stages:
* ``table``: full precision, ``OscarScaledCache(config=...)`` (sliding layers windowed by transformers, the 3
  full-attention layers quantized), ``OscarScaledCache()`` (every layer quantized), ``OscarCache(config=...)``
  uncalibrated, and both caches with ``recent_tokens=10**6`` (nothing quantized: must equal full precision).
* ``breakdown``: one probe per row, quantizing only the named layers and only K, only V or both through an
  ``OscarLayer`` of the given recipe while every other layer (and the other of K/V) stays exact.

    .venv/bin/python benchmarks/gemma3_layers.py                       # both stages
    .venv/bin/python benchmarks/gemma3_layers.py --stages table --out benchmarks/results/gemma3_layers_before
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=1536, help="tokens of Emma in the evaluated window")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the first forward (then chunks)")
    p.add_argument("--chunk", type=int, default=64, help="tokens per teacher-forced chunk after the prefill")
    p.add_argument("--stages", default="table,breakdown", help="comma-separated: table (the cache table), "
                   "breakdown (one layer / keys or values at a time)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=str(RESULTS / "gemma3_layers"), help="output path prefix (.json is added)")
    p.add_argument("--plot", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"),
                   help="only draw <out>.png from two result files of this script")
    return p


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    build_parser().parse_args()  # help printed before torch and the model code load

import torch
import transformers
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.evaluation import EVAL_TEXT, encode, eval_windows, load_text
from hf_kvint2.layers import OscarLayer
from hf_kvint2.models import load_gemma3
from hf_kvint2.recipes import LayerRecipe


@torch.no_grad()
def chunked_perplexity(model, ids: torch.Tensor, cache, prefill: int, chunk: int, desc: str) -> float:
    """Teacher-forced perplexity of ids [1, T] through ``cache``: one prefill forward, then chunks."""
    out = model(ids[:, :prefill], past_key_values=cache, use_cache=True)
    nll = -torch.log_softmax(out.logits[0, -1].double(), -1)[ids[0, prefill]]
    count = 1
    for start in tqdm(range(prefill, ids.shape[1], chunk), desc=desc, leave=False):
        stop = min(start + chunk, ids.shape[1])
        logits = model(ids[:, start:stop], past_key_values=cache, use_cache=True).logits[0]
        targets = ids[0, start + 1:stop + 1]
        logp = torch.log_softmax(logits[:targets.shape[0]].double(), -1)
        nll -= logp.gather(-1, targets[:, None]).sum()
        count += targets.shape[0]
    return math.exp(nll.item() / count)


class ProbeLayer(DynamicLayer):
    """Exact storage plus an :class:`OscarLayer` fed the same K/V; attention reads the quantized K and/or V."""

    def __init__(self, recipe: LayerRecipe, layer_idx: int, keys: bool, values: bool):
        super().__init__()
        self.quantized = OscarLayer(recipe, layer_idx)
        self.use_keys, self.use_values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        exact_k, exact_v = super().update(key_states, value_states)
        quant_k, quant_v = self.quantized.update(key_states, value_states)
        return (quant_k if self.use_keys else exact_k), (quant_v if self.use_values else exact_v)


def probe_cache(config, recipe: LayerRecipe, layers: set[int], keys: bool, values: bool) -> Cache:
    text = config.get_text_config(decoder=True)
    built = []
    for idx, kind in enumerate(text.layer_types):
        if idx in layers:
            built.append(ProbeLayer(recipe, idx, keys, values))
        elif kind == "sliding_attention":
            built.append(DynamicSlidingWindowLayer(text.sliding_window))
        else:
            built.append(DynamicLayer())
    return Cache(layers=built)


def plot(before: dict, after: dict, path: Path) -> None:
    """Bars of the table rows (perplexity vs full precision), before and after the fix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in after["table"] if n != "full precision" and n in before["table"]]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for offset, (label, res) in zip((-0.2, 0.2), (("before", before), ("after", after))):
        ax.bar([i + offset for i in x], [100 * res["table"][n]["vs_full_precision"] for n in names], 0.4, label=label)
    ax.axhline(10, color="gray", ls="--", lw=0.8)
    ax.set_xticks(list(x), [n.replace("(config=model.config", "(config").replace(", recent_tokens=10**6)", ",\nrecent=1e6)")
                            for n in names], fontsize=7)
    ax.set_ylabel("perplexity vs full precision (%)")
    ax.set_title("Gemma 3 270M, Emma 1536 tokens, prefill 512, chunks of 64 (fp32, sdpa)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.plot:
        before, after = (json.loads(Path(f).read_text()) for f in args.plot)
        png = Path(args.out).with_suffix(".png")
        plot(before, after, png)
        print(f"wrote {png}")
        return after
    if args.threads:
        torch.set_num_threads(args.threads)
    stages = set(args.stages.split(","))

    model, tokenizer = load_gemma3(attn_implementation="sdpa")
    config = model.config
    text = config.get_text_config(decoder=True)
    ids = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), 1, args.window)
    full_layers = [i for i, t in enumerate(text.layer_types) if t == "full_attention"]

    def run(name, make_cache):
        t0 = time.perf_counter()
        ppl = chunked_perplexity(model, ids, make_cache(), args.prefill, args.chunk, name)
        return {"perplexity": ppl, "seconds": time.perf_counter() - t0}

    result = {"model": "Gemma 3 270M (Q4_K_M GGUF dequantized, fp32, sdpa)",
              "protocol": {"text": EVAL_TEXT, "window": args.window, "offset": 0, "prefill": args.prefill,
                           "chunk": args.chunk, "scored_tokens": args.window - args.prefill},
              "layer_types": list(text.layer_types),
              "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                              "machine": platform.machine(), "threads": torch.get_num_threads()},
              "table": {}, "breakdown": {}}
    methods = {
        "full precision": lambda: DynamicCache(config=config),
        "OscarScaledCache(config=model.config)": lambda: OscarScaledCache(config=config),
        "OscarScaledCache()": lambda: OscarScaledCache(),
        "OscarCache(config=model.config)": lambda: OscarCache(config=config),
        "OscarScaledCache(config=model.config, recent_tokens=10**6)":
            lambda: OscarScaledCache(config=config, recent_tokens=10**6),
        "OscarCache(config=model.config, recent_tokens=10**6)":
            lambda: OscarCache(config=config, recent_tokens=10**6),
    }
    probes = []
    if "breakdown" in stages:
        recipes = {"OScaR": lambda: OscarScaledCache()._recipe_for_layer(0),
                   "OSCAR uncalibrated": lambda: OscarCache()._recipe_for_layer(0)}
        for recipe_name, recipe in recipes.items():
            for layers, label in [(set(full_layers), "full-attention layers " + ",".join(map(str, full_layers)))] + \
                    [({i}, f"layer {i}") for i in full_layers]:
                for keys, values, what in ((True, True, "K+V"), (True, False, "K only"), (False, True, "V only")):
                    if len(layers) == 1 and (what != "K+V" or recipe_name != "OScaR"):
                        continue  # single layers: OScaR, K+V only (keeps the run short)
                    probes.append((f"{recipe_name}: {label}, {what}", recipe, layers, keys, values))
    total = len(methods) * ("table" in stages) + len(probes)
    bar = tqdm(total=total, desc="gemma3 layers")
    fp = None
    if "table" in stages or probes:
        result["table"]["full precision"] = run("full precision", methods["full precision"])
        fp = result["table"]["full precision"]["perplexity"]
        bar.update()
    if "table" in stages:
        for name, make in list(methods.items())[1:]:
            result["table"][name] = run(name, make)
            bar.update()
    for name, recipe, layers, keys, values in probes:
        result["breakdown"][name] = run(name, lambda r=recipe, lay=layers, k=keys, v=values:
                                        probe_cache(config, r(), lay, k, v))
        bar.update()
    bar.close()
    for section in ("table", "breakdown"):
        for row in result[section].values():
            row["vs_full_precision"] = row["perplexity"] / fp - 1
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for section in ("table", "breakdown"):
        for name, row in result[section].items():
            print(f"{name:70s} {row['perplexity']:8.3f} {100 * row['vs_full_precision']:+7.1f}%")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
