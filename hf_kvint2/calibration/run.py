"""Calibration, step 4: run the steps and turn the per-layer choices into an :class:`OscarCalibration` plus the
clip settings (``OscarCache.calibrate`` builds the cache from them), with the artifact's description and a
printable summary (see :mod:`hf_kvint2.calibration`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..distributed import is_main_process
from ..model_config import layer_types
from ..settings import OscarCalibration, OscarSettings
from .fitting import DEFAULT_CLIP_GRID, DEFAULT_K_CLIP, DEFAULT_V_CLIP, LAYOUTS, LayerChoice, fit_layers
from .statistics import CalibrationData, _peak_memory_bytes, collect_statistics


@dataclass
class CalibrationResult:
    """What a calibration produced: the cache's settings and calibration, and a report (time, peak memory, the
    choices and the statistics: printed, not saved, so that the artifact is bit-identical for the same inputs)."""

    settings: OscarSettings
    calibration: OscarCalibration
    report: dict


def calibration_from_choices(choices: Sequence[LayerChoice | None], info: dict | None = None) -> OscarCalibration:
    """Every layer stored as its :class:`LayerChoice` says (the clips are in the layouts); a None choice (a layer
    not calibrated, e.g. sliding-window) has None entries: stored like an uncalibrated OscarCache layer if ever
    quantized."""
    def each(get):
        return [None if c is None else get(c) for c in choices]

    return OscarCalibration(
        k_rotations=each(lambda c: c.key.rotation), v_rotations=each(lambda c: c.value.rotation),
        key_means=each(lambda c: c.key.mean), value_means=each(lambda c: c.value.mean),
        layer_layouts=each(lambda c: (c.key.layout, c.value.layout)),
        k_eigenvalues=each(lambda c: c.key.eigenvalues), v_eigenvalues=each(lambda c: c.value.eigenvalues),
        layout_names=each(lambda c: f"key={c.key.name} value={c.value.name}"), info=dict(info or {}))


def settings_from_choices(choices: Sequence[LayerChoice | None], *, sink_tokens: int = 64, recent_tokens: int = 256,
                          group_size: int = 128, scale_dtype: torch.dtype = torch.float16) -> OscarSettings:
    """The windows and group size calibrated with, and each layer's chosen clip ratios (the reference clips for
    layers not calibrated)."""
    return OscarSettings(sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size,
                         k_clip=tuple(DEFAULT_K_CLIP if c is None else c.key.layout.clip for c in choices),
                         v_clip=tuple(DEFAULT_V_CLIP if c is None else c.value.layout.clip for c in choices),
                         scale_dtype=scale_dtype)


def calibration_info(data: CalibrationData, choices: Sequence[LayerChoice], config, data_description: str,
                     model_id: str | None = None, model_revision: str | None = None, *, layouts=LAYOUTS,
                     centering=(False, True), fit_clip: bool = True, clip_grid=DEFAULT_CLIP_GRID) -> dict:
    """The deterministic description stored in the artifact (no timings: same inputs, same bytes)."""
    return {
        "base_model": model_id or getattr(config, "name_or_path", None) or None,
        "base_model_revision": model_revision or getattr(config, "_commit_hash", None),
        "num_layers": data.num_layers, "num_key_value_heads": data.kv_heads, "head_dim": data.head_dim,
        "data": data_description,
        "num_tokens": data.info["num_tokens"], "statistics_tokens": data.info["statistics_tokens"],
        "held_out_tokens": data.info["held_out_tokens"], "window": data.info["window"],
        "token_sha256": data.info["token_sha256"],
        "method": "two-pass streaming qqt/sst metrics, per-layer layout and clip by held-back attention error",
        "candidates": {"layouts": list(layouts), "centering": list(centering), "fit_clip": fit_clip,
                       "clip_grid": [float(r) for r in clip_grid] if fit_clip else None},
        "layer_types": layer_types(config),
        "calibrated_layers": data.calibrated_layers,
        "attention_error": {"key": [None if c is None else c.key_error for c in choices],
                            "value": [None if c is None else c.value_error for c in choices]},
    }


def fit_calibration(model, tokenizer, texts: Sequence[str], num_tokens: int = 30000, text_window: int = 2048, *,
                    fit_clip: bool = True, layouts: Sequence[str] = LAYOUTS, centering: Sequence[bool] = (False, True),
                    clip_grid: Sequence[float] = DEFAULT_CLIP_GRID, fit_windows: int = 1, fit_queries: int = 256,
                    sink_tokens: int = 64, recent_tokens: int = 256, group_size: int = 128,
                    scale_dtype: torch.dtype = torch.float16, data_description: str | None = None,
                    model_id: str | None = None, model_revision: str | None = None, value_pass: str = "spill",
                    spill_dir: str | None = None, layers: Sequence[int] | None = None,
                    progress: bool = True) -> CalibrationResult:
    """Calibrate OSCAR for ``model`` on ``texts`` (what :meth:`hf_kvint2.OscarCache.calibrate` runs; the arguments
    are documented there)."""
    layouts, centering = tuple(layouts), tuple(centering)
    if not layouts or any(lay not in LAYOUTS for lay in layouts):
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {layouts}.")
    if not centering or any(not isinstance(c, bool) for c in centering):
        raise ValueError(f"centering must be a non-empty tuple of booleans, got {centering}.")
    if any(not (0.0 < r <= 1.0) for r in clip_grid):
        raise ValueError(f"clip_grid ratios must lie in (0, 1], got {tuple(clip_grid)}.")
    if num_tokens <= 0 or text_window <= 0 or fit_windows < 0:
        raise ValueError("num_tokens and text_window must be positive and fit_windows non-negative.")
    choosing = fit_clip or len(layouts) * len(centering) > 1
    if choosing and fit_windows == 0:
        raise ValueError("Fitting clips or choosing among layouts needs fit_windows >= 1 held-back window.")
    start = time.perf_counter()
    data = collect_statistics(model, tokenizer, texts, num_tokens=num_tokens, text_window=text_window,
                              fit_windows=fit_windows if choosing else 0, fit_queries=fit_queries,
                              sink_tokens=sink_tokens, recent_tokens=recent_tokens, value_pass=value_pass,
                              spill_dir=spill_dir, layers=layers, progress=progress)
    fit_start = time.perf_counter()
    choices = fit_layers(data, layouts=layouts, centering=centering, fit_clip=fit_clip, clip_grid=clip_grid,
                         sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size,
                         scale_dtype=scale_dtype, progress=progress)
    seconds = time.perf_counter() - start
    info = calibration_info(data, choices, model.config, data_description or
                            f"{len(texts) if not isinstance(texts, str) else 1} text(s)", model_id, model_revision,
                            layouts=layouts, centering=centering, fit_clip=fit_clip, clip_grid=clip_grid)
    device = next(model.parameters()).device
    report = {"seconds": seconds, "seconds_capture": data.info["seconds_capture"],
              "seconds_fit": time.perf_counter() - fit_start, "peak_memory_bytes": _peak_memory_bytes(device),
              "choices": choices, "data": data}
    settings = settings_from_choices(choices, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                     group_size=group_size, scale_dtype=scale_dtype)
    return CalibrationResult(settings, calibration_from_choices(choices, info), report)


def print_summary(cache) -> None:
    if is_main_process():
        print(calibration_summary(cache))


def _clip_str(clip) -> str:
    return "-" if clip is None else f"{clip:.2f}"


def calibration_summary(cache, artifact_path: str | None = None) -> str:
    """A printable table: tokens, time, peak memory, and per layer the chosen layouts, clips and errors."""
    calibration = cache.calibration
    info, report = calibration.info or {}, getattr(cache, "calibration_report", {}) or {}
    lines = [
        f"OSCAR calibration of {info.get('base_model')} on {info.get('data')}",
        (f"  tokens: {info.get('num_tokens')} ({info.get('statistics_tokens')} for statistics, "
         f"{info.get('held_out_tokens')} held back for fitting), text window {info.get('window')}"),
    ]
    if report:
        lines.append(f"  time: {report['seconds']:.1f} s (capture {report['seconds_capture']:.1f} s, fitting "
                     f"{report['seconds_fit']:.1f} s); peak memory: {report['peak_memory_bytes'] / 2**20:.0f} MiB")
    lines.append(f"  {'layer':>5}  {'key layout':<16}{'k clip':>7}{'k err':>10}  {'value layout':<16}{'v clip':>7}"
                 f"{'v err':>10}")
    errors = info.get("attention_error", {})
    types = info.get("layer_types") or [None] * len(calibration.layer_layouts)
    for i, pair in enumerate(calibration.layer_layouts):
        if pair is None:
            lines.append(f"  {i:>5}  not calibrated ({types[i] or 'not quantized'}: kept as the model's window)")
            continue
        kname, vname = calibration.layout_names[i].removeprefix("key=").split(" value=")
        ke, ve = errors.get("key", [None] * (i + 1))[i], errors.get("value", [None] * (i + 1))[i]
        fmt = lambda e: "-" if e is None or math.isnan(e) else f"{e:.2e}"
        lines.append(f"  {i:>5}  {kname:<16}{_clip_str(pair[0].clip):>7}{fmt(ke):>10}  {vname:<16}"
                     f"{_clip_str(pair[1].clip):>7}{fmt(ve):>10}")
    if artifact_path is not None:
        lines.append(f"  artifact written to: {artifact_path}")
    return "\n".join(lines)
