"""Typed settings of the two caches: frozen dataclasses with their defaults, one validation, and the versioned
dict form the Hub format stores (``settings`` in an artifact's ``config.json``).

* :class:`OscarScaledSettings` - ``OscarScaledCache``: windows, group sizes, Hadamard block, token scaling.
* :class:`OscarSettings` - ``OscarCache``: windows, group size, clip ratios (one or one per layer).
* :class:`OscarCalibration` - what ``OscarCache.calibrate`` fits per layer (rotations, means, layouts, ...).

Each default is written once, in these dataclasses: the layer recipes are built from them (:meth:`OscarSettings.recipe`,
:meth:`OscarScaledSettings.recipe`, :func:`oscar_recipe`, :func:`oscar_scaled_recipe`), the calibration reads its
windows and reference clips from :data:`OSCAR_DEFAULTS`, and the baselines the quality benchmark compares
(:func:`kivi2_recipe`, :func:`hadamard_only_recipe`, :func:`naive_int2_recipe`) are recipes of the same layer.

Validation lives in :func:`validate` (called by every constructor): each field declares its kind in
``field(metadata={"kind": ...})`` and a value of another type is refused with an error that names the setting and
the expected type (a string ``"false"`` for a bool, ``True`` for a group size). :meth:`to_dict` gives JSON
values (dtypes as names); :meth:`from_dict` reads the dict of any format version up to
:data:`SETTINGS_VERSION`, refusing unknown keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .quant import SCALE_DTYPES
from .recipes import GroupLayout, LayerRecipe, default_demotion_tokens, is_power_of_two_int
from .transforms import hadamard_matrix

SETTINGS_VERSION = 1  # the artifact format_version whose settings dict to_dict writes
SCALE_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# What a sliding-window layer may store its window in (sliding_window_dtype; None: the K/V dtype).
WINDOW_DTYPES = SCALE_DTYPES  # the same three dtypes the scales may use


class SettingsError(ValueError):
    """A setting of the wrong type or out of range."""


# ---------------------------------------------------------------------------------------------- kinds
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ratio(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and 0.0 < v <= 1.0


KINDS = {  # kind -> (check, what the error says is expected)
    "non_negative_int": (lambda v: _is_int(v) and v >= 0, "a non-negative int"),
    "positive_int": (lambda v: _is_int(v) and v > 0, "a positive int"),
    "optional_positive_int": (lambda v: v is None or (_is_int(v) and v > 0), "a positive int or None"),
    "optional_power_of_two": (lambda v: v is None or is_power_of_two_int(v), "a power of two or None"),
    "bool": (lambda v: isinstance(v, bool), "a bool (True or False)"),
    "scale_dtype": (lambda v: v in SCALE_DTYPES, f"one of {SCALE_DTYPES}"),
    "window_dtype": (lambda v: v is None or v in WINDOW_DTYPES, f"None or one of {WINDOW_DTYPES}"),
    "clip": (lambda v: v is None or _is_ratio(v) or (isinstance(v, tuple) and len(v) > 0 and all(
        x is None or _is_ratio(x) for x in v)), "a clip ratio in (0, 1], None, or a per-layer sequence of them"),
}


# Integer settings and the largest value a stored artifact may set (a window or group this large is a corrupt or
# hostile file: the static caches allocate them). Settings passed in Python are not bounded here.
MAX_HEAD_DIM = 2048  # hub.safety.MAX_HEAD_DIM: the largest head_dim an artifact may declare
SETTING_BOUNDS = {"sink_tokens": 1 << 20, "recent_tokens": 1 << 20, "group_size": 1 << 16,
                  "key_group_size": 1 << 16, "value_group_size": 1 << 16, "hadamard_block": MAX_HEAD_DIM,
                  "demotion_tokens": 1 << 16}
_OPTIONAL = ("key_group_size", "value_group_size", "hadamard_block", "demotion_tokens")


def check_setting_bounds(values: dict, where: str) -> None:
    """Stored integer settings must be integers within :data:`SETTING_BOUNDS` (``None`` where optional)."""
    for key, bound in SETTING_BOUNDS.items():
        if key not in values or (values[key] is None and key in _OPTIONAL):
            continue
        v = values[key]
        if not _is_int(v) or not 0 <= v <= bound:
            raise SettingsError(f"{where}: settings.{key} must be an integer in [0, {bound}]"
                                f"{' or null' if key in _OPTIONAL else ''}, got {v!r}. Fix config.json or "
                                f"override it: from_pretrained(..., {key}=...).")


def validate(settings) -> None:
    """Check every field of a settings dataclass against its declared kind (the one place settings are checked)."""
    name = type(settings).__name__
    for f in dataclasses.fields(settings):
        kind = f.metadata.get("kind")
        if kind is None:
            continue
        check, expected = KINDS[kind]
        value = getattr(settings, f.name)
        if not check(value):
            raise SettingsError(f"{name}: {f.name} must be {expected}, got {value!r} ({type(value).__name__}).")


class _Settings:
    """Shared behaviour of the settings dataclasses (frozen; validated on construction)."""

    def __post_init__(self):
        validate(self)

    def replace(self, **changes) -> _Settings:
        """A copy with ``changes`` (validated); unknown names are refused."""
        unknown = set(changes) - self.field_names()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no settings {sorted(unknown)}; valid: "
                            f"{sorted(self.field_names())}.")
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """JSON values (dtypes by name, per-layer clips as lists), in the current :data:`SETTINGS_VERSION`."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif f.metadata.get("kind") == "clip" and value is not None:  # ratios as floats, per-layer as a list
                value = [None if v is None else float(v) for v in value] if isinstance(value, tuple) else float(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict, version: int = SETTINGS_VERSION, where: str = "settings"):
        """Settings from :meth:`to_dict` output of format ``version`` (1: the current form); missing keys take
        their defaults, unknown keys and wrong types are refused with an error naming the key."""
        if not isinstance(data, dict):
            raise SettingsError(f"{where}: 'settings' must be an object, got {type(data).__name__}.")
        if not (_is_int(version) and 1 <= version <= SETTINGS_VERSION):
            raise SettingsError(f"{where}: settings version {version!r} is not one this hf_kvint2 reads "
                                f"(1..{SETTINGS_VERSION}).")
        unknown = set(data) - cls.field_names()
        if unknown:
            raise SettingsError(f"{where}: unknown settings {sorted(unknown)} for {cls.__name__} (known: "
                                f"{sorted(cls.field_names())}); was it written by a newer hf_kvint2?")
        values = dict(data)
        check_setting_bounds(values, where)
        for name, optional in (("scale_dtype", False), ("sliding_window_dtype", True)):
            if name not in values or (optional and values[name] is None):
                continue
            if not isinstance(values[name], str) or values[name] not in SCALE_DTYPE_NAMES:
                raise SettingsError(f"{where}: {name} {values[name]!r} is not one of {sorted(SCALE_DTYPE_NAMES)}"
                                    f"{' or null' if optional else ''}.")
            values[name] = SCALE_DTYPE_NAMES[values[name]]
        for name in ("k_clip", "v_clip"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except SettingsError as e:
            raise SettingsError(f"{where}: {e}") from e


# ---------------------------------------------------------------------------------------------- the caches
@dataclass(frozen=True)
class OscarScaledSettings(_Settings):
    """OScaR: block Hadamard rotation, keys per channel over token groups with omni-token scaling (both
    dropped by keys that settle in the model's basis, hf_kvint2.key_basis), values per token over channel groups, a
    full-precision recent window, and a 64-token full-precision sink (not in the paper, whose recipe is
    ``sink_tokens=0``: the first tokens of models with attention sinks are read with large weights; docs/design.md).
    ``key_group_size`` / ``value_group_size`` default to ``group_size``; ``hadamard_block``
    to the largest power of two dividing head_dim. ``sliding_window_dtype``: the dtype sliding-window layers store
    their window in (None: the K/V dtype; :class:`~hf_kvint2.window_layer.WindowLayer`)."""

    sink_tokens: int = field(default=64, metadata={"kind": "non_negative_int"})
    recent_tokens: int = field(default=128, metadata={"kind": "non_negative_int"})
    group_size: int = field(default=32, metadata={"kind": "positive_int"})
    key_group_size: int | None = field(default=None, metadata={"kind": "optional_positive_int"})
    value_group_size: int | None = field(default=None, metadata={"kind": "optional_positive_int"})
    hadamard_block: int | None = field(default=None, metadata={"kind": "optional_power_of_two"})
    token_scaling: bool = field(default=True, metadata={"kind": "bool"})
    scale_dtype: torch.dtype = field(default=torch.float16, metadata={"kind": "scale_dtype"})
    sliding_window_dtype: torch.dtype | None = field(default=None, metadata={"kind": "window_dtype"})

    def recipe(self) -> LayerRecipe:
        """The layer recipe: block Hadamard, keys per channel over token groups (with omni-token scaling), values
        per token over channel groups, a full-precision sink and residual flushed in whole blocks. Data-free."""
        return LayerRecipe(
            key=GroupLayout("channel", self.key_group_size or self.group_size, None, self.token_scaling),
            value=GroupLayout("token", self.value_group_size or self.group_size, None, False),
            sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens, scale_dtype=self.scale_dtype,
            hadamard_block=self.hadamard_block, method="oscar_scaled")


@dataclass(frozen=True)
class OscarSettings(_Settings):
    """OSCAR: windows, the per-token group size (capped at head_dim) and the clip ratios of keys and
    values (one ratio, None for no clipping, or one per layer). ``sliding_window_dtype``: the dtype
    sliding-window layers store their window in (None: the K/V dtype; :class:`~hf_kvint2.window_layer.WindowLayer`).
    ``demotion_tokens``: tokens leave the recent window this many at a time (it holds ``recent_tokens`` to
    ``recent_tokens + demotion_tokens - 1`` tokens), so a decode step pays a demotion's fixed cost once per
    ``demotion_tokens`` steps; 1 demotes every token as soon as it leaves the window; None (the default):
    ``recent_tokens // 16`` between 1 and 16 (:func:`~hf_kvint2.recipes.default_demotion_tokens`: 16 for the
    default window)."""

    k_clip: float | tuple[float | None, ...] | None = field(default=0.96, metadata={"kind": "clip"})
    v_clip: float | tuple[float | None, ...] | None = field(default=0.92, metadata={"kind": "clip"})
    sink_tokens: int = field(default=64, metadata={"kind": "non_negative_int"})
    recent_tokens: int = field(default=256, metadata={"kind": "non_negative_int"})
    group_size: int = field(default=128, metadata={"kind": "positive_int"})
    scale_dtype: torch.dtype = field(default=torch.float16, metadata={"kind": "scale_dtype"})
    sliding_window_dtype: torch.dtype | None = field(default=None, metadata={"kind": "window_dtype"})
    demotion_tokens: int | None = field(default=None, metadata={"kind": "optional_positive_int"})

    def __post_init__(self):
        for name in ("k_clip", "v_clip"):  # a per-layer list is stored as a tuple (frozen, hashable)
            value = getattr(self, name)
            if isinstance(value, Sequence) and not isinstance(value, (str, bytes, tuple)):
                object.__setattr__(self, name, tuple(value))
        super().__post_init__()

    def recipe(self, layer_idx: int = 0, *, key_rotation: torch.Tensor | None = None,
               value_rotation: torch.Tensor | None = None, key_mean: torch.Tensor | None = None,
               value_mean: torch.Tensor | None = None, key_layout: GroupLayout | None = None,
               value_layout: GroupLayout | None = None) -> LayerRecipe:
        """The recipe of layer ``layer_idx``: the rotations (None: Hadamard) and means given, row clipping (this
        layer's clips), per-token INT2 over ``min(group_size, d)`` channels unless a calibrated layout is given,
        full-precision sink and recent windows; tokens leave the recent window ``demotion_tokens`` at a time."""
        demotion = default_demotion_tokens(self.recent_tokens) if self.demotion_tokens is None else self.demotion_tokens
        return LayerRecipe(
            key=key_layout or GroupLayout("token", self.group_size, self.clip_for("k_clip", layer_idx), False),
            value=value_layout or GroupLayout("token", self.group_size, self.clip_for("v_clip", layer_idx), False),
            sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens, scale_dtype=self.scale_dtype,
            key_rotation=key_rotation, value_rotation=value_rotation, key_mean=key_mean, value_mean=value_mean,
            method="oscar", demotion_tokens=demotion)

    def clip_for(self, name: str, layer_idx: int) -> float | None:
        value = getattr(self, name)
        if isinstance(value, tuple):
            if layer_idx >= len(value):
                raise ValueError(f"{name} has {len(value)} entries but the model has a layer {layer_idx}: the "
                                 "calibration does not match this model's layer count.")
            return value[layer_idx]
        return value


# What one entry of an OscarCalibration per-layer list is (None: that layer has none): a tensor of that many
# dimensions, or a string.
_CALIBRATION_ENTRIES = {
    "k_rotations": (2, "a [head_dim, head_dim] tensor"), "v_rotations": (2, "a [head_dim, head_dim] tensor"),
    "key_means": (2, "a [kv_heads, head_dim] tensor"), "value_means": (2, "a [kv_heads, head_dim] tensor"),
    "k_eigenvalues": (1, "a [head_dim] tensor"), "v_eigenvalues": (1, "a [head_dim] tensor"),
    "layout_names": (str, "a string")}


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class OscarCalibration:
    """What calibration fits per layer (entries may be None: Hadamard rotation, not centred, default layout).

    k_rotations / v_rotations ``[d, d]`` orthogonal, key_means / value_means ``[kv_heads, d]``, layer_layouts
    ``(key GroupLayout, value GroupLayout)`` pairs, k_eigenvalues / v_eigenvalues ``[d]`` (provenance for the
    card), layout_names (strings), info (a JSON-able description: data, token count, ...)."""

    k_rotations: tuple | None = None
    v_rotations: tuple | None = None
    key_means: tuple | None = None
    value_means: tuple | None = None
    layer_layouts: tuple | None = None
    k_eigenvalues: tuple | None = None
    v_eigenvalues: tuple | None = None
    layout_names: tuple | None = None
    info: dict | None = None

    PER_LAYER = ("k_rotations", "v_rotations", "key_means", "value_means", "layer_layouts", "k_eigenvalues",
                 "v_eigenvalues", "layout_names")

    def __post_init__(self):
        for name in self.PER_LAYER:
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
                    raise SettingsError(f"OscarCalibration: {name} must be a per-layer sequence or None, got "
                                        f"{type(value).__name__}.")
                object.__setattr__(self, name, tuple(value))
        for name, (kind, expected) in _CALIBRATION_ENTRIES.items():
            for i, entry in enumerate(getattr(self, name) or ()):
                ok = entry is None or (isinstance(entry, str) if kind is str else
                                       isinstance(entry, torch.Tensor) and entry.dim() == kind)
                if not ok:  # a nested list for a rotation would fail at the first update, far from its cause
                    shape = f" of shape {tuple(entry.shape)}" if isinstance(entry, torch.Tensor) else ""
                    raise SettingsError(f"OscarCalibration: {name}[{i}] must be {expected} or None, got "
                                        f"{type(entry).__name__}{shape}.")
        for pair in self.layer_layouts or ():
            if pair is not None and not (len(pair) == 2 and all(isinstance(x, GroupLayout) for x in pair)):
                raise SettingsError(f"OscarCalibration: layer_layouts entries must be (key GroupLayout, value "
                                    f"GroupLayout) pairs, got {pair!r}.")

    @property
    def calibrated(self) -> bool:
        return self.k_rotations is not None

    def num_layers(self) -> int | None:
        lengths = {len(getattr(self, n)) for n in self.PER_LAYER if getattr(self, n) is not None}
        return next(iter(lengths)) if len(lengths) == 1 else (None if not lengths else max(lengths))

    def check_layers(self, num_layers: int) -> None:
        for name in ("k_rotations", "v_rotations", "key_means", "value_means", "layer_layouts"):
            seq = getattr(self, name)
            if seq is not None and len(seq) != num_layers:
                raise ValueError(f"{name} has {len(seq)} entries but the model has {num_layers} layers: the "
                                 "calibration does not match this model.")

    def entry(self, name: str, layer_idx: int):
        seq = getattr(self, name)
        if seq is None:
            return None
        if layer_idx >= len(seq):
            raise ValueError(f"{name} has {len(seq)} entries but the model has a layer {layer_idx}: the "
                             "calibration does not match this model's layer count.")
        return seq[layer_idx]


def oscar_layer_recipe(settings: OscarSettings, calibration: OscarCalibration, layer_idx: int) -> LayerRecipe:
    """The recipe of one layer of an ``OscarCache``."""
    layouts = calibration.entry("layer_layouts", layer_idx) or (None, None)
    return settings.recipe(
        layer_idx, key_rotation=calibration.entry("k_rotations", layer_idx),
        value_rotation=calibration.entry("v_rotations", layer_idx), key_mean=calibration.entry("key_means", layer_idx),
        value_mean=calibration.entry("value_means", layer_idx), key_layout=layouts[0], value_layout=layouts[1])


OSCAR_DEFAULTS = OscarSettings()  # OSCAR's defaults: the calibration's windows, group size and reference clips


# ---------------------------------------------------------------------------------------------- recipes
def oscar_recipe(*, key_rotation: torch.Tensor | None = None, value_rotation: torch.Tensor | None = None,
                 key_mean: torch.Tensor | None = None, value_mean: torch.Tensor | None = None,
                 key_layout: GroupLayout | None = None, value_layout: GroupLayout | None = None,
                 **settings) -> LayerRecipe:
    """OSCAR's layer recipe: :class:`OscarSettings` fields as keywords (its defaults for the rest), with these
    rotations (None: Hadamard), means and layouts (:meth:`OscarSettings.recipe`)."""
    return OscarSettings(**settings).recipe(key_rotation=key_rotation, value_rotation=value_rotation,
                                            key_mean=key_mean, value_mean=value_mean, key_layout=key_layout,
                                            value_layout=value_layout)


def oscar_scaled_recipe(**settings) -> LayerRecipe:
    """OScaR's layer recipe: :class:`OscarScaledSettings` fields as keywords (its defaults for the rest)."""
    return OscarScaledSettings(**settings).recipe()


def kivi2_recipe(head_dim: int) -> LayerRecipe:
    """KIVI-2 on this engine: no rotation, keys per channel over 32-token groups, values per token over 32
    channels, a 128-token full-precision residual flushed in 32-token blocks, no sink, no clipping."""
    eye = torch.eye(head_dim)
    return LayerRecipe(key=GroupLayout("channel", 32), value=GroupLayout("token", 32), sink_tokens=0,
                       recent_tokens=128, key_rotation=eye, value_rotation=eye)


def hadamard_only_recipe(head_dim: int) -> LayerRecipe:
    """Hadamard-only INT2 (QuaRot-style) whatever the keys look like: OSCAR's defaults with the normalised Hadamard
    on keys and values given explicitly, so that the uncalibrated cache's key-basis choice (hf_kvint2.key_basis:
    the model basis with per-channel groups for very uneven keys, e.g. Gemma 3's full-attention layers) never
    applies."""
    return oscar_recipe(key_rotation=hadamard_matrix(head_dim), value_rotation=hadamard_matrix(head_dim))


def naive_int2_recipe(head_dim: int) -> LayerRecipe:
    """Per-token INT2 without rotation or clipping, with OSCAR's windows and group size."""
    eye = torch.eye(head_dim)
    return oscar_recipe(key_rotation=eye, value_rotation=eye, k_clip=None, v_clip=None)


__all__ = ["OSCAR_DEFAULTS", "SETTINGS_VERSION", "OscarCalibration", "OscarScaledSettings", "OscarSettings",
           "SettingsError", "hadamard_only_recipe", "kivi2_recipe", "naive_int2_recipe", "oscar_layer_recipe",
           "oscar_recipe", "oscar_scaled_recipe", "validate"]
