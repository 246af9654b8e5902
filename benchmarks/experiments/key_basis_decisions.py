"""Which layers' keys leave the Hadamard basis, and by what margin, on the bundled models.

An uncalibrated key stream settles its basis from the first tokens it quantizes: channel-grouped keys (OScaR) drop
the Hadamard, per-token keys (uncalibrated OSCAR) switch to per-channel groups, when the spread of the per-channel
ranges (``hf_kvint2.key_basis.range_spread``) exceeds ``RANGE_SPREAD_LIMIT``. This runs the prefill (512 tokens) of
several Emma windows through ``OscarScaledCache()`` and ``OscarCache()`` with every layer quantized and records,
per layer, the spread and the choice.

    .venv/bin/python benchmarks/experiments/key_basis_decisions.py --model smollm2
    .venv/bin/python benchmarks/experiments/key_basis_decisions.py --model gemma3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2", help="bundled model to inspect")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of Emma")
    p.add_argument("--window", type=int, default=2048, help="tokens per window")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the first forward (its demotion decides)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="default benchmarks/experiments/results/key_basis_<model>.json")
    return p


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    build_parser().parse_args()  # help printed before torch and the model code load

import torch
from tqdm.auto import tqdm

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.evaluation import EVAL_TEXT, encode, eval_windows, load_text
from hf_kvint2.key_basis import RANGE_SPREAD_LIMIT
from hf_kvint2.layers import OscarLayer
from hf_kvint2.models import load_gemma3, load_smollm2

RESULTS = Path(__file__).resolve().parent / "results"


@torch.no_grad()
def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = (load_gemma3 if args.model == "gemma3" else load_smollm2)(attn_implementation="sdpa")
    windows = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), args.windows, args.window)
    caches = {"OscarScaledCache()": OscarScaledCache, "OscarCache()": OscarCache}
    rows = {name: [] for name in caches}
    for w in tqdm(range(windows.shape[0]), desc=f"{args.model} prefills"):
        for name, cls in caches.items():
            cache = cls()
            model(windows[w:w + 1, :args.prefill], past_key_values=cache, use_cache=True, logits_to_keep=1)
            per_layer = []
            for layer in cache.layers:
                assert isinstance(layer, OscarLayer) and layer.body_len > 0
                keys = layer.key_body.codec
                basis = "model" if torch.equal(keys.rotation.cpu(), torch.eye(keys.rotation.shape[0])) else "hadamard"
                per_layer.append({"spread": layer.key_range_spread, "key_basis": basis, "key_axis": keys.layout.axis})
            rows[name].append(per_layer)
    summary = {}
    for name, per_window in rows.items():
        layers = range(len(per_window[0]))
        summary[name] = [{"layer": i, "spread_max": max(win[i]["spread"] for win in per_window),
                          "model_basis_windows": sum(win[i]["key_basis"] == "model" for win in per_window),
                          "channel_axis_windows": sum(win[i]["key_axis"] == "channel" for win in per_window)}
                         for i in layers]
    result = {"model": args.model, "limit": RANGE_SPREAD_LIMIT, "windows": args.windows, "prefill": args.prefill,
              "note": "spread: range_spread of the first keys each layer quantized (what decided)",
              "summary": summary, "per_window": rows}
    out = Path(args.out or RESULTS / f"key_basis_{args.model}.json")
    out.write_text(json.dumps(result, indent=1))
    for name, layers in summary.items():
        switched = [row["layer"] for row in layers if row["model_basis_windows"]]
        top = max(layers, key=lambda row: row["spread_max"])
        print(f"{name}: layers keeping the model basis in some window {switched}; largest spread "
              f"{top['spread_max']:.2f} (layer {top['layer']}); limit {RANGE_SPREAD_LIMIT}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
