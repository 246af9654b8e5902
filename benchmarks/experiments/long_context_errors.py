"""Where a 2-bit cache loses quality as the context grows: per layer, keys vs values, body vs windows.

One window of Emma runs through the model at full precision (a ``DynamicCache``, chunks of ``--chunk``); at each
``--lengths`` point the post-RoPE queries of the last ``--probe`` tokens and all keys/values of every
full-attention layer are captured. Each cache's layer recipe (calibrated ``OscarCache`` from the artifact,
``OscarScaledCache``, and window variants) then stores those keys/values as that cache would (one
``OscarLayer`` filled with the first L - probe tokens, then the probe tokens as one chunk, which it attends at full
precision), and the layer's attention output for the probe queries is compared with full precision:

* ``key`` / ``value`` / ``both``: relative error ``||o_hat - o||^2 / ||o||^2`` with only keys, only values or both
  stored quantized;
* ``mass``: the share of the probe queries' attention (full precision) on the sink, the INT2 body, the recent
  window and the current chunk: the body's share is what the quantization error is multiplied by.

    .venv/bin/python benchmarks/experiments/long_context_errors.py --model gemma3 --lengths 2048,8192,16384,32768
    .venv/bin/python benchmarks/experiments/long_context_errors.py --model smollm2 --lengths 2048,8192

Writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3", choices=("gemma3", "smollm2"), help="bundled model")
    p.add_argument("--calibration", default=None, help="OscarCache artifact (default: the model's embedded one)")
    p.add_argument("--lengths", default="2048,8192,16384,32768", help="context lengths probed (tokens)")
    p.add_argument("--probe", type=int, default=64, help="queries probed at each length (the last chunk)")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per full-precision forward between probes")
    p.add_argument("--offset", type=int, default=0, help="first token of the Emma window")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/experiments/results/long_context_<model>)")
    return p


def variants(config, calibrated):
    """name -> per-layer recipe factory (layer_idx -> LayerRecipe)."""
    from hf_kvint2 import OscarScaledCache

    scaled = OscarScaledCache(config=config)
    out = {"OSCAR (calibrated)": lambda i: calibrated.layers[i].recipe,
           "OSCAR, recent 1024": lambda i: calibrated.layers[i].recipe.with_overrides(recent_tokens=1024),
           "OSCAR, sink 256": lambda i: calibrated.layers[i].recipe.with_overrides(sink_tokens=256),
           "OScaR": lambda i: scaled.layers[i].recipe}
    return out


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from hf_kvint2 import OscarCache, hub
    from hf_kvint2.calibration import capture_attention
    from hf_kvint2.evaluation import EVAL_TEXT, cache_kwarg, encode, load_text
    from hf_kvint2.layers import OscarLayer
    from hf_kvint2.model_config import layer_types
    from hf_kvint2.models import load_gemma3, load_smollm2

    torch.set_num_threads(args.threads)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    model, tokenizer = (load_gemma3 if args.model == "gemma3" else load_smollm2)(attn_implementation="sdpa")
    config = model.config
    source = args.calibration or (hub.GEMMA3_ARTIFACT_ID if args.model == "gemma3" else hub.SMOLLM2_ARTIFACT_ID)
    calibrated = OscarCache.from_pretrained(source, config=config)
    full = [i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"]
    ids = torch.tensor(encode(tokenizer, load_text(EVAL_TEXT))[args.offset:args.offset + lengths[-1]])[None]
    if ids.shape[1] < lengths[-1]:
        raise SystemExit(f"Emma has only {ids.shape[1]} tokens from offset {args.offset}; lower --lengths.")

    captured: dict[int, dict[int, tuple]] = {}  # length -> layer -> (q, k, v, scaling)
    state = {"length": None}

    def on_attention(module, query, key, value, kwargs):
        if state["length"] is not None and module.layer_idx in full:
            scaling = kwargs.get("scaling") or module.scaling
            captured[state["length"]][module.layer_idx] = (query[0].float(), key[0].float(), value[0].float(),
                                                           float(scaling))

    cache = DynamicCache(config=config)
    t0 = time.time()
    pos = 0
    with torch.inference_mode(), capture_attention(model, on_attention):
        for length in tqdm(lengths, desc="full-precision pass"):
            stops = list(range(pos + args.chunk, length - args.probe, args.chunk)) + [length - args.probe, length]
            for stop in stops:
                if stop <= pos:
                    continue
                probing = stop == length
                state["length"] = length if probing else None
                if probing:
                    captured[length] = {}
                model(ids[:, pos:stop], **cache_kwarg(model, cache), use_cache=True, logits_to_keep=1)
                pos = stop
            state["length"] = None
    capture_seconds = time.time() - t0

    recipes = variants(config, calibrated)
    rows = []
    for length in lengths:
        for idx in full:
            q, k, v, scaling = captured[length][idx]
            h, t, d = k.shape
            group = q.shape[0] // h
            qh = q.reshape(h, group * q.shape[1], d)
            n_probe = q.shape[1]
            qpos = torch.arange(t - n_probe, t).repeat(group)
            j = torch.arange(t)
            causal = j[None, :] <= qpos[:, None]

            def attend(kk, vv, qh=qh, scaling=scaling, causal=causal):
                s = (qh @ kk.transpose(1, 2)) * scaling
                return (s.masked_fill(~causal, float("-inf")).softmax(-1) @ vv), s

            exact, scores = attend(k, v)
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            norm = exact.square().sum().item()
            for name, recipe_for in recipes.items():
                recipe = recipe_for(idx)
                layer = OscarLayer(recipe, idx)
                layer.update(k[None, :, :t - n_probe], v[None, :, :t - n_probe])
                kq, vq = layer.update(k[None, :, t - n_probe:], v[None, :, t - n_probe:])
                kq, vq = kq[0].float(), vq[0].float()
                sink = recipe.sink_tokens
                err = {}
                for part, (kk, vv) in {"key": (kq, v), "value": (k, vq), "both": (kq, vq)}.items():
                    err[part] = (attend(kk, vv)[0] - exact).square().sum().item() / norm
                quantized = ~torch.isclose(kq, k).all(-1).all(0)  # token positions stored as INT2 (keys)
                seg = torch.zeros(t, dtype=torch.long)  # 0 sink, 1 body, 2 recent, 3 current chunk
                seg[quantized] = 1
                past = torch.arange(t) < t - n_probe
                seg[past & ~quantized & (torch.arange(t) >= sink)] = 2
                seg[torch.arange(t) < sink] = 0
                seg[~past] = 3
                mass = [(probs * (seg == s_)[None, None]).sum().item() / probs.sum().item() for s_ in range(4)]
                rows.append({"length": length, "layer": idx, "method": name, "error": err,
                             "mass": dict(zip(("sink", "body", "recent", "current"), mass)),
                             "body_tokens": int(quantized.sum()), "sink_tokens": sink,
                             "recent_tokens": recipe.recent_tokens})
                print(f"L={length:>6} layer {idx:>2} {name:<20} err K {err['key']:.2e} V {err['value']:.2e} "
                      f"both {err['both']:.2e}  body mass {mass[1]:.3f}")
    result = {"model": args.model, "calibration": source, "lengths": lengths, "probe": args.probe,
              "full_attention_layers": full, "rows": rows,
              "run": {"command": "python benchmarks/experiments/long_context_errors.py " + " ".join(sys.argv[1:] if argv is None
                                                                                           else argv),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
                      "platform": platform.platform(), "threads": args.threads,
                      "capture_seconds": capture_seconds}}
    out = Path(args.out or RESULTS / f"long_context_{args.model}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    layers = result["full_attention_layers"]
    fig, axes = plt.subplots(1, len(layers) + 1, figsize=(4 * (len(layers) + 1), 3.8), squeeze=False)
    for ax, idx in zip(axes[0], layers):
        for m in methods:
            rs = [r for r in result["rows"] if r["layer"] == idx and r["method"] == m]
            ax.plot([r["length"] for r in rs], [r["error"]["both"] for r in rs], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"layer {idx}: attention-output error (K+V)", fontsize=9)
        ax.set_xlabel("context length")
    ax = axes[0][-1]
    for idx in layers:
        rs = [r for r in result["rows"] if r["layer"] == idx and r["method"] == methods[0]]
        ax.plot([r["length"] for r in rs], [r["mass"]["body"] for r in rs], marker="o", label=f"layer {idx}")
    ax.set_xscale("log", base=2)
    ax.set_title(f"attention mass on the INT2 body ({methods[0]})", fontsize=9)
    ax.set_xlabel("context length")
    ax.legend(fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
