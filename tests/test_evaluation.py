"""The quality harness: protocol correctness (chunked == plain forward), each method read through its own cache and
the "oscar" attention as a user runs it, shared prefill exactness, bits accounting, passkey prompts, and the whole
benchmark pipeline on a tiny random model."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvint2 import OscarCache, OscarScaledCache, steps
from hf_kvint2.evaluation import (
    ByteTokenizer,
    CacheMethod,
    _answer_correct,
    bits_at_length,
    chunked_perplexity,
    engine_cache,
    eval_windows,
    greedy_agreement,
    load_text,
    passkey_prompts,
    plain_perplexity,
    standard_methods,
    with_key_token_scaling,
)
from hf_kvint2.layers import OscarLayer
from hf_kvint2.perplexity import full_precision_prefill, method_caches, token_nll
from hf_kvint2.settings import hadamard_only_recipe, kivi2_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module", autouse=True)
def torch_body():
    """The caches' bodies read by the PyTorch backend: what is tested here is the protocol, on tiny models whose
    layouts the Numba kernel would first compile (the kernel is tested against the reference in test_attention)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_KVINT2_CPU_KERNEL", "torch")
        yield


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


def test_methods_measure_alone_what_they_measure_together(tiny, windows):
    """Each method runs through its own cache(s): one cache for all windows or one per window (batched=False) give
    the same perplexity, and a method measured beside others gives what it gives alone."""
    scaled = _method("scaled", lambda cfg: OscarScaledCache(config=cfg))
    scaled_rows = _method("scaled_rows", lambda cfg: OscarScaledCache(config=cfg), batched=False)
    hadamard = _method("hadamard", lambda cfg: OscarCache(config=cfg))
    together = chunked_perplexity(tiny, windows, [FP, scaled, scaled_rows, hadamard], 128, 32, progress=False)
    alone = chunked_perplexity(tiny, windows, [hadamard], 128, 32, progress=False)["hadamard"]
    assert abs(together["scaled"].perplexity / together["scaled_rows"].perplexity - 1) < 1e-5
    assert together["hadamard"].nll_sum == alone.nll_sum
    assert together["scaled"].perplexity != together["fp"].perplexity  # quantization did happen
    assert together["scaled"].bits_per_element < 16  # 448 tokens, 64 + 128 of them in the fp32 sink and residual


def test_the_harness_reads_each_cache_as_a_user_runs_it(tiny, windows, monkeypatch):
    """What chunked_perplexity measures for a cache is what a user gets: a model with the "oscar" attention, a real
    prefill forward and then the chunks through that cache (per-token and per-channel layouts, token scaling,
    calibrated means, a key basis settled at the first demotion, KIVI-2 as a recipe of the same layer). Every
    chunk after the prefill reads the INT2 body through the fused read path (LayerStep.attend), never through the
    portable view; the model's own attention implementation is restored afterwards."""
    d = 32
    means = [torch.randn(2, d, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    methods = [_method("scaled", lambda cfg: OscarScaledCache(config=cfg)),
               _method("hadamard", lambda cfg: OscarCache(config=cfg)),  # uncalibrated: the key basis settles
               _method("kivi2", lambda cfg: engine_cache(kivi2_recipe(d), cfg)),
               _method("centred", lambda cfg: engine_cache(hadamard_only_recipe(d).with_overrides(
                   key_mean=means[0], value_mean=means[1]), cfg))]
    attends, views = [], []
    monkeypatch.setattr(steps.LayerStep, "attend", lambda self, *a, _f=steps.LayerStep.attend: attends.append(1)
                        or _f(self, *a))
    monkeypatch.setattr(steps.LayerStep, "_view", lambda self, _f=steps.LayerStep._view: views.append(
        self.body_tokens) or _f(self))
    prefill, chunk = 128, 32
    got = chunked_perplexity(tiny, windows, methods, prefill, chunk, progress=False)
    assert tiny.config._attn_implementation == "sdpa"
    assert attends and not any(views)  # no portable view of a layer with an INT2 body
    by_user = []
    tiny.set_attn_implementation("oscar")
    try:
        with torch.no_grad():
            for m in methods:
                cache = m.make_cache(tiny.config)
                logits = [tiny(windows[:, :prefill], past_key_values=cache, use_cache=True).logits[:, -1:]]
                for start in range(prefill, windows.shape[1], chunk):
                    logits.append(tiny(windows[:, start:start + chunk], past_key_values=cache, use_cache=True).logits)
                nll = token_nll(torch.cat(logits, 1)[:, :-1], windows[:, prefill:])
                by_user.append(nll.sum(-1).tolist())
    finally:
        tiny.set_attn_implementation("sdpa")
    for m, nll in zip(methods, by_user):
        assert got[m.key].nll_sum == pytest.approx(nll, rel=1e-6), m.key


def test_shared_prefill_replay_equals_a_real_prefill(tiny, windows):
    """The harness replays one full-precision prefill into each cache; a prefill forward through the cache itself
    must give the same cache contents and the same next-chunk logits, read with the "oscar" attention."""
    ids = windows[:1]
    method = _method("oscar", lambda cfg: OscarCache(config=cfg))
    tiny.set_attn_implementation("oscar")
    try:
        with torch.no_grad():
            real = method.make_cache(tiny.config)
            tiny(ids[:, :400], past_key_values=real, use_cache=True)
            kv, _ = full_precision_prefill(tiny, ids[:, :400])
            [(replay, _)] = method_caches(method, tiny.config, 1, kv)
            for a, b in zip(real.layers, replay.layers):
                assert a.body_len == b.body_len > 0
                assert torch.equal(a.key_body.read(a.body_len).codes, b.key_body.read(b.body_len).codes)
                assert torch.equal(a.recent_k, b.recent_k)
            a = tiny(ids[:, 400:], past_key_values=real, use_cache=True).logits
            b = tiny(ids[:, 400:], past_key_values=replay, use_cache=True).logits
    finally:
        tiny.set_attn_implementation("sdpa")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stack", ["llama", "gemma3"])
def test_replayed_first_layers_give_the_losses_of_a_full_run(stack, windows):
    """``same_first_layers``: a method whose first n layers have the first method's recipes is measured with those
    layers replayed from the first method's run (they do not run again: only their caches are fed the K/V that run
    stored). The losses are those of a full run, bit for bit, on a plain stack and on a Gemma 3-style one whose
    replayed layer is a sliding window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from hf_kvint2 import GroupLayout

    torch.manual_seed(0)
    if stack == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
        quantized = [0, 1, 2]
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, sliding_window=64, max_position_embeddings=1024,
            layer_types=["sliding_attention", "full_attention", "full_attention"], attn_implementation="sdpa"))
        quantized = [1, 2]
    model.eval()
    fitted = (GroupLayout("token", 32, 0.96), GroupLayout("token", 32, 0.92))
    other = (GroupLayout("channel", 32, None), GroupLayout("token", 16, None))

    def method(key, changed=None):
        layouts = [(other if i == changed else fitted) if i in quantized else None for i in range(3)]
        return _method(key, lambda cfg: OscarCache(config=cfg, sink_tokens=8, recent_tokens=32,
                                                   layer_layouts=layouts))

    methods = [method("fitted"), method("layer 1", changed=1), method("layer 2", changed=2)]
    full = chunked_perplexity(model, windows, methods, prefill=128, chunk=32, progress=False)
    calls = []
    hooks = [layer.self_attn.register_forward_hook(lambda *_, i=i: calls.append(i))
             for i, layer in enumerate(model.model.layers)]
    replayed = chunked_perplexity(model, windows, methods, prefill=128, chunk=32, progress=False,
                                  same_first_layers={"layer 1": 1, "layer 2": 2})
    for hook in hooks:
        hook.remove()
    chunks = len(range(128, windows.shape[1], 32))
    # each layer once in the shared prefill, then layer 0 in one method's chunks, layer 1 in two, layer 2 in three
    assert [calls.count(i) for i in range(3)] == [1 + chunks, 1 + 2 * chunks, 1 + 3 * chunks]
    for key in full:
        assert replayed[key].nll_sum == full[key].nll_sum, key
    assert full["layer 1"].nll_sum != full["fitted"].nll_sum  # the variants do differ
    with pytest.raises(ValueError, match="not methods after the first"):
        chunked_perplexity(model, windows, methods, 128, 32, progress=False, same_first_layers={"fitted": 1})


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


def test_hybrid_model_reads_sliding_layers_and_counts_quantized_layer_bits(windows):
    """Gemma 3-style stack (sliding layers window 64): the masks fit each layer's kind (chunked == plain forward
    with sliding layers past their window), and bits/element covers the full-attention layers (the sliding windows
    are the same full-precision window in every method)."""
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
    prompt = windows[:, :300]
    kv, last = full_precision_prefill(model, prompt, batch_size=1, chunk=64)
    assert len(kv[0]) == 3 and kv[0][2] == 300 and len(kv[1]) == 2  # sliding: (K, V, seen); full: (K, V)
    [(fp_cache, _)] = method_caches(methods[0], config, 2, kv)
    with torch.no_grad():
        ref = model(windows[:, :301]).logits[:, -1]
        got = model(windows[:, 300:301], past_key_values=fp_cache).logits[:, -1]
        assert torch.allclose(last, model(prompt).logits[:, -1], atol=1e-4)
    assert torch.allclose(got, ref, atol=1e-4)
    fp16 = bits_at_length(methods[0], config, 4096, dtype=torch.float16)
    assert fp16 == 16.0
    assert 2.0 < bits_at_length(methods[1], config, 4096, dtype=torch.float16) < 4.0
