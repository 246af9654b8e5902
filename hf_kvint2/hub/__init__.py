"""Calibration artifacts: the on-disk format, save / load / push through ``huggingface_hub``, validation
against the model, the reference OSCAR RotationZoo import, and the registry of artifacts shipped in the package.

An artifact is a folder (a Hub repo, a ``subfolder`` of a model repo, or a local directory) with:

- ``config.json``: ``format`` (``"hf_kvint2.oscar"`` or ``"hf_kvint2.oscar_scaled"``), ``format_version``,
  ``base_model`` / ``base_model_revision``, the model shapes ``num_layers`` / ``num_key_value_heads`` /
  ``head_dim`` (null: not recorded, any model), ``settings`` (the cache's settings dataclass as ``to_dict()`` writes it: windows, group
  size, scale dtype, ``k_clip`` / ``v_clip`` as a number or a per-layer list), ``layers`` (OSCAR: one entry per layer
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
tensors, identifiers and strings the model card renders; docs/robustness.md lists it all) and records the model
shapes and calibrated layers; the cache compares them with the model at its first ``update`` (the layers with the
model's layer plan once the ``"oscar"`` attention tells it) and with ``config`` when given to ``from_pretrained``,
raising an error that names both sides. A different base model name only warns: local copies and fine-tunes have
other names.

Modules: :mod:`.artifact` (the format: checks, cache <-> dict + tensors), :mod:`.files` (embedded / local / Hub
files, load and write), :mod:`.card` (the model card), :mod:`.zoo` (the RotationZoo import). This package holds
the mixin that gives the caches ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..distributed import is_main_process
from .artifact import (
    CONFIG_NAME,
    FORMAT_VERSION,
    OSCAR_FORMAT,
    OSCAR_SCALED_FORMAT,
    SHAPE_KEYS,
    TENSORS_NAME,
    ArtifactError,
    artifact_payload,
    check_config,
    check_layer_plan,
    check_shape,
    check_update,
    decode_payload,
    model_shape_from_config,
)
from .card import CARD_NAME, CARD_TEMPLATE, quality_markdown, render_card
from .files import (
    EMBEDDED_ARTIFACTS,
    EMBEDDED_ARTIFACTS_DIR,
    GEMMA3_ARTIFACT_DIR,
    GEMMA3_ARTIFACT_ID,
    SMOLLM2_ARTIFACT_DIR,
    SMOLLM2_ARTIFACT_ID,
    load_artifact,
    resolve_file,
    write_artifact,
)
from .zoo import ZOO_K_METHOD, ZOO_V_METHOD, load_rotation_zoo


class CacheHubMixin:
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for the caches (``huggingface_hub`` conventions).

    Subclasses set ``artifact_format`` and ``settings_type`` (their settings dataclass) and hold ``settings``,
    ``artifact_info`` (set when loaded: the recorded model shapes that ``update`` checks at first use) and
    ``quality`` (the card's table).
    """

    artifact_format: str = ""
    settings_type: type
    artifact_info: dict | None = None
    quality: list[dict] | None = None

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


__all__ = [
    "CARD_NAME", "CARD_TEMPLATE", "CONFIG_NAME", "EMBEDDED_ARTIFACTS", "EMBEDDED_ARTIFACTS_DIR", "FORMAT_VERSION",
    "GEMMA3_ARTIFACT_DIR", "GEMMA3_ARTIFACT_ID", "OSCAR_FORMAT", "OSCAR_SCALED_FORMAT", "SHAPE_KEYS",
    "SMOLLM2_ARTIFACT_DIR", "SMOLLM2_ARTIFACT_ID",
    "TENSORS_NAME", "ZOO_K_METHOD", "ZOO_V_METHOD", "ArtifactError", "CacheHubMixin", "artifact_payload",
    "check_config", "check_layer_plan", "check_shape", "check_update", "decode_payload", "load_artifact", "load_rotation_zoo",
    "model_shape_from_config", "quality_markdown", "render_card", "resolve_file", "write_artifact",
]
