"""Gemma 3 270M: the shipped calibration with a per-layer group-size allocation, on the 2k quality protocol.

The calibration's layouts with other group sizes (same rotations, means and clips): ``--key-groups 5:32`` gives
layer 5's keys 32-token groups, ``--value-group 256`` groups every layer's values over the whole head. Run on the
same Emma windows as ``benchmarks/quality.py --model gemma3 --windows 4`` (chunked protocol, prefill 512, chunks of
32) and compared with that run's full-precision perplexity (``benchmarks/results/quality_gemma3.json``).

    python benchmarks/gemma3_group_allocation.py --key-groups 5:32 --value-group 256

``--calibration DIR`` starts from another artifact (``--key-groups '' --value-group 0``: its own group sizes);
``--key-range-clips 5:0.85`` narrows layer 5's key groups to 85% of their range (``none``: every layer's full range);
``--text pride-heldout`` evaluates on Pride and Prejudice from token 100000 on (past the 30000 or 90000 tokens any
calibration here used) instead of Emma, with ``--baselines`` measuring full precision and KIVI-2 in the same run
(there is no reference file for that text): a second text on which to rank fits that Emma ranks.
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
    p.add_argument("--value-group", type=int, default=256,
                   help="group size of every calibrated layer's values (0: the artifact's own)")
    p.add_argument("--key-range-clips", default="",
                   help="layer:fraction pairs setting the keys' narrowed group range (GroupLayout.range_clip), "
                        "comma-separated; 'none' clears every layer's (default: the artifact's own)")
    p.add_argument("--windows", type=int, default=4, help="Emma windows of 2048 (default 4, as the 2k run)")
    p.add_argument("--calibration", default=None, help="OscarCache artifact folder (default: the shipped Gemma 3 one)")
    p.add_argument("--text", default="emma", choices=("emma", "pride-heldout"),
                   help="evaluation text (default emma; pride-heldout: the calibration book from token 100000 on)")
    p.add_argument("--baselines", action="store_true", help="also measure full precision and KIVI-2 in this run")
    p.add_argument("--reference", default=None,
                   help="ratios against the baselines of an earlier --baselines run (its output JSON; same text and "
                        "windows) instead of measuring them again")
    p.add_argument("--out", default=str(RESULTS / "gemma3_group_allocation.json"), help="output JSON")
    args = p.parse_args(argv)
    if args.baselines and args.reference:
        p.error("--baselines measures full precision and KIVI-2 in this run, --reference takes them from an earlier "
                "one: give one of the two.")
    import dataclasses

    import torch

    from hf_kvint2 import OscarCache, hub
    from hf_kvint2.evaluation import (
        CALIBRATION_TEXT,
        EVAL_TEXT,
        CacheMethod,
        bits_at_length,
        chunked_perplexity,
        encode,
        eval_windows,
        load_text,
        standard_methods,
    )
    from hf_kvint2.models import load_gemma3

    torch.set_num_threads(1)
    model, tokenizer = load_gemma3(attn_implementation="sdpa")
    base = OscarCache.from_pretrained(args.calibration or hub.GEMMA3_ARTIFACT_ID)
    key_groups = {int(a): int(b) for a, b in (x.split(":") for x in args.key_groups.split(",") if x)}
    clear_ranges = args.key_range_clips == "none"
    key_ranges = {} if clear_ranges else {int(a): float(b) for a, b in
                                          (x.split(":") for x in args.key_range_clips.split(",") if x)}
    layouts = []
    for idx, pair in enumerate(base.calibration.layer_layouts):
        if pair is None:
            layouts.append(None)
            continue
        k, v = pair
        if clear_ranges or idx in key_ranges:
            k = dataclasses.replace(k, range_clip=key_ranges.get(idx))
        layouts.append((dataclasses.replace(k, group_size=key_groups.get(idx, k.group_size)),
                        dataclasses.replace(v, group_size=args.value_group or v.group_size)))
    calibration = dataclasses.replace(base.calibration, layer_layouts=tuple(layouts))
    method = CacheMethod("oscar_alloc", "OSCAR calibrated, allocated groups",
                         lambda cfg: OscarCache(cfg, settings=base.settings, calibration=calibration))
    bits16 = bits_at_length(method, model.config, 131072, (4096, 8192), dtype=torch.bfloat16)
    if args.text == "emma":
        ids = encode(tokenizer, load_text(EVAL_TEXT))
    else:  # the calibration text, past every token a calibration here saw (load_text refuses it on purpose)
        from importlib import resources

        book = resources.files("hf_kvint2.data").joinpath(CALIBRATION_TEXT).read_text(encoding="utf-8")
        ids = encode(tokenizer, book)[100000:]
    windows = eval_windows(ids, args.windows, 2048)
    methods = [method]
    if args.baselines:
        methods = [m for m in standard_methods(model.config, None, ()) if m.key in ("fp", "kivi2")] + methods
    t0 = time.time()
    results = chunked_perplexity(model, windows, methods, 512, 32)
    res = results["oscar_alloc"]
    if args.baselines:
        rows = {k: {"perplexity": r.perplexity, "window_perplexities": r.window_perplexities}
                for k, r in results.items() if k != "oscar_alloc"}
    elif args.reference:
        ref = json.loads(Path(args.reference).read_text())
        if (ref.get("text"), ref.get("windows")) != (args.text, args.windows):
            raise SystemExit(f"--reference {args.reference} was measured on {ref.get('text')} x {ref.get('windows')} "
                             f"windows, not {args.text} x {args.windows}.")
        rows = {k: r for k, r in ref["reference"].items() if k in ("fp", "kivi2")}
    else:
        ref = json.loads((RESULTS / "quality_gemma3.json").read_text())
        if args.text != "emma" or args.windows != ref["protocol"]["windows"]:
            raise SystemExit("Without --baselines the ratios are against quality_gemma3.json (Emma, its windows): "
                             "pass --baselines for another text or window count.")
        rows = {r["key"]: r for r in ref["rows"]}
    fp = rows["fp"]["perplexity"]
    out = {"command": "python benchmarks/gemma3_group_allocation.py " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv),
           "calibration": args.calibration or hub.GEMMA3_ARTIFACT_ID, "text": args.text,
           "key_groups": key_groups, "value_group": args.value_group, "windows": args.windows,
           "key_range_clips": "none" if clear_ranges else key_ranges,
           "layouts": {i: [dataclasses.asdict(x) for x in pair] for i, pair in enumerate(layouts) if pair},
           "perplexity": res.perplexity, "window_perplexities": res.window_perplexities,
           "delta_pct_vs_fp": 100 * (res.perplexity / fp - 1), "bits_per_element_16bit": bits16,
           "reference": {k: {"perplexity": r["perplexity"], "delta_pct": 100 * (r["perplexity"] / fp - 1),
                             "bits_per_element_16bit": r.get("bits_per_element_16bit"),
                             "window_perplexities": r.get("window_perplexities")} for k, r in rows.items()},
           "seconds": time.time() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    others = ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows.items() if k in ("oscar", "kivi2"))
    print(f"allocated: ppl {res.perplexity:.3f} ({out['delta_pct_vs_fp']:+.2f}% vs fp {fp:.3f}) at {bits16:.3f} "
          f"bits (16-bit K/V); {others}")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
