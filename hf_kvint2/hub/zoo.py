"""Import of the reference OSCAR RotationZoo (``{k,v}_rotation_<method>.pt`` files, read with
``torch.load(weights_only=True)`` only) as an :class:`~hf_kvint2.OscarCalibration`."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from ..settings import OscarCalibration
from ..transforms import check_orthogonal
from . import safety
from .artifact import ORTHOGONAL_ATOL, ArtifactError, check_config, model_shape_from_config
from .files import resolve_file

# The reference RotationZoo's default file names (``{k,v}_rotation_<method>.pt``).
ZOO_K_METHOD = "qqt_r_h_pbr"
ZOO_V_METHOD = "sst_r_h_pbr"


def _load_zoo_file(path: Path, config=None) -> dict:
    """``torch.load(weights_only=True)``: tensors and plain containers only; any other pickle is refused. The zip
    index is checked first: no storage larger than the model's (or the largest supported) rotations."""
    shape = model_shape_from_config(config) if config is not None else {}
    safety.check_zoo_archive(path, f"RotationZoo file {str(path)!r}", shape.get("head_dim"), shape.get("num_layers"))
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
            check_orthogonal(r, f"{path}: layer {i} rotation", atol=ORTHOGONAL_ATOL)
        except ValueError as e:
            raise ArtifactError(str(e)) from e
        ev = by_index[i].get("eigenvalues")
        if ev is not None and (not isinstance(ev, torch.Tensor) or tuple(ev.shape) != (d,)
                               or not torch.isfinite(ev).all()):
            raise ArtifactError(f"{path}: layer {i} eigenvalues must be a finite [{d}] tensor.")
        rotations.append(r.float())
        eigenvalues.append(None if ev is None else ev.float())
    return rotations, eigenvalues


def load_rotation_zoo(path_or_repo, *, subfolder=None, revision=None, cache_dir=None, token=None,
                      local_files_only=False, k_method: str = ZOO_K_METHOD, v_method: str = ZOO_V_METHOD,
                      config=None) -> tuple[OscarCalibration, dict]:
    """The calibration and the recorded shapes of a RotationZoo (``OscarCache.from_rotation_zoo``, see there)."""
    common = {"subfolder": subfolder, "revision": revision, "cache_dir": cache_dir, "token": token,
              "local_files_only": local_files_only}
    zoo_files = {kind: resolve_file(path_or_repo, f"{kind}_rotation_{method}.pt", **common)
                 for kind, method in (("k", k_method), ("v", v_method))}
    payloads = {kind: _load_zoo_file(path, config) for kind, path in zoo_files.items()}
    (k_rot, k_eig), (v_rot, v_eig) = (_zoo_layers(payloads[k], zoo_files[k]) for k in ("k", "v"))
    if len(k_rot) != len(v_rot) or k_rot[0].shape != v_rot[0].shape:
        raise ArtifactError(f"{path_or_repo}: key and value rotations disagree ({len(k_rot)} vs {len(v_rot)} "
                            f"layers, head_dim {k_rot[0].shape[0]} vs {v_rot[0].shape[0]}).")
    source = f"RotationZoo {str(path_or_repo)!r}" + (f" (subfolder {subfolder!r})" if subfolder else "")
    info = {"num_layers": len(k_rot), "num_key_value_heads": None, "head_dim": k_rot[0].shape[0],
            "source": source, "base_model": None, "base_model_revision": None}
    if config is not None:
        check_config(info, config)
    description = {
        "data": f"imported from the OSCAR RotationZoo ({path_or_repo}{'/' + subfolder if subfolder else ''})",
        "files": [f"{k}_rotation_{m}.pt" for k, m in (("k", k_method), ("v", v_method))],
        "objective": {k: p.get("objective") if isinstance(p.get("objective"), (str, int, float)) else None
                      for k, p in payloads.items()},
        "zoo_format_version": {k: p.get("format_version") if isinstance(p.get("format_version"), (str, int))
                               else None for k, p in payloads.items()},
    }
    calibration = OscarCalibration(
        k_rotations=k_rot, v_rotations=v_rot,
        k_eigenvalues=k_eig if any(e is not None for e in k_eig) else None,
        v_eigenvalues=v_eig if any(e is not None for e in v_eig) else None, info=description)
    return calibration, info
