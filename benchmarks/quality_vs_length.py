"""Both bundled models side by side at 2k, 8k and 32k tokens: a table and a plot of perplexity vs context length,
from the result files of benchmarks/quality.py (no model is run here).

    python benchmarks/quality_vs_length.py      # reads benchmarks/results/quality*.json, writes quality_vs_length.*

Inputs (each from its own quality.py run; the command is in each file's "runs"):
* SmolLM2 2k: quality.json, 8k: quality_smollm2_8k.json (--long --windows 2)
* Gemma 3 2k: quality_gemma3.json, 32k: quality_gemma3_32k.json (windows of 32768, prefill 1024, chunks of 64,
  every 8th token scored); while that run is incomplete, its checkpoint quality_gemma3_32k.partial.json (the
  positions scored so far, per method). Gemma 3 "8k" / "16k" are the 32k windows scored up to position 8192 /
  16384 (tokens predicted from at most that much context, as a window of that length would), from the
  per-position spans that chunked_perplexity reports; a column needs every method's spans to reach it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = {"fp": "full precision", "oscar": "OSCAR (calibrated)", "oscar_scaled": "OScaR"}
SOURCES = {  # (model, file, context label, how many positions: None = the whole window)
    ("SmolLM2-135M", "2k"): ("quality.json", None),
    ("SmolLM2-135M", "8k"): ("quality_smollm2_8k.json", None),
    ("Gemma 3 270M", "2k"): ("quality_gemma3.json", None),
    ("Gemma 3 270M", "8k"): ("quality_gemma3_32k.json", 8192),
    ("Gemma 3 270M", "16k"): ("quality_gemma3_32k.json", 16384),
    ("Gemma 3 270M", "32k"): ("quality_gemma3_32k.json", None),
}


def _load(name: str) -> dict | None:
    """A result file, with the rows its unfinished runs have checkpointed (<name>.partial.json: the positions each
    method has scored so far, ``scored_up_to``) for the methods it has no perplexity of yet; then
    ``protocol.scored_up_to`` is the least position those rows reached."""
    done_path, partial_path = RESULTS / name, (RESULTS / name).with_suffix(".partial.json")
    data = json.loads(done_path.read_text()) if done_path.exists() else None
    if partial_path.exists():
        partial = json.loads(partial_path.read_text())
        if data is None:
            data = partial
        else:
            measured = {r["key"] for r in data["rows"] if r.get("perplexity") is not None}
            extra = [r for r in partial["rows"] if r["key"] not in measured]
            if extra:
                data["rows"] = [r for r in data["rows"] if r["key"] not in {e["key"] for e in extra}] + extra
                data["protocol"] = dict(data["protocol"], scored_up_to=min(
                    r.get("scored_up_to", partial["protocol"]["scored_up_to"]) for r in extra))
    if data is None or not any(r.get("perplexity") is not None for r in data["rows"]):
        return None
    return data


def _perplexity(row: dict, upto: int | None) -> float | None:
    if row.get("perplexity") is None:
        return None
    if upto is None:
        return row["perplexity"]
    spans = [s for s in row.get("by_position") or [] if s["stop"] <= upto]
    if not spans or max(s["stop"] for s in spans) != upto:  # a span cut short: the row has not reached upto
        return None
    nll = sum(math.log(s["perplexity"]) * s["tokens"] for s in spans)
    return math.exp(nll / sum(s["tokens"] for s in spans))


def collect() -> dict:
    table = {}
    for (model, ctx), (name, upto) in SOURCES.items():
        data = _load(name)
        if data is None:
            continue
        rows = {r["key"]: r for r in data["rows"]}
        reached = data["protocol"].get("scored_up_to", data["protocol"]["window"])
        if upto is None and reached < data["protocol"]["window"]:
            continue  # an unfinished run: only the spans it reached count
        fp = _perplexity(rows.get("fp", {}), upto)
        for key in METHODS:
            if key not in rows:
                continue
            ppl = _perplexity(rows[key], upto)
            if ppl is None or fp is None:
                continue
            table.setdefault(key, {})[(model, ctx)] = {
                "perplexity": ppl, "delta_pct": 100 * (ppl / fp - 1), "source": name, "upto": upto,
                "bits_16bit": rows[key].get("bits_per_element_16bit"), "scored_up_to": reached,
                "protocol": {k: data["protocol"].get(k) for k in ("windows", "window", "prefill", "chunk",
                                                                 "score_every", "scored_tokens")}}
    return table


def markdown(table: dict) -> str:
    cols = [c for c in SOURCES if any(c in v for v in table.values())]
    head = ["Method"] + [f"{m} {c}" for m, c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, name in METHODS.items():
        cells = [name]
        for c in cols:
            e = table.get(key, {}).get(c)
            cells.append("—" if e is None else f"{e['perplexity']:.2f} ({e['delta_pct']:+.1f}%)" if key != "fp"
                         else f"{e['perplexity']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path) -> None:
    """Top: perplexity per span of predicted-token positions; bottom: the same relative to full precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("SmolLM2-135M", [("quality.json", "2k run"), ("quality_smollm2_8k.json", "8k run")]),
              ("Gemma 3 270M", [("quality_gemma3.json", "2k run"), ("quality_gemma3_32k.json", "32k run")])]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    colors = {"fp": "black", "oscar": "tab:blue", "oscar_scaled": "tab:orange"}
    for col, (model, files) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        for name, label in files:
            data = _load(name)
            if data is None:
                continue
            reached = data["protocol"].get("scored_up_to")
            label = label if reached is None else f"{label}, scored to {reached}"  # the least of its methods
            rows = {r["key"]: r for r in data["rows"]}
            style = ":" if label.startswith("2k") else "-"
            for key, row in rows.items():
                if key not in METHODS or row.get("perplexity") is None:
                    continue
                window = data["protocol"]["window"]
                # whole spans only: a checkpoint's last span stops where that method had got to
                spans = [s for s in row.get("by_position") or [] if s["stop"] == window
                         or s["stop"] & (s["stop"] - 1) == 0]
                if spans:
                    xs = [math.sqrt(max(s["start"], 1) * s["stop"]) for s in spans]
                    top.plot(xs, [s["perplexity"] for s in spans], style, marker="o", color=colors[key],
                             label=f"{METHODS[key]} ({label})")
                    # against fp over the same spans (runs of one method each may have reached different positions)
                    fp_spans = {(f["start"], f["stop"]): f for f in rows["fp"].get("by_position") or []}
                    same = [(x, s, fp_spans[s["start"], s["stop"]]) for x, s in zip(xs, spans)
                            if (s["start"], s["stop"]) in fp_spans]
                    if key != "fp" and same:
                        bottom.plot([x for x, _, _ in same],
                                    [100 * (s["perplexity"] / f["perplexity"] - 1) for _, s, f in same],
                                    style, marker="o", color=colors[key], label=f"{METHODS[key]} ({label})")
                else:  # an older run without per-position spans: the whole window at its length
                    w = data["protocol"]["window"]
                    top.scatter([w], [row["perplexity"]], marker="s", color=colors[key],
                                label=f"{METHODS[key]} ({label}, whole window)")
                    if key != "fp":
                        bottom.scatter([w], [100 * (row["perplexity"] / rows["fp"]["perplexity"] - 1)], marker="s",
                                       color=colors[key], label=f"{METHODS[key]} ({label}, whole window)")
        top.set_xscale("log", base=2)
        top.set_ylabel("perplexity (chunked decode, Emma)")
        top.set_title(model)
        top.legend(fontsize=6)
        bottom.axhline(0, color="gray", lw=0.8)
        bottom.set_xlabel("position of the predicted token (context length); spans between powers of two")
        bottom.set_ylabel("perplexity vs full precision (%)")
        bottom.legend(fontsize=6)
    fig.suptitle("Perplexity vs context length: full precision, OSCAR (calibrated OscarCache), OScaR")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    table = collect()
    out = RESULTS / "quality_vs_length"
    serial = {k: {f"{m} {c}": e for (m, c), e in v.items()} for k, v in table.items()}
    out.with_suffix(".json").write_text(json.dumps(serial, indent=1))
    out.with_suffix(".md").write_text(markdown(table))
    plot(out.with_suffix(".png"))
    print(markdown(table))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return serial


if __name__ == "__main__":
    main()
