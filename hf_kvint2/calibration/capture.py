"""Calibration, step 1: observe the post-RoPE queries, keys and values of every layer (see
:mod:`hf_kvint2.calibration`), and the token stream the windows are cut from."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence

import torch

_CAPTURE_PREFIX = "hf_kvint2_capture_"
_active_callbacks: list[Callable] = []


def _original_attention(module, implementation: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation == "eager":
        if eager is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward in its modeling file; "
                               "load the model with attn_implementation='sdpa' for calibration.")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def _capture_name(implementation: str) -> str:
    """Register (once) a recording wrapper around ``implementation`` and its mask function; return its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _CAPTURE_PREFIX + implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        if _active_callbacks:
            _active_callbacks[-1](module, query, key, value, kwargs)
        return _original_attention(module, implementation)(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, recording_attention)
    if implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # same masks as the original
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


@contextlib.contextmanager
def capture_attention(model, callback: Callable):
    """Within the block, every attention call of ``model`` first calls ``callback(module, query, key, value,
    kwargs)`` with post-RoPE ``query`` [B, Hq, T, d] and ``key`` / ``value`` [B, Hkv, T, d], then runs the model's
    own attention implementation unchanged."""
    original = model.config._attn_implementation
    if original is None or original.startswith(_CAPTURE_PREFIX):
        raise RuntimeError(f"Cannot capture attention: the model's attn_implementation is {original!r}.")
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                         "AttentionInterface, so OSCAR calibration cannot observe its post-RoPE queries and keys.")
    model.set_attn_implementation(_capture_name(original))
    _active_callbacks.append(callback)
    try:
        yield
    finally:
        _active_callbacks.remove(callback)
        model.set_attn_implementation(original)



def tokenize_texts(tokenizer, texts: Sequence[str], num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` token ids of the texts, tokenized one by one without special tokens (windows are
    slices of this stream) and concatenated. ``tokenizer`` needs ``encode(text, add_special_tokens=False)``."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError("texts must be a non-empty list of non-empty strings (the calibration corpus).")
    ids: list[int] = []
    for text in texts:
        try:  # verbose=False: transformers tokenizers would warn that the text exceeds the model's length
            ids.extend(tokenizer.encode(text, add_special_tokens=False, verbose=False))
        except TypeError:
            ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= num_tokens:
            break
    return torch.tensor(ids[:num_tokens], dtype=torch.long)
