"""Calibration, step 3: candidate transforms per layer and the choice of layout, centring and clip ratio by
the attention-output error on the held-back windows, then the budgeted choice of each stream's group size
(:func:`allocate_group_sizes`; see :mod:`hf_kvint2.calibration`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..recipes import GroupLayout
from ..settings import OSCAR_DEFAULTS, OscarCalibration, OscarSettings
from ..stream import QuantizedStream, StreamCodec
from ..transforms import hadamard_matrix, spectral_rotation
from .statistics import CalibrationData, HeldOutLayer, LayerStatistics

LAYOUTS = ("spectral", "hadamard", "channel")
CENTERING = (False, True)  # candidates without and with the means subtracted
DEFAULT_CLIP_GRID = (0.86, 0.89, 0.92, 0.94, 0.96, 0.98, 1.0)
# Per-channel token groups: the fractions of each group's [min, max] the four levels may span
# (GroupLayout.range_clip). With 2 bits a group's extreme tokens set levels that most of its tokens fall between.
# What the held-back error prefers is then checked end to end (confirm.confirm_range_clips; docs/calibration.md), so
# fit_layer / fit_layers narrow only when given this grid (fit_from_statistics does, with the model). The full range
# first: ties keep it.
DEFAULT_RANGE_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
FULL_RANGE = (1.0,)
DEFAULT_K_CLIP, DEFAULT_V_CLIP = OSCAR_DEFAULTS.k_clip, OSCAR_DEFAULTS.v_clip
# Group sizes each K/V stream may get (per-token groups are capped at head_dim) and the default budget of the
# quantized body in bits/element, averaged over the calibrated K/V streams: 2-bit codes plus a scale and a zero
# point per group (2 x 16 bits with fp16 scales: 32 / group bits). 2.35 is what the uniform group of 128 costs
# (2.25) plus 0.1 bit to spend where it pays; with the default 64 + 256 full-precision tokens a 16-bit model's
# cache holds about 2.39 bits/element at 128k tokens. The calibration's default budget ("auto") is this, or the
# uniform layout's bits where those are more (head_dim 64: 2.5).
DEFAULT_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_BITS_BUDGET = 2.35

@dataclass(frozen=True)
class Candidate:
    """One way to store K or V of a layer: a layout, its rotation and (optional) mean, and a name."""

    name: str
    layout: GroupLayout
    rotation: torch.Tensor
    mean: torch.Tensor | None
    eigenvalues: torch.Tensor | None = None


def candidate_transforms(stats: LayerStatistics, kind: str, layout: str, centered: bool, head_dim: int):
    """(rotation [d, d] float32, mean [H, d] float32 or None, eigenvalues or None) of a layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}; choose from {LAYOUTS}.")
    mean = (stats.key_mean() if kind == "key" else stats.value_mean()).float() if centered else None
    if layout == "spectral":
        sigma = stats.key_metric() if kind == "key" else stats.value_metric(centered)
        rot, evals = spectral_rotation(sigma)
        return rot.float(), mean, evals.float()
    if layout == "hadamard":
        return hadamard_matrix(head_dim), mean, None
    return torch.eye(head_dim), mean, None  # per-channel (KIVI-style): channels kept as they are


class LayerErrorProbe:
    """Attention-output error of a quantized K or V on the held-back windows of one layer.

    Per window the cache is simulated as it is at decode time: keys/values before ``sink`` and within the
    ``recent`` tokens before each query are exact, the rest is stored as the candidate stores it. The error is
    ``sum ||o_hat - o||^2 / sum ||o||^2`` over sampled queries and query heads.
    """

    def __init__(self, held: Sequence[HeldOutLayer], sink: int, recent: int, scale_dtype: torch.dtype):
        self.sink, self.recent, self.scale_dtype = sink, recent, scale_dtype
        self.windows = []
        for w in held:
            h, t, d = w.k.shape
            group = w.q.shape[0] // h
            q = w.q.reshape(h, group * w.q.shape[1], d)
            pos = w.positions.repeat(group)  # row r of q belongs to position positions[r % n_q]
            j = torch.arange(t)
            causal = j[None, :] <= pos[:, None]
            body = (j[None, :] >= sink) & (j[None, :] <= pos[:, None] - recent) & causal
            scores = (q @ w.k.transpose(1, 2)) * w.scaling
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = scores.softmax(-1)
            out = probs @ w.v
            self.windows.append({"w": w, "q": q, "causal": causal, "body": body, "scores": scores, "probs": probs,
                                 "out": out, "norm": out.square().sum().item()})

    def _quantized(self, x: torch.Tensor, cand: Candidate) -> torch.Tensor:
        """x [H, T, d] with tokens from ``sink`` on replaced by their stored (quantize -> dequantize) form."""
        d = x.shape[-1]
        group = cand.layout.group_for(d)
        n = x.shape[1] - self.sink
        if cand.layout.axis == "channel":
            n -= n % group  # whole token blocks only; the rest is still in the recent window
        codec = StreamCodec(cand.layout, group, cand.rotation, cand.mean, self.scale_dtype)
        stream = QuantizedStream(codec)
        stream.append(x[None, :, self.sink: self.sink + n])
        out = x.clone()
        out[:, self.sink: self.sink + n] = stream.dequantize()[0]
        rest = x.shape[1] - self.sink - n
        if rest and cand.layout.axis == "channel" and x.shape[1] - self.sink >= group:
            # the tokens after the last whole block: stored as part of the block of the window's last `group`
            # tokens, so that every token of the body is quantized whatever the group size (at longer contexts
            # they would be in a block; an exact tail would favour large groups)
            tail = QuantizedStream(codec)
            tail.append(x[None, :, -group:])
            out[:, -rest:] = tail.dequantize()[0][:, -rest:]
        return out

    @property
    def longest_group(self) -> int:
        """The largest per-channel token group the held-back windows can measure (tokens after the sink)."""
        return min(win["w"].k.shape[1] for win in self.windows) - self.sink

    def error(self, kind: str, cand: Candidate) -> float:
        num = den = 0.0
        for win in self.windows:
            w = win["w"]
            if kind == "key":
                k_hat = self._quantized(w.k, cand)
                s_hat = (win["q"] @ k_hat.transpose(1, 2)) * w.scaling
                s = torch.where(win["body"], s_hat, win["scores"])
                diff = s.softmax(-1) @ w.v - win["out"]
            else:
                dv = self._quantized(w.v, cand) - w.v
                diff = (win["probs"] * win["body"]) @ dv
            num += diff.square().sum().item()
            den += win["norm"]
        return num / den if den > 0 else 0.0


@dataclass
class LayerChoice:
    """What calibration chose for one layer, and the errors it measured."""

    key: Candidate
    value: Candidate
    key_error: float
    value_error: float
    errors: dict = field(default_factory=dict)  # "key:<name>@<clip>" -> error (default group; "/g<n>" others)
    # kind ("key" / "value") -> {group size actually used: (best Candidate, its error)}: what the group-size
    # allocation chooses from
    options: dict = field(default_factory=dict)


def _candidate_name(layout: str, centered: bool) -> str:
    return layout + ("+center" if centered else "")


def _group_options(axis: str, sizes: Sequence[int], head_dim: int) -> list[int]:
    """The distinct group sizes actually used for ``sizes`` on ``axis`` (per-token groups capped at head_dim)."""
    out = []
    for g in sizes:
        eff = min(g, head_dim) if axis == "token" else g
        if eff not in out:
            out.append(eff)
    return out


def fit_layer(stats: LayerStatistics, probe: LayerErrorProbe | None, head_dim: int, *, layouts=LAYOUTS,
              centering=CENTERING, fit_clip: bool = True, clip_grid=DEFAULT_CLIP_GRID,
              range_clip_grid=FULL_RANGE, group_size: int = OSCAR_DEFAULTS.group_size,
              group_sizes: Sequence[int] | None = None) -> LayerChoice:
    """Pick the key and the value candidate with the lowest attention-output error (first wins ties); without
    ``fit_clip`` the reference clips ``DEFAULT_K_CLIP`` / ``DEFAULT_V_CLIP`` and per-channel groups span their
    whole range. Per-token candidates try the row clips of ``clip_grid``, per-channel ones the narrowed group
    ranges of ``range_clip_grid`` (:attr:`GroupLayout.range_clip`; default: the full range only, since the
    attention error alone is no safe guide to them: :func:`hf_kvint2.calibration.confirm.confirm_range_clips`).

    The choice is made at ``group_size`` (per-channel key groups over ``min(group_size, head_dim)`` tokens: the
    same scale count as per-token groups); ``group_sizes`` also measures every candidate at those group sizes and
    keeps the best per group size in :attr:`LayerChoice.options` for :func:`allocate_group_sizes`."""
    if probe is None and (fit_clip or len(layouts) * len(centering) > 1 or group_sizes):
        raise ValueError("Fitting clips, choosing among layouts or group sizes needs held-back windows "
                         "(fit_windows >= 1).")
    default = min(group_size, head_dim)
    extra = [g for g in (group_sizes or ()) if isinstance(g, int) and g > 0]
    if group_sizes is not None and len(extra) != len(group_sizes):
        raise ValueError(f"group_sizes must be positive ints, got {tuple(group_sizes)}.")
    chosen, errors, options = {}, {}, {}
    for kind, default_clip in (("key", DEFAULT_K_CLIP), ("value", DEFAULT_V_CLIP)):
        best = {}  # group size actually used -> (candidate, error)
        for layout in layouts:
            for centered in centering:
                rot, mean, evals = candidate_transforms(stats, kind, layout, centered, head_dim)
                if layout == "channel":  # per-channel groups over tokens: no row clip, a narrowed group range
                    clips, axis = (list(range_clip_grid) if fit_clip else [None]), "channel"
                else:
                    clips, axis = (list(clip_grid) if fit_clip else [default_clip]), "token"
                sizes = _group_options(axis, [default, *extra], head_dim)
                if axis == "channel" and probe is not None:  # a group longer than the windows is never measured
                    sizes = [g for g in sizes if g == default or g <= probe.longest_group]
                for clip in clips:
                    clip = None if clip is not None and clip >= 1.0 else clip
                    row_clip, range_clip = (None, clip) if axis == "channel" else (clip, None)
                    for size in sizes:
                        # the default group is stored as before (token groups as group_size, capped when used)
                        stored = (group_size if axis == "token" else default) if size == default else size
                        cand = Candidate(_candidate_name(layout, centered),
                                         GroupLayout(axis, stored, row_clip, range_clip=range_clip), rot, mean, evals)
                        err = float("nan") if probe is None else probe.error(kind, cand)
                        where = f"@range{clip}" if range_clip is not None else f"@{clip}"
                        errors[f"{kind}:{cand.name}{where}" + ("" if size == default else f"/g{size}")] = err
                        if size not in best or err < best[size][1]:
                            best[size] = (cand, err)
        chosen[kind] = best[default]
        options[kind] = dict(sorted(best.items()))
    return LayerChoice(chosen["key"][0], chosen["value"][0], chosen["key"][1], chosen["value"][1], errors,
                       options if group_sizes else {})


def stream_bits(group: int, scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype) -> float:
    """Bits/element of a quantized body stored in groups of ``group``: 2-bit codes + scale and zero point."""
    return 2.0 + 2 * torch.finfo(scale_dtype).bits / group


def body_bits(choices: Sequence[LayerChoice | None], head_dim: int,
              scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype) -> float:
    """Mean bits/element of the quantized body over the calibrated layers' K and V streams (the same number of
    elements each; the full-precision windows not counted: they depend on the context length)."""
    groups = [c.key.layout.group_for(head_dim) for c in choices if c is not None] + \
             [c.value.layout.group_for(head_dim) for c in choices if c is not None]
    if not groups:
        raise ValueError("No calibrated layer: no quantized body to count the bits of.")
    return sum(stream_bits(g, scale_dtype) for g in groups) / len(groups)


def allocate_group_sizes(choices: Sequence[LayerChoice | None], bits_budget: float, head_dim: int,
                         scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype) -> list[LayerChoice | None]:
    """Give every calibrated K/V stream the group size (among its :attr:`LayerChoice.options`) that minimises the
    summed held-back attention-output error with the mean body bits/element (:func:`body_bits`) within
    ``bits_budget``: an exact multiple-choice knapsack by dynamic programming over the scale bits (few streams,
    few group sizes: instant). Ties go to fewer bits. Layers without options (or None) are kept as they are."""
    streams = [(i, kind) for i, c in enumerate(choices) if c is not None for kind in ("key", "value")]
    if not streams:
        raise ValueError("No calibrated layer: nothing to allocate group sizes to.")
    for i, kind in streams:
        if not choices[i].options.get(kind):
            raise ValueError(f"Layer {i} has no measured group-size options for its {kind}s: fit it with "
                             "fit_layer(..., group_sizes=...).")
    opts = [sorted(choices[i].options[kind].items()) for i, kind in streams]
    unit = math.lcm(*(g for o in opts for g, _ in o))  # scale bits of group g: 2 * bits * (unit / g) / unit
    per_unit = 2 * torch.finfo(scale_dtype).bits / unit
    capacity = math.floor((bits_budget - 2.0) * len(streams) / per_unit + 1e-9)
    cheapest = sum(min(unit // g for g, _ in o) for o in opts)
    if capacity < cheapest:
        lowest = 2.0 + cheapest * per_unit / len(streams)
        raise ValueError(f"bits_budget={bits_budget} is below what the largest candidate groups cost "
                         f"({lowest:.4f} bits/element over the calibrated K/V streams): raise bits_budget or add "
                         "larger group_sizes.")
    # dp[w] = (summed error, choices) with exactly w scale units spent; built stream by stream
    dp = {0: (0.0, ())}
    for o in opts:
        nxt = {}
        for w, (err, picked) in dp.items():
            for g, (_, e) in o:
                w2 = w + unit // g
                if w2 > capacity:
                    continue
                cand = (err + e, picked + (g,))
                if w2 not in nxt or cand[0] < nxt[w2][0]:
                    nxt[w2] = cand
        dp = nxt
    best_w = min(dp, key=lambda w: (dp[w][0], w))
    picked = dp[best_w][1]
    out = list(choices)
    for (i, kind), g in zip(streams, picked):
        cand, err = choices[i].options[kind][g]
        out[i] = replace(out[i], **{kind: cand, f"{kind}_error": err})
    return out


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


def settings_from_choices(choices: Sequence[LayerChoice | None], *, sink_tokens: int = OSCAR_DEFAULTS.sink_tokens,
                          recent_tokens: int = OSCAR_DEFAULTS.recent_tokens,
                          group_size: int = OSCAR_DEFAULTS.group_size,
                          scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype) -> OscarSettings:
    """The windows and group size calibrated with, and each layer's chosen clip ratios (the reference clips for
    layers not calibrated)."""
    return OscarSettings(sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size,
                         k_clip=tuple(DEFAULT_K_CLIP if c is None else c.key.layout.clip for c in choices),
                         v_clip=tuple(DEFAULT_V_CLIP if c is None else c.value.layout.clip for c in choices),
                         scale_dtype=scale_dtype)


def fit_layers(data: CalibrationData, *, layouts=LAYOUTS, centering=CENTERING, fit_clip: bool = True,
               clip_grid=DEFAULT_CLIP_GRID, range_clip_grid=FULL_RANGE, sink_tokens: int = OSCAR_DEFAULTS.sink_tokens,
               recent_tokens: int = OSCAR_DEFAULTS.recent_tokens, group_size: int = OSCAR_DEFAULTS.group_size,
               group_sizes: Sequence[int] | None = None, scale_dtype: torch.dtype = OSCAR_DEFAULTS.scale_dtype,
               progress: bool = True) -> list[LayerChoice | None]:
    """One :class:`LayerChoice` per layer, None for the layers without statistics (not calibrated)."""
    from tqdm.auto import tqdm

    choices: list[LayerChoice | None] = []
    for idx in tqdm(range(data.num_layers), desc="fitting layouts and clips", unit="layer", disable=not progress):
        if data.stats[idx] is None:
            choices.append(None)
            continue
        held = [w[idx] for w in data.held_out]
        probe = LayerErrorProbe(held, sink_tokens, recent_tokens, scale_dtype) if held else None
        choices.append(fit_layer(data.stats[idx], probe, data.head_dim, layouts=layouts, centering=centering,
                                 fit_clip=fit_clip, clip_grid=clip_grid, range_clip_grid=range_clip_grid,
                                 group_size=group_size,
                                 group_sizes=group_sizes))
    return choices
