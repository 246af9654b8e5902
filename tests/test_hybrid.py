"""Hybrid models (sliding-window + full-attention layers, Gemma 3): windowed layers stay a full-precision window,
full-attention layers are quantized, in the dynamic caches (with and without ``config=``, on the "oscar" and the
SDPA paths), in the static/export caches, in ``memory_report`` and in every generation mode of the cache contract
(tests/test_cache_contract.py). On the tiny Gemma 3 of tests/test_gemma3.py (window 32); the bundled Gemma 3 270M
is measured by ``benchmarks/hybrid_gemma3.py``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import tiny_config
from test_cache_contract import MODES
from test_gemma3 import LAYER_TYPES, tiny_gemma3
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_kvint2  # noqa: F401  (registers "oscar")
import hf_kvint2.cache as cache_module
from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.export import OscarExportableModule, export_decoder, generate
from hf_kvint2.layers import OscarLayer
from hf_kvint2.model_config import QUANTIZED, WINDOWED, layer_plan, quantized_layers
from hf_kvint2.static_cache import StaticOscarCache
from hf_kvint2.transforms import block_hadamard_matrix
from hf_kvint2.window_layer import StaticWindowLayer, WindowLayer, window_memory_bytes

pytestmark = pytest.mark.usefixtures("module_single_thread")

WINDOW = 32  # tiny_gemma3's sliding window
ALL_TOKENS = 4096  # a recent window longer than any sequence here: quantization off
KINDS = {
    "scaled": lambda **kw: OscarScaledCache(**{"sink_tokens": 0, "recent_tokens": 8, "group_size": 8, **kw}),
    # given rotations: no key basis is settled from the data, so the static layer stores the dynamic layer's codes
    "oscar": lambda **kw: OscarCache(**{"sink_tokens": 4, "recent_tokens": 8, "k_rotations": [_H] * 4,
                                        "v_rotations": [_H] * 4, **kw}),
}
_H = block_hadamard_matrix(64, 64)


@pytest.fixture(scope="module")
def model():
    m = tiny_gemma3()
    m.generation_config.pad_token_id = 0
    return m


def _ids(n, batch=1, seed=0):
    return torch.randint(1, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, cache, ids, prefill):
    out = [model(ids[:, :prefill], past_key_values=cache).logits]
    out += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.fixture
def attn(model, request):
    model.set_attn_implementation(request.param)
    yield request.param
    model.set_attn_implementation("sdpa")


def _kinds(cache):
    return [type(layer).__name__ for layer in cache.layers]


# ---------------------------------------------------------------------------------------------- the layer plan
def test_layer_plan_says_which_layers_are_quantized(model):
    plan = layer_plan(model.config)
    assert [p.storage for p in plan] == [WINDOWED, QUANTIZED, WINDOWED, QUANTIZED]
    assert [p.window for p in plan] == [WINDOW, None, WINDOW, None]
    assert quantized_layers(model.config) == [1, 3]
    config = type(model.config)(**{**model.config.to_dict(), "layer_types": ["full_attention", "linear_attention"],
                                   "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="Layer 1 of this model is of type 'linear_attention', which OscarCache"):
        layer_plan(config, "OscarCache")


# ---------------------------------------------------------------------------------------------- dynamic caches
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("attn", ["oscar"], indirect=True)
def test_without_config_the_oscar_attention_teaches_the_layer_types(model, attn, kind, monkeypatch):
    """No config: the first forward through "oscar" tells the cache the model's layer types; the cache is then the
    one config= builds, logits bit for bit, and nothing warns. The prefill (48) is longer than the window and the
    recent window, so the first sliding layer's INT2 copy is dropped for a window holding the exact chunk."""
    monkeypatch.setitem(cache_module._layer_types_warning, "issued", False)
    ids = _ids(80)
    want_cache = KINDS[kind](config=model.config)
    want = _logits(model, want_cache, ids, 48)
    cache = KINDS[kind]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _logits(model, cache, ids, 48)
    assert not [w for w in caught if "hf_kvint2" in str(w.message)]
    assert _kinds(cache) == _kinds(want_cache) == ["WindowLayer", "OscarLayer", "WindowLayer", "OscarLayer"]
    assert torch.equal(got, want)
    assert all(layer.body_len > 0 for layer in cache.layers if isinstance(layer, OscarLayer))
    report = cache.memory_report()
    assert [row["storage"] for row in report["layers"]] == ["windowed", "quantized", "windowed", "quantized"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"], indirect=True)
def test_without_config_other_attentions_warn_once(model, attn, monkeypatch):
    """SDPA / eager give the cache no way to learn the layer types: every layer is quantized (right output, as the
    portable path always is) and one warning says what to pass."""
    monkeypatch.setitem(cache_module._layer_types_warning, "issued", False)
    ids = _ids(60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cache = KINDS["scaled"]()
            _logits(model, cache, ids, 48)
    ours = [str(w.message) for w in caught if "without config=" in str(w.message)]
    assert len(ours) == 1 and "config=model.config" in ours[0]
    assert _kinds(cache) == ["OscarLayer"] * 4


@pytest.mark.parametrize("attn", ["sdpa", "oscar"], indirect=True)
def test_windows_hold_the_window_in_full_precision(model, attn):
    """memory_report: a windowed layer holds window - 1 tokens at full precision, and only those (a long prefill's
    chunk is let go: transformers' layer keeps a view into it), a quantized layer holds codes for the rest."""
    ids = _ids(200)
    ours, ref = KINDS["scaled"](config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=ours)
        model(ids, past_key_values=ref)
    report = ours.memory_report()
    token_bytes = 2 * 1 * 64 * 4  # K and V, 1 KV head, head_dim 64, fp32
    for idx, row in enumerate(report["layers"]):
        if LAYER_TYPES[idx] == "sliding_attention":
            assert row["storage"] == "windowed" and row["codes"] == 0
            assert row["full_precision"] == row["allocated"] == (WINDOW - 1) * token_bytes
            assert ref.layers[idx].keys.untyped_storage().nbytes() == 200 * token_bytes // 2  # transformers: all
        else:
            assert row["storage"] == "quantized" and row["codes"] > 0 and row["bits_per_element"] < 8
    assert report["total"]["total_bytes"] == sum(row["total_bytes"] for row in report["layers"])
    quantized, windowed = report["by_storage"]["quantized"], report["by_storage"]["windowed"]
    assert windowed["bits_per_element"] == 32.0 and quantized["bits_per_element"] < 8
    assert quantized["total_bytes"] + windowed["total_bytes"] == report["total"]["total_bytes"]


# ---------------------------------------------------------------------------------------------- generation modes
def _mode_inputs(mode):
    """Prompts of 40 tokens (beyond the window of 32), the left-padded batch of the contract's shape."""
    if mode == "left_padded":
        ids = _ids(40, batch=2, seed=2)
        mask = torch.ones_like(ids)
        ids[0, :7], mask[0, :7] = 0, 0
        return "greedy", ids, mask
    if mode == "prompt_lookup":
        return mode, torch.tensor([[5, 9, 17, 33, 65, 3, 7, 11] * 5]), None
    return mode, _ids(40, seed=3), None


def _generate(model, cache, mode, ids, mask, new=12):
    torch.manual_seed(0)
    kw = {} if mask is None else {"attention_mask": mask}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, **MODES[mode], **kw)


@pytest.mark.parametrize("mode", [*MODES, "left_padded"])
@pytest.mark.parametrize("attn", ["sdpa", "oscar"], indirect=True)
def test_generation_with_quantization_off_gives_dynamic_cache_tokens(model, attn, mode):
    """Every generation mode of the cache contract, with and without config=, both caches: DynamicCache's tokens."""
    gen_mode, ids, mask = _mode_inputs(mode)
    want = _generate(model, DynamicCache(config=model.config), gen_mode, ids, mask)
    for make in (OscarScaledCache, OscarCache):
        for config in (model.config, None):
            cache = make(config=config, recent_tokens=ALL_TOKENS)
            got = _generate(model, cache, gen_mode, ids, mask)
            assert torch.equal(got, want), (make.__name__, config is None)
            assert cache.get_seq_length() == got.shape[1] - 1
            if config is not None or attn == "oscar":
                assert _kinds(cache) == ["WindowLayer", "OscarLayer", "WindowLayer", "OscarLayer"]


@pytest.mark.parametrize("mode", [*MODES, "left_padded"])
def test_generation_with_quantization_runs_in_every_mode(model, mode):
    """The quantized full-attention layers fill their INT2 body in every mode; the sliding layers stay windows."""
    gen_mode, ids, mask = _mode_inputs(mode)
    cache = KINDS["scaled"](config=model.config)
    got = _generate(model, cache, gen_mode, ids, mask)
    assert got.shape == (ids.shape[0], ids.shape[1] + 12)
    assert cache.get_seq_length() == got.shape[1] - 1
    for idx, layer in enumerate(cache.layers):
        if LAYER_TYPES[idx] == "full_attention":
            assert layer.body_len > 0 and layer.seq_len == got.shape[1] - 1
        else:
            assert isinstance(layer, WindowLayer) and layer.keys.shape[-2] <= WINDOW - 1 + 3  # (+ lookup candidates)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_cache_built_for_other_layer_types_is_refused_by_the_oscar_attention(model, static):
    """A cache built with config= of another model: under "oscar" the attention module tells each layer's type,
    so a sliding-window layer stored quantized, a full-attention layer stored as a window, or a window of another
    length, is refused at the first forward, naming both, instead of cutting a layer to the wrong window. (Under
    SDPA the cache never sees the module: docs/robustness.md.)"""
    llama = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=4, num_attention_heads=2,
                                                         num_key_value_heads=1, head_dim=64, vocab_size=256),
                                             attn_implementation="oscar").eval()
    narrower = copy.deepcopy(model.config)
    narrower.sliding_window = WINDOW // 2

    def make(config):
        if static:
            return StaticOscarCache.from_cache(KINDS["scaled"](), config, 96)
        return KINDS["scaled"](config=config)

    model.set_attn_implementation("oscar")
    try:
        for runs, built_for, message in (
                (llama, model.config, ("Layer 0 of this cache is a full-precision window of 32 tokens, but layer 0 "
                                       "of the model is a full_attention layer")),
                (model, llama.config, ("Layer 0 of this cache is quantized .*, but layer 0 of the model is a "
                                       "sliding_attention layer \\(window 32\\)")),
                (model, narrower, ("window of 16 tokens, but layer 0 of the model is a sliding_attention layer "
                                   "\\(window 32\\)"))):
            with pytest.raises(ValueError, match=message + ".*config=model.config"):
                _logits(runs, make(built_for), _ids(40), 36)
        cache = make(model.config)  # the model's own config: checked once per layer, then one identity test
        _logits(model, cache, _ids(40), 36)
        assert all(layer.oscar_checked_config is model.config for layer in cache.layers)
    finally:
        model.set_attn_implementation("sdpa")


# ---------------------------------------------------------------------------------------------- static / export
PROMPT, STEPS, MAX_LEN = 40, 40, 96  # the decode steps wrap the sliding rings (window 32) twice


@pytest.mark.parametrize("kind", list(KINDS))
def test_static_cache_with_sliding_layers_matches_dynamic_and_exports(model, kind):
    """Static cache (sliding rings + INT2 full layers) against the dynamic cache (OSCAR with given rotations: the same
    codes), then torch.export of its decode step against the eager static cache: within 1e-4 (here bit for bit) at
    every step, and greedy generation through the program."""
    model.set_attn_implementation("oscar")
    ids = _ids(PROMPT + STEPS)
    want = _logits(model, KINDS[kind](config=model.config), ids, PROMPT)
    # OScaR's exported with its windows in float16 (sliding_window_dtype): the rings trace like float32 ones
    extra = {"sliding_window_dtype": torch.float16} if kind == "scaled" else {}
    module = OscarExportableModule(model, KINDS[kind](**extra), max_cache_len=MAX_LEN, attention_block=16)
    try:
        layers = module.static_cache.layers
        assert [type(layer).__name__ for layer in layers] == ["StaticWindowLayer", "StaticOscarLayer"] * 2
        assert layers[0].ring_k.shape[-2] == WINDOW
        assert layers[0].ring_k.dtype == extra.get("sliding_window_dtype", torch.float32)
        states, eager = [], []
        with torch.no_grad():
            eager.append(module.prefill(ids[:, :PROMPT])[:, -1:])
            for t in range(PROMPT, PROMPT + STEPS):
                states.append([s.clone() for s in module.static_cache.state_tensors()])
                eager.append(module(ids[:, t:t + 1], torch.tensor([t])))
        got = torch.cat(eager, dim=1)
        if kind == "oscar":  # (OScaR's dynamic layers settle the key basis from the data, the static ones cannot)
            assert (got - want[:, PROMPT - 1:]).abs().max().item() < 1e-4
        assert layers[1]._body_tokens_now() > 0
        program = export_decoder(model, module=module, max_cache_len=MAX_LEN)
        step = program.module()
        for dst, src in zip(module.static_cache.state_tensors(), states[0]):
            dst.copy_(src)
        with torch.no_grad():
            free = [step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t])) for t in range(PROMPT, PROMPT + STEPS)]
        assert max((a - b).abs().max().item() for a, b in zip(eager[1:], free)) < 1e-4
        assert all(torch.equal(a, b) for a, b in zip(eager[1:], free))
        tokens = generate(program, ids[:, :8], max_new_tokens=16)
        assert torch.equal(tokens, generate(module, ids[:, :8], max_new_tokens=16, max_cache_len=MAX_LEN))
    finally:
        module.unbind()
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("attn", ["sdpa", "oscar"], indirect=True)
def test_model_generate_with_static_hybrid_cache(model, attn):
    """Eager generate with a StaticOscarCache on the hybrid model (the static layers' portable views under SDPA, the
    fused read under "oscar"): with quantization off, DynamicCache's tokens."""
    ids, mask = _mode_inputs("left_padded")[1:]
    want = _generate(model, DynamicCache(config=model.config), "greedy", ids, mask, new=30)
    static = StaticOscarCache.from_cache(OscarScaledCache(sink_tokens=0, recent_tokens=ALL_TOKENS), model.config, 96)
    got = _generate(model, static, "greedy", ids, mask, new=30)
    assert torch.equal(got, want)
    report = static.memory_report()
    assert report["layers"][0]["full_precision"] == 2 * 2 * WINDOW * 64 * 4  # batch 2, K and V, ring of 32 slots


def test_a_mask_narrower_than_the_static_slots_is_refused():
    """Both fixed-shape layers read the model's mask over all their positions: a mask with fewer columns than
    ``max_cache_len`` is refused, naming both."""
    from hf_kvint2.static_layer import StaticOscarLayer

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
    q = torch.randn(1, 2, 4, 64, generator=g)
    short = torch.ones(1, 1, 4, 32, dtype=torch.bool)
    for layer in (StaticWindowLayer(max_cache_len=64, sliding_window=8, layer_idx=0),
                  StaticOscarLayer(OscarScaledCache()._recipe_for_layer(0), 64, 0)):
        layer.bound = True
        stored = layer.update(k, v)
        with pytest.raises(ValueError, match="32 columns, expected max_cache_len=64"):
            layer.attend(q, *stored, short, 0.25)
        assert layer.attend(q, *stored, torch.ones(1, 1, 4, 64, dtype=torch.bool), 0.25).shape == q.shape


def test_static_window_layer_reads_the_window(model):
    """The ring against a direct computation: a query at position p sees p - window + 1 .. p, nothing older."""
    layer = StaticWindowLayer(max_cache_len=64, sliding_window=8, layer_idx=0)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, 30, 16, generator=g), torch.randn(1, 1, 30, 16, generator=g)
    q = torch.randn(1, 2, 30, 16, generator=g)
    layer.bound = True
    out = [layer.attend(q[:, :, :20], *layer.update(k[:, :, :20], v[:, :, :20]), None, 0.25)]
    for t in range(20, 30):
        out.append(layer.attend(q[:, :, t:t + 1], *layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1]), None, 0.25))
    got = torch.cat(out, dim=2)
    pos = torch.arange(30)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 2, 30, 16), v.expand(1, 2, 30, 16),
                                                           attn_mask=allowed, scale=0.25)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cannot be cropped"):
        layer.crop(-1)
    with pytest.raises(ValueError, match="beyond max_cache_len=64"):
        layer.update(torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16))


# ---------------------------------------------------------------------------------------------- 16-bit windows
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_layer_stores_its_window_narrower(dtype):
    """storage_dtype: the window is stored in half the bytes of float32; the attention reads the past window widened
    from what is stored and the step's own tokens exactly as they came; positions and masks are transformers'."""
    g = torch.Generator().manual_seed(0)
    k, v = 3 * torch.randn(1, 2, 40, 16, generator=g), 3 * torch.randn(1, 2, 40, 16, generator=g)
    layer, ref = WindowLayer(sliding_window=8, storage_dtype=dtype), DynamicSlidingWindowLayer(sliding_window=8)
    keys, values = layer.update(k[:, :, :20], v[:, :, :20])
    ref.update(k[:, :, :20], v[:, :, :20])
    assert torch.equal(keys, k[:, :, :20]) and torch.equal(values, v[:, :, :20])  # nothing stored before: exact
    for t in range(20, 40):
        keys, values = layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        ref.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert keys.dtype == values.dtype == torch.float32
        for got, want in ((keys, k), (values, v)):
            assert torch.equal(got[:, :, -1:], want[:, :, t:t + 1])
            assert torch.equal(got[:, :, :-1], want[:, :, t - 7:t].to(dtype).float())
        assert layer.get_mask_sizes(1) == ref.get_mask_sizes(1)
    assert layer.keys.dtype == layer.values.dtype == dtype and layer.get_seq_length() == 40
    assert window_memory_bytes(layer)["full_precision"] == window_memory_bytes(ref)["full_precision"] // 2


def test_float16_windows_refuse_values_beyond_its_range():
    """float16 holds at most 65504: a larger K/V would be stored as inf (NaN attention), so it is refused, naming
    the fix; bfloat16 (float32's range) takes it; the static ring checks the same."""
    big, small = torch.full((1, 1, 4, 16), 7e4), torch.zeros(1, 1, 4, 16)
    layer = WindowLayer(sliding_window=8, storage_dtype=torch.float16)
    with pytest.raises(ValueError, match="do not fit sliding_window_dtype=torch.float16.*bfloat16"):
        layer.update(small, big)
    assert layer.get_seq_length() == 0  # refused before anything was stored
    keys, _ = WindowLayer(sliding_window=8, storage_dtype=torch.bfloat16).update(big, small)
    assert torch.isfinite(keys).all()
    with pytest.raises(ValueError, match="do not fit sliding_window_dtype=torch.float16"):
        StaticWindowLayer(64, 8, 0, storage_dtype=torch.float16).update(big, small)


@pytest.mark.parametrize("model_dtype,window_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                                                       (torch.float16, torch.float32)], ids=str)
@pytest.mark.parametrize("attn", ["sdpa", "oscar"], indirect=True)
def test_windows_in_another_dtype_than_a_16_bit_models(model, attn, model_dtype, window_dtype):
    """A 16-bit model whose windows are stored in another dtype: every forward reads the past window in the model's
    dtype (torch.cat would promote a bfloat16 chunk beside a float16 or float32 window to float32, which SDPA
    refuses beside a bfloat16 query). With quantization off, DynamicCache's logits at every step (these windows
    hold this model's 16-bit values exactly); quantized, the logits of windows in the model's dtype."""
    m = copy.deepcopy(model).to(model_dtype)
    ids = _ids(80)
    want = _logits(m, DynamicCache(config=m.config), ids, 40)
    for kind, make in KINDS.items():
        got = _logits(m, make(config=m.config, sliding_window_dtype=window_dtype, recent_tokens=ALL_TOKENS), ids, 40)
        assert torch.equal(got, want), kind
        cache = make(config=m.config, sliding_window_dtype=window_dtype)
        got = _logits(m, cache, ids, 40)
        assert cache.layers[0].keys.dtype == window_dtype and cache.layers[1].body_len > 0
        assert torch.equal(got, _logits(m, make(config=m.config), ids, 40)), kind


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("attn", ["sdpa", "oscar"], indirect=True)
def test_sliding_window_dtype_halves_the_windows_only(model, attn, kind):
    """sliding_window_dtype=float16 on the hybrid model: the windowed layers hold half their bytes, the quantized
    layers the same bytes; with quantization off the logits are within 16-bit rounding of the float32 windows'
    (and not identical: the windows were narrowed). The static cache built from it has 16-bit rings and matches."""
    ids = _ids(120)
    caches = {}
    for name, extra in (("wide", {}), ("narrow", {"sliding_window_dtype": torch.float16})):
        cache = KINDS[kind](config=model.config, **extra)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        caches[name] = cache.memory_report()["by_storage"]
    assert caches["narrow"]["windowed"]["total_bytes"] * 2 == caches["wide"]["windowed"]["total_bytes"]
    assert caches["narrow"]["quantized"]["total_bytes"] == caches["wide"]["quantized"]["total_bytes"]
    off = {"recent_tokens": ALL_TOKENS}
    wide = _logits(model, KINDS[kind](config=model.config, **off), ids, 80)
    narrow_cache = KINDS[kind](config=model.config, sliding_window_dtype=torch.float16, **off)
    narrow = _logits(model, narrow_cache, ids, 80)
    assert 0 < (wide - narrow).abs().max().item() < 1e-2
    static = StaticOscarCache.from_cache(KINDS[kind](sliding_window_dtype=torch.float16, **off), model.config, 128)
    got = _logits(model, static, ids, 80)
    assert static.layers[0].ring_k.dtype == torch.float16
    assert (got - narrow).abs().max().item() < 1e-4
