"""Where a batch-1 decode step's time goes: cProfile (CPU-time clock) of decode steps on the synthetic SmolLM2-shaped
Llama (fp32, one thread), grouped into model matmuls, the Numba kernel, its Python wrapper (the whole-layer step),
the rest of the fused attention, the cache's write path (update: checks, windows, quantization of demoted tokens)
and the rest.

    python benchmarks/profile_decode.py --cache oscar --context 2048     # -> results/profile_decode_oscar_2048.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
# (label, predicate on a pstats key (file, line, function)): cumulative time of the outermost matching frame (the
# largest cumulative time among the matches: an inner frame of the same name is part of it)
GROUPS = (
    ("model linear layers (torch.nn.functional.linear)", lambda k: k[2] == "<built-in method torch._C._nn.linear>"),
    ("Numba body kernel", lambda k: k[0].endswith("cpu_kernels/kernel.py") and k[2] == "attend"),
    ("kernel wrapper (cpu_kernels.layer_step_attention, incl. kernel)", lambda k: k[0].endswith("cpu_kernels/calls.py")
     and k[2] in ("layer_step_attention", "body_attention")),
    ("fused attention (steps.LayerStep.attend, incl. wrapper and kernel)", lambda k: k[0].endswith("steps.py")
     and k[2] == "attend"),
    ("SDPA (DynamicCache; for Oscar: the prefill path only)", lambda k: k[2] == "sdpa_attention_forward"),
    ("cache update (write path)", lambda k: k[2] == "update" and ("layers.py" in k[0] or "cache_utils.py" in k[0])),
    # both demotion paths (a decode step's _demote_past_recent, a chunk's _demote) quantize through _append_to_body
    ("  of which quantization of demoted tokens", lambda k: k[0].endswith("layers.py") and k[2] == "_append_to_body"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="oscar", choices=("dynamic", "oscar", "scaled"),
                    help="dynamic (DynamicCache, sdpa), oscar (OscarCache), scaled (OscarScaledCache); default oscar")
    ap.add_argument("--context", type=int, default=2048, help="cached tokens (default 2048)")
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--steps", type=int, default=4, help="profiled decode steps (default 4, after 2 untimed)")
    ap.add_argument("--out", type=Path, default=None, help="default results/profile_decode_<cache>_<context>.txt")
    args = ap.parse_args()
    import torch
    from speedlib import fill_cache, load_model, make_cache, set_threads

    set_threads(1)
    fused = args.cache != "dynamic"
    model = load_model("synthetic", "oscar" if fused else "sdpa")
    cache = make_cache(args.cache, model.config)
    fill_cache(cache, model.config, args.batch, args.context, fused)
    tok = torch.zeros(args.batch, 1, dtype=torch.long)

    def step():
        nonlocal tok
        with torch.no_grad():
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    for _ in range(2):
        step()
    prof = cProfile.Profile(time.process_time)
    c0 = time.process_time()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    total = (time.process_time() - c0) / args.steps
    stats = pstats.Stats(prof)
    head = (f"{args.cache} batch {args.batch} context {args.context}: {total * 1e3:.1f} ms CPU per step "
            f"(under cProfile), {args.steps} steps")
    lines = [head, ""]
    for label, match in GROUPS:
        t = max([v[3] for k, v in stats.stats.items() if match(k)] or [0.0]) / args.steps  # cumulative time
        lines.append(f"{label:70s} {t * 1e3:8.1f} ms/step  {100 * t / total:5.1f}%")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    out = args.out or RESULTS / f"profile_decode_{args.cache}_{args.context}.txt"
    out.write_text("\n".join(lines) + "\n\n" + buf.getvalue().replace(str(Path.cwd()) + "/", ""))
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
