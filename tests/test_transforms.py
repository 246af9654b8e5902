"""Transforms: Hadamard, block Hadamard, OSCAR's spectral rotation, clipping, head_dim errors."""

import pytest
import torch

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.transforms import (
    CLIP_FLOOR,
    bit_reversal_permutation,
    block_hadamard_matrix,
    check_orthogonal,
    clip_rows,
    hadamard_matrix,
    row_quantile,
    spectral_rotation,
)


def _eye(d):
    return torch.eye(d, dtype=torch.float64)


@pytest.mark.parametrize("d", [1, 2, 4, 16, 64, 128, 256])
def test_hadamard_is_normalised_symmetric_orthogonal(d):
    h = hadamard_matrix(d, torch.float64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, _eye(d), atol=1e-12, rtol=0)
    assert torch.allclose(h.abs(), torch.full_like(h, d**-0.5))
    if d > 1:  # Sylvester construction: H_2d = [[H, H], [H, -H]]
        half = hadamard_matrix(d // 2, torch.float64) / 2**0.5
        torch.testing.assert_close(h, torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0))


@pytest.mark.parametrize("d,block", [(64, 16), (64, 64), (80, 16), (96, 32), (128, None)])
def test_block_hadamard_is_block_diagonal_and_orthogonal(d, block):
    h = block_hadamard_matrix(d, block, torch.float64)
    b = d if block is None else block
    torch.testing.assert_close(h @ h.T, _eye(d), atol=1e-12, rtol=0)
    assert torch.equal(h, h.T)
    hb = hadamard_matrix(b, torch.float64)
    for i in range(d // b):
        blk = slice(i * b, (i + 1) * b)
        torch.testing.assert_close(h[blk, blk], hb)
        off = h[blk].clone()
        off[:, blk] = 0
        assert not off.any()


@pytest.mark.parametrize("block", [3, 12, 48, 256])
def test_block_hadamard_rejects_bad_blocks_naming_valid_ones(block):
    with pytest.raises(ValueError, match=r"hadamard_block=\d+ must be a power of two dividing head_dim=80.*16"):
        block_hadamard_matrix(80, block)


def test_bit_reversal_permutation():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reversal_permutation(1).tolist() == [0]
    p = bit_reversal_permutation(64)
    assert sorted(p.tolist()) == list(range(64))
    assert torch.equal(p[p], torch.arange(64))  # an involution


@pytest.mark.parametrize("d", [8, 64])
def test_spectral_rotation_structure(d):
    """R = U H P: orthogonal; eigenvalues returned descending; eigen-direction i (i-th largest) is carried by
    Hadamard column i into position rev(i): U^T R P^T = S H with S a diagonal of signs (eigenvector sign freedom)."""
    g = torch.Generator().manual_seed(d)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    true_evals = torch.linspace(10.0, 0.1, d, dtype=torch.float64) ** 2  # distinct, descending
    sigma = q @ torch.diag(true_evals) @ q.T
    sigma = sigma + 1e-9 * torch.randn(d, d, generator=g, dtype=torch.float64)  # slightly asymmetric input
    r, evals = spectral_rotation(sigma)
    torch.testing.assert_close(r @ r.T, _eye(d), atol=1e-10, rtol=0)
    torch.testing.assert_close(evals, true_evals, atol=1e-6, rtol=1e-6)
    perm = torch.zeros(d, d, dtype=torch.float64)
    perm[torch.arange(d), bit_reversal_permutation(d)] = 1.0
    signs = q.T @ r @ perm.T @ hadamard_matrix(d, torch.float64).T
    torch.testing.assert_close(signs.abs(), _eye(d), atol=1e-6, rtol=0)


def test_spectral_rotation_rejects_non_square():
    with pytest.raises(ValueError, match="square"):
        spectral_rotation(torch.zeros(4, 8))


def test_check_orthogonal():
    check_orthogonal(hadamard_matrix(16), "R")
    with pytest.raises(ValueError, match="R_K of layer 3 is not orthogonal"):
        check_orthogonal(2 * torch.eye(16), "R_K of layer 3")
    with pytest.raises(ValueError, match="square"):
        check_orthogonal(torch.eye(16)[:8], "R")
    bad = torch.eye(4)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_orthogonal(bad, "R")


def test_row_quantile_matches_torch_and_clip_bounds_rows():
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    for ratio in (0.5, 0.92, 0.96, 1.0):
        torch.testing.assert_close(row_quantile(x, ratio), torch.quantile(x, ratio, dim=-1, keepdim=True))
    # the quantile, but at least CLIP_FLOOR x the row's largest |x| (no row is erased) and at least the largest
    # minus the second largest |x| (a coordinate that carries the row alone is no outlier)
    top2 = x.abs().topk(2, dim=-1).values
    tau = torch.maximum(torch.maximum(torch.quantile(x.abs(), 0.9, dim=-1, keepdim=True), CLIP_FLOOR * top2[:, :1]),
                        top2[:, :1] - top2[:, 1:])
    c = clip_rows(x, 0.9)
    torch.testing.assert_close(c.abs().amax(dim=-1, keepdim=True), tau)
    inside = x.abs() <= tau
    assert torch.equal(c[inside], x[inside])  # only the outliers move
    assert torch.equal(clip_rows(x, None), x) and torch.equal(clip_rows(x, 1.0), x)
    rows = torch.zeros(3, 64)
    rows[0, 5] = 3.0  # its energy in one coordinate: nothing to clip
    rows[1, 7], rows[1, 9] = -3.0, 0.25  # nearly so: it loses the second largest |x| at most
    rows[2, 5], rows[2, 6] = 3.0, 2.0  # two comparable coordinates: CLIP_FLOOR, as for any row
    c = clip_rows(rows, 0.9)
    assert torch.equal(c[0], rows[0])
    assert c[1, 7] == -2.75 and c[1, 9] == 0.25
    assert c[2, 5] == 1.5 and c[2, 6] == 1.5


def test_row_quantile_takes_the_sorted_rows_order_statistics_without_a_sort():
    """Bit for bit the interpolation of a full sort's neighbours (ties and one-channel rows included), computed from
    the top of each row: the traced graph has no sort, nor has clip_rows' (ExecuTorch's portable kernels have none)."""
    import math

    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0, :8] = 0.25  # ties
    for d in (1, 2, 7, 64):
        for ratio in (0.0, 0.3, 0.92, 0.96, 0.999, 1.0):
            a = x[..., :d].abs()
            srt, pos = a.sort(dim=-1).values, ratio * (d - 1)
            i0 = math.floor(pos)
            i1, frac = min(i0 + 1, d - 1), pos - i0
            assert torch.equal(row_quantile(a, ratio), srt[..., i0:i0 + 1] * (1 - frac) + srt[..., i1:i1 + 1] * frac)

    class Quantile(torch.nn.Module):
        def forward(self, a):
            return row_quantile(a, 0.96), clip_rows(a, 0.96)

    graph = torch.export.export(Quantile(), (x.abs(),)).run_decompositions({}).graph
    assert not [n for n in graph.nodes if "sort" in str(n.target)]


@pytest.mark.parametrize("d", [80, 96, 48])
def test_non_power_of_two_head_dim_error_names_working_settings(d):
    with pytest.raises(ValueError, match=rf"power-of-two size, got {d}.*hadamard_block={d & -d}.*k_rotations"):
        hadamard_matrix(d)
    k = torch.randn(1, 2, 3, d)
    # each cache names its own fix (OscarCache takes no hadamard_block)
    for cache, fix in ((OscarScaledCache(), rf"hadamard_block={d & -d}"), (OscarCache(), "k_rotations")):
        with pytest.raises(ValueError, match=fix):
            cache.update(k, k.clone(), 0)


@pytest.mark.parametrize("d,block", [(80, 16), (96, 32)])
def test_non_power_of_two_head_dim_works_with_a_hadamard_block(d, block):
    """The settings the error names do work: block Hadamard for OScaR, and OSCAR given (block Hadamard or
    any orthogonal) rotations."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 40, d, generator=g), torch.randn(2, 2, 40, d, generator=g)
    caches = [
        OscarScaledCache(hadamard_block=block, value_group_size=16, sink_tokens=0, recent_tokens=8, group_size=8),
        OscarCache(k_rotations=[block_hadamard_matrix(d, block)], v_rotations=[block_hadamard_matrix(d, block)],
                   sink_tokens=4, recent_tokens=8),
        OscarCache(k_rotations=[torch.eye(d)], v_rotations=[torch.eye(d)], sink_tokens=4, recent_tokens=8),
    ]
    for cache in caches:
        keys, _values = cache.update(k, v, 0)
        torch.testing.assert_close(keys, k)  # the current chunk is attended at full precision
        keys, _values = cache.update(k[:, :, :1], v[:, :, :1], 0)
        assert keys.shape == (2, 2, 41, d) and cache.layers[0].body_len > 0
        rel = (keys[:, :, :40] - k).norm() / k.norm()
        assert rel < 0.6, f"{cache}: relative error {rel:.3f}"  # INT2 of Gaussian data: about 0.3-0.45
