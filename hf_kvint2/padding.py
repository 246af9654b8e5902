"""Left padding of a batch, as the cache layers see it.

``update()`` never sees the attention mask, but transformers (>= 5.24) passes the layer's ``position_ids`` with
it, and ``generate`` derives them from the attention mask: a left-padded row's first real token has position 0.
A fresh layer that receives a first chunk of ``n`` tokens whose row ends at position ``p < n - 1`` therefore knows
that the row starts with ``n - 1 - p`` padding tokens. The layer then widens its full-precision sink by the
batch's largest padding, so that padding never enters a quantization group and every row keeps its own first
``sink_tokens`` real tokens at full precision.
"""

from __future__ import annotations

import torch

from .quant import tracing


def position_ids_of_update(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``position_ids`` passed to ``Cache.update`` / ``CacheLayerMixin.update``, if any (transformers >= 5.24
    passes the attention module's keyword arguments as ``kwargs=``; earlier 5.x pass none)."""
    for found in (kwargs, kwargs.get("kwargs"), args[0] if args else None, kwargs.get("cache_kwargs")):
        if isinstance(found, dict) and isinstance(found.get("position_ids"), torch.Tensor):
            return found["position_ids"]
    return None


def check_position_ids(position_ids: torch.Tensor | None, where: str) -> None:
    """Refuse position ids no position can be read from: meta tensors, booleans, complex numbers, NaN or Inf."""
    if position_ids is None or tracing():
        return
    problem = None
    if position_ids.is_meta:
        problem = "are meta tensors (shapes without data)"
    elif position_ids.dtype == torch.bool or position_ids.is_complex():
        problem = f"have dtype {position_ids.dtype}"
    elif position_ids.is_floating_point() and not torch.isfinite(position_ids).all():
        problem = "contain NaN or Inf"
    if problem is not None:
        raise ValueError(f"{where}: the position_ids passed with the K/V {problem}; positions are integers counted "
                         "from 0 (torch.long, e.g. torch.arange(seq_len)[None], or none: the model derives them).")


def left_padding(position_ids: torch.Tensor | None, n_new: int, where: str = "this cache layer") -> int:
    """Largest number of left-padding tokens over the rows of a first chunk of ``n_new`` tokens (0 if unknown);
    position ids that hold no positions are refused (:func:`check_position_ids`)."""
    check_position_ids(position_ids, where)
    if position_ids is None or tracing() or position_ids.dim() != 2 or position_ids.shape[-1] != n_new:
        return 0
    last = position_ids[:, -1]
    return int((n_new - 1 - last).clamp(min=0, max=n_new).max().item())
