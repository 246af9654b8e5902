"""Static Oscar caches and the export entry points: torch.export, torch.compile (inductor), ONNX Runtime.

Protocol: a prompt is stored eagerly, then the same 32 tokens are fed one step at a time. The eager
static cache must match the dynamic caches, and every backend must give the eager logits within 1e-4 (fp32) at
every step when it runs the step from the eager cache state. (Running freely, a backend's last-bit differences
can move an INT2 code across a rounding boundary and the trajectories drift apart; the exported program is
bit-identical to eager even then, which is checked too.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_kvint2  # noqa: F401  (registers "oscar")
from hf_kvint2 import OscarCache, OscarScaledCache, quant
from hf_kvint2.export import (
    OscarExportableModule,
    OscarOnnxDecoder,
    export_decoder,
    export_onnx,
    generate,
    onnx_generate,
    onnx_step,
)
from hf_kvint2.quant import dequantize_int2, pack_int2, quantize_int2, unpack_int2
from hf_kvint2.recipes import GroupLayout
from hf_kvint2.static_cache import StaticOscarCache, StaticOscarLayer

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-4
PROMPT, STEPS, MAX_LEN, BLOCK = 20, 32, 64, 16


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def _mixed_cache():
    """Per-layer layouts as calibration picks them: layer 0 keys per channel (token-scaled) and values per token,
    layer 1 the reverse (on a narrowed group range); calibrated-style rotations, key means and clips."""
    layouts = [(GroupLayout("channel", 8, None, True), GroupLayout("token", 16, 0.92)),
               (GroupLayout("token", 16, 0.96), GroupLayout("channel", 8, range_clip=0.85))]
    means = [torch.randn(2, 16, generator=torch.Generator().manual_seed(i)) * 0.3 for i in range(2)]
    return OscarCache(sink_tokens=4, recent_tokens=8, group_size=16, layer_layouts=layouts,
                      k_rotations=[_orthogonal(16, 1), _orthogonal(16, 2)],
                      v_rotations=[_orthogonal(16, 3), _orthogonal(16, 4)], key_means=means)


CACHES = {
    "oscar": lambda: OscarCache(sink_tokens=4, recent_tokens=8, group_size=16),
    "scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=8),
    "mixed": _mixed_cache,
}


@pytest.fixture(scope="module")
def model():
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    m = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32, attn_implementation="oscar")
    m.generation_config.pad_token_id = 0
    return m.eval()


def _ids(n=PROMPT + STEPS, batch=1, seed=0):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _module(model, kind, cls=OscarExportableModule, batch=1):
    return cls(model, CACHES[kind](), max_cache_len=MAX_LEN, batch_size=batch, attention_block=BLOCK)


def _state(module):
    return [t.clone() for t in module.static_cache.state_tensors()]


def _set_state(module, state):
    for dst, src in zip(module.static_cache.state_tensors(), state):
        dst.copy_(src)


def _eager_trajectory(module, ids):
    """Prefill the prompt eagerly, then STEPS single-token steps: (states before each step, logits of each step)."""
    states, logits = [], []
    with torch.no_grad():
        module.prefill(ids[:, :PROMPT])
        for t in range(PROMPT, PROMPT + STEPS):
            states.append(_state(module))
            logits.append(module(ids[:, t:t + 1], torch.tensor([t])))
    return states, logits


# ------------------------------------------------------------------------------------------------ building blocks
def test_traced_packing_is_the_same_bytes(monkeypatch):
    """The arithmetic packing used under tracing (ONNX-exportable) against the shifts, on every byte value."""
    codes = unpack_int2(torch.arange(256, dtype=torch.uint8)[:, None])  # [256, 4]: all code combinations
    monkeypatch.setattr(quant, "tracing", lambda: True)
    assert torch.equal(pack_int2(codes)[:, 0], torch.arange(256, dtype=torch.uint8))
    assert torch.equal(pack_int2(codes.float()), pack_int2(codes))
    traced = unpack_int2(torch.arange(256, dtype=torch.uint8)[:, None])
    assert traced.dtype == torch.int32 and torch.equal(traced, codes.to(torch.int32))


@pytest.mark.parametrize("axis,group,range_clip", [("token", 16, None), ("channel", 8, None), ("channel", 8, 0.8)])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_quantizer_under_inductor_and_export_is_bit_identical(axis, group, range_clip, scale_dtype):
    """quantize_int2 + dequantize_int2 compiled by inductor and exported by torch.export give eager's bits: the
    16-bit rounding of scales is kept (inductor elides the cast pair otherwise) and the packing is the same."""
    x = torch.randn(2, 3, 16, 16) * torch.logspace(-3, 2, 16)[None, None, :, None]
    x[0, 0, :8] = 1.5  # constant groups: scale 0

    def roundtrip(x):
        q = quantize_int2(x, axis, group, scale_dtype, range_clip)
        return q.codes, q.scale, q.lo, dequantize_int2(q, axis, group)

    class Roundtrip(torch.nn.Module):
        def forward(self, x):
            return roundtrip(x)

    ref = roundtrip(x)
    torch._dynamo.reset()
    compiled = torch.compile(roundtrip, fullgraph=True, dynamic=False)(x)
    exported = torch.export.export(Roundtrip(), (x,)).module()(x)
    for got in (compiled, exported):
        for a, b in zip(ref, got):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_stream_transform_under_inductor_is_bit_identical():
    """StreamCodec.quantize (centre, rotate, omni-token norm, clip, INT2) compiled against eager: the division
    uses the stored, rounded norm in both."""
    from hf_kvint2.layers import OscarLayer

    layer = OscarLayer(_mixed_cache()._recipe_for_layer(0), 0)
    x = torch.randn(2, 2, 8, 16) * 3
    layer.lazy_initialization(x, x)
    for codec in (layer.key_body.codec, layer.value_body.codec):  # token-scaled keys with a mean; clipped values
        ref = codec.quantize(x)
        torch._dynamo.reset()
        got = torch.compile(codec.quantize, fullgraph=True, dynamic=False)(x)
        for a, b in zip(ref[0], got[0]):
            assert torch.equal(a, b)
        assert (ref[1] is None and got[1] is None) or torch.equal(ref[1], got[1])


# ------------------------------------------------------------------------------------------------ eager numerics
@pytest.mark.parametrize("kind", list(CACHES))
def test_static_cache_matches_dynamic_cache(model, kind):
    """Same tokens into the dynamic cache (fused "oscar" attention) and the static one: same logits, same codes."""
    ids = _ids()
    dynamic = CACHES[kind]()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = [model(ids[:, :PROMPT], past_key_values=dynamic, use_cache=True).logits[:, -1]]
        for t in range(PROMPT, PROMPT + STEPS):
            ref.append(model(ids[:, t:t + 1], past_key_values=dynamic, use_cache=True).logits[:, -1])
    module = _module(model, kind)
    try:
        with torch.no_grad():
            got = [module.prefill(ids[:, :PROMPT])[:, -1]]
            for t in range(PROMPT, PROMPT + STEPS):
                got.append(module(ids[:, t:t + 1], torch.tensor([t]))[:, -1])
    finally:
        module.unbind()
    diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
    assert diff < TOL, diff
    for dyn_layer, st_layer in zip(dynamic.layers, module.static_cache.layers):
        n = dyn_layer.body_len
        assert n > 0  # the body is exercised
        for prefix, stream in (("key", dyn_layer.key_body), ("value", dyn_layer.value_body)):
            assert torch.equal(getattr(st_layer, f"{prefix}_codes")[:, :, :n], stream.codes.view())


# ------------------------------------------------------------------------------------------------ torch.export
@pytest.mark.parametrize("kind", list(CACHES))
def test_exported_program_matches_eager(model, kind):
    ids = _ids()
    module = _module(model, kind)
    try:
        states, eager = _eager_trajectory(module, ids)
        program = export_decoder(model, module=module, max_cache_len=MAX_LEN)
        step = program.module()  # shares the module's cache buffers
        _set_state(module, states[0])
        with torch.no_grad():
            free = [step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t]))
                    for t in range(PROMPT, PROMPT + STEPS)]
    finally:
        module.unbind()
    # running freely from the same prefilled cache, the program reproduces every eager step exactly
    assert all(torch.equal(a, b) for a, b in zip(eager, free))


def test_generate_through_exported_program(model):
    """Greedy loop through the program from position 0 (prompt fed token by token) == the eager module's."""
    prompt = _ids(12, batch=2, seed=3)
    module = _module(model, "mixed", batch=2)
    try:
        program = export_decoder(model, module=module, max_cache_len=MAX_LEN)
        out = generate(program, prompt, max_new_tokens=40)
        ref = generate(module, prompt, max_new_tokens=40, max_cache_len=MAX_LEN)
    finally:
        module.unbind()
    assert out.shape == (2, 52) and torch.equal(out[:, :12], prompt)
    assert torch.equal(out, ref)


def test_exported_program_mutates_its_cache_buffers(model):
    """The cache is the program's state: functionalized, the program writes every state tensor of every layer back
    as a buffer mutation, and no constant of the program shares memory with a buffer (tensors the layers reach
    outside the module's buffers would be captured as constants: copied by a serializer, their writes lost)."""
    module = _module(model, "mixed")
    try:
        program = export_decoder(model, module=module, max_cache_len=MAX_LEN)
    finally:
        module.unbind()
    functional = program.run_decompositions({})
    mutated = set(functional.graph_signature.buffers_to_mutate.values())
    assert mutated == {name for name, _ in module.named_buffers() if name.startswith("cache_")}
    buffers = {t.untyped_storage().data_ptr() for t in program.buffers()}
    lifted = program.graph_signature.lifted_tensor_constants
    assert not [name for name in lifted if program.constants[name].untyped_storage().data_ptr() in buffers]


def _float_kv_temporaries(program, head_dim):
    """Token extents of every float [..., tokens, head_dim] value the exported graph computes."""
    sizes = []
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point and val.dim() >= 3 \
                and val.shape[-1] == head_dim:
            sizes.append(int(val.shape[-2]))
    return sizes


def test_exported_graph_reads_body_block_by_block(model):
    """No full-precision copy of the cache per step: the largest float K/V temporary is one attention block (or
    the sink/ring windows), never the body; the portable path, which dequantizes everything, is caught."""
    module = _module(model, "scaled")
    try:
        program = export_decoder(model, module=module, max_cache_len=MAX_LEN)
        layer = module.static_cache.layers[0]
        assert layer.body_capacity == MAX_LEN and layer.attention_block == BLOCK
        sizes = _float_kv_temporaries(program, 16)
        assert sizes and max(sizes) <= max(layer.sink, layer.ring_size, layer.attention_block) < layer.body_capacity
        codes = [n for n in program.graph.nodes if n.op == "placeholder" and "key_codes" in n.name]
        assert len(codes) == len(module.static_cache.layers)  # the body is read from the packed codes
        module.unbind()  # portable path: update() hands the attention a dequantized [B, H, max_cache_len, D] view
        with torch.no_grad():
            portable = torch.export.export(module, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long),
                                                        "cache_position": torch.tensor([0])})
        assert max(_float_kv_temporaries(portable, 16)) >= MAX_LEN
    finally:
        module.unbind()


# ------------------------------------------------------------------------------------------------ torch.compile
def test_torch_compile_fullgraph_matches_eager(model):
    ids = _ids()
    module = _module(model, "mixed")
    try:
        states, eager = _eager_trajectory(module, ids)
        compiled = torch.compile(module, fullgraph=True)  # inductor on CPU
        worst = 0.0
        with torch.no_grad():
            for i, t in enumerate(range(PROMPT, PROMPT + STEPS)):
                _set_state(module, states[i])
                got = compiled(ids[:, t:t + 1], torch.tensor([t]))
                worst = max(worst, (got - eager[i]).abs().max().item())
    finally:
        module.unbind()
    assert worst < TOL, worst


# ------------------------------------------------------------------------------------------------ ONNX Runtime
def test_onnx_runtime_matches_eager(model, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="pip install 'hf-kvint2[export]'")
    np = pytest.importorskip("numpy")
    spec = export_onnx(model, tmp_path / "decoder.onnx", _mixed_cache(), max_cache_len=MAX_LEN,
                       attention_block=BLOCK)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(spec.path, options, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == spec.input_names
    assert [o.name for o in session.get_outputs()] == spec.output_names
    assert spec.input_names[:3] == ["input_ids", "cache_position", "layers.0.sink_k"]
    assert spec.shapes["layers.0.key_codes"] == (1, 2, MAX_LEN, 4) and spec.dtypes["layers.0.key_codes"] == "uint8"
    assert spec.shapes["layers.0.key_scale"] == (1, 2, MAX_LEN // 8, 16)  # keys per channel over 8 tokens
    assert spec.shapes["layers.0.value_scale"] == (1, 2, MAX_LEN, 1)  # values per token over 16 channels

    ids = _ids()
    module = OscarOnnxDecoder(model, _mixed_cache(), max_cache_len=MAX_LEN, attention_block=BLOCK)
    assert not module.training  # the wrapper follows the model's eval mode (exporters warn otherwise)
    try:
        state = module.initial_state()
        worst, codes_equal = 0.0, True
        with torch.no_grad():
            for t in range(PROMPT + STEPS):
                logits, *new_state = module(ids[:, t:t + 1], torch.tensor([t]), *state)
                feeds = {n: s.numpy() for n, s in zip(spec.state_names, state)}
                ort_logits, ort_state = onnx_step(session, spec, feeds, ids[:, t:t + 1].numpy(), t)
                if t >= PROMPT:
                    worst = max(worst, float(np.abs(ort_logits - logits.numpy()).max()))
                for name, s in zip(spec.state_names, new_state):
                    if s.dtype == torch.uint8:
                        codes_equal &= bool(np.array_equal(ort_state[name], s.numpy()))
                state = new_state
    finally:
        module.unbind()
    assert worst < TOL, worst
    assert codes_equal
    tokens = onnx_generate(session, spec, _ids(8).numpy(), max_new_tokens=8)
    assert tokens.shape == (1, 16)


# ------------------------------------------------------------------------------------------------ generate, errors
@pytest.mark.parametrize("attn", ["oscar", "sdpa"])
def test_model_generate_with_static_cache(model, attn, monkeypatch):
    """Eager generate with a static cache (fused route through DeferredKV, or the portable view under SDPA)
    gives the dynamic cache's greedy logits, with left padding. The static cache's sink is sized by position, so
    it cannot widen by the batch's padding as a dynamic layer does (hf_kvint2.padding): compare with a dynamic
    cache that stores the padding the same way."""
    import hf_kvint2.layers

    monkeypatch.setattr(hf_kvint2.layers, "left_padding", lambda position_ids, n_new, where=None: 0)
    calls = []
    original = StaticOscarLayer.attend
    monkeypatch.setattr(StaticOscarLayer, "attend", lambda self, *a: calls.append(1) or original(self, *a))
    ids = _ids(30, batch=2, seed=5)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0
    model.set_attn_implementation(attn)
    try:
        outs = []
        for cache in (CACHES["mixed"](), StaticOscarCache.from_cache(CACHES["mixed"](), model.config, MAX_LEN)):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outs.append(model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16,
                                           do_sample=False, output_logits=True, return_dict_in_generate=True))
    finally:
        model.set_attn_implementation("oscar")
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert (len(calls) > 0) == (attn == "oscar")  # "oscar" reads the codes; SDPA gets the portable view
    diff = max((a - b).abs().max().item() for a, b in zip(outs[0].logits, outs[1].logits))
    assert diff < TOL, diff


def test_static_attention_features_only_sdpa_has(monkeypatch):
    """Eager static layer: a per-head mask runs SDPA on the full view; a bound (exported) layer refuses it."""
    from conftest import tiny_config
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_kvint2 import attention

    layer = StaticOscarCache.from_cache(CACHES["oscar"](), tiny_config("llama"), MAX_LEN).layers[0]
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g))
    layer.fused_attention = True
    k1, v1 = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    dk, dv = layer.update(k1, v1)
    want_k, want_v = layer.full_view(k1, v1)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    monkeypatch.setattr(StaticOscarLayer, "attend", lambda *a, **k: pytest.fail("the fused path ran"))
    q, per_head = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 4, 1, MAX_LEN, generator=g)
    got, _ = attention.oscar_attention_forward(module, q, dk, dv, per_head, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, want_k, want_v, per_head, scaling=0.25)
    assert torch.equal(got, want)
    module.oscar_static_layer = layer
    with pytest.raises(ValueError, match="does not support dropout, per-head masks; export this model with"):
        attention.oscar_attention_forward(module, q, k1, v1, per_head, dropout=0.1, scaling=0.25)


def test_bad_inputs_fail_clearly(model):
    module = _module(model, "oscar")
    try:
        with pytest.raises(ValueError, match="max_cache_len"):
            module(_ids(1), torch.tensor([MAX_LEN]))
        with pytest.raises(ValueError, match="batch"):
            module(_ids(1, batch=2), torch.tensor([0]))
        with pytest.raises(ValueError, match="max_cache_len"):
            module.prefill(_ids(MAX_LEN + 1))
        with pytest.raises(ValueError, match="cannot be cropped"):
            module.static_cache.crop(-1)
        with pytest.raises(TypeError, match="already static"):
            StaticOscarCache.from_cache(module.static_cache, model.config, MAX_LEN)
        # K/V checks shared with the dynamic layer: nothing is written when they fail
        module.unbind()
        layer = module.static_cache.layers[0]
        before = _state(module)
        k = torch.randn(1, 2, 1, 16)
        with pytest.raises(ValueError, match="layer 0: key/value states contain NaN or Inf"):
            layer.update(k, torch.full_like(k, float("nan")))
        with pytest.raises(ValueError, match="dtype changed from torch.float32 to torch.bfloat16. Build the static"):
            layer.update(k.bfloat16(), k.bfloat16())
        with pytest.raises(ValueError, match="kv_heads=3.*kv_heads=2.*Build the static cache"):
            layer.update(torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16))
        with pytest.raises(ValueError, match="differ in shape"):
            layer.update(k, k[..., :8])
        assert all(torch.equal(a, b) for a, b in zip(before, _state(module)))
    finally:
        module.unbind()
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    sliding = AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=8,
                                                           layer_types=["sliding_attention", "full_attention"]))
    hybrid = StaticOscarCache.from_cache(OscarCache(), sliding.config, MAX_LEN)  # sliding layers: a window ring
    assert [type(layer).__name__ for layer in hybrid.layers] == ["StaticWindowLayer", "StaticOscarLayer"]
    chunked = tiny_config("mistral", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    chunked.layer_types, chunked.attention_chunk_size = ["chunked_attention", "full_attention"], 8
    with pytest.raises(ValueError, match="'chunked_attention'; the static Oscar cache supports full-attention and"):
        StaticOscarCache.from_cache(OscarCache(), chunked, MAX_LEN)
    with pytest.raises(ValueError, match="attn_implementation"):
        from hf_kvint2.export import bind_static_cache

        sdpa = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
        bind_static_cache(sdpa, StaticOscarCache.from_cache(OscarCache(), sdpa.config, MAX_LEN))
