"""Orthogonal transforms applied to keys/values before quantization, and row clipping.

Every transform is a ``d x d`` orthogonal matrix ``R`` applied on the right (``x' = x @ R``), so the same code
serves the data-free Hadamard (OScaR), its block-diagonal variant and OSCAR's calibrated spectral rotation
``R = U @ H @ P``. Scores are invariant: ``q . k = (q R) . (k R)``; outputs de-rotate once: ``(sum p v') R^T``.
"""

from __future__ import annotations

import math

import torch

from .quant import as_stored, tracing


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix of size ``d`` (a power of two): symmetric and orthogonal."""
    if not is_power_of_two(d):
        raise ValueError(
            f"A Hadamard rotation needs a power-of-two size, got {d}. For a head_dim that is not a power of two, "
            f"use OscarScaledCache(hadamard_block={largest_pow2_divisor(d)}) (any power of two dividing head_dim), "
            "or give OscarCache rotations for every layer (k_rotations/v_rotations: calibrated ones, or "
            f"hf_kvint2.transforms.block_hadamard_matrix({d}, {largest_pow2_divisor(d)})); head_dim must be a multiple "
            "of 4."
        )
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype=dtype, device=device)


def largest_pow2_divisor(d: int) -> int:
    return d & -d if d > 0 else 0


def block_hadamard_matrix(d: int, block: int | None = None, dtype=torch.float32, device=None) -> torch.Tensor:
    """Block-diagonal normalised Hadamard (OScaR's canalized rotation); ``block=None`` means one block of ``d``."""
    block = d if block is None else block
    if not is_power_of_two(block) or d % block:
        raise ValueError(
            f"hadamard_block={block} must be a power of two dividing head_dim={d} "
            f"(valid: {[2**i for i in range(1, 16) if d % 2**i == 0]})."
        )
    h = hadamard_matrix(block, torch.float64)
    return torch.block_diag(*[h] * (d // block)).to(dtype=dtype, device=device)


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """``perm[i]`` = ``i`` with its ``log2(d)`` bits reversed."""
    bits = int(math.log2(d))
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(d)], dtype=torch.long)


def spectral_rotation(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OSCAR's rotation ``R = U H P`` from a metric ``sigma`` (d x d, float64 recommended).

    ``U`` holds the eigenvectors sorted by descending eigenvalue; ``H`` mixes them; ``P`` sends eigen-direction
    ``i`` (i-th largest) to bit-reversed position ``rev(i)``, which spreads high-variance directions evenly over
    quantization groups. Returns ``(R, eigenvalues_descending)``.
    """
    d = sigma.shape[-1]
    if sigma.shape != (d, d):
        raise ValueError(f"The calibration metric must be square, got shape {tuple(sigma.shape)}.")
    s = sigma.double()
    evals, evecs = torch.linalg.eigh((s + s.T) / 2)
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order], evecs[:, order]
    perm = torch.zeros(d, d, dtype=torch.float64)
    perm[torch.arange(d), bit_reversal_permutation(d)] = 1.0
    return evecs @ hadamard_matrix(d, torch.float64) @ perm, evals


def check_orthogonal(r: torch.Tensor, name: str, atol: float = 1e-4) -> None:
    """Raise if ``r`` is not a finite square orthogonal matrix."""
    if not isinstance(r, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(r).__name__}.")  # noqa: TRY004 (callers catch ValueError)
    if r.layout != torch.strided:
        raise ValueError(f"{name} is a {r.layout} tensor; pass a dense one (r.to_dense()).")
    if r.is_complex() or not r.is_floating_point():
        raise ValueError(f"{name} has dtype {r.dtype}; a rotation is a real floating-point matrix.")
    if r.dim() != 2 or r.shape[0] != r.shape[1] or r.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty square matrix, got shape {tuple(r.shape)}.")
    if not torch.isfinite(r).all():
        raise ValueError(f"{name} contains NaN or Inf.")
    rd = r.double()
    err = (rd @ rd.T - torch.eye(r.shape[0], dtype=torch.float64, device=r.device)).abs().max().item()
    if err > atol:
        raise ValueError(f"{name} is not orthogonal (max |R R^T - I| = {err:.3g} > {atol}).")


def row_quantile(a: torch.Tensor, ratio: float) -> torch.Tensor:
    """Linear-interpolated ``ratio`` quantile of each row of ``a`` (last dim), like ``torch.quantile`` but with
    no size limit."""
    d = a.shape[-1]
    return _quantile_from_top(a.topk(d - math.floor(ratio * (d - 1)), dim=-1).values, d, ratio)


def _quantile_from_top(top: torch.Tensor, d: int, ratio: float) -> torch.Tensor:
    """The ``ratio`` quantile of rows of ``d`` values from ``top``, each row's largest values in descending order
    (at least ``d - floor(ratio * (d - 1))`` of them). ``topk``, not a full sort: ExecuTorch's kernels have no sort,
    and the clip quantiles sit near the top of a row; ``top[..., j]`` is the ``(d - 1 - j)``-th smallest value."""
    pos = ratio * (d - 1)
    i0 = math.floor(pos)
    i1 = min(i0 + 1, d - 1)
    frac = pos - i0
    lo, hi = d - 1 - i0, d - 1 - i1
    return top[..., lo : lo + 1] * (1 - frac) + top[..., hi : hi + 1] * frac


# Clipping never takes a coordinate below this fraction of its row's largest |x|: a row whose energy sits in a few
# coordinates (a constant vector after a Hadamard rotation has it all in one) would otherwise be clipped to the
# quantile of the near-zero rest and come back as zeros.
CLIP_FLOOR = 0.5


def clip_rows(x: torch.Tensor, ratio: float | None) -> torch.Tensor:
    """Clamp each row (last dim) to ``[-tau, tau]``, ``tau`` the ``ratio`` quantile of ``|row|``, but at least
    ``CLIP_FLOOR`` times the row's largest ``|x|`` (no row is erased) and at least the largest minus the second
    largest ``|x|``: clipping trades outliers for the resolution of the rest of the row, and a coordinate that
    carries the row alone (a constant token after a Hadamard rotation) is no outlier. Such a row comes back within
    the INT2 quantizer's bound instead of at half its magnitude; rows whose two largest ``|x|`` are within a factor
    of two clip as before."""
    if ratio is None or ratio >= 1.0:
        return x
    a = x.abs()
    d = a.shape[-1]
    largest = a.topk(max(d - math.floor(ratio * (d - 1)), min(2, d)), dim=-1).values  # descending
    top = largest[..., :1]
    second = largest[..., 1:2] if d > 1 else torch.zeros_like(top)
    tau = torch.maximum(torch.maximum(_quantile_from_top(largest, d, ratio), CLIP_FLOOR * top), top - second)
    return torch.minimum(torch.maximum(x, -tau), tau)


def rotate_tokens(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """The first part of :func:`transform_tokens`: float32 ``(x - mean) @ rotation`` for x [B, H, n, D]."""
    xf = x.float()
    if mean is not None:
        xf = xf - mean[None, :, None, :]
    return xf @ rotation


def transform_tokens(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None, *, clip: float | None,
                     token_scaling: bool, scale_dtype: torch.dtype,
                     all_reduce_sum=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The write path's transform of original-space tokens x [B, H, n, D]: centre, rotate, omni-token scale,
    clip. Returns (float32 transformed x, stored norms [B, n] in ``scale_dtype`` or None).

    The omni-token norm runs over all heads and channels; x is divided by the *stored* (rounded) value so that
    multiplying back on read is exact. A zero norm (a zero row, or one below the scale dtype's range) is stored as
    0, so the token reads back as zeros (its error is at most its own norm); it divides by 1. Norms that overflow
    the scale dtype are refused (:func:`check_norms`). The sum of squares is float64 so that a
    tensor-parallel ``all_reduce_sum`` of per-rank partial sums rounds to the same stored norm as one process.
    """
    xr = rotate_tokens(x, rotation, mean)
    norm = None
    if token_scaling:
        squared = xr.double().square().sum(dim=(1, 3))
        if all_reduce_sum is not None:
            all_reduce_sum(squared)
        norm = squared.sqrt().to(scale_dtype)
        check_norms(norm, scale_dtype)
        stored = as_stored(norm)
        xr = xr / torch.where(stored > 0, stored, torch.ones_like(stored))[:, None, :, None]
    return clip_rows(xr, clip), norm


def check_norms(norm: torch.Tensor, scale_dtype: torch.dtype) -> None:
    """Refuse token norms that did not fit ``scale_dtype`` (stored as inf, they would dequantize to NaN)."""
    if not tracing() and not torch.isfinite(norm).all():
        raise ValueError(f"token norms (over all KV heads and channels of a token) exceed the range of "
                         f"scale_dtype={scale_dtype} (max {torch.finfo(scale_dtype).max:.4g}); pass "
                         "scale_dtype=torch.bfloat16 or torch.float32 to the cache.")
