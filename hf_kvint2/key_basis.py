"""Uncalibrated keys whose channels vary very unevenly keep the model's basis.

A quantized key costs the logit error ``q . (k_hat - k)``, so where the error lies matters as much as its size.
Per-channel groups give every channel its own scale: a Hadamard rotation before them only redistributes range
between channels, so that every channel's error follows the rms of all channels' ranges. Per-token groups spread
the error evenly over all channels whatever the rotation. When a few channels' ranges dwarf the others' (Gemma 3's
full-attention keys: RoPE theta 1e6 with QK-norm) and the queries read the low-range channels, both cost 2-9x the
logit error of per-channel groups in the model's basis.

Without the queries at hand (data-free), the first tokens a layer quantizes decide, once per layer;
:func:`settled_key_codec` gives the codec the key stream keeps:

* channel-grouped keys (OScaR): both candidate encodings are tried on those tokens, and the model's basis is kept
  when it preserves every channel's own variation far better (:func:`relative_channel_error` under
  :data:`CHANNEL_ERROR_LIMIT`), then without OScaR's omni-token scaling (measured on Gemma 3's full-attention
  layers, the keys this applies to: perplexity +2.5% without it, +4.9% with it, at 2k; in that basis a key's norm
  is mostly its few high-range channels', and dividing every channel by it presumably adds their fluctuation to
  the low-range channels the queries read; docs/design.md, "Why the defaults"). The error
  is counted per channel in units of that channel's variance over the tokens, since the queries may read any
  channel: a sum of squared errors would be rotation-invariant and cannot tell the bases apart. Measured on the
  first 32-384 demoted keys: Gemma 3 full-attention layers 0.018-0.042, SmolLM2 0.155-0.88
  (benchmarks/experiments/oscar_scaled_errors.py; the range spread cannot make this call: Gemma's layer 17, spread
  1.96, has 9x the key error in the Hadamard basis that it has in its own, while SmolLM2's layer 18, spread 2.2-2.3, is
  better off rotated);
* per-token keys (uncalibrated OSCAR): the spread of the per-channel ranges (:func:`range_spread` over
  :data:`RANGE_SPREAD_LIMIT`) switches them to per-channel groups in the model's basis.

Calibrated rotations are never changed (calibration measures the choice per layer), nor are static caches' (fixed
shapes, traced steps).
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
# full-attention layers 1.9-5.3 (benchmarks/experiments/key_basis_decisions.py).
RANGE_SPREAD_LIMIT = 3.0

# Channel-grouped (OScaR) key streams keep the model's basis when its relative per-channel error
# (relative_channel_error) is below this fraction of the Hadamard's: Gemma 3 full-attention layers 0.018-0.042,
# SmolLM2 0.155-0.88 (the geometric middle of the gap, about 2x from either side).
CHANNEL_ERROR_LIMIT = 0.08
# relative_channel_error looks at most this many of the first demoted keys: the decision needs a sample, and a
# long prompt's first demotion (32k tokens) would otherwise quantize all of it twice more (memory, time).
CHANNEL_ERROR_TOKENS = 1024
# range_spread reads the tokens this many at a time (whole groups): it reads all of them, however long the prompt
RANGE_SPREAD_BLOCK = 4096


def range_spread(x: torch.Tensor, group: int, shard: TensorParallelShard | None = None) -> float | None:
    """How unevenly x [B, H, n, D]'s channels vary: per head, the rms over channels of each channel's mean range
    over ``group``-token groups, over the median channel's (tokens scaled to unit norm first: scale-free), averaged
    over the heads of the layer (all ranks' under tensor parallelism). None if x has fewer than ``group`` tokens."""
    n = (x.shape[-2] // group) * group
    if n == 0:
        return None
    # whole groups, RANGE_SPREAD_BLOCK tokens at a time: the float32 temporaries of a long prefill stay bounded
    step = max(group, RANGE_SPREAD_BLOCK // group * group)
    sums = []
    for start in range(0, n, step):
        xf = x[:, :, start:min(start + step, n)].float()
        xf = xf / xf.norm(dim=(1, 3), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        g = xf.reshape(*xf.shape[:2], xf.shape[2] // group, group, xf.shape[-1])
        sums.append((g.amax(dim=-2) - g.amin(dim=-2)).sum(dim=(0, 2)))  # [H, D]
    ranges = torch.stack(sums).sum(0) / (x.shape[0] * (n // group))  # the mean range per head and channel
    ratio = ranges.square().mean(-1).sqrt() / ranges.median(-1).values.clamp_min(torch.finfo(torch.float32).tiny)
    total = torch.stack([ratio.sum(), torch.tensor(float(ratio.shape[0]), device=ratio.device)]).double()
    if shard is not None:  # one decision for the whole layer
        shard.all_reduce_sum(total)
    return (total[0] / total[1]).item()


def relative_channel_error(codec: StreamCodec, keys: torch.Tensor) -> float | None:
    """How much better the model's basis keeps channel-grouped keys than ``codec``'s rotation: the INT2 error of
    each channel, in units of that channel's variance over the tokens, summed over the channels and heads, with
    the identity rotation over the same with ``codec``'s (both with the codec's groups, token scaling and scales),
    for original-space keys [B, H, n, D] (whole groups only; all ranks' heads under tensor parallelism). None if
    there are fewer than one group of tokens. At most :data:`CHANNEL_ERROR_TOKENS` tokens are used."""
    n = (min(keys.shape[-2], CHANNEL_ERROR_TOKENS) // codec.group) * codec.group
    if n == 0:
        return None
    x = keys[:, :, :n].float()
    if codec.mean is not None:
        x = x - codec.mean[None, :, None, :]
    var = (x - x.mean(dim=2, keepdim=True)).square().mean(dim=(0, 2))  # [H, D]
    var = var + 1e-3 * var.mean(-1, keepdim=True) + torch.finfo(torch.float32).tiny  # dead channels: no 1/0
    sums = []
    for rotation in (torch.eye(x.shape[-1], dtype=torch.float32, device=x.device), codec.rotation):
        trial = replace(codec, rotation=rotation, mean=None)
        groups, norm = trial.quantize(x)
        err = (trial.dequantize_groups(groups, norm) - x).square().mean(dim=(0, 2))
        sums.append((err / var).sum())
    total = torch.stack(sums).double()
    if codec.shard is not None:  # one decision for the whole layer
        codec.shard.all_reduce_sum(total)
    return (total[0] / total[1].clamp_min(torch.finfo(torch.float64).tiny)).item()


def settled_key_codec(codec: StreamCodec, keys: torch.Tensor) -> tuple[StreamCodec, float | None]:
    """The codec an uncalibrated key stream (``codec.rotation`` is the data-free Hadamard) keeps, decided from its
    first original-space keys [B, H, n, D], and the spread that decided.

    * Per-channel groups (OScaR): the same groups in the model's basis (identity rotation), without token
      scaling, if its relative per-channel error is under :data:`CHANNEL_ERROR_LIMIT` times the rotation's
      (returned instead of a spread; both measured with the codec's own token scaling).
    * Per-token groups (uncalibrated OSCAR): per-channel groups of as many tokens as the per-token group has
      channels (same scale bytes), in the model's basis, without a mean, if the spread exceeds the limit.

    Fewer than one group of tokens decides nothing (spread None): the codec is kept."""
    eye = torch.eye(codec.rotation.shape[0], dtype=codec.rotation.dtype, device=codec.rotation.device)
    if codec.layout.axis == "channel":
        ratio = relative_channel_error(codec, keys)
        if ratio is not None and ratio < CHANNEL_ERROR_LIMIT:  # the model's basis, without the token norm
            return replace(codec, rotation=eye, layout=replace(codec.layout, token_scaling=False)), ratio
        return codec, ratio
    spread = range_spread(keys, codec.group, codec.shard)
    if spread is not None and spread > RANGE_SPREAD_LIMIT:
        return StreamCodec(GroupLayout("channel", codec.group), codec.group, eye, None, codec.scale_dtype,
                           codec.shard), spread
    return codec, spread
