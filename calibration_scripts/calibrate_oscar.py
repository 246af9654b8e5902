#!/usr/bin/env python
"""Calibrate OSCAR (fitted rotations, clip ratios, centring, per-layer layout) for a causal LM; write the artifact.

    python calibration_scripts/calibrate_oscar.py --model smollm2 \\
        --text hf_kvint2/data/prideprejudice.txt --num-tokens 30000 --output runs/smollm2-oscar

``--model smollm2`` (the default) is the bundled SmolLM2-135M-Instruct, ``--model gemma3`` the bundled Gemma 3 270M
(the ``[gemma3]`` extra; only its full-attention layers are calibrated: the sliding-window layers keep
transformers' full-precision window); any other value is a Hub id or a local folder for ``AutoModelForCausalLM``. ``--text`` may be given several times. The artifact is written with
``OscarCache.save_pretrained`` and, with ``--push-to-hub REPO_ID``, uploaded.

Time: minutes. SmolLM2-135M with --num-tokens 30000 took about 6 minutes on one CPU thread (1.4 GiB peak memory);
it grows with the model size and --num-tokens. On a shared machine keep --threads at 1 (the default): several
threads competing with other jobs were 8x slower here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# torch and transformers are imported after the arguments are parsed, so that --help prints at once.
_DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv=None):
    # Options left out take OscarCache.calibrate's defaults (hf_kvint2.calibration; OSCAR's windows and group size
    # from hf_kvint2.settings.OscarSettings): the script and the Python call give the same artifact.
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (bundled, default), 'gemma3' (bundled, [gemma3] extra), a Hub id or a local path")
    p.add_argument("--revision", default=None, help="model revision on the Hub")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="model dtype (default float32)")
    p.add_argument("--text", action="append", required=False, metavar="FILE",
                   help="calibration text file (UTF-8); repeat for several")
    p.add_argument("--num-tokens", type=int, default=None,
                   help="tokens of text read in total (default 30000). The last --fit-windows x --window of "
                        "them are held back to choose layouts and fit clips; the rest feed the statistics in two "
                        "passes over the model, so the progress bar counts 2 x statistics + held-back tokens (6144 "
                        "for --num-tokens 4096 with --window 2048)")
    p.add_argument("--window", type=int, default=None, help="tokens per forward window (default 2048)")
    p.add_argument("--fit-windows", type=int, default=None,
                   help="windows at the end of --num-tokens held back to choose layouts, group sizes and clips "
                        "(default 1); more measure the choices on more text and leave fewer for the statistics")
    p.add_argument("--no-fit-clip", action="store_true",
                   help="keep the reference clip ratios 0.96 (keys) / 0.92 (values) instead of fitting them")
    p.add_argument("--layouts", default=None,
                   help="comma-separated per-layer candidates among spectral,hadamard,channel (default: all three)")
    p.add_argument("--no-centering", action="store_true", help="do not consider centred candidates")
    p.add_argument("--sink-tokens", type=int, default=None,
                   help="full-precision tokens at the start that the artifact's cache keeps (default 64)")
    p.add_argument("--recent-tokens", type=int, default=None,
                   help="full-precision recent window of the artifact's cache (default 256)")
    p.add_argument("--bits-budget", default=None, metavar="BITS",
                   help="mean bits/element of the quantized body over the calibrated K/V streams (2-bit codes + "
                        "fp16 scale and zero point per group) within which each stream's group size is chosen by "
                        "held-back error (default 'auto': 2.35, or what --group-size everywhere costs where that "
                        "is more, e.g. 2.5 at head_dim 64; 'none': --group-size everywhere)")
    p.add_argument("--group-sizes", default=None, metavar="SIZES",
                   help="comma-separated candidate group sizes of the allocation (default 32,64,128,256; per-token "
                        "groups are capped at head_dim)")
    p.add_argument("--group-size", type=int, default=None,
                   help="group size without allocation and of layers not calibrated (default 128)")
    p.add_argument("--from-statistics", metavar="FILE", default=None,
                   help="fit from the statistics of an earlier --save-statistics run instead of running the model "
                        "over the text (seconds instead of minutes; --text, --num-tokens, --window and --fit-windows "
                        "are then those of that run, and --sink-tokens / --recent-tokens must be too)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: robust on shared machines; 0 = torch's default)")
    p.add_argument("--output", required=True, help="folder to write the artifact to")
    p.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="also upload the artifact to this repo")
    p.add_argument("--save-statistics", metavar="FILE", default=None,
                   help="also write the raw calibration statistics and held-back activations (safetensors), e.g. "
                        "for benchmarks/experiments/calibration_ablation.py --statistics FILE")
    return p.parse_args(argv)


def load_model(name: str, revision: str | None, dtype):
    """(model, tokenizer, model id, revision) for ``name``."""
    if name.lower() in ("smollm2", "default"):
        from hf_kvint2.models import DEFAULT_MODEL_ID, load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
        return model, tokenizer, DEFAULT_MODEL_ID, None
    if name.lower() == "gemma3":
        from hf_kvint2.models import GEMMA3_MODEL_ID, load_gemma3

        model, tokenizer = load_gemma3(dtype=dtype, attn_implementation="sdpa")
        return model, tokenizer, GEMMA3_MODEL_ID, None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=dtype).eval()
    return model, tokenizer, name, revision or getattr(model.config, "_commit_hash", None)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return calibrate(args)
    finally:  # called in-process (tests): leave torch's thread count as it was
        torch.set_num_threads(threads)


def _given(args) -> dict:
    """The fitting options given on the command line, as ``OscarCache.calibrate`` keywords (the rest: its
    defaults)."""
    out = {}
    if args.no_fit_clip:
        out["fit_clip"] = False
    if args.no_centering:
        out["centering"] = (False,)
    if args.layouts is not None:
        out["layouts"] = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    for name in ("sink_tokens", "recent_tokens", "group_size"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    if args.bits_budget is not None:
        budget = args.bits_budget.strip().lower()
        if budget == "none":
            out["bits_budget"] = None
        elif budget != "auto":
            try:
                out["bits_budget"] = float(budget)
            except ValueError:
                sys.exit(f"--bits-budget {args.bits_budget!r}: give a number of bits/element such as 2.35, or "
                         "'none'.")
    if args.group_sizes is not None:
        try:
            out["group_sizes"] = tuple(int(x) for x in args.group_sizes.split(",") if x.strip())
        except ValueError:
            sys.exit(f"--group-sizes {args.group_sizes!r}: give comma-separated positive integers such as "
                     "32,64,128,256.")
    return out


def calibrate(args) -> int:
    import torch

    from hf_kvint2 import OscarCache
    from hf_kvint2.calibration import CalibrationData, calibration_summary

    if not args.text:
        sys.exit("--text FILE is required (the calibration text; with --from-statistics: the text of that run, "
                 "recorded in the artifact's description).")
    texts, names = [], []
    for path in args.text:
        if not os.path.isfile(path):
            sys.exit(f"--text {path}: no such file.")
        texts.append(Path(path).read_text(encoding="utf-8"))
        names.append(Path(path).name)
    if args.from_statistics and not os.path.isfile(args.from_statistics):
        sys.exit(f"--from-statistics {args.from_statistics}: no such file (write one with --save-statistics).")
    options = _given(args)
    model, tokenizer, model_id, revision = load_model(args.model, args.revision, getattr(torch, args.dtype))
    common = dict(data_description=", ".join(names), model_id=model_id, model_revision=revision, verbose=False,
                  **options)
    if args.from_statistics:
        data = CalibrationData.load(args.from_statistics)
        if data.num_layers != model.config.get_text_config().num_hidden_layers:
            sys.exit(f"--from-statistics {args.from_statistics}: the statistics have {data.num_layers} layers, the "
                     f"model {model.config.get_text_config().num_hidden_layers}: they were saved for another model.")
        import hashlib

        from hf_kvint2.calibration import tokenize_texts

        ids = tokenize_texts(tokenizer, texts, data.info["num_tokens"])
        if hashlib.sha256(ids.numpy().tobytes()).hexdigest() != data.info.get("token_sha256"):
            sys.exit(f"--from-statistics {args.from_statistics}: its tokens are not the first "
                     f"{data.info['num_tokens']} tokens of --text {' '.join(args.text)}: give the text (and model) "
                     "the statistics were collected on.")
        if args.fit_windows is not None and args.fit_windows != len(data.held_out):
            sys.exit(f"--from-statistics {args.from_statistics} holds {len(data.held_out)} held-back window(s), not "
                     f"--fit-windows {args.fit_windows}: drop --fit-windows, or save statistics with it.")
        cache = OscarCache.from_statistics(data, model, **common)
    else:
        sizes = {"num_tokens": args.num_tokens, "text_window": args.window, "fit_windows": args.fit_windows}
        cache = OscarCache.calibrate(model, tokenizer, texts, **{k: v for k, v in sizes.items() if v is not None},
                                     **common)
    folder = cache.save_pretrained(args.output, repo_id=args.push_to_hub)
    if args.save_statistics:
        cache.calibration_report["data"].save(args.save_statistics)
    where = str(folder or args.output)
    if args.push_to_hub:
        cache.push_to_hub(args.push_to_hub)
        where += f" and https://huggingface.co/{args.push_to_hub}"
    print(calibration_summary(cache, artifact_path=where))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
