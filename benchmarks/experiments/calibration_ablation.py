"""Calibrated per-layer layout choice vs each single layout on every layer: does the per-layer choice pay off?

    python benchmarks/experiments/calibration_ablation.py            # SmolLM2-135M, calibrate on Pride and Prejudice, eval on Emma
    python benchmarks/experiments/calibration_ablation.py --quick    # tiny random model, whole pipeline in seconds
    python calibration_scripts/calibrate_oscar.py --text hf_kvint2/data/prideprejudice.txt --output DIR \
        --save-statistics STATS && python benchmarks/experiments/calibration_ablation.py --statistics STATS --artifact DIR

One calibration pass (statistics + held-back windows) feeds every variant; the variants differ only in the
candidates the per-layer fit may choose from. All are evaluated side by side with the evaluation protocol of
``hf_kvint2.evaluation.chunked_perplexity`` (windows of 2048 tokens, prefill 512, chunks of 32, every chunk-phase
token scored, 8 windows of Emma). Writes benchmarks/experiments/results/calibration_ablation.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

# torch and hf_kvint2's modules are imported in main(), so that --help prints at once.

RESULTS = Path(__file__).parent / "results"

# name -> fit_layers candidates. "calibrated" is what OscarCache.calibrate does by default (every layout in
# hf_kvint2.calibration.LAYOUTS, centred or not).
VARIANTS = {
    "calibrated (per-layer choice)": {"layouts": None, "centering": (False, True)},
    "Hadamard + fitted clip (all layers)": {"layouts": ("hadamard",), "centering": (False,)},
    "spectral + fitted clip (all layers)": {"layouts": ("spectral",), "centering": (False,)},
    "per-channel K and V (all layers)": {"layouts": ("channel",), "centering": (False,)},
}
SINGLE = [name for name in VARIANTS if name.endswith("(all layers)")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny random model and small sizes (smoke run)")
    p.add_argument("--num-tokens", type=int, default=30000,
                   help="calibration tokens read from Pride and Prejudice, held-back window included (default 30000)")
    p.add_argument("--calib-window", type=int, default=2048, help="tokens per calibration forward (default 2048)")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of Emma (default 8)")
    p.add_argument("--window", type=int, default=2048, help="tokens per evaluation window (default 2048)")
    p.add_argument("--prefill", type=int, default=512,
                   help="tokens of each window written into a fresh cache in one forward (default 512)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per decode chunk after the prefill (default 32)")
    p.add_argument("--bits-tokens", type=int, default=131072, help="context length for the bits/element column")
    p.add_argument("--statistics", default=None,
                   help="statistics written by calibrate_oscar.py --save-statistics (skips the capture passes)")
    p.add_argument("--artifact", default=None,
                   help="the calibrated artifact written by calibrate_oscar.py from the same statistics: its row "
                        "is loaded with OscarCache.from_pretrained, after checking it equals the re-fit")
    p.add_argument("--out", default=str(RESULTS / "calibration_ablation"),
                   help="output path prefix for .json and .png (default benchmarks/experiments/results/calibration_ablation)")
    return p.parse_args()


def main():
    args = parse_args()
    import torch

    from hf_kvint2 import OscarCache
    from hf_kvint2.calibration import LAYOUTS, CalibrationData, collect_statistics, fit_layers
    from hf_kvint2.evaluation import (
        CALIBRATION_TEXT,
        EVAL_TEXT,
        ByteTokenizer,
        CacheMethod,
        bits_at_length,
        chunked_perplexity,
        encode,
        engine_cache,
        eval_windows,
        load_text,
    )
    from hf_kvint2.settings import naive_int2_recipe

    settings = {"sink_tokens": 64, "recent_tokens": 256}
    if args.quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=4096)).eval()
        tokenizer, model_name = ByteTokenizer(), "tiny random Llama"
        args.num_tokens, args.calib_window, args.windows, args.window, args.prefill = 3000, 512, 2, 512, 128
        args.bits_tokens = 4096
        settings = {"sink_tokens": 16, "recent_tokens": 64}
        args.out = args.out + "_quick"
    else:
        from hf_kvint2.models import DEFAULT_MODEL_ID, load_smollm2

        model, tokenizer = load_smollm2(torch.float32, attn_implementation="sdpa")
        model_name = DEFAULT_MODEL_ID
    from importlib import resources

    calib_text = resources.files("hf_kvint2.data").joinpath(CALIBRATION_TEXT).read_text(encoding="utf-8")
    start = time.perf_counter()
    if args.statistics:
        data = CalibrationData.load(args.statistics)
    else:
        data = collect_statistics(model, tokenizer, [calib_text], num_tokens=args.num_tokens,
                                  text_window=args.calib_window, **settings)
    seconds_stats = time.perf_counter() - start
    caches, choices_json = {}, {}
    for name, cand in VARIANTS.items():
        if args.artifact and name == "calibrated (per-layer choice)":
            continue  # evaluated from the artifact itself (the same fit, written by calibrate_oscar.py)
        choices = fit_layers(data, **{**cand, "layouts": cand["layouts"] or LAYOUTS}, **settings)
        caches[name] = (data, choices)
        choices_json[name] = [{"key": c.key.name, "key_clip": c.key.layout.clip, "key_error": c.key_error,
                               "value": c.value.name, "value_clip": c.value.layout.clip,
                               "value_error": c.value_error} for c in choices]

    def factory(name):
        _, choices_ = caches[name]
        return lambda cfg: OscarCache.from_choices(choices_, cfg, **settings)

    calibrated_name = "calibrated (per-layer choice)"
    caches_artifact = args.artifact
    if caches_artifact:
        loaded = OscarCache.from_pretrained(caches_artifact)
        choices_json[calibrated_name] = [{"layout": name, "key_clip": k.clip, "value_clip": v.clip} for name, (k, v)
                                         in zip(loaded.calibration.layout_names, loaded.calibration.layer_layouts)]

    from transformers import DynamicCache

    d = data.head_dim
    methods = [CacheMethod("fp", "full precision", lambda cfg: DynamicCache(config=cfg)),
               CacheMethod("naive", "naive INT2 (per-token, no rotation, no clip)",
                           lambda cfg: engine_cache(naive_int2_recipe(d), cfg))]
    methods += [CacheMethod(f"v{i}", name, factory(name)) for i, name in enumerate(VARIANTS)
                if name in caches]
    if caches_artifact:
        methods.insert(2, CacheMethod("v0", calibrated_name,
                                      lambda cfg: OscarCache.from_pretrained(caches_artifact, config=cfg)))
    windows = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), args.windows, args.window)
    start = time.perf_counter()
    results = chunked_perplexity(model, windows, methods, prefill=args.prefill, chunk=args.chunk)
    seconds_eval = time.perf_counter() - start

    rows = {}
    results = {m.name: results.get(m.key, results.get(m.name)) for m in methods}  # keyed by CacheMethod.key
    fp = results["full precision"].perplexity
    for m in methods:
        r = results[m.name]
        rows[m.name] = {"perplexity": r.perplexity, "delta_vs_fp_pct": 100 * (r.perplexity / fp - 1),
                        "bits_at_window_end": r.bits_per_element,
                        f"bits_at_{args.bits_tokens}": None if m.key == "fp" else bits_at_length(m, model.config,
                                                                                                 args.bits_tokens),
                        "window_perplexities": r.window_perplexities}
    best_single = min(SINGLE, key=lambda n: rows[n]["perplexity"])
    for row in rows.values():
        row["delta_vs_best_single_pct"] = 100 * (row["perplexity"] / rows[best_single]["perplexity"] - 1)
    calibrated = rows["calibrated (per-layer choice)"]
    verdict = {
        "best_single_layout": best_single,
        "calibrated_within_1pct_of_best_single": calibrated["delta_vs_best_single_pct"] <= 1.0,
        "calibrated_below_naive": calibrated["perplexity"] < rows[methods[1].name]["perplexity"],
        "bits_spread_at_long_context": max(rows[n][f"bits_at_{args.bits_tokens}"] for n in VARIANTS)
        - min(rows[n][f"bits_at_{args.bits_tokens}"] for n in VARIANTS),
    }
    out = {
        "model": model_name, "calibration_text": CALIBRATION_TEXT, "eval_text": EVAL_TEXT,
        "calibration": {"num_tokens": data.info["num_tokens"], "window": data.info["window"], **settings,
                        "statistics_seconds": seconds_stats, "statistics_file": args.statistics,
                        "artifact": caches_artifact},
        "protocol": {"windows": args.windows, "window": args.window, "prefill": args.prefill, "chunk": args.chunk,
                     "scored_tokens": results["full precision"].tokens},
        "results": rows, "verdict": verdict, "choices": choices_json, "eval_seconds": seconds_eval,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"{'method':<46}{'ppl':>9}{'vs fp':>9}{'vs best':>9}{'bits@end':>10}{'bits@long':>10}")
    for name, r in rows.items():
        long_bits = r[f"bits_at_{args.bits_tokens}"]
        print(f"{name:<46}{r['perplexity']:>9.3f}{r['delta_vs_fp_pct']:>8.2f}%{r['delta_vs_best_single_pct']:>8.2f}%"
              f"{r['bits_at_window_end']:>10.3f}{'-' if long_bits is None else f'{long_bits:.3f}':>10}")
    print(json.dumps(verdict, indent=2))
    _plot(rows, args, Path(args.out + ".png"))
    print(f"wrote {args.out}.json and {args.out}.png")


def _plot(rows, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    key = f"bits_at_{args.bits_tokens}"
    for name, r in rows.items():
        if r[key] is None:
            ax.axhline(r["perplexity"], color="gray", ls="--", label=name)
        else:
            ax.scatter(r[key], r["perplexity"], label=name)
    ax.set_xlabel(f"bits per K/V element at {args.bits_tokens} tokens")
    ax.set_ylabel(f"perplexity (Emma, {args.windows}x{args.window}, chunks of {args.chunk})")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
