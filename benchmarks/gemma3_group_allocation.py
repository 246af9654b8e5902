"""Gemma 3 270M: the shipped calibration with a per-layer group-size allocation, on the 2k quality protocol.

The calibration's layouts with other group sizes (same rotations, means and clips): ``--key-groups 5:32`` gives
layer 5's keys 32-token groups, ``--value-group 256`` groups every layer's values over the whole head. Run on the
same Emma windows as ``benchmarks/quality.py --model gemma3 --windows 4`` (chunked protocol, prefill 512, chunks of
32) and compared with that run's full-precision perplexity (``benchmarks/results/quality_gemma3.json``).

    python benchmarks/gemma3_group_allocation.py --key-groups 5:32 --value-group 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--key-groups", default="5:32", help="layer:group pairs for the keys, comma-separated")
    p.add_argument("--value-group", type=int, default=256, help="group size of every calibrated layer's values")
    p.add_argument("--windows", type=int, default=4, help="Emma windows of 2048 (default 4, as the 2k run)")
    p.add_argument("--out", default=str(RESULTS / "gemma3_group_allocation.json"), help="output JSON")
    args = p.parse_args(argv)
    import dataclasses

    import torch

    from hf_kvint2 import OscarCache, hub
    from hf_kvint2.evaluation import (
        EVAL_TEXT,
        CacheMethod,
        bits_at_length,
        chunked_perplexity,
        encode,
        eval_windows,
        load_text,
    )
    from hf_kvint2.models import load_gemma3

    torch.set_num_threads(1)
    model, tokenizer = load_gemma3(attn_implementation="sdpa")
    base = OscarCache.from_pretrained(hub.GEMMA3_ARTIFACT_ID)
    key_groups = {int(a): int(b) for a, b in (x.split(":") for x in args.key_groups.split(",") if x)}
    layouts = []
    for idx, pair in enumerate(base.calibration.layer_layouts):
        if pair is None:
            layouts.append(None)
            continue
        k, v = pair
        layouts.append((dataclasses.replace(k, group_size=key_groups.get(idx, k.group_size)),
                        dataclasses.replace(v, group_size=args.value_group)))
    calibration = dataclasses.replace(base.calibration, layer_layouts=tuple(layouts))
    method = CacheMethod("oscar_alloc", "OSCAR calibrated, allocated groups",
                         lambda cfg: OscarCache(cfg, settings=base.settings, calibration=calibration))
    bits16 = bits_at_length(method, model.config, 131072, (4096, 8192), dtype=torch.bfloat16)
    windows = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), args.windows, 2048)
    t0 = time.time()
    res = chunked_perplexity(model, windows, [method], 512, 32)["oscar_alloc"]
    ref = json.loads((RESULTS / "quality_gemma3.json").read_text())
    rows = {r["key"]: r for r in ref["rows"]}
    fp = rows["fp"]["perplexity"]
    out = {"command": "python benchmarks/gemma3_group_allocation.py " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv),
           "key_groups": key_groups, "value_group": args.value_group, "windows": args.windows,
           "layouts": {i: [dataclasses.asdict(x) for x in pair] for i, pair in enumerate(layouts) if pair},
           "perplexity": res.perplexity, "window_perplexities": res.window_perplexities,
           "delta_pct_vs_fp": 100 * (res.perplexity / fp - 1), "bits_per_element_16bit": bits16,
           "reference": {k: {"perplexity": r["perplexity"], "delta_pct": r.get("delta_pct"),
                             "bits_per_element_16bit": r.get("bits_per_element_16bit")} for k, r in rows.items()},
           "seconds": time.time() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"allocated: ppl {res.perplexity:.3f} ({out['delta_pct_vs_fp']:+.2f}% vs fp {fp:.3f}) at {bits16:.3f} "
          f"bits (16-bit K/V); OSCAR {rows['oscar']['perplexity']:.3f}, KIVI-2 {rows['kivi2']['perplexity']:.3f}")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
