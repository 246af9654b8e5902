"""The README.md model card of an artifact, rendered from ``model_cards/oscar_artifact.md``.

Everything a card shows comes from ``config.json``, which anyone can write: identifiers (base model, revision) are
checked at load (:data:`~.artifact.IDENTIFIER`) and quoted with :func:`python_literal` in the usage snippet;
free-form text (calibration description, layout names, quality rows) goes through :func:`markdown_text`, so that
no string becomes code, a link, HTML or a new table row in the card."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .artifact import OSCAR_FORMAT

CARD_NAME = "README.md"
CARD_TEMPLATE = "oscar_artifact.md"
# Markdown and HTML that a string could use to add structure: code spans, links and images, tables, raw HTML and
# escapes. Emphasis characters other than * are left alone (names such as "sliding_attention" stay readable).
_MARKDOWN_ESCAPES = str.maketrans({**{c: "\\" + c for c in "\\`*[]|"}, "<": "&lt;", ">": "&gt;", "&": "&amp;"})


def markdown_text(value) -> str:
    """``value`` as inline markdown text that renders as itself: one line (control characters and line breaks
    become spaces), markup characters escaped."""
    text = "".join(" " if not c.isprintable() else c for c in str(value))
    return " ".join(text.split()).translate(_MARKDOWN_ESCAPES)


def python_literal(text: str) -> str:
    """``text`` as a Python string literal (quotes included) that evaluates to ``text``."""
    return json.dumps(text)


def render_card(config: dict, cls_name: str, repo_id: str | None = None, subfolder: str | None = None) -> str:
    """The README.md model card of an artifact, from ``model_cards/oscar_artifact.md``."""
    from huggingface_hub import ModelCard, ModelCardData

    fmt = config["format"]
    calibrated = bool(config.get("layers"))
    tags = ["kv-cache", "int2", "hf_kvint2", "oscar" if fmt == OSCAR_FORMAT else "oscar-scaled"]
    tags += ["calibration"] if calibrated else ["data-free"]
    base = config.get("base_model")
    card_data = ModelCardData(library_name="hf_kvint2", base_model=base, tags=tags, license="apache-2.0")
    calib = config.get("calibration") or {}
    rows = []
    for i, layer in enumerate(config.get("layers") or []):
        def groups(lay):
            return "default" if lay is None else f"{lay['axis']}/{lay['group_size']}" + \
                (" +norm" if lay.get("token_scaling") else "")
        def clip(lay, kind, i=i):
            if lay is not None:
                if lay.get("range_clip") is not None:  # per-channel groups: the fraction of the range they span
                    return f"group range {lay['range_clip']:.3g}"
                return "none" if lay.get("clip") is None else f"{lay['clip']:.3g}"
            value = config["settings"].get(f"{kind}_clip")
            value = value[i] if isinstance(value, list) else value
            return "none" if value is None else f"{value:.3g}"
        listed, types = config.get("calibrated_layers"), calib.get("layer_types") or []
        layout = markdown_text(layer.get("layout") or "-")
        if listed is not None and i not in listed:  # a hybrid model's layer the cache does not quantize
            layout = f"not calibrated ({markdown_text(types[i]) if i < len(types) else 'not quantized'})"
        rows.append([str(i), layout,
                     "stored" if layer.get("key_rotation") else "Hadamard", groups(layer.get("key_layout")),
                     clip(layer.get("key_layout"), "k"),
                     "stored" if layer.get("value_rotation") else "Hadamard", groups(layer.get("value_layout")),
                     clip(layer.get("value_layout"), "v"),
                     f"{'yes' if layer.get('key_mean') else 'no'}/{'yes' if layer.get('value_mean') else 'no'}"])
    settings = [(k, "per layer" if isinstance(v, list) else f"`{v}`") for k, v in config["settings"].items()]
    method = "OSCAR (offline spectral covariance-aware rotation)" if fmt == OSCAR_FORMAT else \
        "OScaR (omni-scaled canalized rotation, data-free)"
    title = f"{method.split(' ')[0]} 2-bit KV cache for {markdown_text(base or 'any model')}"
    data = markdown_text(calib.get("data", "unrecorded data"))
    summary = (f"{method} settings for `{base}`." if base else f"{method} settings.") + \
        (f" Calibrated on {data}." if calibrated else "")
    template = Path(__file__).resolve().parents[2] / "model_cards" / CARD_TEMPLATE
    if not template.exists():  # installed wheel: the template ships as package data
        template = Path(__file__).parents[1] / "model_cards" / CARD_TEMPLATE
    repo = repo_id or "<this repo id or local folder>"
    card = ModelCard.from_template(
        card_data, template_path=str(template), title=title, summary=summary, class_name=cls_name,
        calibrated=calibrated, base_model_display=base or "<base model id>",
        base_model_literal=python_literal(base or "<base model id>"),
        base_model_revision=config.get("base_model_revision"), repo_id_literal=python_literal(repo),
        subfolder_literal=python_literal(subfolder) if subfolder else None, format=fmt,
        format_version=config["format_version"],
        num_layers=config.get("num_layers") or "any", num_key_value_heads=config.get("num_key_value_heads") or "any",
        head_dim=config.get("head_dim") or "any", settings=settings, calibration=bool(calib),
        calibration_data=markdown_text(calib.get("data", "not recorded")),
        calibration_tokens=markdown_text(calib.get("num_tokens", "not recorded")),
        calibration_window=markdown_text(calib.get("window", "not recorded")),
        layer_rows=rows, quality_table=quality_markdown(config.get("quality")))
    return str(card)


def quality_markdown(rows: list[dict] | None) -> str | None:
    """A markdown table from rows of dicts (columns: the union of keys in first-seen order), every cell escaped."""
    if not rows:
        return None
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if math.isfinite(v) else str(v)
        return "" if v is None else markdown_text(v)
    lines = ["| " + " | ".join(markdown_text(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
