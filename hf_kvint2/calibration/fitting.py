"""Calibration, step 3: candidate transforms per layer and the choice of layout, centring and clip ratio by
the attention-output error on the held-back windows (see :mod:`hf_kvint2.calibration`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..recipes import GroupLayout
from ..stream import QuantizedStream, StreamCodec
from ..transforms import hadamard_matrix, spectral_rotation
from .statistics import CalibrationData, HeldOutLayer, LayerStatistics

LAYOUTS = ("spectral", "hadamard", "channel")
DEFAULT_CLIP_GRID = (0.86, 0.89, 0.92, 0.94, 0.96, 0.98, 1.0)
DEFAULT_K_CLIP, DEFAULT_V_CLIP = 0.96, 0.92

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
        stream = QuantizedStream(StreamCodec(cand.layout, group, cand.rotation, cand.mean, self.scale_dtype))
        stream.append(x[None, :, self.sink: self.sink + n])
        out = x.clone()
        out[:, self.sink: self.sink + n] = stream.dequantize()[0]
        return out

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
    errors: dict = field(default_factory=dict)  # "key:<name>@<clip>" -> error, same for values


def _candidate_name(layout: str, centered: bool) -> str:
    return layout + ("+center" if centered else "")


def fit_layer(stats: LayerStatistics, probe: LayerErrorProbe | None, head_dim: int, *, layouts=LAYOUTS,
              centering=(False, True), fit_clip: bool = True, clip_grid=DEFAULT_CLIP_GRID,
              group_size: int = 128) -> LayerChoice:
    """Pick the key and the value candidate with the lowest attention-output error (first wins ties); without
    ``fit_clip`` the reference clips ``DEFAULT_K_CLIP`` / ``DEFAULT_V_CLIP``."""
    if probe is None and (fit_clip or len(layouts) * len(centering) > 1):
        raise ValueError("Fitting clips or choosing among layouts needs held-back windows (fit_windows >= 1).")
    chosen, errors = {}, {}
    for kind, default_clip in (("key", DEFAULT_K_CLIP), ("value", DEFAULT_V_CLIP)):
        best = None
        for layout in layouts:
            for centered in centering:
                rot, mean, evals = candidate_transforms(stats, kind, layout, centered, head_dim)
                if layout == "channel":  # per-channel groups over tokens: same scale count as per-token groups
                    clips = [None]
                    axis, size = "channel", min(group_size, head_dim)
                else:
                    clips = list(clip_grid) if fit_clip else [default_clip]
                    axis, size = "token", group_size
                for clip in clips:
                    clip = None if clip is not None and clip >= 1.0 else clip
                    cand = Candidate(_candidate_name(layout, centered), GroupLayout(axis, size, clip), rot, mean,
                                     evals)
                    err = float("nan") if probe is None else probe.error(kind, cand)
                    errors[f"{kind}:{cand.name}@{clip}"] = err
                    if best is None or err < best[1]:
                        best = (cand, err)
        chosen[kind] = best
    return LayerChoice(chosen["key"][0], chosen["value"][0], chosen["key"][1], chosen["value"][1], errors)


def fit_layers(data: CalibrationData, *, layouts=LAYOUTS, centering=(False, True), fit_clip: bool = True,
               clip_grid=DEFAULT_CLIP_GRID, sink_tokens: int = 64, recent_tokens: int = 256, group_size: int = 128,
               scale_dtype: torch.dtype = torch.float16, progress: bool = True) -> list[LayerChoice | None]:
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
                                 fit_clip=fit_clip, clip_grid=clip_grid, group_size=group_size))
    return choices
