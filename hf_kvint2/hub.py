"""Calibration artifacts (SPEC 6): the on-disk format, save / load / push through ``huggingface_hub``, validation
against the model, the reference OSCAR RotationZoo import, and the registry of artifacts shipped in the package.

An artifact is a folder (a Hub repo, a ``subfolder`` of a model repo, or a local directory) with:

- ``config.json``: ``format`` (``"hf_kvint2.oscar"`` or ``"hf_kvint2.oscar_scaled"``), ``format_version``,
  ``base_model`` / ``base_model_revision``, the model shapes ``num_layers`` / ``num_key_value_heads`` /
  ``head_dim`` (null: not recorded, any model), ``settings`` (the cache's keyword arguments: windows, group size,
  scale dtype, ``k_clip`` / ``v_clip`` as a number or a per-layer list), ``layers`` (OSCAR: one entry per layer
  saying which tensors exist and, when calibration chose them, the key/value :class:`GroupLayout` and the layout
  name), ``calibration`` (free-form description: data, token count, ...) and ``quality`` (rows of the card table).
- ``model.safetensors`` (OSCAR with calibrated tensors only): ``layers.<i>.key_rotation`` / ``value_rotation``
  ``[d, d]`` float32 orthogonal (applied as ``x @ R``), ``layers.<i>.key_eigenvalues`` / ``value_eigenvalues``
  ``[d]``, ``layers.<i>.key_mean`` / ``value_mean`` ``[kv_heads, d]``. Never pickle.
- ``README.md``: the model card rendered from ``model_cards/oscar_artifact.md``.

What a calibrated :class:`~hf_kvint2.OscarCache` must carry to be saved (set by ``OscarCache.calibrate``): the
constructor's per-layer lists ``k_rotations``, ``v_rotations``, ``key_means``, ``value_means``, ``layer_layouts``
(entries may be ``None`` for "Hadamard" / "not centred"), ``settings["k_clip"]`` / ``["v_clip"]``, and the
optional attributes ``k_eigenvalues`` / ``v_eigenvalues`` (per-layer ``[d]`` tensors or ``None``),
``layout_names`` (per-layer strings) and ``calibration_info`` (a JSON-able dict; the keys ``base_model``,
``base_model_revision``, ``num_layers``, ``num_key_value_heads``, ``head_dim`` are read when present, ``data``
and ``num_tokens`` are shown on the card).

Loading checks everything it reads (format, version, shapes, finiteness, orthogonality, missing or unexpected
tensors) and records the model shapes; the cache compares them with the model at its first ``update`` (and with
``config`` when given to ``from_pretrained``), raising an error that names both sides. A different base model
name only warns: local copies and fine-tunes have other names.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import pickle
import tempfile
import warnings
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from .recipes import GroupLayout
from .transforms import check_orthogonal

FORMAT_VERSION = 1
OSCAR_FORMAT = "hf_kvint2.oscar"
OSCAR_SCALED_FORMAT = "hf_kvint2.oscar_scaled"
CONFIG_NAME = "config.json"
TENSORS_NAME = "model.safetensors"
CARD_NAME = "README.md"
CARD_TEMPLATE = "oscar_artifact.md"

# Artifacts shipped inside the package (package data): ``OscarCache.from_pretrained(<id>)`` loads them from here
# without touching the network (unless a ``revision`` is asked for). Each folder holds config.json +
# model.safetensors + README.md written by ``save_pretrained``.
EMBEDDED_ARTIFACTS_DIR = Path(__file__).parent / "artifacts"
SMOLLM2_ARTIFACT_ID = "hf-kvint2/SmolLM2-135M-Instruct-oscar"
# The calibration of SmolLM2-135M-Instruct on Pride and Prejudice: written with
# ``cache.save_pretrained(SMOLLM2_ARTIFACT_DIR)`` by calibration_scripts/calibrate_oscar.py.
SMOLLM2_ARTIFACT_DIR = EMBEDDED_ARTIFACTS_DIR / "SmolLM2-135M-Instruct-oscar"
EMBEDDED_ARTIFACTS = {SMOLLM2_ARTIFACT_ID: SMOLLM2_ARTIFACT_DIR}

# The reference RotationZoo's default file names (``{k,v}_rotation_<method>.pt``).
ZOO_K_METHOD = "qqt_r_h_pbr"
ZOO_V_METHOD = "sst_r_h_pbr"

SHAPE_KEYS = ("num_layers", "num_key_value_heads", "head_dim")
_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_ORTHOGONAL_ATOL = 1e-4


class ArtifactError(ValueError):
    """A calibration artifact that is malformed, hostile, or made for another model."""


# ---------------------------------------------------------------------------------------------- model shapes
def model_shape_from_config(config) -> dict:
    """``num_layers`` / ``num_key_value_heads`` / ``head_dim`` of a transformers config (text part)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {"num_layers": text.num_hidden_layers, "num_key_value_heads": kv_heads, "head_dim": head_dim}


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


def check_config(info: dict, config) -> None:
    """Check an artifact against a transformers config: shapes raise, a different base model only warns."""
    check_shape(info, model_shape_from_config(config), f"the model config ({type(config).__name__})")
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


# ---------------------------------------------------------------------------------------------- encoding
def _json_clip(value):
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    return [None if v is None else float(v) for v in value]


def _settings_to_json(settings: dict) -> dict:
    out = {}
    for key, value in settings.items():
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        elif key in ("k_clip", "v_clip"):
            value = _json_clip(value)
        out[key] = value
    return out


def _layers_list(cache, name: str):
    value = getattr(cache, name, None)
    return None if value is None else list(value)


def _encode_oscar(cache) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(config ``layers`` entry, tensors, shapes inferred from the tensors) of an :class:`OscarCache`."""
    per_layer = {name: _layers_list(cache, name) for name in (
        "k_rotations", "v_rotations", "k_eigenvalues", "v_eigenvalues", "key_means", "value_means",
        "layer_layouts", "layout_names")}
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
                    tensors[f"layers.{i}.{kind}_{part}"] = t.detach().to("cpu", torch.float32).contiguous()
                    if part == "rotation":
                        inferred["head_dim"] = t.shape[-1]
                    if part == "mean":
                        inferred["num_key_value_heads"], inferred["head_dim"] = t.shape[0], t.shape[-1]
            layout = pair[side] if pair is not None else None
            entry[f"{kind}_layout"] = asdict(layout) if layout is not None else None
        layers.append(entry)
    return layers, tensors, inferred


def _model_shape_of(cache, inferred: dict) -> dict:
    """The shapes to record: from the model config, a loaded artifact, the calibration, tensors, live layers."""
    sources = []
    if getattr(cache, "config", None) is not None:
        sources.append(model_shape_from_config(cache.config))
    sources += [cache.artifact_info or {}, getattr(cache, "calibration_info", None) or {}, inferred]
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
    from . import __version__

    fmt = type(cache).artifact_format
    layers, tensors, inferred = _encode_oscar(cache) if fmt == OSCAR_FORMAT else (None, {}, {})
    calibration = getattr(cache, "calibration_info", None)
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
        "settings": _settings_to_json(cache.settings),
        "layers": layers,
        "calibration": calibration,
        "quality": quality if quality is not None else getattr(cache, "quality", None),
    }
    try:
        json.dumps(config)
    except TypeError as e:
        raise ArtifactError(f"The cache's settings or calibration_info are not JSON-serialisable: {e}") from e
    decode_payload(type(cache), config, tensors, "the cache being saved")  # never write what cannot be loaded
    return config, tensors


# ---------------------------------------------------------------------------------------------- decoding
def _fail(where: str, problem: str) -> ArtifactError:
    return ArtifactError(f"{where}: {problem}")


def _check_header(cls, config, where: str) -> None:
    if not isinstance(config, dict) or "format" not in config:
        raise _fail(where, "config.json has no 'format' key, so it is not an hf_kvint2 artifact. A transformers "
                           "model config? Pass the calibration's folder or subfolder. A reference OSCAR RotationZoo? "
                           "Use OscarCache.from_rotation_zoo(...).")
    fmt, version = config["format"], config.get("format_version")
    if fmt != cls.artifact_format:
        other = {OSCAR_FORMAT: "OscarCache", OSCAR_SCALED_FORMAT: "OscarScaledCache"}.get(fmt)
        hint = f"load it with {other}.from_pretrained(...)" if other else "it is not an hf_kvint2 cache format"
        raise _fail(where, f"format is {fmt!r}, but {cls.__name__} reads {cls.artifact_format!r}: {hint}.")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _fail(where, f"unknown format_version {version!r} (this hf_kvint2 reads 1..{FORMAT_VERSION}).")
    if version > FORMAT_VERSION:
        raise _fail(where, f"format_version {version} is newer than this hf_kvint2 reads ({FORMAT_VERSION}); "
                           "upgrade it: pip install -U hf-kvint2.")
    for key in SHAPE_KEYS:
        v = config.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise _fail(where, f"{key} must be a positive integer or null, got {v!r}.")


def _init_params(cls) -> set[str]:
    return {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "config")}


def _settings_from_json(cls, settings, where: str) -> dict:
    if not isinstance(settings, dict):
        raise _fail(where, f"'settings' must be an object, got {type(settings).__name__}.")
    unknown = set(settings) - _init_params(cls)
    if unknown:
        raise _fail(where, f"unknown settings {sorted(unknown)} for {cls.__name__} (known: "
                           f"{sorted(_init_params(cls))}); was it written by a newer hf_kvint2?")
    out = dict(settings)
    if "scale_dtype" in out:
        if out["scale_dtype"] not in _SCALE_DTYPES:
            raise _fail(where, f"scale_dtype {out['scale_dtype']!r} is not one of {sorted(_SCALE_DTYPES)}.")
        out["scale_dtype"] = _SCALE_DTYPES[out["scale_dtype"]]
    return out


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


def _layout_from_json(value, where: str) -> GroupLayout | None:
    if value is None:
        return None
    known = {f.name for f in fields(GroupLayout)}
    if not isinstance(value, dict) or set(value) - known:
        raise _fail(where, f"a layout must be an object with keys {sorted(known)}, got {value!r}.")
    try:
        return GroupLayout(**value)
    except (TypeError, ValueError) as e:
        raise _fail(where, f"invalid layout {value!r}: {e}") from e


def _decode_oscar_layers(config: dict, tensors: dict, where: str) -> tuple[dict, dict]:
    """Per-layer constructor lists and extra attributes from config ``layers`` + tensors."""
    layers = config.get("layers")
    if layers is None:
        if tensors:
            raise _fail(where, f"{TENSORS_NAME} holds tensors but config.json lists no layers.")
        return {}, {}
    n, d, h = config.get("num_layers"), config.get("head_dim"), config.get("num_key_value_heads")
    if not isinstance(layers, list) or n is None or len(layers) != n:
        raise _fail(where, f"config.json lists {len(layers) if isinstance(layers, list) else layers!r} layers but "
                           f"num_layers is {n}: layers are missing.")
    lists = {k: [None] * n for k in ("k_rotations", "v_rotations", "k_eigenvalues", "v_eigenvalues",
                                     "key_means", "value_means")}
    layouts, names, used = [None] * n, [None] * n, set()
    for i, entry in enumerate(layers):
        at = f"{where}, layer {i}"
        if not isinstance(entry, dict):
            raise _fail(at, f"layer entry must be an object, got {entry!r}.")
        for kind, short in (("key", "k"), ("value", "v")):
            for part, listname, shape in (("rotation", f"{short}_rotations", (d, d)),
                                          ("eigenvalues", f"{short}_eigenvalues", (d,)),
                                          ("mean", f"{kind}_means", (h, d))):
                if not entry.get(f"{kind}_{part}"):
                    continue
                if None in shape:
                    raise _fail(at, f"has a {kind} {part} but config.json does not record num_key_value_heads / "
                                    "head_dim.")
                t = _tensor(tensors, f"layers.{i}.{kind}_{part}", shape, at, used)
                if part == "rotation":
                    try:
                        check_orthogonal(t, f"tensor 'layers.{i}.{kind}_rotation'", atol=_ORTHOGONAL_ATOL)
                    except ValueError as e:
                        raise _fail(at, f"{e} A rotation must be orthogonal (R R^T = I).") from e
                lists[listname][i] = t
        pair = (_layout_from_json(entry.get("key_layout"), at), _layout_from_json(entry.get("value_layout"), at))
        if (pair[0] is None) != (pair[1] is None):
            raise _fail(at, "key_layout and value_layout must both be given or both be null.")
        layouts[i], names[i] = (pair if pair[0] is not None else None), entry.get("layout")
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise _fail(where, f"{TENSORS_NAME} has tensors that config.json does not list: {unexpected[:5]}.")
    kwargs = {k: (v if any(t is not None for t in v) else None) for k, v in lists.items()
              if k in ("k_rotations", "v_rotations", "key_means", "value_means")}
    if any(p is not None for p in layouts):
        if any(p is None for p in layouts):
            raise _fail(where, "some layers have calibrated layouts and some do not; give all or none.")
        kwargs["layer_layouts"] = layouts
    extra = {"k_eigenvalues": lists["k_eigenvalues"] if any(t is not None for t in lists["k_eigenvalues"]) else None,
             "v_eigenvalues": lists["v_eigenvalues"] if any(t is not None for t in lists["v_eigenvalues"]) else None,
             "layout_names": names if any(x is not None for x in names) else None}
    return kwargs, extra


def _apply_clip_override(layouts, key_clip, value_clip):
    """``k_clip`` / ``v_clip`` overrides also rewrite calibrated per-layer layouts (scalar or per-layer)."""
    def pick(v, i):
        return v[i] if isinstance(v, (list, tuple)) else v
    out = []
    for i, (k, v) in enumerate(layouts):
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


def decode_payload(cls, config: dict, tensors: dict, where: str, overrides: dict | None = None,
                   model_config=None):
    """Build a ``cls`` cache from a validated artifact; ``overrides`` replace stored settings."""
    _check_header(cls, config, where)
    kwargs = _settings_from_json(cls, config.get("settings", {}), where)
    for name in ("k_clip", "v_clip"):
        _check_clip(kwargs.get(name), name, config.get("num_layers"), where)
    extra = {}
    if cls.artifact_format == OSCAR_FORMAT:
        layer_kwargs, extra = _decode_oscar_layers(config, tensors, where)
        kwargs.update(layer_kwargs)
    elif tensors:
        raise _fail(where, f"an {cls.__name__} artifact has no tensors, but {TENSORS_NAME} holds {len(tensors)}.")
    overrides = dict(overrides or {})
    unknown = set(overrides) - _init_params(cls)
    if unknown:
        raise TypeError(f"{cls.__name__}.from_pretrained got unknown settings {sorted(unknown)}; "
                        f"valid overrides: {sorted(_init_params(cls))}.")
    if kwargs.get("layer_layouts") is not None and ("k_clip" in overrides or "v_clip" in overrides):
        kwargs["layer_layouts"] = _apply_clip_override(kwargs["layer_layouts"], overrides.get("k_clip", _UNSET),
                                                       overrides.get("v_clip", _UNSET))
    kwargs.update(overrides)
    info = {key: config.get(key) for key in SHAPE_KEYS}
    info.update(source=where, base_model=config.get("base_model"), base_model_revision=config.get(
        "base_model_revision"))
    if model_config is not None:
        check_config(info, model_config)
    try:
        cache = cls(config=model_config, **kwargs)
    except (TypeError, ValueError) as e:
        raise _fail(where, f"its settings are invalid for {cls.__name__}: {e}") from e
    for name, value in extra.items():
        setattr(cache, name, value)
    cache.calibration_info = config.get("calibration")
    cache.quality = config.get("quality")
    cache.artifact_info = info
    return cache


# ---------------------------------------------------------------------------------------------- files
def _hub_errors():
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    return EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError


def resolve_file(repo_or_path, filename: str, *, subfolder=None, revision=None, cache_dir=None, token=None,
                 local_files_only=False) -> Path:
    """A file of an artifact: from an embedded artifact, a local folder, or the Hub (``hf_hub_download``)."""
    name = str(repo_or_path)
    if name in EMBEDDED_ARTIFACTS and revision is None and subfolder is None:
        folder = EMBEDDED_ARTIFACTS[name]
        if not (folder / CONFIG_NAME).exists():
            raise OSError(f"{name} is an artifact shipped with hf_kvint2, but {folder} is missing from this "
                          "installation; reinstall hf-kvint2 or regenerate it with calibration_scripts/"
                          "calibrate_oscar.py.")
        if not (folder / filename).exists():
            raise OSError(f"{folder / filename} is missing from this installation of hf_kvint2; reinstall it.")
        return folder / filename
    local = Path(os.path.expanduser(name))
    if local.is_dir():
        path = local / (subfolder or "") / filename
        if not path.exists():
            raise OSError(f"{path} does not exist: {local} is not an hf_kvint2 artifact folder"
                          f"{' (check subfolder=)' if subfolder else ''}.")
        return path
    from huggingface_hub import hf_hub_download

    from .network import hub_endpoint, hub_offline, hub_reachable

    entry_missing, http_error, invalid, not_cached = _hub_errors()
    offline = local_files_only or hub_offline()
    unreachable = not offline and not hub_reachable()  # then only the local cache is looked at, without retries
    try:
        return Path(hf_hub_download(name, filename, subfolder=subfolder, revision=revision, cache_dir=cache_dir,
                                    token=token, local_files_only=offline or unreachable))
    except not_cached as e:  # before entry_missing: it subclasses it
        if unreachable:
            raise OSError(f"{name}: the Hugging Face Hub ({hub_endpoint()}) cannot be reached from here (no network?) "
                          f"and {filename} is not in the local Hub cache. Pass a local artifact folder, download the "
                          "repo where there is network (`hf download REPO`) and copy the cache or the folder here, "
                          "or set HF_HUB_OFFLINE=1 to look only at the local cache.") from None
        if offline:
            raise OSError(f"{filename} of {name} is not in the local Hub cache, and the Hub is not asked "
                          f"({'local_files_only=True' if local_files_only else 'HF_HUB_OFFLINE is set'}). Download "
                          "it once with network access, or pass a local folder.") from e
        raise OSError(f"{filename} of {name} could not be downloaded and is not in the local Hub cache: {e}") from e
    except entry_missing:
        raise OSError(f"{name} (revision {revision or 'main'}{f', subfolder {subfolder}' if subfolder else ''}) has "
                      f"no {filename}: is it an hf_kvint2 calibration artifact?") from None
    except invalid as e:
        raise OSError(f"{name!r} is neither a local folder nor a valid Hub repo id: {e}") from e
    except http_error as e:
        raise OSError(f"Could not download {filename} of {name} (revision {revision or 'main'}): {e}") from e


def load_artifact(cls, repo_or_path, *, subfolder=None, revision=None, cache_dir=None, token=None,
                  local_files_only=False, config=None, **overrides):
    """Implementation of ``from_pretrained`` (see :class:`CacheHubMixin`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = f"artifact {str(repo_or_path)!r}" + (f" (subfolder {subfolder!r})" if subfolder else "") + \
        (f" at revision {revision!r}" if revision else "")
    common = {"subfolder": subfolder, "revision": revision, "cache_dir": cache_dir, "token": token,
              "local_files_only": local_files_only}
    config_path = resolve_file(repo_or_path, CONFIG_NAME, **common)
    try:
        artifact_config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(where, f"{CONFIG_NAME} is not valid JSON: {e}") from e
    _check_header(cls, artifact_config, where)
    tensors = {}
    if artifact_config.get("layers"):
        tensors_path = resolve_file(repo_or_path, TENSORS_NAME, **common)
        try:
            tensors = load_file(str(tensors_path))
        except (SafetensorError, OSError) as e:
            raise _fail(where, f"{TENSORS_NAME} is not a readable safetensors file: {e}") from e
    return decode_payload(cls, artifact_config, tensors, where, overrides, model_config=config)


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
                return "none" if lay.get("clip") is None else f"{lay['clip']:.3g}"
            value = config["settings"].get(f"{kind}_clip")
            value = value[i] if isinstance(value, list) else value
            return "none" if value is None else f"{value:.3g}"
        rows.append([str(i), layer.get("layout") or "-",
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
    template = Path(__file__).resolve().parent.parent / "model_cards" / CARD_TEMPLATE
    if not template.exists():  # installed wheel: the template ships as package data
        template = Path(__file__).parent / "model_cards" / CARD_TEMPLATE
    card = ModelCard.from_template(
        card_data, template_path=str(template), title=title, summary=summary, class_name=cls_name,
        calibrated=calibrated, base_model_display=base or "<base model id>",
        base_model_revision=config.get("base_model_revision"), repo_id=repo_id or "<this repo id or local folder>",
        subfolder=subfolder, format=fmt, format_version=config["format_version"],
        num_layers=config.get("num_layers") or "any", num_key_value_heads=config.get("num_key_value_heads") or "any",
        head_dim=config.get("head_dim") or "any", settings=settings, calibration=bool(calib),
        calibration_data=calib.get("data", "not recorded"), calibration_tokens=calib.get("num_tokens", "not recorded"),
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


def write_artifact(cache, save_directory, *, base_model=None, base_model_revision=None, quality=None,
                   repo_id=None, subfolder=None) -> Path:
    """Implementation of ``save_pretrained`` (see :class:`CacheHubMixin`)."""
    from safetensors.torch import save

    config, tensors = artifact_payload(cache, base_model=base_model, base_model_revision=base_model_revision,
                                       quality=quality)
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if tensors:
        # One metadata key only: safetensors writes several in random order, and artifacts must be reproducible.
        # Serialised in memory and written like the other files, so the file mode follows the umask.
        (folder / TENSORS_NAME).write_bytes(save(dict(sorted(tensors.items())), metadata={"format": config["format"]}))
    elif (folder / TENSORS_NAME).exists():
        (folder / TENSORS_NAME).unlink()  # a stale file from an earlier save would contradict config.json
    (folder / CARD_NAME).write_text(render_card(config, type(cache).__name__, repo_id, subfolder), encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------- RotationZoo
def _load_zoo_file(path: Path) -> dict:
    """``torch.load(weights_only=True)``: tensors and plain containers only; any other pickle is refused."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as e:
        raise ArtifactError(f"{path}: refusing to load it. RotationZoo files may hold only tensors and plain "
                            f"containers (loaded with torch.load(weights_only=True)); this one does not: {e}") from e
    if not isinstance(payload, dict) or not isinstance(payload.get("layers"), dict):
        raise ArtifactError(f"{path}: not a RotationZoo rotation file (expected a dict with a 'layers' dict of "
                            "{'rotation', 'eigenvalues'} per layer).")
    return payload


def _zoo_layers(payload: dict, path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    by_index = {}
    for key, entry in payload["layers"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
            raise ArtifactError(f"{path}: layer {key!r} has no 'rotation' tensor.")
        idx = entry.get("layer_id", key)
        try:
            idx = int(idx)
        except (TypeError, ValueError):
            raise ArtifactError(f"{path}: layer key {key!r} is not a layer index.") from None
        if idx in by_index:
            raise ArtifactError(f"{path}: layer {idx} appears twice.")
        by_index[idx] = entry
    n = len(by_index)
    missing = sorted(set(range(n)) - set(by_index))
    if missing:
        raise ArtifactError(f"{path}: layers {missing[:5]} are missing (found indices {sorted(by_index)[:8]}...).")
    rotations, eigenvalues = [], []
    for i in range(n):
        r = by_index[i]["rotation"]
        if r.dim() == 3:
            raise ArtifactError(f"{path}: layer {i} has per-head rotations {tuple(r.shape)}; hf_kvint2 uses one "
                                "rotation per layer shared by its KV heads. Use a per-layer RotationZoo file.")
        d = rotations[0].shape[0] if rotations else r.shape[-1]
        if tuple(r.shape) != (d, d):
            raise ArtifactError(f"{path}: layer {i} rotation has shape {tuple(r.shape)}, expected ({d}, {d}).")
        try:
            check_orthogonal(r, f"{path}: layer {i} rotation", atol=_ORTHOGONAL_ATOL)
        except ValueError as e:
            raise ArtifactError(str(e)) from e
        ev = by_index[i].get("eigenvalues")
        if ev is not None and (not isinstance(ev, torch.Tensor) or tuple(ev.shape) != (d,)
                               or not torch.isfinite(ev).all()):
            raise ArtifactError(f"{path}: layer {i} eigenvalues must be a finite [{d}] tensor.")
        rotations.append(r.float())
        eigenvalues.append(None if ev is None else ev.float())
    return rotations, eigenvalues


def load_rotation_zoo(cls, path_or_repo, *, subfolder=None, revision=None, cache_dir=None, token=None,
                      local_files_only=False, k_method: str = ZOO_K_METHOD, v_method: str = ZOO_V_METHOD,
                      config=None, **overrides):
    """Implementation of ``OscarCache.from_rotation_zoo`` (see there)."""
    common = {"subfolder": subfolder, "revision": revision, "cache_dir": cache_dir, "token": token,
              "local_files_only": local_files_only}
    files = {kind: resolve_file(path_or_repo, f"{kind}_rotation_{method}.pt", **common)
             for kind, method in (("k", k_method), ("v", v_method))}
    payloads = {kind: _load_zoo_file(path) for kind, path in files.items()}
    (k_rot, k_eig), (v_rot, v_eig) = (_zoo_layers(payloads[k], files[k]) for k in ("k", "v"))
    if len(k_rot) != len(v_rot) or k_rot[0].shape != v_rot[0].shape:
        raise ArtifactError(f"{path_or_repo}: key and value rotations disagree ({len(k_rot)} vs {len(v_rot)} "
                            f"layers, head_dim {k_rot[0].shape[0]} vs {v_rot[0].shape[0]}).")
    source = f"RotationZoo {str(path_or_repo)!r}" + (f" (subfolder {subfolder!r})" if subfolder else "")
    info = {"num_layers": len(k_rot), "num_key_value_heads": None, "head_dim": k_rot[0].shape[0],
            "source": source, "base_model": None, "base_model_revision": None}
    if config is not None:
        check_config(info, config)
    unknown = set(overrides) - _init_params(cls)
    if unknown:
        raise TypeError(f"{cls.__name__}.from_rotation_zoo got unknown settings {sorted(unknown)}.")
    cache = cls(config=config, k_rotations=k_rot, v_rotations=v_rot, **overrides)
    cache.k_eigenvalues = k_eig if any(e is not None for e in k_eig) else None
    cache.v_eigenvalues = v_eig if any(e is not None for e in v_eig) else None
    cache.calibration_info = {
        "data": f"imported from the OSCAR RotationZoo ({path_or_repo}{'/' + subfolder if subfolder else ''})",
        "files": [f"{k}_rotation_{m}.pt" for k, m in (("k", k_method), ("v", v_method))],
        "objective": {k: p.get("objective") if isinstance(p.get("objective"), (str, int, float)) else None
                      for k, p in payloads.items()},
        "zoo_format_version": {k: p.get("format_version") if isinstance(p.get("format_version"), (str, int))
                               else None for k, p in payloads.items()},
    }
    cache.artifact_info = info
    return cache


# ---------------------------------------------------------------------------------------------- the mixin
class CacheHubMixin:
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for the caches (``huggingface_hub`` conventions).

    Subclasses set ``artifact_format``. ``artifact_info`` (set when loaded) holds the recorded model shapes that
    ``update`` checks at first use.
    """

    artifact_format: str = ""
    artifact_info: dict | None = None

    def save_pretrained(self, save_directory: str | os.PathLike, *, base_model: str | None = None,
                        base_model_revision: str | None = None, quality: list[dict] | None = None,
                        repo_id: str | None = None, subfolder: str | None = None) -> Path:
        """Write ``config.json``, ``model.safetensors`` (when there are tensors) and ``README.md``.

        ``quality``: rows (dicts) of the measured quality table for the card, e.g.
        ``[{"cache": "DynamicCache", "perplexity": 28.8}, {"cache": "OscarCache", "perplexity": 30.1}]``.
        ``base_model`` defaults to the calibration's or the model config's name. ``repo_id``/``subfolder`` only
        fill the card's usage snippet. Returns the folder. Under torch.distributed only rank 0 writes (every rank
        holds the same calibration).
        """
        from .distributed import is_main_process

        if not is_main_process():
            return Path(save_directory)
        return write_artifact(self, save_directory, base_model=base_model, base_model_revision=base_model_revision,
                              quality=quality, repo_id=repo_id, subfolder=subfolder)

    @classmethod
    def from_pretrained(cls, repo_or_path: str | os.PathLike, *, subfolder: str | None = None,
                        revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                        token: str | bool | None = None, local_files_only: bool = False, config=None, **overrides):
        """Load a cache from a Hub repo id, a local folder, or an id shipped with hf_kvint2 (``EMBEDDED_ARTIFACTS``).

        ``subfolder``, ``revision``, ``cache_dir``, ``token``, ``local_files_only`` and ``HF_HUB_OFFLINE`` behave
        as in ``hf_hub_download``. ``config`` (the model's config) creates the layers up front and checks the
        artifact against it now; otherwise the check runs at the first ``update``. ``**overrides`` replace stored
        settings (``recent_tokens=128``, ``k_clip=0.9``, ...).
        """
        return load_artifact(cls, repo_or_path, subfolder=subfolder, revision=revision, cache_dir=cache_dir,
                             token=token, local_files_only=local_files_only, config=config, **overrides)

    def push_to_hub(self, repo_id: str, *, subfolder: str | None = None, commit_message: str | None = None,
                    private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                    create_pr: bool = False, base_model: str | None = None, base_model_revision: str | None = None,
                    quality: list[dict] | None = None):
        """Save to a temporary folder and upload it to ``repo_id`` (into ``subfolder`` of it when given, e.g. next
        to a model's own files). Creates the repo if needed. Returns the ``CommitInfo`` (None on torch.distributed
        ranks other than 0, which do not upload)."""
        from huggingface_hub import HfApi

        from .distributed import is_main_process

        if not is_main_process():
            return None

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, base_model=base_model, base_model_revision=base_model_revision,
                                 quality=quality, repo_id=repo_id, subfolder=subfolder)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, path_in_repo=subfolder, revision=revision,
                                     create_pr=create_pr,
                                     commit_message=commit_message or f"Upload {type(self).__name__} artifact")
