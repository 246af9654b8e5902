"""The quality harness: protocol correctness (chunked == plain forward), stacking and shared prefill exactness,
bits accounting, passkey prompts, and the whole benchmark pipeline on a tiny random model."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.evaluation import (
    ByteTokenizer,
    CacheMethod,
    _answer_correct,
    bits_at_length,
    chunked_perplexity,
    engine_cache,
    eval_windows,
    greedy_agreement,
    kivi2_recipe,
    load_text,
    passkey_prompts,
    plain_perplexity,
    standard_methods,
    with_key_token_scaling,
)
from hf_kvint2.layers import OscarLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def windows():
    return eval_windows(ByteTokenizer().encode(load_text("emma.txt")[:200_000]), 2, 448)


def _method(key, factory, batched=True):
    return CacheMethod(key, key, factory, batched)


FP = _method("fp", lambda cfg: DynamicCache(config=cfg))


def test_chunked_full_precision_equals_plain_forward(tiny, windows):
    chunked = chunked_perplexity(tiny, windows, [FP], prefill=128, chunk=32, progress=False)["fp"]
    plain = plain_perplexity(tiny, windows, prefill=128, progress=False)
    assert chunked.tokens == plain.tokens == [448 - 128] * 2
    assert abs(chunked.perplexity / plain.perplexity - 1) < 1e-3
    for a, b in zip(chunked.window_perplexities, plain.window_perplexities):
        assert abs(a / b - 1) < 1e-3


def test_stacking_and_batching_do_not_change_results(tiny, windows):
    scaled = _method("scaled", lambda cfg: OscarScaledCache(config=cfg))
    scaled_rows = _method("scaled_rows", lambda cfg: OscarScaledCache(config=cfg), batched=False)
    hadamard = _method("hadamard", lambda cfg: OscarCache(config=cfg))
    together = chunked_perplexity(tiny, windows, [FP, scaled, scaled_rows, hadamard], 128, 32, progress=False)
    alone = chunked_perplexity(tiny, windows, [hadamard], 128, 32, progress=False)["hadamard"]
    assert abs(together["scaled"].perplexity / together["scaled_rows"].perplexity - 1) < 1e-5
    assert abs(together["hadamard"].perplexity / alone.perplexity - 1) < 1e-5
    assert together["scaled"].perplexity != together["fp"].perplexity  # quantization did happen
    assert together["scaled"].bits_per_element < 16  # 448 tokens, 64 + 128 of them in the fp32 sink and residual


def test_stacked_body_dequantized_once_equals_the_portable_view(tiny, windows, monkeypatch):
    """The stacked cache dequantizes each body token once (_DequantizedBody) instead of the whole body at every
    chunk; what the attention gets is the layer's own portable view (up to the de-rotation's rounding), for
    per-token and per-channel layouts, token scaling, calibrated means and a key basis settled at the first
    demotion, and the perplexities are those of the plain portable path."""
    from hf_kvint2 import evaluation
    from hf_kvint2.evaluation import StackedCache, hadamard_only_recipe

    d = 32
    means = [torch.randn(2, d) for _ in range(2)]
    methods = [FP, _method("scaled", lambda cfg: OscarScaledCache(config=cfg)),
               _method("hadamard", lambda cfg: OscarCache(config=cfg)),  # uncalibrated: the key basis settles
               _method("kivi2", lambda cfg: engine_cache(kivi2_recipe(d), cfg)),
               _method("centred", lambda cfg: engine_cache(hadamard_only_recipe(d).with_overrides(
                   key_mean=means[0], value_mean=means[1]), cfg))]
    # the K/V the attention reads, chunk by chunk: stacked (dequantized once) vs each cache's own update()
    gen = torch.Generator().manual_seed(0)
    stacked = StackedCache([(m.make_cache(tiny.config), slice(2 * i, 2 * i + 2)) for i, m in enumerate(methods)], 2)
    alone = [m.make_cache(tiny.config) for m in methods]
    uneven = torch.ones(d)
    uneven[:3] = 30.0  # a few wide key channels: the uncalibrated cache switches to the model basis
    for n in [400, 32, 64, 1, 96, 128]:
        k, v = (torch.randn(2 * len(methods), 2, n, d, generator=gen) for _ in range(2))
        k = k * uneven
        for idx in range(2):
            got_k, got_v = stacked.update(k, v, idx)
            for i, cache in enumerate(alone):
                ref_k, ref_v = cache.update(k[2 * i:2 * i + 2], v[2 * i:2 * i + 2], idx)
                torch.testing.assert_close(got_k[2 * i:2 * i + 2], ref_k, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(got_v[2 * i:2 * i + 2], ref_v, rtol=1e-6, atol=1e-6)
    assert all(layer.body_len > 0 for c, _ in stacked.parts[1:] for layer in c.layers)
    assert stacked.parts[2][0].layers[0].recipe.key.axis == "channel"  # the key basis settled (a new stream)
    fast = chunked_perplexity(tiny, windows, methods, 128, 32, progress=False)
    monkeypatch.setattr(evaluation._StackedLayer, "_update_part",
                        lambda self, cache, body, k, v, args, kwargs: cache.update(k, v, self.layer_idx, *args,
                                                                                   **kwargs))
    plain = chunked_perplexity(tiny, windows, methods, 128, 32, progress=False)
    for m in methods:
        assert fast[m.key].nll_sum == pytest.approx(plain[m.key].nll_sum, rel=1e-7)
        assert fast[m.key].bits_per_element == plain[m.key].bits_per_element


def test_shared_prefill_replay_equals_a_real_prefill(tiny, windows):
    """The harness replays one full-precision prefill into each cache; a prefill forward through the cache itself
    must give the same cache contents and the same next-chunk logits."""
    ids = windows[:1, :320]
    with torch.no_grad():
        real = OscarCache(config=tiny.config)
        tiny(ids[:, :256], past_key_values=real, use_cache=True)
        fp = DynamicCache(config=tiny.config)
        tiny(ids[:, :256], past_key_values=fp, use_cache=True)
        replay = OscarCache(config=tiny.config)
        for idx, layer in enumerate(fp.layers):
            replay.update(layer.keys, layer.values, idx)
        a = tiny(ids[:, 256:], past_key_values=real, use_cache=True).logits
        b = tiny(ids[:, 256:], past_key_values=replay, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bits_per_element(tiny):
    cfg = tiny.config
    assert bits_at_length(FP, cfg, 512) == 32.0
    kivi = _method("kivi", lambda c: engine_cache(kivi2_recipe(32), c))
    # KIVI-2 at head_dim 32: codes 2 bits + fp16 scale/lo per 32 elements (K: per channel over 32 tokens, V: per
    # token over 32 channels) = 3 bits, plus the 128-token full-precision residual (32 bits) -> 3 + 29 * 128 / T.
    t = 4096
    assert bits_at_length(kivi, cfg, t) == pytest.approx(3 + 29 * 128 / t, rel=1e-6)
    assert 2.0 < bits_at_length(_method("o", lambda c: OscarCache(config=c)), cfg, t) < 8.0
    # the linear extrapolation from two probe lengths equals a direct fill
    for m in (kivi, _method("o", lambda c: OscarCache(config=c)), _method("s", lambda c: OscarScaledCache(config=c))):
        assert bits_at_length(m, cfg, t, probes=(1024, 2048)) == pytest.approx(bits_at_length(m, cfg, t), rel=1e-9)


def test_with_key_token_scaling_adds_norms_to_a_calibrated_cache(tiny, windows):
    rots = [torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0].float() for _ in range(2)]
    calibrated = lambda cfg: OscarCache(config=cfg, k_rotations=rots, v_rotations=rots)
    methods = standard_methods(tiny.config, calibrated, transformers_backends=())
    keys = [m.key for m in methods]
    assert keys[:4] == ["fp", "oscar_scaled", "oscar", "oscar_token_scaling"]
    cache = next(m for m in methods if m.key == "oscar_token_scaling").make_cache(tiny.config)
    assert all(layer.recipe.key.token_scaling and not layer.recipe.value.token_scaling for layer in cache.layers)
    assert torch.equal(cache.layers[1].recipe.key_rotation, rots[1])
    with torch.no_grad():
        tiny(windows[:1, :400], past_key_values=cache, use_cache=True)
    assert isinstance(cache.layers[0], OscarLayer) and cache.memory_report()["total"]["norms"] > 0
    with pytest.raises(ValueError, match="fresh cache"):
        with_key_token_scaling(cache)


def test_greedy_agreement_reference_is_exact(tiny, windows):
    res = greedy_agreement(tiny, windows[:, :200], [FP, _method("fp2", lambda cfg: DynamicCache(config=cfg))],
                           new_tokens=6, progress=False)
    assert res["fp"]["agreement"] == 1.0 and res["fp2"]["agreement"] == 1.0
    assert res["fp"]["mean_identical_prefix"] == 6.0


def test_passkey_prompts_place_the_needle():
    tok = ByteTokenizer()
    hay = load_text("sensesensibility.txt")[:20_000]
    prompts = passkey_prompts(tok, hay, 2000, [0.0, 0.5, 1.0], seed=3)
    for p in prompts:
        assert len(p.ids) == 2000 and len(p.key) == 5
        text = tok.decode(p.ids)
        assert text.count(p.key) == 3 and text.endswith("The pass key is")
    assert prompts[0].needle_position < prompts[1].needle_position < prompts[2].needle_position
    assert _answer_correct(" 12345.\n", "12345") and not _answer_correct(" 1234 5", "12345")
    assert not _answer_correct(" none", "12345")
    with pytest.raises(ValueError, match="haystack tokens"):
        passkey_prompts(tok, hay, 50, [0.5])


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="calibration text"):
        load_text("prideprejudice.txt")
    with pytest.raises(ValueError, match="fewer than one window"):
        eval_windows(list(range(100)), 2, 200)


def test_quick_pipeline_writes_sane_outputs(tmp_path):
    import quality

    out = tmp_path / "q"
    quality.main(["--quick", "--out", str(out), "--methods", "fp,oscar_scaled,hadamard,kivi2,naive"])
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == ["fp", "oscar_scaled", "hadamard", "kivi2", "naive"]
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert len(r["window_perplexities"]) == result["protocol"]["windows"] == 2
        assert r["scored_tokens"] == 2 * (512 - 128)
        assert 1 < r["bits_per_element_16bit"] <= r["bits_per_element"] <= 32
        assert set(r["passkey"]["per_length"]) == {"384", "512"}
        assert 0 <= r["agreement"]["agreement"] <= 1
    assert rows["fp"]["delta_pct"] == 0 and rows["fp"]["agreement"]["agreement"] == 1.0
    assert rows["fp"]["bits_per_element"] == 32 and rows["oscar_scaled"]["bits_per_element"] < 8
    assert result["plain_forward_check"]["relative_difference"] < 1e-3
    table = out.with_suffix(".md").read_text()
    assert sum(line.startswith("| ") for line in table.splitlines()) == 1 + len(rows)
    assert "Δ vs full precision" in table
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --update keeps earlier rows and a hand-written provenance note (also in the table's footer)
    out.with_suffix(".json").write_text(json.dumps({**result, "note": "naive row measured elsewhere"}))
    quality.main(["--quick", "--out", str(out), "--methods", "fp,naive", "--skip", "plain,agreement,passkey",
                  "--update"])
    merged = json.loads(out.with_suffix(".json").read_text())
    assert [r["key"] for r in merged["rows"]] == list(rows) and len(merged["runs"]) == 2
    assert merged["note"] == "naive row measured elsewhere"
    assert out.with_suffix(".md").read_text().rstrip().endswith("naive row measured elsewhere")


@pytest.mark.slow
def test_smollm2_chunked_equals_plain_forward():
    from hf_kvint2.models import load_smollm2

    model, tok = load_smollm2(torch.float32, attn_implementation="sdpa")
    ids = eval_windows(tok.encode(load_text("emma.txt")[:60_000], add_special_tokens=False), 1, 768)
    chunked = chunked_perplexity(model, ids, [FP], prefill=256, chunk=32, progress=False)["fp"]
    plain = plain_perplexity(model, ids, prefill=256, progress=False)
    assert abs(chunked.perplexity / plain.perplexity - 1) < 1e-3


def test_hybrid_model_stacks_sliding_layers_and_counts_quantized_layer_bits(windows):
    """Gemma 3-style stack (sliding layers window 64): the stacked caches report each layer's kind, so the masks
    fit (chunked == plain forward with sliding layers past their window), and bits/element covers the
    full-attention layers (the sliding windows are the same full-precision window in every method)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=64,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              max_position_embeddings=1024, attn_implementation="sdpa")
    model = Gemma3ForCausalLM(config).eval()
    methods = [FP, _method("oscar_scaled", lambda cfg: OscarScaledCache(config=cfg))]
    got = chunked_perplexity(model, windows, methods, prefill=128, chunk=32, progress=False)
    plain = plain_perplexity(model, windows, prefill=128, progress=False)
    assert abs(got["fp"].perplexity / plain.perplexity - 1) < 1e-3
    assert got["fp"].bits_per_element == 32.0  # the one full-attention layer, fp32
    spans = got["fp"].position_spans  # perplexity by position: the spans cover every scored token once
    assert spans[0][0] == 128 and spans[-1][1] == windows.shape[1]
    assert sum(n for *_, n in spans) == sum(got["fp"].tokens)
    assert sum(s for _, _, s, _ in spans) == pytest.approx(sum(got["fp"].nll_sum), rel=1e-12)
    # score_every=k: the output head runs only at every k-th predicted position; same NLL there as a plain forward
    sampled = chunked_perplexity(model, windows, [FP], prefill=128, chunk=32, progress=False, score_every=8)["fp"]
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).logits.float(), -1)
    pos = torch.arange(128, windows.shape[1], 8)
    ref = -logp[:, pos - 1].gather(-1, windows[:, pos, None]).squeeze(-1).double().sum(-1)
    assert sampled.tokens == [len(pos)] * 2
    assert sampled.nll_sum == pytest.approx(ref.tolist(), rel=1e-4)
    assert math.isfinite(got["oscar_scaled"].perplexity)
    # a chunked full-precision prefill (long prompts) restores the sliding windows with the tokens they have seen
    from hf_kvint2.evaluation import full_precision_prefill, stacked_caches

    prompt = windows[:, :300]
    kv, last = full_precision_prefill(model, prompt, batch_size=1, chunk=64)
    assert len(kv[0]) == 3 and kv[0][2] == 300 and len(kv[1]) == 2  # sliding: (K, V, seen); full: (K, V)
    stacked = stacked_caches(methods, config, 2, kv)
    with torch.no_grad():
        ref = model(windows[:, :301]).logits[:, -1]
        got = model(windows[:, 300:301].repeat(2, 1), past_key_values=stacked).logits[:, -1]
        assert torch.allclose(last, model(prompt).logits[:, -1], atol=1e-4)
    assert torch.allclose(got[:2], ref, atol=1e-4)  # the full-precision rows
    fp16 = bits_at_length(methods[0], config, 4096, dtype=torch.float16)
    assert fp16 == 16.0
    assert 2.0 < bits_at_length(methods[1], config, 4096, dtype=torch.float16) < 4.0
