"""The codes-as-matrices body read (hf_kvint2.code_matmul) against the one dense reference."""

from __future__ import annotations

import torch

from hf_kvint2.code_matmul import CODE_TABLE, body_partial_codes
from hf_kvint2.layers import OscarLayer
from hf_kvint2.quant import pack_int2
from hf_kvint2.read_path import reference_body_partial


def test_code_table_unpacks_every_byte():
    codes = torch.stack(torch.meshgrid(*[torch.arange(4)] * 4, indexing="ij"), dim=-1).reshape(256, 4)
    assert torch.equal(CODE_TABLE[pack_int2(codes).reshape(-1).long()], codes.float())


def test_code_matmul_matches_the_reference():
    """The codes-as-matrices read == the dense reference on every stored layout (per-token groups of 1 and 2 per
    vector, per-channel groups, token norms, key means, a mask, several query rows per KV head, a body ending inside
    a token group, one and several blocks)."""
    from test_attention import LAYOUTS

    for recipe in LAYOUTS.values():
        torch.manual_seed(1)
        layer = OscarLayer(recipe, 0)
        for n in (24, 16):
            layer.update(torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16))
        n_tokens = layer.body_len - 3
        kb, vb = layer.key_body.read(n_tokens), layer.value_body.read(n_tokens)
        for groups, query_len in ((2, 1), (3, 2)):
            q = torch.randn(2, 2 * groups, query_len, 16) @ kb.codec.rotation
            args = {"scaling": 0.3, "key_mean_logits": torch.randn(2, 2 * groups, query_len),
                    "mask": torch.rand(2, 1, query_len, n_tokens) > 0.3}
            ref = reference_body_partial(q, kb, vb, **args)
            for block in (8, 512):
                got = body_partial_codes(q, kb, vb, block_tokens=block, **args)
                torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
