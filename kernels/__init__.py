"""Triton kernels for hf_kvint2 (installed as ``hf_kvint2.kernels``), with their PyTorch references.

Two kernels, both optional (``pip install '.[triton]'`` in a clone) and used for CUDA tensors only:

* :func:`quantize_tokens` - fused centre -> rotate -> omni-token norm -> row clip -> INT2 quantize -> pack of new
  tokens, producing exactly what :meth:`hf_kvint2.layers.QuantizedStream.append` stores (``QuantizedGroups`` in
  the layout of :mod:`hf_kvint2.quant`, plus the token norms ``[B, n]`` or None). Codes equal
  ``quantize_int2(stream.transform(x))`` except where a value sits on a rounding tie (the rotation sums in a
  different order).
* :func:`body_attention` - split-K decode attention of rotated queries over a layer's packed INT2 body, every
  layout the caches store (per-token or per-channel groups, any group size, token norms on K or V, centred keys),
  GQA-aware: one program reads each code once for all query heads of its KV head. Returns the body's partial
  result ``(out_rot, lse)``: the softmax-normalised output *in the rotated value space* (without the value
  mean) and the log-sum-exp of the body's scores, so a caller merges segments
  (:func:`hf_kvint2.read_path.merge_partials`) and de-rotates once: ``out = out_rot @ R_V.T + mu_V``.
* :func:`layer_decode_attention` - a whole decode step of one :class:`~hf_kvint2.layers.OscarLayer`: the shared
  read pipeline (:func:`hf_kvint2.read_path.attend_segments`) with this body kernel. Same result as SDPA over the
  layer's dequantized cache (see :func:`reference_layer_attention`).

Scores follow SDPA: ``s = scaling * q.k + mask`` (bool mask: True attends; float mask: added). For the body,
``q.k = (q R_K).k_rot + q.mu_K`` with ``k_rot = (code * scale + lo) * norm`` in fp32. The in-kernel products use
IEEE fp32 for fp32 models and the model's 16-bit dtype (fp32 accumulation, tensor cores) otherwise: pass
``dot_dtype=query.dtype`` to :func:`body_attention`.

CPU testing: Triton decides between interpreter and compiler when it is first imported (``torch._dynamo`` imports
it as soon as transformers loads), so ``TRITON_INTERPRET=1`` must be in the environment before that; then the
kernels run on CPU tensors (tests/conftest.py sets it when no GPU is present). GPU numbers:
``python benchmarks/bench_gpu.py`` (``--dry-run`` checks it on a CPU).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

import torch


def _hand_over_to_the_installed_kernels_library() -> None:
    """This folder imported as a top-level ``kernels``: put Hugging Face's ``kernels`` library, if installed, in its
    place in ``sys.modules`` (the import statement then returns that module).

    Python run from a checkout's root (``python -m pytest``, ``python -m hf_kvint2.demo``) puts the root on sys.path,
    where this folder shadows the library of the same name; transformers >= 5.25 depends on that library and imports
    names from it (``from kernels import CUDAProperties``) when its model code loads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:  # not installed: nothing is shadowed
        return
    library = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = library
    try:
        spec.loader.exec_module(library)
    except BaseException:
        del sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _hand_over_to_the_installed_kernels_library()

# The references import hf_kvint2 (absolute imports); they load on first use (PEP 562), so that a stray top-level
# import of this folder as ``kernels`` (where no library of that name is installed) stays free of side effects.
_REFERENCES = ("reference_layer_attention", "reference_quantize_tokens")


def __getattr__(name):
    if name in _REFERENCES:
        from . import reference

        return getattr(reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "body_attention",
    "kernels_enabled_for",
    "layer_decode_attention",
    "quantize_stream",
    "quantize_tokens",
    "reference_layer_attention",
    "reference_quantize_tokens",
    "triton_available",
]


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def kernels_enabled_for(t: torch.Tensor) -> bool:
    """Whether the automatic dispatch should use the Triton kernels for tensor ``t``: CUDA tensor and Triton
    installed. (Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors when called directly, but the
    library never dispatches CPU tensors to the slow interpreter.)"""
    return t.is_cuda and triton_available()


def _require_triton():
    if not triton_available():
        raise ImportError("The hf_kvint2 Triton kernels need Triton: pip install 'triton>=3.2' (the clone's '.[triton]' extra).")


def quantize_tokens(x, rotation, mean, *, axis, group_size, clip, token_scaling, scale_dtype, range_clip=None):
    """Transform and quantize new tokens ``x`` [B, H, n, D] (original space) in one kernel.

    rotation: [D, D] (fp32), mean: [H, D] or None, axis: "token" | "channel", group_size: the group actually used
    (``GroupLayout.group_for(D)``), clip: row-quantile ratio or None, token_scaling: divide by the omni-token norm,
    range_clip: per-channel groups' narrowed range (``GroupLayout.range_clip``) or None.
    Returns ``(QuantizedGroups(codes, scale, lo), norm [B, n] or None)``.
    """
    _require_triton()
    from .quantize_pack import quantize_tokens as impl

    return impl(x, rotation, mean, axis=axis, group_size=group_size, clip=clip, token_scaling=token_scaling,
                scale_dtype=scale_dtype, range_clip=range_clip)


def quantize_stream(codec, x):
    """:func:`quantize_tokens` with the settings of a :class:`~hf_kvint2.stream.StreamCodec`."""
    lay = codec.layout
    return quantize_tokens(x, codec.rotation, codec.mean, axis=lay.axis, group_size=codec.group, clip=lay.clip,
                           token_scaling=lay.token_scaling, scale_dtype=codec.scale_dtype,
                           range_clip=lay.range_clip)


def body_attention(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None, num_splits=None,
                   dot_dtype=None, block_n=None):
    """Partial attention of rotated queries over INT2 body tokens (the ``"triton"`` body backend of
    :mod:`hf_kvint2.backends`).

    q_rot: [B, Hq, Lq, D], the queries already rotated by the key rotation (``q.float() @ R_K``).
    key_body / value_body: :class:`~hf_kvint2.stream.QuantizedBody` views (e.g. ``layer.key_body.read()``); their
    ``tokens`` are attended.
    key_mean_logits: [B, Hq, Lq], ``q . mu_K`` (unscaled, original-space q) for centred keys, else None.
    mask: None, or bool (True attends) / additive float, broadcastable to [B, 1, Lq, tokens] (body columns).
    num_splits: token splits per (batch, KV head); default fills the GPU a few times over.
    dot_dtype: operand dtype of the in-kernel matrix products (fp32 accumulation). Default ``q_rot.dtype``; pass
        the model's dtype (``query.dtype``) with an fp32 ``q_rot`` so bf16/fp16 models use tensor cores - IEEE fp32
        products (fp32 models) run on CUDA cores and are several times slower.
    Returns ``(out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq] fp32)``; rows with no attended token get
    ``out_rot = 0`` and ``lse = -inf``.
    """
    _require_triton()
    from .decode_attention import body_attention as impl

    return impl(q_rot, key_body, value_body, scaling=scaling, key_mean_logits=key_mean_logits, mask=mask,
                num_splits=num_splits, dot_dtype=dot_dtype, block_n=block_n)


def layer_decode_attention(query, layer, *, scaling, attention_mask=None, num_splits=None):
    """Attention of ``query`` [B, Hq, Lq, D] (original space, post-RoPE) over everything ``layer`` holds, after the
    layer's ``update()`` with this step's K/V (which must all still be in the full-precision windows).

    attention_mask: None (then the last Lq keys are causal among themselves, bottom-right aligned), or bool / additive
    float [B, 1, Lq, >= seq_len] over the layer's token order (sink, body, recent), like SDPA's.
    Returns [B, Hq, Lq, D] in ``query.dtype`` (SDPA's layout, not transposed).
    """
    _require_triton()
    from .decode_attention import layer_decode_attention as impl

    return impl(query, layer, scaling=scaling, attention_mask=attention_mask, num_splits=num_splits)
