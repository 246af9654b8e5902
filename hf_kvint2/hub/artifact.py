"""The artifact format (see :mod:`hf_kvint2.hub`): its constants, the checks of an artifact against a model, and
the conversion between a cache and ``(config.json dict, tensors)`` in both directions. No file or network I/O.

Over 400 lines because every check of untrusted ``config.json`` keys and tensor shapes lives here, next to the
format it checks (one place to read what an artifact may contain); file-level safety is :mod:`.safety`."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from ..model_config import QUANTIZED, layer_plan, model_shape
from ..recipes import GroupLayout
from ..settings import SETTING_BOUNDS, OscarCalibration, SettingsError
from ..transforms import check_orthogonal
from ..version import __version__
from . import safety
from .safety import ArtifactError

FORMAT_VERSION = 1
OSCAR_FORMAT = "hf_kvint2.oscar"
OSCAR_SCALED_FORMAT = "hf_kvint2.oscar_scaled"
CONFIG_NAME = "config.json"
TENSORS_NAME = "model.safetensors"
SHAPE_KEYS = ("num_layers", "num_key_value_heads", "head_dim")
ORTHOGONAL_ATOL = 1e-4
# What to do about a newer format or a damaged installation: hf_kvint2 is installed from its source (a clone, or a
# wheel built from it), not from PyPI.
UPDATE = ("update hf_kvint2 from the source you installed it from (it is not on PyPI): `git pull` and "
          "`pip install .` in its clone, or a wheel built from a newer clone")
REINSTALL = "reinstall hf_kvint2 from the source you installed it from (its clone, or a wheel built from it)"
# Names config.json holds that the model card renders and its usage snippet quotes: a Hub repo id ("org/name") or
# a local model folder, in these characters only (no quotes, spaces, backslashes or markup).
IDENTIFIER = re.compile(r"[A-Za-z0-9._~/-]{1,256}")
IDENTIFIER_RULE = "a Hub repo id such as 'org/name' (or a local model folder) of letters, digits and . _ - / ~"


def model_shape_from_config(config) -> dict:
    """``num_layers`` / ``num_key_value_heads`` / ``head_dim`` of a transformers config (text part)."""
    shape = model_shape(config)
    return {"num_layers": shape.num_layers, "num_key_value_heads": shape.num_key_value_heads,
            "head_dim": shape.head_dim}


def _describe(info: dict) -> str:
    name = info.get("source") or "the calibration artifact"
    base = f" (calibrated for {info['base_model']})" if info.get("base_model") else ""
    return f"{name}{base}"


def check_shape(info: dict, model: dict, where: str) -> None:
    """Raise if a recorded artifact shape differs from the model's (keys missing or None are not checked)."""
    for key in SHAPE_KEYS:
        want, got = info.get(key), model.get(key)
        if want is not None and got is not None and want != got:
            raise ArtifactError(
                f"{_describe(info)} has {key}={want}, but {where} has {key}={got}. This artifact was made for another "
                "model: load the artifact calibrated for this model, or calibrate it with OscarCache.calibrate(...).")


def _same_model_name(a: str, b: str) -> bool:
    # Local copies keep the repo's last path component; compare that, case-insensitively.
    return Path(str(a).rstrip("/")).name.lower() == Path(str(b).rstrip("/")).name.lower()


def check_layer_plan(info: dict, config, where: str) -> None:
    """Raise if the layers an artifact calibrates (``info["calibrated_layers"]``, when it records them) are not the
    layers the model quantizes (its full-attention layers, :func:`~hf_kvint2.model_config.layer_plan`): the
    calibration of the others would be dropped and the model's quantized layers run uncalibrated."""
    calibrated = info.get("calibrated_layers")
    if calibrated is None:
        return
    plan = layer_plan(config)
    quantized = [i for i, p in enumerate(plan) if p.storage == QUANTIZED]
    if list(calibrated) != quantized:
        windowed = [i for i, p in enumerate(plan) if p.storage != QUANTIZED]
        raise ArtifactError(
            f"{_describe(info)} calibrates layers {list(calibrated)}, but {where} quantizes layers {quantized} (its "
            f"full-attention layers; {windowed or 'none'} keep a sliding window in full precision). The artifact "
            "was calibrated for a model with another layer plan: its calibration would be dropped on some layers and "
            "missing on others. Load the artifact calibrated for this model, or calibrate it with "
            "OscarCache.calibrate(...).")


def check_config(info: dict, config) -> None:
    """Check an artifact against a transformers config: shapes and layer plans raise, a different base model only
    warns."""
    where = f"the model config ({type(config).__name__})"
    check_shape(info, model_shape_from_config(config), where)
    check_layer_plan(info, config, where)
    base, name = info.get("base_model"), getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", "")
    if base and name and not _same_model_name(base, name):
        warnings.warn(f"{info.get('source') or 'The calibration artifact'} was calibrated for {base!r} but the model "
                      f"is {name!r}. Shapes match, so it loads; quality may differ from the card if the weights "
                      "differ (fine-tunes usually transfer).", UserWarning, stacklevel=3)


def check_update(cache, key_states: torch.Tensor, layer_idx: int) -> None:
    """First-use validation, called by the cache on every ``update`` (a few integer compares).

    KV heads and head dim fail at the first update; the layer count as soon as it is known: a layer index beyond
    the artifact's layers fails at once, fewer layers fail when the next forward starts at layer 0.
    """
    info = cache.artifact_info
    shard = getattr(cache, "shard", None)  # tensor parallelism: this rank sees 1/world_size of the KV heads
    model = {"num_key_value_heads": key_states.shape[1] * (shard.world_size if shard is not None else 1),
             "head_dim": key_states.shape[-1]}
    if any(info.get(k) not in (None, v) for k, v in model.items()):
        check_shape(info, model, f"the model (key states of layer {layer_idx} have shape {tuple(key_states.shape)})")
    n = info.get("num_layers")
    if n is None:
        return
    seen = getattr(cache, "_artifact_layers_seen", 0)
    if layer_idx >= n or (layer_idx == 0 and 0 < seen < n):
        model_layers = f"at least {layer_idx + 1}" if layer_idx >= n else f"{seen} (its forward updated only these)"
        raise ArtifactError(
            f"{_describe(info)} has num_layers={n}, but the model has num_layers={model_layers}. This artifact was "
            "made for another model: load the artifact calibrated for this model, or calibrate it with "
            "OscarCache.calibrate(...).")
    cache._artifact_layers_seen = max(seen, layer_idx + 1)


def _encode_oscar(cache) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(config ``layers`` entry, tensors, shapes inferred from the tensors) of an :class:`OscarCache`."""
    calibration = cache.calibration
    per_layer = {name: None if getattr(calibration, name) is None else list(getattr(calibration, name))
                 for name in calibration.PER_LAYER}
    lengths = {name: len(v) for name, v in per_layer.items() if v is not None}
    if not lengths:
        return None, {}, {}
    if len(set(lengths.values())) > 1:
        raise ArtifactError(f"The per-layer lists of this cache differ in length ({lengths}); cannot save it.")
    n = next(iter(lengths.values()))
    tensors, layers, inferred = {}, [], {"num_layers": n}
    for i in range(n):
        entry = {"layout": per_layer["layout_names"][i] if per_layer["layout_names"] else None}
        pair = per_layer["layer_layouts"][i] if per_layer["layer_layouts"] else None
        for kind, short, side in (("key", "k", 0), ("value", "v", 1)):
            for part, listname in (("rotation", f"{short}_rotations"), ("eigenvalues", f"{short}_eigenvalues"),
                                   ("mean", f"{kind}_means")):
                t = per_layer[listname][i] if per_layer[listname] else None
                entry[f"{kind}_{part}"] = t is not None
                if t is not None:
                    # a copy: layers may share one tensor, and safetensors refuses tensors that share memory
                    tensors[f"layers.{i}.{kind}_{part}"] = t.detach().to("cpu", torch.float32, copy=True).contiguous()
                    if part == "rotation":
                        inferred["head_dim"] = t.shape[-1]
                    if part == "mean":
                        inferred["num_key_value_heads"], inferred["head_dim"] = t.shape[0], t.shape[-1]
            layout = pair[side] if pair is not None else None
            entry[f"{kind}_layout"] = _layout_to_json(layout)
        layers.append(entry)
    return layers, tensors, inferred


def _calibrated_layers_entry(cache) -> dict:
    """``{"calibrated_layers": [...]}`` when only some layers are calibrated (a hybrid model: the sliding-window
    layers are not quantized, so not calibrated); nothing when all or none are (older artifacts unchanged)."""
    layouts = getattr(getattr(cache, "calibration", None), "layer_layouts", None)
    if not layouts or all(p is not None for p in layouts):
        return {}
    return {"calibrated_layers": [i for i, p in enumerate(layouts) if p is not None]}


def _check_calibrated_layers(config: dict, n: int, where: str) -> list[int] | None:
    """The validated ``calibrated_layers`` of config.json (None when absent: all or none calibrated)."""
    listed = config.get("calibrated_layers")
    if listed is None:
        return None
    if not isinstance(listed, list) or not listed or \
            any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n for i in listed) or \
            listed != sorted(set(listed)):
        raise _fail(where, f"calibrated_layers must be a non-empty ascending list of distinct layer indices in "
                           f"[0, {n}) (the layers with a calibration), got {listed!r}.")
    return listed


def _model_shape_of(cache, inferred: dict) -> dict:
    """The shapes to record: from the model config, a loaded artifact, the calibration, tensors, live layers."""
    sources = []
    if getattr(cache, "config", None) is not None:
        sources.append(model_shape_from_config(cache.config))
    calibration = getattr(cache, "calibration", None)
    sources += [cache.artifact_info or {}, (calibration.info if calibration is not None else None) or {}, inferred]
    live = [layer for layer in cache.layers if getattr(layer, "is_initialized", False) and hasattr(layer, "head_dim")]
    if live:
        sources.append({"num_key_value_heads": live[0].num_heads, "head_dim": live[0].head_dim})
    shape = {}
    for key in SHAPE_KEYS:
        shape[key] = next((s[key] for s in sources if s.get(key) is not None), None)
    return shape


def artifact_payload(cache, *, base_model: str | None = None, base_model_revision: str | None = None,
                     quality: list[dict] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The ``config.json`` dict and the tensors of a cache (validated as the loader would)."""
    fmt = type(cache).artifact_format
    layers, tensors, inferred = _encode_oscar(cache) if fmt == OSCAR_FORMAT else (None, {}, {})
    calibration = cache.calibration.info if fmt == OSCAR_FORMAT else None
    loaded = cache.artifact_info or {}
    model_name = getattr(cache.config, "name_or_path", None) if getattr(cache, "config", None) is not None else None
    config = {
        "format": fmt,
        "format_version": FORMAT_VERSION,
        "hf_kvint2_version": __version__,
        "base_model": base_model or (calibration or {}).get("base_model") or loaded.get("base_model") or model_name
        or None,
        "base_model_revision": base_model_revision or (calibration or {}).get("base_model_revision")
        or loaded.get("base_model_revision"),
        **_model_shape_of(cache, inferred),
        "settings": cache.settings.to_dict(),
        "layers": layers,
        **_calibrated_layers_entry(cache),
        "calibration": calibration,
        "quality": quality if quality is not None else cache.quality,
    }
    try:
        json.dumps(config)
    except TypeError as e:
        raise ArtifactError(f"The cache's settings or calibration_info are not JSON-serialisable: {e}") from e
    decode_payload(type(cache), config, tensors, "the cache being saved")  # never write what cannot be loaded
    return config, tensors


def _fail(where: str, problem: str) -> ArtifactError:
    return ArtifactError(f"{where}: {problem}")


def _check_header(cls, config, where: str) -> None:
    if not isinstance(config, dict) or "format" not in config:
        raise _fail(where, "config.json has no 'format' key, so it is not an hf_kvint2 artifact. A transformers "
                           "model config? Pass the calibration's folder or subfolder. A reference OSCAR RotationZoo? "
                           "Use OscarCache.from_rotation_zoo(...).")
    fmt, version = config["format"], config.get("format_version")
    if not isinstance(fmt, str):
        raise _fail(where, f"'format' must be a string such as {cls.artifact_format!r}, got {fmt!r}.")
    if fmt != cls.artifact_format:
        other = {OSCAR_FORMAT: "OscarCache", OSCAR_SCALED_FORMAT: "OscarScaledCache"}.get(fmt)
        hint = f"load it with {other}.from_pretrained(...)" if other else "it is not an hf_kvint2 cache format"
        raise _fail(where, f"format is {fmt!r}, but {cls.__name__} reads {cls.artifact_format!r}: {hint}.")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _fail(where, f"unknown format_version {version!r} (this hf_kvint2 reads 1..{FORMAT_VERSION}).")
    if version > FORMAT_VERSION:
        raise _fail(where, f"format_version {version} is newer than this hf_kvint2 ({__version__}) reads "
                           f"({FORMAT_VERSION}); {UPDATE}.")
    for key, bound in zip(SHAPE_KEYS, (safety.MAX_LAYERS, safety.MAX_KV_HEADS, safety.MAX_HEAD_DIM)):
        v = config.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= bound):
            raise _fail(where, f"{key} must be a positive integer up to {bound} or null, got {v!r}.")


def expected_tensor_shapes(config: dict, model_config, where: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``config.json`` lists (what ``model.safetensors`` must hold), checked against
    the model's config first when given, so that nothing is loaded for another model."""
    if model_config is not None:
        info = {key: config.get(key) for key in SHAPE_KEYS}
        info.update(source=where, base_model=config.get("base_model"))
        check_shape(info, model_shape_from_config(model_config), f"the model config ({type(model_config).__name__})")
    layers = config.get("layers")
    n = config.get("num_layers")
    if not isinstance(layers, list) or n is None or len(layers) != n:
        raise _fail(where, f"config.json lists {len(layers) if isinstance(layers, list) else layers!r} layers but "
                           f"num_layers is {n}: layers are missing.")
    d, h = config.get("head_dim"), config.get("num_key_value_heads")
    shapes = {}
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict):
            raise _fail(f"{where}, layer {i}", f"layer entry must be an object, got {entry!r}.")
        for kind in ("key", "value"):
            for part, shape in (("rotation", (d, d)), ("eigenvalues", (d,)), ("mean", (h, d))):
                if _layer_has(entry, f"{kind}_{part}", i, where):
                    if None in shape:
                        raise _fail(f"{where}, layer {i}", f"has a {kind} {part} but config.json does not record "
                                                           "num_key_value_heads / head_dim.")
                    shapes[f"layers.{i}.{kind}_{part}"] = shape
    return shapes


def _tensor(tensors: dict, name: str, shape: tuple, where: str, used: set) -> torch.Tensor:
    if name not in tensors:
        raise _fail(where, f"tensor {name!r} is listed in config.json but missing from {TENSORS_NAME} (a truncated "
                           "or partial upload?).")
    t = tensors[name]
    used.add(name)
    if not t.is_floating_point():
        raise _fail(where, f"tensor {name!r} has dtype {t.dtype}; expected a floating-point tensor.")
    if tuple(t.shape) != shape:
        raise _fail(where, f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}.")
    if not torch.isfinite(t).all():
        raise _fail(where, f"tensor {name!r} contains NaN or Inf.")
    return t.float()


def _layer_has(entry: dict, key: str, i: int, where: str) -> bool:
    """Whether layer entry ``i`` of config.json lists tensor ``key`` (a JSON bool, or absent/null)."""
    v = entry.get(key)
    if v is not None and not isinstance(v, bool):
        raise _fail(where, f"config.json key layers[{i}].{key} must be true, false or null (whether "
                           f"{TENSORS_NAME} holds the tensor), got {v!r} ({type(v).__name__}).")
    return bool(v)


def _layout_to_json(layout: GroupLayout | None) -> dict | None:
    """A layout as config.json stores it; ``range_clip`` only where set, so that artifacts without it read the
    same in versions that predate it."""
    if layout is None:
        return None
    out = asdict(layout)
    if out["range_clip"] is None:
        del out["range_clip"]
    return out


def _layout_from_json(value, where: str) -> GroupLayout | None:
    if value is None:
        return None
    known = {f.name for f in fields(GroupLayout)}
    if not isinstance(value, dict) or set(value) - known:
        raise _fail(where, f"a layout must be an object with keys {sorted(known)}, got {value!r}.")
    group = value.get("group_size", 1)
    if isinstance(group, bool) or not isinstance(group, int) or not 0 < group <= SETTING_BOUNDS["group_size"]:
        # each K/V stream's group size (chosen per layer by the calibration's bits budget); the static caches
        # allocate per-channel blocks of this many tokens, so a huge value is a corrupt or hostile file
        raise _fail(where, f"a layout's group_size must be an integer in [1, {SETTING_BOUNDS['group_size']}] (the "
                           f"tokens or channels per quantization group), got {group!r}.")
    try:
        return GroupLayout(**value)
    except (TypeError, ValueError) as e:
        raise _fail(where, f"invalid layout {value!r}: {e}") from e


def _decode_oscar_layers(config: dict, tensors: dict, where: str) -> dict:
    """The :class:`OscarCalibration` fields stored in config ``layers`` + tensors."""
    layers = config.get("layers")
    if layers is None:
        if tensors:
            raise _fail(where, f"{TENSORS_NAME} holds tensors but config.json lists no layers.")
        return {}
    n, d, h = config.get("num_layers"), config.get("head_dim"), config.get("num_key_value_heads")
    if not isinstance(layers, list) or n is None or len(layers) != n:
        raise _fail(where, f"config.json lists {len(layers) if isinstance(layers, list) else layers!r} layers but "
                           f"num_layers is {n}: layers are missing.")
    lists = {k: [None] * n for k in ("k_rotations", "v_rotations", "k_eigenvalues", "v_eigenvalues",
                                     "key_means", "value_means")}
    layouts, names, used = [None] * n, [None] * n, set()
    calibrated = _check_calibrated_layers(config, n, f"{where}, {CONFIG_NAME}")
    for i, entry in enumerate(layers):
        at = f"{where}, layer {i}"
        if not isinstance(entry, dict):
            raise _fail(at, f"layer entry must be an object, got {entry!r}.")
        for kind, short in (("key", "k"), ("value", "v")):
            for part, listname, shape in (("rotation", f"{short}_rotations", (d, d)),
                                          ("eigenvalues", f"{short}_eigenvalues", (d,)),
                                          ("mean", f"{kind}_means", (h, d))):
                if not _layer_has(entry, f"{kind}_{part}", i, where):
                    continue
                if None in shape:
                    raise _fail(at, f"has a {kind} {part} but config.json does not record num_key_value_heads / "
                                    "head_dim.")
                t = _tensor(tensors, f"layers.{i}.{kind}_{part}", shape, at, used)
                if part == "rotation":
                    try:
                        check_orthogonal(t, f"tensor 'layers.{i}.{kind}_rotation'", atol=ORTHOGONAL_ATOL)
                    except ValueError as e:
                        raise _fail(at, f"{e} A rotation must be orthogonal (R R^T = I).") from e
                lists[listname][i] = t
        pair = tuple(_layout_from_json(entry.get(f"{kind}_layout"), f"{at}, {CONFIG_NAME} key layers[{i}].{kind}_layout")
                     for kind in ("key", "value"))
        if (pair[0] is None) != (pair[1] is None):
            raise _fail(at, "key_layout and value_layout must both be given or both be null.")
        name = entry.get("layout")
        if name is not None and not isinstance(name, str):
            raise _fail(at, f"config.json key layers[{i}].layout must be a string (the layout's name) or null, got "
                            f"{name!r} ({type(name).__name__}).")
        layouts[i], names[i] = (pair if pair[0] is not None else None), name
        if calibrated is not None:
            stored = pair[0] is not None or any(lists[listname][i] is not None for listname in lists)
            if i in calibrated and pair[0] is None:
                raise _fail(at, "is listed in calibrated_layers but has no calibrated layout.")
            if i not in calibrated and stored:
                raise _fail(at, "is not listed in calibrated_layers but has a calibrated layout or tensors; "
                                "calibrated_layers must name exactly the calibrated layers.")
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise _fail(where, f"{TENSORS_NAME} has tensors that config.json does not list: {unexpected[:5]}.")
    kwargs = {k: (v if any(t is not None for t in v) else None) for k, v in lists.items()
              if k in ("k_rotations", "v_rotations", "key_means", "value_means")}
    if any(p is not None for p in layouts):
        if calibrated is None and any(p is None for p in layouts):
            raise _fail(where, "some layers have calibrated layouts and some do not; give all or none, or list the "
                               "calibrated ones in calibrated_layers.")
        kwargs["layer_layouts"] = layouts
    kwargs.update(
        k_eigenvalues=lists["k_eigenvalues"] if any(t is not None for t in lists["k_eigenvalues"]) else None,
        v_eigenvalues=lists["v_eigenvalues"] if any(t is not None for t in lists["v_eigenvalues"]) else None,
        layout_names=names if any(x is not None for x in names) else None)
    return kwargs


def _apply_clip_override(layouts, key_clip, value_clip):
    """``k_clip`` / ``v_clip`` overrides also rewrite calibrated per-layer layouts (scalar or per-layer)."""
    def pick(v, i):
        return v[i] if isinstance(v, (list, tuple)) else v
    out = []
    for i, pair in enumerate(layouts):
        if pair is None:  # a layer not calibrated: its clips come from the settings (overridden there too)
            out.append(None)
            continue
        k, v = pair
        out.append((replace(k, clip=pick(key_clip, i)) if key_clip is not _UNSET else k,
                    replace(v, clip=pick(value_clip, i)) if value_clip is not _UNSET else v))
    return out


_UNSET = object()


def _check_clip(value, name: str, num_layers: int | None, where: str) -> None:
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and len(value) != num_layers:
        raise _fail(where, f"{name} lists {len(value)} clip ratios but num_layers is {num_layers}.")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0):
            raise _fail(where, f"{name} ratios must be numbers in (0, 1] or null, got {v!r}.")


# Top-level metadata keys of config.json and the JSON types they may have (None: absent or null).
_METADATA_TYPES = {"base_model": (str,), "base_model_revision": (str,), "quality": (list,), "calibration": (dict,),
                   "hf_kvint2_version": (str,)}


def _check_metadata_types(config: dict, where: str) -> None:
    """Types of the metadata, the identifiers the card quotes, and the card's quality rows (what a save writes
    back: an artifact that loads can be saved again)."""
    for key, types in _METADATA_TYPES.items():
        v = config.get(key)
        if v is not None and not isinstance(v, types):
            names = " or ".join({str: "a string", list: "a list", dict: "an object"}[t] for t in types)
            raise _fail(where, f"{key} must be {names} or null, got {v!r} ({type(v).__name__}).")
    for key in ("base_model", "base_model_revision"):
        v = config.get(key)
        if v is not None and not IDENTIFIER.fullmatch(v):
            raise _fail(where, f"{key} must be {IDENTIFIER_RULE} (no spaces, quotes or markup; the model card quotes "
                               f"it in Python code), got {v!a}. Fix it in config.json, or pass {key}=... to "
                               "save_pretrained.")
    for i, row in enumerate(config.get("quality") or ()):
        if not isinstance(row, dict):
            raise _fail(where, f"quality[{i}] must be an object (one row of the card's quality table, column -> "
                               f"value), got {row!r} ({type(row).__name__}).")


def _check_mean_range(fields: dict, scale_dtype, where: str) -> None:
    """A stored mean is subtracted from every K/V before quantization: one beyond half the scale dtype's range
    makes every update fail with an error about the K/V. Blame the artifact instead, at load."""
    dtype = scale_dtype if scale_dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
    limit = torch.finfo(dtype).max / 2
    for kind, name in (("key", "key_means"), ("value", "value_means")):
        for i, mean in enumerate(fields.get(name) or ()):
            if isinstance(mean, torch.Tensor) and mean.numel() and mean.abs().max().item() > limit:
                raise _fail(where, f"tensor 'layers.{i}.{kind}_mean' has values up to {mean.abs().max().item():.4g}, "
                                   f"beyond what scale_dtype={dtype} can hold once subtracted from the K/V (max "
                                   f"{limit:.4g}); the artifact is corrupt or not for this model. Re-calibrate it.")


def decode_payload(cls, config: dict, tensors: dict, where: str, overrides: dict | None = None,
                   model_config=None):
    """Build a ``cls`` cache from a validated artifact; ``overrides`` replace stored settings (and, for OSCAR,
    calibration fields)."""
    cfg = f"{where}, {CONFIG_NAME}"  # errors about a key of config.json name the file
    _check_header(cls, config, cfg)
    raw = config.get("settings", {})
    if not isinstance(raw, dict):
        raise _fail(cfg, f"'settings' must be an object, got {type(raw).__name__}.")
    for name in ("k_clip", "v_clip"):
        if name in raw:
            _check_clip(raw[name], name, config.get("num_layers"), cfg)
    _check_metadata_types(config, cfg)
    try:
        settings = cls.settings_type.from_dict(raw, version=config["format_version"], where=cfg)
    except SettingsError as e:
        raise ArtifactError(str(e)) from e
    fields = {}
    if cls.artifact_format == OSCAR_FORMAT:
        fields = _decode_oscar_layers(config, tensors, where)
    elif tensors:
        raise _fail(where, f"an {cls.__name__} artifact has no tensors, but {TENSORS_NAME} holds {len(tensors)}.")
    overrides = dict(overrides or {})
    calibration_names = set(OscarCalibration.PER_LAYER) if cls.artifact_format == OSCAR_FORMAT else set()
    valid = cls.settings_type.field_names() | calibration_names
    unknown = set(overrides) - valid
    if unknown:
        raise TypeError(f"{cls.__name__}.from_pretrained got unknown settings {sorted(unknown)}; "
                        f"valid overrides: {sorted(valid)}.")
    if fields.get("layer_layouts") is not None and ("k_clip" in overrides or "v_clip" in overrides):
        fields["layer_layouts"] = _apply_clip_override(fields["layer_layouts"], overrides.get("k_clip", _UNSET),
                                                       overrides.get("v_clip", _UNSET))
    fields.update({k: v for k, v in overrides.items() if k in calibration_names})
    _check_mean_range(fields, overrides.get("scale_dtype", settings.scale_dtype), where)
    info = {key: config.get(key) for key in SHAPE_KEYS}
    layouts = fields.get("layer_layouts")
    info.update(source=where, base_model=config.get("base_model"), base_model_revision=config.get(
        "base_model_revision"), calibrated_layers=None if layouts is None else [
            i for i, pair in enumerate(layouts) if pair is not None])
    if model_config is not None:
        check_config(info, model_config)
    extra = {}
    try:
        settings = settings.replace(**{k: v for k, v in overrides.items() if k not in calibration_names})
        if cls.artifact_format == OSCAR_FORMAT:
            extra["calibration"] = OscarCalibration(**fields, info=config.get("calibration"))
        return cls(config=model_config, settings=settings, artifact_info=info, quality=config.get("quality"),
                   **extra)
    except (TypeError, ValueError) as e:
        raise _fail(where, f"its settings are invalid for {cls.__name__}: {e}") from e
