"""The README.md model card of an artifact, rendered from ``model_cards/oscar_artifact.md``."""

from __future__ import annotations

import math
from pathlib import Path

from .artifact import OSCAR_FORMAT

CARD_NAME = "README.md"
CARD_TEMPLATE = "oscar_artifact.md"


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
        layout = layer.get("layout") or "-"
        if listed is not None and i not in listed:  # a hybrid model's layer the cache does not quantize
            layout = f"not calibrated ({types[i] if i < len(types) else 'not quantized'})"
        rows.append([str(i), layout,
                     "stored" if layer.get("key_rotation") else "Hadamard", groups(layer.get("key_layout")),
                     clip(layer.get("key_layout"), "k"),
                     "stored" if layer.get("value_rotation") else "Hadamard", groups(layer.get("value_layout")),
                     clip(layer.get("value_layout"), "v"),
                     f"{'yes' if layer.get('key_mean') else 'no'}/{'yes' if layer.get('value_mean') else 'no'}"])
    settings = [(k, "per layer" if isinstance(v, list) else f"`{v}`") for k, v in config["settings"].items()]
    method = "OSCAR (offline spectral covariance-aware rotation)" if fmt == OSCAR_FORMAT else \
        "OScaR (omni-scaled canalized rotation, data-free)"
    title = f"{method.split(' ')[0]} 2-bit KV cache for {base or 'any model'}"
    summary = (f"{method} settings for `{base}`." if base else f"{method} settings.") + \
        (f" Calibrated on {calib.get('data', 'unrecorded data')}." if calibrated else "")
    template = Path(__file__).resolve().parents[2] / "model_cards" / CARD_TEMPLATE
    if not template.exists():  # installed wheel: the template ships as package data
        template = Path(__file__).parents[1] / "model_cards" / CARD_TEMPLATE
    card = ModelCard.from_template(
        card_data, template_path=str(template), title=title, summary=summary, class_name=cls_name,
        calibrated=calibrated, base_model_display=base or "<base model id>",
        base_model_revision=config.get("base_model_revision"), repo_id=repo_id or "<this repo id or local folder>",
        subfolder=subfolder, format=fmt, format_version=config["format_version"],
        num_layers=config.get("num_layers") or "any", num_key_value_heads=config.get("num_key_value_heads") or "any",
        head_dim=config.get("head_dim") or "any", settings=settings, calibration=bool(calib),
        calibration_data=calib.get("data", "not recorded"), calibration_tokens=calib.get("num_tokens", "not recorded"),
        calibration_window=calib.get("window", "not recorded"),
        layer_rows=rows, quality_table=quality_markdown(config.get("quality")))
    return str(card)


def quality_markdown(rows: list[dict] | None) -> str | None:
    """A markdown table from rows of dicts (columns: the union of keys in first-seen order)."""
    if not rows:
        return None
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if math.isfinite(v) else str(v)
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
