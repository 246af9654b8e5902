"""What one cache layer does (:class:`LayerRecipe`) and how it groups K or V (:class:`GroupLayout`): every method is
a recipe of the one engine. The recipes of OSCAR, OScaR and the baselines, with their defaults, are built from the
typed settings in :mod:`hf_kvint2.settings`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .quant import AXES, SCALE_DTYPES


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_fraction(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and 0.0 < v <= 1.0


def is_power_of_two_int(v) -> bool:
    return _is_int(v) and v > 0 and v & (v - 1) == 0


# GroupLayout's fields: (check, what the error says is expected). Checked at construction, so a layout read from an
# artifact or given in Python is refused before any K/V is quantized with it.
_LAYOUT_FIELDS = {
    "axis": (lambda v: isinstance(v, str) and v in AXES, f"one of {AXES}"),
    "group_size": (lambda v: _is_int(v) and v > 0, "a positive int"),
    "clip": (lambda v: v is None or _is_fraction(v), "a ratio in (0, 1] or None"),
    "token_scaling": (lambda v: isinstance(v, bool), "a bool (True or False)"),
    "range_clip": (lambda v: v is None or _is_fraction(v), "a fraction in (0, 1] or None"),
}


@dataclass(frozen=True)
class GroupLayout:
    """How one of K or V is quantized in the INT2 body.

    axis: ``"token"`` groups ``group_size`` channels of one token (capped at head_dim); ``"channel"`` groups
        ``group_size`` tokens of one channel (KIVI-style keys), so tokens leave the full-precision window in
        blocks of ``group_size``.
    clip: clamp each rotated row to its ``clip`` quantile of ``|x|`` before quantizing (None: no clipping).
    token_scaling: divide each token by its norm over all KV heads and channels of the layer (OScaR's
        omni-token scaling) and store the norm.
    range_clip: ``"channel"`` groups only: each group's ``[min, max]`` is narrowed to this fraction of its width
        about its centre before the four levels are set, and the values outside saturate to the end codes
        (None: the full range). A few extreme tokens per group otherwise set the levels for all of them; the
        calibration fits the fraction per stream (:mod:`hf_kvint2.calibration.fitting`).
    """

    axis: str = "token"
    group_size: int = 128
    clip: float | None = None
    token_scaling: bool = False
    range_clip: float | None = None

    def __post_init__(self):
        for name, (check, expected) in _LAYOUT_FIELDS.items():
            value = getattr(self, name)
            if not check(value):  # a string "false" would turn scaling on, True would be a group of 1
                raise ValueError(f"GroupLayout: {name} must be {expected}, got {value!r} ({type(value).__name__}).")
        if self.range_clip is not None and self.axis != "channel":
            raise ValueError("GroupLayout.range_clip narrows per-channel token groups; per-token groups "
                             "('token' axis) clip rows with `clip` instead.")

    def group_for(self, head_dim: int) -> int:
        """The group size actually used: per-token groups never exceed head_dim (SPEC: G = min(128, d))."""
        return min(self.group_size, head_dim) if self.axis == "token" else self.group_size


@dataclass
class LayerRecipe:
    """Everything one cache layer needs; the two cache classes only differ in the recipes they build."""

    key: GroupLayout
    value: GroupLayout
    sink_tokens: int = 0
    recent_tokens: int = 128
    scale_dtype: torch.dtype = torch.float16
    key_rotation: torch.Tensor | None = None  # [d, d] orthogonal; None: (block) Hadamard
    value_rotation: torch.Tensor | None = None
    hadamard_block: int | None = None
    key_mean: torch.Tensor | None = None  # [kv_heads, d], subtracted before the rotation (lossless centering)
    value_mean: torch.Tensor | None = None
    check_finite: bool = True
    method: str = ""  # "oscar" or "oscar_scaled": the cache that built it (errors name that cache's fix)
    # Per-token layouts: tokens leave the recent window this many at a time (the window holds recent_tokens ..
    # recent_tokens + demotion_tokens - 1 tokens), so most decode steps only append to it: a demotion's fixed
    # work (rotation, quantizer call, buffer bookkeeping) is paid once per demotion_tokens steps.
    demotion_tokens: int = 1

    def __post_init__(self):
        for name in ("sink_tokens", "recent_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}.")
        if not _is_int(self.demotion_tokens) or self.demotion_tokens <= 0:
            raise ValueError(f"demotion_tokens must be a positive int, got {self.demotion_tokens!r}.")
        if self.hadamard_block is not None and not is_power_of_two_int(self.hadamard_block):
            raise ValueError(f"hadamard_block must be a power of two (dividing head_dim) or None, got "
                             f"{self.hadamard_block!r}.")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype}.")

    @property
    def group_block(self) -> int:
        """The body's length is a multiple of this: the token group of per-channel layouts (1 for per-token ones,
        whose body may end at any token, e.g. after a crop)."""
        blocks = [lay.group_size for lay in (self.key, self.value) if lay.axis == "channel"]
        return math.lcm(*blocks) if blocks else 1

    @property
    def demotion_block(self) -> int:
        """Tokens leave the recent window in multiples of this: whole token groups and ``demotion_tokens``."""
        return math.lcm(self.group_block, self.demotion_tokens)

    def with_overrides(self, **kw) -> LayerRecipe:
        return replace(self, **kw)


def default_demotion_tokens(recent_tokens: int) -> int:
    """OSCAR's tokens leave a window of ``recent_tokens`` this many at a time by default: 16 for the default
    256-token window, never more than a sixteenth of the window (which then holds at most ~6% more tokens), at
    least 1 (every token, as soon as it leaves: small windows)."""
    return max(1, min(16, recent_tokens // 16))
