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
from ..settings import OSCAR_DEFAULTS, OscarCalibration, OscarSettings
from .confirm import confirm_range_clips
from .fitting import (
    CENTERING,
    DEFAULT_BITS_BUDGET,
    DEFAULT_CLIP_GRID,
    DEFAULT_GROUP_SIZES,
    DEFAULT_RANGE_CLIP_GRID,
    FULL_RANGE,
    LAYOUTS,
    LayerChoice,
    allocate_group_sizes,
    body_bits,
    calibration_from_choices,
    fit_layers,
    settings_from_choices,
)
from .statistics import (
    DEFAULT_FIT_QUERIES,
    DEFAULT_FIT_WINDOWS,
    DEFAULT_NUM_TOKENS,
    DEFAULT_TEXT_WINDOW,
    DEFAULT_VALUE_PASS,
    CalibrationData,
    _peak_memory_bytes,
    collect_statistics,
)

AUTO_BUDGET = "auto"  # DEFAULT_BITS_BUDGET, or what group_size everywhere costs where that is more


@dataclass
class CalibrationResult:
    """What a calibration produced: the cache's settings and calibration, and a report (time, peak memory, the
    choices and the statistics: printed, not saved, so that the artifact is bit-identical for the same inputs)."""

    settings: OscarSettings
    calibration: OscarCalibration
    report: dict


def calibration_info(data: CalibrationData, choices: Sequence[LayerChoice], config, data_description: str,
                     model_id: str | None = None, model_revision: str | None = None, *, layouts=LAYOUTS,
                     centering=CENTERING, fit_clip: bool = True, clip_grid=DEFAULT_CLIP_GRID,
                     range_clip_grid=None, group_allocation: dict | None = None,
                     range_clip_check: dict | None = None) -> dict:
    """The deterministic description stored in the artifact (no timings: same inputs, same bytes).
    ``group_allocation`` (the budget, candidate group sizes and the bits reached) is recorded when the group sizes
    were allocated; the chosen group size of each layer's K and V is in its layouts."""
    info = {
        "base_model": model_id or getattr(config, "name_or_path", None) or None,
        "base_model_revision": model_revision or getattr(config, "_commit_hash", None),
        "num_layers": data.num_layers, "num_key_value_heads": data.kv_heads, "head_dim": data.head_dim,
        "data": data_description,
        "num_tokens": data.info["num_tokens"], "statistics_tokens": data.info["statistics_tokens"],
        "held_out_tokens": data.info["held_out_tokens"], "window": data.info["window"],
        "token_sha256": data.info["token_sha256"],
        "method": "two-pass streaming qqt/sst metrics, per-layer layout and clip by held-back attention error",
        "candidates": {"layouts": list(layouts), "centering": list(centering), "fit_clip": fit_clip,
                       "clip_grid": [float(r) for r in clip_grid] if fit_clip else None,
                       "range_clip_grid": [float(r) for r in range_clip_grid] if range_clip_grid else None},
        "layer_types": layer_types(config),
        "calibrated_layers": data.calibrated_layers,
        "attention_error": {"key": [None if c is None else c.key_error for c in choices],
                            "value": [None if c is None else c.value_error for c in choices]},
    }
    if group_allocation is not None:
        info["group_allocation"] = group_allocation
    if range_clip_check is not None:
        info["range_clip_check"] = range_clip_check
    return info




def _check_allocation(group_sizes, bits_budget) -> tuple[int, ...] | None:
    if bits_budget is None:
        return None
    if bits_budget != AUTO_BUDGET and (isinstance(bits_budget, bool) or not isinstance(bits_budget, (int, float))
                                  or not 2.0 < bits_budget <= 16.0):
        raise ValueError(f"bits_budget must be a number of bits/element in (2, 16] (2-bit codes plus the scales), "
                         f"'auto' (the default: {DEFAULT_BITS_BUDGET}, or what group_size everywhere costs where "
                         f"that is more) or None (group_size everywhere), got {bits_budget!r}.")
    sizes = tuple(group_sizes or ())
    if not sizes or any(not isinstance(g, int) or isinstance(g, bool) or g <= 0 for g in sizes):
        raise ValueError(f"group_sizes must be a non-empty sequence of positive ints (default "
                         f"{DEFAULT_GROUP_SIZES}), got {group_sizes!r}.")
    return sizes


def fit_from_statistics(data: CalibrationData, config, *, fit_clip: bool = True, layouts: Sequence[str] = LAYOUTS,
                        centering: Sequence[bool] = CENTERING, clip_grid: Sequence[float] = DEFAULT_CLIP_GRID,
                        sink_tokens: int = OSCAR_DEFAULTS.sink_tokens,
                        recent_tokens: int = OSCAR_DEFAULTS.recent_tokens, group_size: int = OSCAR_DEFAULTS.group_size,
                        group_sizes: Sequence[int] | None = DEFAULT_GROUP_SIZES,
                        bits_budget: float | str | None = AUTO_BUDGET,
                        scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype, data_description: str = "",
                        model_id: str | None = None, model_revision: str | None = None, progress: bool = True,
                        choices: Sequence[LayerChoice | None] | None = None, model=None,
                        cache_type=None) -> CalibrationResult:
    """Steps 3-4 of a calibration from collected (or saved, :meth:`CalibrationData.load`) statistics: fit every
    calibrated layer (or take ``choices`` fitted before with the same arguments), allocate the group sizes within
    ``bits_budget`` and build the settings and calibration. ``bits_budget``: bits/element of the quantized body
    (mean over the calibrated K/V streams); ``"auto"`` is ``DEFAULT_BITS_BUDGET`` (2.35), or what ``group_size``
    everywhere costs where that is more (head_dim 64: per-token groups cannot exceed 64 channels, 2.5 bits), so
    that the default never stores a model in fewer bits than one group size everywhere would; None:
    ``group_size`` everywhere. ``sink_tokens`` / ``recent_tokens`` must be those the statistics were collected
    with.

    ``model`` and ``cache_type`` (the cache class the result is for, ``OscarCache``: its ``calibrate`` passes
    both), with ``fit_clip`` and statistics that hold their held-back token ids: per-channel groups may also narrow
    their range (:attr:`GroupLayout.range_clip`), and every stream that does is checked end to end by
    :func:`~hf_kvint2.calibration.confirm.confirm_range_clips` (the model's loss on the held-back windows through
    the calibrated ``cache_type``): the held-back attention error favours narrowing where the model's loss does
    not. Without them no range is narrowed."""
    sizes = _check_allocation(group_sizes, bits_budget)
    start = time.perf_counter()
    confirming = model is not None and cache_type is not None and fit_clip and bool(data.held_ids)
    range_grid = DEFAULT_RANGE_CLIP_GRID if confirming else None
    if choices is None:
        choices = fit_layers(data, layouts=layouts, centering=centering, fit_clip=fit_clip, clip_grid=clip_grid,
                             range_clip_grid=range_grid or FULL_RANGE, sink_tokens=sink_tokens,
                             recent_tokens=recent_tokens, group_size=group_size, group_sizes=sizes,
                             scale_dtype=scale_dtype, progress=progress)
    allocation = None
    if sizes is not None:
        uniform = body_bits(choices, data.head_dim, scale_dtype)
        budget = max(DEFAULT_BITS_BUDGET, uniform) if bits_budget == AUTO_BUDGET else bits_budget
        choices = allocate_group_sizes(choices, budget, data.head_dim, scale_dtype)
        allocation = {"bits_budget": float(budget), "budget_rule": "auto" if bits_budget == AUTO_BUDGET else "given",
                      "group_sizes": list(sizes), "scale_dtype":
                      str(scale_dtype).removeprefix("torch."),
                      "body_bits": body_bits(choices, data.head_dim, scale_dtype), "uniform_body_bits": uniform,
                      "method": "per K/V stream group size minimising the summed held-back attention error "
                                "within the mean body bits/element budget (exact knapsack)"}
    confirmation = None
    if confirming:
        choices, confirmation = confirm_range_clips(
            choices, model, data.held_ids, cache_type=cache_type, sink_tokens=sink_tokens,
            recent_tokens=recent_tokens, group_size=group_size, scale_dtype=scale_dtype, head_dim=data.head_dim,
            progress=progress)
    info = calibration_info(data, choices, config, data_description, model_id, model_revision, layouts=layouts,
                            centering=centering, fit_clip=fit_clip, clip_grid=clip_grid,
                            range_clip_grid=range_grid, group_allocation=allocation,
                            range_clip_check=confirmation)
    report = {"seconds_fit": time.perf_counter() - start, "choices": choices, "data": data}
    settings = settings_from_choices(choices, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                     group_size=group_size, scale_dtype=scale_dtype)
    return CalibrationResult(settings, calibration_from_choices(choices, info), report)


def fit_calibration(model, tokenizer, texts: Sequence[str], num_tokens: int = DEFAULT_NUM_TOKENS,
                    text_window: int = DEFAULT_TEXT_WINDOW, *, fit_clip: bool = True, layouts: Sequence[str] = LAYOUTS,
                    centering: Sequence[bool] = CENTERING, clip_grid: Sequence[float] = DEFAULT_CLIP_GRID,
                    fit_windows: int = DEFAULT_FIT_WINDOWS, fit_queries: int = DEFAULT_FIT_QUERIES,
                    sink_tokens: int = OSCAR_DEFAULTS.sink_tokens, recent_tokens: int = OSCAR_DEFAULTS.recent_tokens,
                    group_size: int = OSCAR_DEFAULTS.group_size,
                    group_sizes: Sequence[int] | None = DEFAULT_GROUP_SIZES,
                    bits_budget: float | str | None = AUTO_BUDGET,
                    scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype, data_description: str | None = None,
                    model_id: str | None = None, model_revision: str | None = None,
                    value_pass: str = DEFAULT_VALUE_PASS, spill_dir: str | None = None,
                    layers: Sequence[int] | None = None, cache_type=None, progress: bool = True) -> CalibrationResult:
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
    _check_allocation(group_sizes, bits_budget)
    choosing = fit_clip or len(layouts) * len(centering) > 1 or bits_budget is not None
    if choosing and fit_windows == 0:
        raise ValueError("Fitting clips, choosing among layouts or allocating group sizes (bits_budget) needs "
                         "fit_windows >= 1 held-back window (or bits_budget=None).")
    start = time.perf_counter()
    data = collect_statistics(model, tokenizer, texts, num_tokens=num_tokens, text_window=text_window,
                              fit_windows=fit_windows if choosing else 0, fit_queries=fit_queries,
                              sink_tokens=sink_tokens, recent_tokens=recent_tokens, value_pass=value_pass,
                              spill_dir=spill_dir, layers=layers, progress=progress)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1
    result = fit_from_statistics(
        data, model.config, fit_clip=fit_clip, layouts=layouts, centering=centering, clip_grid=clip_grid,
        sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size, group_sizes=group_sizes,
        bits_budget=bits_budget, scale_dtype=scale_dtype,
        data_description=data_description or f"{len(texts) if not isinstance(texts, str) else 1} text(s)",
        model_id=model_id, model_revision=model_revision, progress=progress,
        model=None if distributed else model,  # the end-to-end check decodes with one process's whole model
        cache_type=cache_type)
    device = next(model.parameters()).device
    result.report.update(seconds=time.perf_counter() - start, seconds_capture=data.info["seconds_capture"],
                         peak_memory_bytes=_peak_memory_bytes(device))
    return result


def print_summary(cache) -> None:
    if is_main_process():
        print(calibration_summary(cache))


def _clip_str(layout) -> str:
    """A layout's row clip, or its narrowed group range as ``r<fraction>`` (per-channel groups)."""
    if layout.range_clip is not None:
        return f"r{layout.range_clip:.2f}"
    return "-" if layout.clip is None else f"{layout.clip:.2f}"


def calibration_summary(cache, artifact_path: str | None = None) -> str:
    """A printable table: tokens, time, peak memory, and per layer the chosen layouts, clips and errors."""
    calibration = cache.calibration
    info, report = calibration.info or {}, getattr(cache, "calibration_report", {}) or {}
    lines = [
        f"OSCAR calibration of {info.get('base_model')} on {info.get('data')}",
        (f"  tokens: {info.get('num_tokens')} ({info.get('statistics_tokens')} for statistics, "
         f"{info.get('held_out_tokens')} held back for fitting), text window {info.get('window')}"),
    ]
    if report.get("seconds") is not None:
        lines.append(f"  time: {report['seconds']:.1f} s (capture {report['seconds_capture']:.1f} s, fitting "
                     f"{report['seconds_fit']:.1f} s); peak memory: {report['peak_memory_bytes'] / 2**20:.0f} MiB")
    elif report.get("seconds_fit") is not None:
        lines.append(f"  fitted from saved statistics in {report['seconds_fit']:.1f} s")
    allocation = info.get("group_allocation")
    if allocation:
        lines.append(f"  group sizes allocated within {allocation['bits_budget']} bits/element (candidates "
                     f"{allocation['group_sizes']}): body {allocation['body_bits']:.4f} bits/element (one group "
                     f"size everywhere: {allocation['uniform_body_bits']:.4f})")
    check = info.get("range_clip_check")
    if check:
        lines.append(f"  narrowed group ranges checked on the held-back loss: kept {check['kept'] or 'none'}, "
                     f"widened {check['widened'] or 'none'} (layer:stream)")
    lines.append(f"  {'layer':>5}  {'key layout':<16}{'k grp':>6}{'k clip':>7}{'k err':>10}  {'value layout':<16}"
                 f"{'v grp':>6}{'v clip':>7}{'v err':>10}")
    errors = info.get("attention_error", {})
    types = info.get("layer_types") or [None] * len(calibration.layer_layouts)
    for i, pair in enumerate(calibration.layer_layouts):
        if pair is None:
            lines.append(f"  {i:>5}  not calibrated ({types[i] or 'not quantized'}: kept as the model's window)")
            continue
        kname, vname = calibration.layout_names[i].removeprefix("key=").split(" value=")
        ke, ve = errors.get("key", [None] * (i + 1))[i], errors.get("value", [None] * (i + 1))[i]
        fmt = lambda e: "-" if e is None or math.isnan(e) else f"{e:.2e}"
        d = info.get("head_dim") or 1 << 30
        lines.append(f"  {i:>5}  {kname:<16}{pair[0].group_for(d):>6}{_clip_str(pair[0]):>7}{fmt(ke):>10}  "
                     f"{vname:<16}{pair[1].group_for(d):>6}{_clip_str(pair[1]):>7}{fmt(ve):>10}")
    if artifact_path is not None:
        lines.append(f"  artifact written to: {artifact_path}")
    return "\n".join(lines)
