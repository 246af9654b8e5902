"""Left-padded batches: padding never enters a quantization group, each row keeps its own first sink tokens at full
precision, and each row's logits stay close to the row run alone (hf_kvint2.padding)."""

from __future__ import annotations

import pytest
import torch

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.padding import left_padding, position_ids_of_update

CACHES = {"oscar": lambda: OscarCache(sink_tokens=4, recent_tokens=8),
          "scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=8)}


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' generate derives them from a left-padded attention mask."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def test_left_padding_from_position_ids():
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert left_padding(generate_positions(mask), 5) == 4
    assert left_padding(generate_positions(mask[:2]), 5) == 2
    assert left_padding(torch.arange(5)[None], 5) == 0
    assert left_padding(torch.arange(100, 105)[None], 5) == 0  # a chunk that continues a sequence: no padding
    assert left_padding(None, 5) == 0
    positions = generate_positions(mask)
    assert position_ids_of_update((), {"kwargs": {"position_ids": positions}}) is positions  # transformers >= 5.24
    assert position_ids_of_update(({"position_ids": positions},), {}) is positions
    assert position_ids_of_update(({"cache_position": torch.arange(5)},), {}) is None  # earlier 5.x: unknown


@pytest.mark.parametrize("name", CACHES)
def test_the_most_padded_row_stores_exactly_what_it_stores_alone(name):
    """Its body starts at the same real token as alone, so every code, scale and norm is the same; the padding is
    held in the widened sink."""
    g = torch.Generator().manual_seed(0)
    n, pads = 40, (0, 3, 7)
    real = [torch.randn(2, 2, n - p, 16, generator=g) for p in pads]  # [K|V, heads, tokens, head_dim] per row
    k = torch.stack([torch.cat([torch.randn(2, p, 16, generator=g) * 50, r[0]], dim=1) for r, p in zip(real, pads)])
    v = torch.stack([torch.cat([torch.randn(2, p, 16, generator=g) * 50, r[1]], dim=1) for r, p in zip(real, pads)])
    mask = torch.stack([torch.cat([torch.zeros(p), torch.ones(n - p)]) for p in pads])
    batched = CACHES[name]()
    batched.update(k, v, 0, kwargs={"position_ids": generate_positions(mask)})
    layer = batched.layers[0]
    assert layer.left_padding == 7 and layer.sink_k.shape[-2] == layer.recipe.sink_tokens + 7
    alone = CACHES[name]()
    alone.update(real[2][0][None], real[2][1][None], 0, kwargs={"position_ids": torch.arange(n - 7)[None]})
    ref = alone.layers[0]
    assert ref.left_padding == 0 and ref.body_len == layer.body_len > 0
    for got, want in ((layer.key_body, ref.key_body), (layer.value_body, ref.value_body)):
        for b_got, b_want in zip(got.buffers(), want.buffers()):
            assert torch.equal(b_got.view()[2], b_want.view()[0])
    for r, p in enumerate(pads):  # every row's first sink_tokens real tokens are in the sink, at full precision
        s = layer.recipe.sink_tokens
        assert torch.equal(layer.sink_k[r, :, p:p + s], real[r][0][:, :s])


def teacher_forced_logprobs(model, ids, mask, cache, prefill):
    """Log-probabilities of each next token, the first ``prefill`` tokens in one forward, then chunks of 8."""
    out, positions = [], generate_positions(mask)
    with torch.no_grad():
        for start, stop in [(0, prefill)] + [(s, min(s + 8, ids.shape[1])) for s in range(prefill, ids.shape[1], 8)]:
            logits = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                           position_ids=positions[:, start:stop], cache=cache, use_cache=True).logits
            out.append(torch.log_softmax(logits.float(), -1))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attn", ["sdpa", "oscar"])
@pytest.mark.parametrize("name", CACHES)
def test_each_rows_logits_match_the_row_alone(tiny_model, single_thread, name, attn):
    model = tiny_model("llama", attn=attn)
    g = torch.Generator().manual_seed(1)
    n, pads, prefill = 72, (0, 5, 19), 40
    rows = [torch.randint(3, 128, (n - p,), generator=g) for p in pads]
    ids = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), r]) for r, p in zip(rows, pads)])
    mask = (torch.arange(n)[None] >= torch.tensor(pads)[:, None]).long()
    batched = teacher_forced_logprobs(model, ids, mask, CACHES[name](), prefill)
    for r, (row, p) in enumerate(zip(rows, pads)):
        alone = teacher_forced_logprobs(model, row[None], torch.ones(1, n - p, dtype=torch.long), CACHES[name](),
                                        prefill - p)
        full = teacher_forced_logprobs(model, row[None], torch.ones(1, n - p, dtype=torch.long), None, prefill - p)
        diff = (batched[r, p:] - alone[0]).abs().max().item()
        quant_error = (alone[0] - full[0]).abs().max().item()
        if p == max(pads):  # stores exactly what it stores alone
            assert diff < 1e-3, f"row {r}: {diff}"
        else:  # only the group alignment moved (and more tokens kept at full precision)
            assert diff < 0.5 * quant_error, f"row {r}: {diff} vs quantization error {quant_error}"


def test_generate_detects_the_padding(tiny_model, single_thread):
    model = tiny_model("llama", attn="oscar")
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    cache = OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=8)
    model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False)
    assert all(layer.left_padding == 9 for layer in cache.layers)
