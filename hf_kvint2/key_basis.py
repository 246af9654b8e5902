"""Uncalibrated keys whose channels vary very unevenly keep the model's basis (issue 18).

A quantized key costs the logit error ``q . (k_hat - k)``, so where the error lies matters as much as its size.
Per-channel groups give every channel its own scale: a Hadamard rotation before them only redistributes range
between channels, so that every channel's error follows the rms of all channels' ranges. Per-token groups spread
the error evenly over all channels whatever the rotation. When a few channels' ranges dwarf the others' (Gemma 3's
full-attention keys: RoPE theta 1e6 with QK-norm) and the queries read the low-range channels, both cost 2-4x the
logit error of per-channel groups in the model's basis.

Without the queries at hand (data-free), the spread of the per-channel ranges of the first tokens a layer
quantizes decides (:func:`range_spread` over :data:`RANGE_SPREAD_LIMIT`), once per layer:
:func:`settled_key_codec` gives the codec the key stream keeps. Calibrated rotations are never changed
(calibration measures the choice per layer), nor are static caches' (fixed shapes, traced steps).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .distributed import TensorParallelShard
from .recipes import GroupLayout
from .stream import StreamCodec

# Uncalibrated key streams keep the model's channel basis (with per-channel groups) when the Hadamard would raise
# the typical channel's quantization range this much: rms over channels of the per-channel range / its median.
# Measured on the first demoted keys: SmolLM2 layers 1.1-2.3, Gemma 3 sliding layers 1.05-1.9, Gemma 3
# full-attention layers 1.9-5.3 (benchmarks/gemma3_layers.py, benchmarks/key_basis_decisions.py).
RANGE_SPREAD_LIMIT = 3.0


def range_spread(x: torch.Tensor, group: int, shard: TensorParallelShard | None = None) -> float | None:
    """How unevenly x [B, H, n, D]'s channels vary: per head, the rms over channels of each channel's mean range
    over ``group``-token groups, over the median channel's (tokens scaled to unit norm first: scale-free), averaged
    over the heads of the layer (all ranks' under tensor parallelism). None if x has fewer than ``group`` tokens."""
    n = (x.shape[-2] // group) * group
    if n == 0:
        return None
    xf = x[:, :, :n].float()
    xf = xf / xf.norm(dim=(1, 3), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    g = xf.reshape(*xf.shape[:2], n // group, group, xf.shape[-1])
    ranges = (g.amax(dim=-2) - g.amin(dim=-2)).mean(dim=(0, 2))  # [H, D]
    ratio = ranges.square().mean(-1).sqrt() / ranges.median(-1).values.clamp_min(torch.finfo(torch.float32).tiny)
    total = torch.stack([ratio.sum(), torch.tensor(float(ratio.shape[0]), device=ratio.device)]).double()
    if shard is not None:  # one decision for the whole layer
        shard.all_reduce_sum(total)
    return (total[0] / total[1]).item()


def settled_key_codec(codec: StreamCodec, keys: torch.Tensor) -> tuple[StreamCodec, float | None]:
    """The codec an uncalibrated key stream (``codec.rotation`` is the data-free Hadamard) keeps, decided from its
    first original-space keys [B, H, n, D], and the spread that decided.

    * Per-channel groups (OScaR): the same layout in the model's basis (identity rotation) if the spread of the
      centred keys exceeds the limit.
    * Per-token groups (uncalibrated OSCAR): per-channel groups of as many tokens as the per-token group has
      channels (same scale bytes), in the model's basis, without a mean, if the spread exceeds the limit.

    Fewer than one group of tokens decides nothing (spread None): the codec is kept."""
    eye = torch.eye(codec.rotation.shape[0], dtype=codec.rotation.dtype, device=codec.rotation.device)
    if codec.layout.axis == "channel":
        centred = keys if codec.mean is None else keys.float() - codec.mean[None, :, None, :]
        spread = range_spread(centred, codec.group, codec.shard)
        if spread is not None and spread > RANGE_SPREAD_LIMIT:
            return replace(codec, rotation=eye), spread
        return codec, spread
    spread = range_spread(keys, codec.group, codec.shard)
    if spread is not None and spread > RANGE_SPREAD_LIMIT:
        return StreamCodec(GroupLayout("channel", codec.group), codec.group, eye, None, codec.scale_dtype,
                           codec.shard), spread
    return codec, spread
