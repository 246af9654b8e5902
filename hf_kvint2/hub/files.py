"""Artifact files: where they come from (embedded in the package, a local folder, the Hub through
``huggingface_hub``), reading them into a cache and writing a cache to a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import network
from . import safety
from .artifact import (
    CONFIG_NAME,
    REINSTALL,
    TENSORS_NAME,
    _check_header,
    _fail,
    artifact_payload,
    decode_payload,
    expected_tensor_shapes,
)
from .card import CARD_NAME, render_card

# Artifacts shipped inside the package (package data): ``OscarCache.from_pretrained(<id>)`` loads them from here
# without touching the network (unless a ``revision`` is asked for). Each folder holds config.json +
# model.safetensors + README.md written by ``save_pretrained``.
EMBEDDED_ARTIFACTS_DIR = Path(__file__).parents[1] / "artifacts"
SMOLLM2_ARTIFACT_ID = "hf-kvint2/SmolLM2-135M-Instruct-oscar"
# The calibration of SmolLM2-135M-Instruct on Pride and Prejudice: written with
# ``cache.save_pretrained(SMOLLM2_ARTIFACT_DIR)`` by calibration_scripts/calibrate_oscar.py.
SMOLLM2_ARTIFACT_DIR = EMBEDDED_ARTIFACTS_DIR / "SmolLM2-135M-Instruct-oscar"
GEMMA3_ARTIFACT_ID = "hf-kvint2/gemma-3-270m-oscar"
# The calibration of Gemma 3 270M on Pride and Prejudice (its 3 full-attention layers; the 15 sliding-window layers
# keep transformers' window and are not calibrated): calibration_scripts/calibrate_oscar.py --model gemma3.
GEMMA3_ARTIFACT_DIR = EMBEDDED_ARTIFACTS_DIR / "gemma-3-270m-oscar"
EMBEDDED_ARTIFACTS = {SMOLLM2_ARTIFACT_ID: SMOLLM2_ARTIFACT_DIR, GEMMA3_ARTIFACT_ID: GEMMA3_ARTIFACT_DIR}


def _hub_errors():
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    return EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError


def resolve_file(repo_or_path, filename: str, *, subfolder=None, revision=None, cache_dir=None, token=None,
                 local_files_only=False) -> Path:
    """A file of an artifact: from an embedded artifact, a local folder, or the Hub (``hf_hub_download``); always
    a regular file inside the artifact's folder (:func:`safety.regular_file`)."""
    name = str(repo_or_path)
    subfolder = safety.safe_subfolder(subfolder)
    if name in EMBEDDED_ARTIFACTS and revision is None and subfolder is None:
        folder = EMBEDDED_ARTIFACTS[name]
        if not (folder / CONFIG_NAME).exists():
            raise OSError(f"{name} is an artifact shipped with hf_kvint2, but {folder} is missing from this "
                          f"installation; {REINSTALL}, or regenerate it with calibration_scripts/calibrate_oscar.py.")
        if not (folder / filename).exists():
            raise OSError(f"{folder / filename} is missing from this installation of hf_kvint2; {REINSTALL}.")
        return safety.regular_file(folder / filename, folder, f"artifact {name!r}")
    local = Path(os.path.expanduser(name))
    if local.is_dir():
        path = local / (subfolder or "") / filename
        if not path.exists():
            raise OSError(f"{path} does not exist: {local} is not an hf_kvint2 artifact folder"
                          f"{' (check subfolder=)' if subfolder else ''}.")
        return safety.regular_file(path, local, f"artifact {name!r}")
    from huggingface_hub import hf_hub_download

    entry_missing, http_error, invalid, not_cached = _hub_errors()
    offline = local_files_only or network.hub_offline()
    unreachable = not offline and not network.hub_reachable()  # then only the local cache is looked at, without retries
    try:
        path = Path(hf_hub_download(name, filename, subfolder=subfolder, revision=revision, cache_dir=cache_dir,
                                    token=token, local_files_only=offline or unreachable))
    except not_cached as e:  # before entry_missing: it subclasses it
        if unreachable:
            raise OSError(f"{name}: the Hugging Face Hub ({network.hub_endpoint()}) cannot be reached from here (no network?) "
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
    return safety.regular_file(path, None, f"artifact {name!r}")


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
    artifact_config = safety.read_json(config_path, where)
    _check_header(cls, artifact_config, f"{where}, {CONFIG_NAME}")
    tensors = {}
    # layers with layouts and no tensors (Hadamard rotations, not centred) are saved without model.safetensors
    expected = expected_tensor_shapes(artifact_config, config, where) if artifact_config.get("layers") else {}
    if expected:
        tensors_path = resolve_file(repo_or_path, TENSORS_NAME, **common)
        safety.check_safetensors_header(tensors_path, expected, where)
        try:
            tensors = load_file(str(tensors_path))
        except (SafetensorError, OSError) as e:
            raise _fail(where, f"{TENSORS_NAME} is not a readable safetensors file: {e}") from e
        except MemoryError:  # its header was checked: the tensors config.json lists do not fit in memory here
            raise _fail(where, f"not enough memory to load {TENSORS_NAME} ({tensors_path.stat().st_size} bytes) "
                               "in this process (an address-space or memory limit?).") from None
    return decode_payload(cls, artifact_config, tensors, where, overrides, model_config=config)


def write_artifact(cache, save_directory, *, base_model=None, base_model_revision=None, quality=None,
                   repo_id=None, subfolder=None) -> Path:
    """Implementation of ``save_pretrained`` (see :class:`CacheHubMixin`)."""
    from safetensors.torch import save

    config, tensors = artifact_payload(cache, base_model=base_model, base_model_revision=base_model_revision,
                                       quality=quality)
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    # safety.write_file replaces symlinks already in the folder (a cloned repo) instead of writing through them.
    safety.write_file(folder / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    if tensors:
        # One metadata key only: safetensors writes several in random order, and artifacts must be reproducible.
        # Serialised in memory and written like the other files, so the file mode follows the umask.
        safety.write_file(folder / TENSORS_NAME, save(dict(sorted(tensors.items())),
                                                      metadata={"format": config["format"]}))
    elif (folder / TENSORS_NAME).is_symlink() or (folder / TENSORS_NAME).exists():
        (folder / TENSORS_NAME).unlink()  # a stale file from an earlier save would contradict config.json
    safety.write_file(folder / CARD_NAME, render_card(config, type(cache).__name__, repo_id, subfolder).encode("utf-8"))
    return folder
