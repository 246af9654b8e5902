"""OScaR's omni-token key scaling, measured by perplexity: with and without it, in the model's basis and in the
Hadamard, against KIVI-2 with and without it (why OScaR trailed KIVI-2 on Gemma 3; the answer: docs/design.md, "Why the defaults").

    python benchmarks/experiments/token_scaling.py --model gemma3 --windows 4
    python benchmarks/experiments/token_scaling.py --model smollm2 --windows 8 --variants fp,oscar_scaled,oscar_scaled_no_ts,kivi2_sink64,kivi2_sink64_ts

Same protocol as benchmarks/quality.py (Emma, windows of 2048 tokens, prefill 512, chunks of 32, fp32); all
variants one after the other, each through its own cache (hf_kvint2.evaluation.chunked_perplexity). Variants:

* ``oscar_scaled``: ``OscarScaledCache()`` (keys that settle in the model's basis drop the token norm,
  hf_kvint2.key_basis)
* ``oscar_scaled_model_basis_ts``: OScaR with keys in the model's basis *with* token scaling (on Gemma 3, whose
  full-attention keys all settle in the model's basis, exactly the default before the change)
* ``oscar_scaled_no_ts``: OScaR with ``token_scaling=False`` (every layer, whichever basis it settles in)
* ``model_basis_ts_off_at:<i>``: keys in the model's basis with token scaling in every layer but ``i``
* ``oscar_scaled_values_model_basis``: OScaR with values in the model's basis (no Hadamard on values)
* ``kivi2`` / ``kivi2_ts``: KIVI-2 on this engine without / with the token norm on keys; ``kivi2_value_hadamard``;
  ``kivi2_sink64`` / ``kivi2_sink64_ts``: the same with OScaR's 64-token full-precision sink

Writes benchmarks/experiments/results/token_scaling_<model>.json (perplexity per variant and per window, commands).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEFAULT_VARIANTS = ("fp,oscar_scaled,oscar_scaled_model_basis_ts,oscar_scaled_no_ts,model_basis_ts_off_at:5,"
                    "model_basis_ts_off_at:11,model_basis_ts_off_at:17,oscar_scaled_values_model_basis,kivi2,kivi2_ts,"
                    "kivi2_value_hadamard")


def variant_factory(name: str, head_dim: int):
    """``config -> fresh cache`` for a variant name (see the module docstring)."""
    import torch
    from transformers import DynamicCache

    from hf_kvint2 import OscarScaledCache
    from hf_kvint2.cache import OscarCacheBase
    from hf_kvint2.evaluation import engine_cache
    from hf_kvint2.settings import kivi2_recipe, oscar_scaled_recipe

    eye = torch.eye(head_dim)
    scaled = oscar_scaled_recipe()

    def model_basis(token_scaling: bool):
        return replace(scaled, key_rotation=eye, key=replace(scaled.key, token_scaling=token_scaling))

    kivi = kivi2_recipe(head_dim)
    kivi_ts = replace(kivi, key=replace(kivi.key, token_scaling=True))
    fixed = {
        "fp": lambda c: DynamicCache(config=c),
        "oscar_scaled": lambda c: OscarScaledCache(config=c),
        "oscar_scaled_model_basis_ts": lambda c: engine_cache(model_basis(True), c),
        "oscar_scaled_no_ts": lambda c: engine_cache(oscar_scaled_recipe(token_scaling=False), c),
        "oscar_scaled_values_model_basis": lambda c: engine_cache(replace(scaled, value_rotation=eye), c),
        "kivi2": lambda c: engine_cache(kivi, c),
        "kivi2_ts": lambda c: engine_cache(kivi_ts, c),
        "kivi2_value_hadamard": lambda c: engine_cache(replace(kivi, value_rotation=None), c),
        "kivi2_sink64": lambda c: engine_cache(replace(kivi, sink_tokens=64), c),
        "kivi2_sink64_ts": lambda c: engine_cache(replace(kivi_ts, sink_tokens=64), c),
    }
    if name in fixed:
        return fixed[name]
    if name.startswith("model_basis_ts_off_at:"):
        layer = int(name.split(":", 1)[1])
        return lambda c: OscarCacheBase(lambda i: model_basis(i != layer), c)
    raise SystemExit(f"unknown variant {name!r}; known: {sorted(fixed)} and model_basis_ts_off_at:<layer>")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3", choices=["gemma3", "smollm2"], help="bundled model (default gemma3)")
    p.add_argument("--windows", type=int, default=4, help="evaluation windows of Emma (default 4)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated; 'fp' first (the baseline)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/experiments/results/token_scaling_<model>.json)")
    args = p.parse_args(argv)

    import torch

    from hf_kvint2.evaluation import EVAL_TEXT, CacheMethod, chunked_perplexity, encode, eval_windows, load_text
    from hf_kvint2.model_config import model_shape
    from hf_kvint2.models import load_gemma3, load_smollm2

    torch.set_num_threads(args.threads)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if names[0] != "fp":
        raise SystemExit("--variants must start with 'fp' (the baseline).")
    model, tokenizer = (load_gemma3 if args.model == "gemma3" else load_smollm2)(torch.float32,
                                                                                 attn_implementation="sdpa")
    head_dim = model_shape(model.config).head_dim
    methods = [CacheMethod(n, n, variant_factory(n, head_dim), True, "") for n in names]
    windows = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), args.windows, 2048)
    started, start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.perf_counter()
    results = chunked_perplexity(model, windows, methods, 512, 32)
    base = results["fp"].perplexity
    out = {
        "command": "python benchmarks/experiments/token_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "protocol": {"text": EVAL_TEXT, "windows": args.windows, "window": 2048, "prefill": 512,
                                          "chunk": 32, "dtype": "float32", "attention": "sdpa"},
        "started": started,
        "seconds": time.perf_counter() - start,
        "variants": {n: {"perplexity": r.perplexity, "delta_pct": 100 * (r.perplexity / base - 1),
                         "window_perplexities": r.window_perplexities} for n, r in results.items()},
    }
    path = Path(args.out) if args.out else RESULTS / f"token_scaling_{args.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    for n, r in out["variants"].items():
        print(f"{n:34s} {r['perplexity']:8.3f} {r['delta_pct']:+6.2f}%")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
