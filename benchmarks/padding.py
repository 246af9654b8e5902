"""Left-padded batches vs the same rows alone: teacher-forced perplexity on SmolLM2-135M, both caches, both paths.

Rows of different lengths from Emma are left-padded to the longest and run as one batch (the first --prefill
positions in one forward, then chunks of 32, position ids from the attention mask as generate makes them); each
row is then run alone with the same chunk boundaries in its own tokens. Reported: each row's perplexity batched
and alone, and the relative difference. The most-padded row stores exactly what it stores alone; the others see
their quantization groups shifted by the padding difference (and keep more tokens at full precision).

    python benchmarks/padding.py                     # writes benchmarks/results/padding.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1100,800,600", help="comma-separated row lengths in tokens; the longest "
                   "sets the padded length (default 1100,800,600)")
    p.add_argument("--prefill", type=int, default=560,
                   help="padded positions in the first forward; must exceed every row's padding (default 560)")
    p.add_argument("--attention", default="sdpa,oscar", help="comma-separated attention implementations "
                   "(default sdpa,oscar)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", default=str(RESULTS / "padding.json"), help="result JSON (default "
                   "benchmarks/results/padding.json)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from hf_kvint2 import OscarCache, OscarScaledCache
    from hf_kvint2.evaluation import EVAL_TEXT, load_text
    from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID
    from hf_kvint2.models import load_smollm2

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.prefill <= max(lengths) - min(lengths):
        sys.exit(f"--prefill {args.prefill} must exceed the largest padding {max(lengths) - min(lengths)}")
    caches = {"OscarScaledCache": OscarScaledCache,
              "OscarCache (shipped calibration)": lambda: OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID)}

    def nll(model, rows, prefill, make_cache):
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache, logits = make_cache(), []
        bounds = [(0, prefill)] + [(s, min(s + 32, width)) for s in range(prefill, width, 32)]
        with torch.no_grad():
            for start, stop in bounds:
                out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                            position_ids=positions[:, start:stop], cache=cache, use_cache=True)
                logits.append(torch.log_softmax(out.logits.float(), -1))
        logp = torch.cat(logits, 1)
        return [-logp[i, width - len(r):-1].gather(-1, r[1:, None]).mean().item() for i, r in enumerate(rows)]

    result = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "text": "Emma", "lengths": lengths,
              "prefill": args.prefill, "chunk": 32, "rows": [],
              "command": "python benchmarks/padding.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
              "platform": platform.platform(), "threads": args.threads}
    for attn in args.attention.split(","):
        model, tokenizer = load_smollm2(torch.float32, attn_implementation=attn)
        ids = tokenizer(load_text(EVAL_TEXT)[5000:80000], return_tensors="pt").input_ids[0]
        rows = [ids[i * 1500: i * 1500 + n] for i, n in enumerate(lengths)]
        for name, make in caches.items():
            start = time.perf_counter()
            batched = nll(model, rows, args.prefill, make)
            width = max(lengths)
            for i, row in enumerate(rows):
                alone = nll(model, [row], args.prefill - (width - len(row)), make)[0]
                entry = {"attention": attn, "cache": name, "row": i, "tokens": len(row), "padding": width - len(row),
                         "ppl_batched": math.exp(batched[i]), "ppl_alone": math.exp(alone)}
                entry["relative_pct"] = 100 * (entry["ppl_batched"] / entry["ppl_alone"] - 1)
                result["rows"].append(entry)
                print(f"{attn:>6} {name:<34} row {i} ({len(row)} tokens, padding {entry['padding']:>4}): "
                      f"ppl {entry['ppl_batched']:.4f} batched, {entry['ppl_alone']:.4f} alone, "
                      f"{entry['relative_pct']:+.3f}%", flush=True)
            print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
