"""Why OScaR (``OscarScaledCache``) loses what it loses: per layer, keys vs values, against KIVI-2 and variants.

The quality protocol's windows of Emma (``benchmarks/quality.py``: evenly spaced windows, a prefill, then chunks)
run once through the model at full precision; the post-RoPE queries, keys and values of every full-attention layer
are captured (``--capture``: saved there and reused by later runs). Each variant's layer recipe then stores those
keys/values exactly as the cache does in the quality run (one ``OscarLayer`` per layer, all windows in one batch,
filled with the prefill and then chunk by chunk), and after every ``--every``-th chunk the chunk's queries attend
the layer's K/V (dequantized body + full-precision windows + the chunk itself, causal) against full precision:

* ``key`` / ``value`` / ``both``: relative error ``sum ||o_hat - o||^2 / sum ||o||^2`` over the scored queries
  with only keys, only values or both stored quantized;
* ``error_after_o_proj``: the same after the layer's output projection (what the residual stream sees);
* ``memory``: the bytes the layer holds at the end of the window.

    .venv/bin/python benchmarks/experiments/oscar_scaled_errors.py --model gemma3 --windows 4
    .venv/bin/python benchmarks/experiments/oscar_scaled_errors.py --model smollm2 --long --windows 2 --every 4

Writes benchmarks/experiments/results/oscar_scaled_errors_<model>[_long].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3", choices=("gemma3", "smollm2"), help="bundled model")
    p.add_argument("--windows", type=int, default=4, help="evaluation windows of Emma (as quality.py)")
    p.add_argument("--long", action="store_true", help="windows 8192, prefill 1024, chunks 64")
    p.add_argument("--every", type=int, default=1, help="score every k-th chunk")
    p.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    p.add_argument("--layers", default=None, help="comma-separated subset of the full-attention layers")
    p.add_argument("--capture", default=None, help="file for the captured Q/K/V (default /tmp/<name>.pt)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=None, help="output JSON (default benchmarks/experiments/results/oscar_scaled_errors_<model>[_long].json)")
    return p


def variants(config, head_dim):
    """name -> (layer_idx, recipe) -> recipe."""
    import torch

    from hf_kvint2 import OscarScaledCache
    from hf_kvint2.settings import kivi2_recipe

    scaled = OscarScaledCache(config=config)
    eye = torch.eye(head_dim)

    def lay(i, kg=None, vg=None, ks=None, krot=None, vrot=None, recent=None, sink=None):
        r = scaled.layers[i].recipe
        key = r.key if kg is None else replace(r.key, group_size=kg)
        key = key if ks is None else replace(key, token_scaling=ks)
        value = r.value if vg is None else replace(r.value, group_size=vg)
        kw = {}
        if krot is not None:
            kw["key_rotation"] = krot
        if vrot is not None:
            kw["value_rotation"] = vrot
        if recent is not None:
            kw["recent_tokens"] = recent
        if sink is not None:
            kw["sink_tokens"] = sink
        return r.with_overrides(key=key, value=value, **kw)

    return {
        "OScaR": lambda i: lay(i),
        "KIVI-2": lambda i: kivi2_recipe(head_dim),
        "OScaR, no key scaling": lambda i: lay(i, ks=False),
        "OScaR, keys model basis": lambda i: lay(i, krot=eye),
        "OScaR, values model basis": lambda i: lay(i, vrot=eye),
        "OScaR, K+V model basis": lambda i: lay(i, krot=eye, vrot=eye),
        "OScaR, V group 64": lambda i: lay(i, vg=64),
        "OScaR, V group 128": lambda i: lay(i, vg=128),
        "OScaR, V group 256": lambda i: lay(i, vg=256),
        "OScaR, K group 64": lambda i: lay(i, kg=64),
        "OScaR, recent 64": lambda i: lay(i, recent=64),
        "OScaR, recent 256": lambda i: lay(i, recent=256),
        "OScaR, recent 512": lambda i: lay(i, recent=512),
        "OScaR, sink 4": lambda i: lay(i, sink=4),
        "OScaR, sink 16": lambda i: lay(i, sink=16),
        "OScaR, sink 64": lambda i: lay(i, sink=64),
        "OScaR, keys model basis, no key scaling": lambda i: lay(i, krot=eye, ks=False),
    }


def capture(args, model, tokenizer, full, window, path):
    import torch

    from hf_kvint2.calibration import capture_attention
    from hf_kvint2.evaluation import EVAL_TEXT, encode, eval_windows, load_text

    if path.exists():
        return torch.load(path)
    windows = eval_windows(encode(tokenizer, load_text(EVAL_TEXT)), args.windows, window)
    out = {}

    def on_attention(module, query, key, value, kwargs):
        if module.layer_idx in full:
            scaling = kwargs.get("scaling") or module.scaling
            out[module.layer_idx] = (query.float().clone(), key.float().clone(), value.float().clone(),
                                     float(scaling))

    with torch.inference_mode(), capture_attention(model, on_attention):
        for w in range(windows.shape[0]):  # one window at a time (dense masks), stacked after
            model(windows[w:w + 1], use_cache=False, logits_to_keep=1)
            for idx in full:
                out.setdefault("rows", {}).setdefault(idx, []).append(out.pop(idx))
    data = {idx: tuple(torch.cat([r[j] for r in rows]) for j in range(3)) + (rows[0][3],)
            for idx, rows in out["rows"].items()}
    torch.save(data, path)
    return data


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    from hf_kvint2.layers import OscarLayer
    from hf_kvint2.model_config import layer_types
    from hf_kvint2.models import load_gemma3, load_smollm2

    torch.set_num_threads(args.threads)
    window, prefill, chunk = (8192, 1024, 64) if args.long else (2048, 512, 32)
    model, tokenizer = (load_gemma3 if args.model == "gemma3" else load_smollm2)(attn_implementation="sdpa")
    config = model.config
    full = [i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"]
    if args.layers:
        full = [int(x) for x in args.layers.split(",")]
    name = f"oscar_scaled_errors_{args.model}{'_long' if args.long else ''}"
    path = Path(args.capture or f"/tmp/{name}_{args.windows}w.pt")
    t0 = time.time()
    data = capture(args, model, tokenizer, full, window, path)
    capture_seconds = time.time() - t0
    o_proj = {idx: model.model.layers[idx].self_attn.o_proj.weight.detach().float().clone() for idx in full}
    del model
    head_dim = data[full[0]][1].shape[-1]
    table = variants(config, head_dim)
    chosen = list(table) if not args.variants else [v.strip() for v in args.variants.split(";")]
    rows = []
    for idx in tqdm(full, desc="layers"):
        q, k, v, scaling = data[idx]
        _, hq, t, _ = q.shape
        h = k.shape[1]
        group = hq // h
        wo = o_proj[idx]

        def projected(o, wo=wo):  # [B, Hq, c, d] -> the o_proj output [B, c, hidden]
            return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1) @ wo.T

        def attend(kk, vv, qq, start, scaling=scaling, group=group):
            # qq [B, Hq, c, d] at positions start.., kk/vv [B, H, start + c, d]
            kk = kk.repeat_interleave(group, dim=1)
            vv = vv.repeat_interleave(group, dim=1)
            s = (qq @ kk.transpose(-1, -2)) * scaling
            c = qq.shape[-2]
            mask = torch.arange(kk.shape[-2])[None, :] <= (start + torch.arange(c))[:, None]
            return s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv

        for vname in chosen:
            recipe = table[vname](idx)
            layer = OscarLayer(recipe, idx)
            num = {"key": 0.0, "value": 0.0, "both": 0.0}
            num_out = dict(num)
            den = den_out = 0.0
            layer.update(k[:, :, :prefill], v[:, :, :prefill])
            for n_chunk, start in enumerate(range(prefill, t, chunk)):
                stop = min(start + chunk, t)
                kq, vq = layer.update(k[:, :, start:stop], v[:, :, start:stop])
                if n_chunk % args.every:
                    continue
                kq, vq = kq.float(), vq.float()
                qq = q[:, :, start:stop]
                exact = attend(k[:, :, :stop], v[:, :, :stop], qq, start)
                den += exact.square().sum().item()
                exact_out = projected(exact)
                den_out += exact_out.square().sum().item()
                for part, (kk, vv) in {"key": (kq, v[:, :, :stop]), "value": (k[:, :, :stop], vq),
                                       "both": (kq, vq)}.items():
                    approx = attend(kk, vv, qq, start)
                    num[part] += (approx - exact).square().sum().item()
                    num_out[part] += (projected(approx) - exact_out).square().sum().item()
            report = layer.memory_bytes()
            err = {p: num[p] / den for p in num}
            err_out = {p: num_out[p] / den_out for p in num}
            rows.append({"layer": idx, "variant": vname, "error": err, "error_after_o_proj": err_out,
                         "key_range_spread": layer.key_range_spread,
                         "key_basis": "model" if layer.key_body.codec.rotation.diagonal().abs().min().item() > 0.999
                         else "rotated", "memory": report})
            print(f"layer {idx:>2} {vname:<28} K {err['key']:.3e} V {err['value']:.3e} both {err['both']:.3e} "
                  f"| after o_proj K {err_out['key']:.3e} V {err_out['value']:.3e} both {err_out['both']:.3e} "
                  f"| decided by {layer.key_range_spread}", flush=True)
    summary = {}
    for vname in chosen:
        rs = [r for r in rows if r["variant"] == vname]
        summary[vname] = {f"{p}{suffix}": sum(r[field][p] for r in rs) / len(rs) for p in ("key", "value", "both")
                          for field, suffix in (("error", ""), ("error_after_o_proj", "_after_o_proj"))}
    result = {"model": args.model, "long": args.long, "windows": args.windows, "window": window, "prefill": prefill,
              "chunk": chunk, "every": args.every, "layers": full, "rows": rows, "mean_over_layers": summary,
              "run": {"command": "python benchmarks/experiments/oscar_scaled_errors.py " + " ".join(sys.argv[1:] if argv is None
                                                                                          else argv),
                      "torch": torch.__version__, "capture_seconds": capture_seconds,
                      "seconds": time.time() - t0}}
    out = Path(args.out or RESULTS / name).with_suffix(".json")
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
