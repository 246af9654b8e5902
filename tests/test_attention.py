"""The "oscar" fused attention: same results as the portable path, SDPA fallback, warnings, no full-precision copy."""

from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_kvint2
from hf_kvint2 import OscarCache, OscarScaledCache, attention, backends, cpu_kernels, read_path, steps
from hf_kvint2.cpu_kernels import calls as cpu_calls
from hf_kvint2.layers import OscarLayer
from hf_kvint2.recipes import GroupLayout
from hf_kvint2.settings import oscar_recipe, oscar_scaled_recipe
from hf_kvint2.stream import PagedQuantizedBody

pytestmark = pytest.mark.usefixtures("single_thread")

# Small windows so that a few dozen tokens already reach the INT2 body.
CACHES = {
    "oscar": lambda: OscarCache(sink_tokens=4, recent_tokens=8, group_size=16, k_clip=0.96, v_clip=0.92),
    "scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=8),
}
TOL = 1e-4
# Whole generations (each path writes the K/V its own attention produced): a float32 summation difference can move
# one INT2 code of a later token at a rounding boundary, which moves a logit by ~1e-4 here. The greedy tokens must
# still be equal; test_numerics.py holds every path to 5e-5 of the logits' scale from shared cache states.
GENERATE_TOL = 1e-3


@pytest.fixture(params=["torch", "numba"])
def cpu_kernel(request, monkeypatch):
    """Run a test with the blocked PyTorch body path and with the Numba kernel."""
    if request.param == "numba" and not cpu_kernels.available():
        pytest.skip("numba is not installed (optional extra 'cpu')")
    monkeypatch.setenv("HF_KVINT2_CPU_KERNEL", request.param)
    return request.param


def _left_padded(batch=2, length=30, pad=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


def _generate(model, cache, ids, mask, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, do_sample=False, output_logits=True,
                             output_scores=True, return_dict_in_generate=True, **kw)
    return out


def _count_body_calls(monkeypatch):
    calls = []
    original = backends.select_body_partial

    def select(*args, **kwargs):
        backend = original(*args, **kwargs)

        def run(q_rot, key_body, value_body, **kw):
            calls.append(key_body.tokens)
            return backend.run(q_rot, key_body, value_body, **kw)

        return backends.BodyBackend(backend.name, backend.device_type, backend.available, run)

    monkeypatch.setattr(steps, "select_body_partial", select)
    return calls


# ------------------------------------------------------------------------------------------------ registration
def test_registered_and_selectable(tiny_model):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "oscar" in AttentionInterface._global_mapping and "oscar" in AttentionMaskInterface._global_mapping
    assert tiny_model("llama", attn="oscar").config._attn_implementation == "oscar"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(copy.deepcopy(tiny_model("llama").config), attn_implementation="sdpa")
    model.set_attn_implementation("oscar")
    assert model.config._attn_implementation == "oscar"


# ------------------------------------------------------------------------------------------------ fused == portable
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_greedy_left_padded_matches_portable(tiny_model, arch, cache, cpu_kernel, monkeypatch):
    ids, mask = _left_padded()
    ref = _generate(tiny_model(arch), CACHES[cache](), ids, mask, max_new_tokens=24)
    calls = _count_body_calls(monkeypatch)
    out = _generate(tiny_model(arch, attn="oscar"), CACHES[cache](), ids, mask, max_new_tokens=24)
    assert len(calls) >= 2 * 20, "the fused path must read the INT2 body at every decode step"
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=GENERATE_TOL, rtol=0)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_beam_search_matches_portable(tiny_model, cache):
    ids, mask = _left_padded(length=26)
    ref = _generate(tiny_model("llama"), CACHES[cache](), ids, mask, max_new_tokens=12, num_beams=3)
    out = _generate(tiny_model("llama", attn="oscar"), CACHES[cache](), ids, mask, max_new_tokens=12, num_beams=3)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=TOL, rtol=0)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_prefill_continuing_a_cache(tiny_model, cache, cpu_kernel):
    """Chunked prefill / multi-turn: forwards of several tokens on top of a cache that already has an INT2 body."""
    ids, mask = _left_padded(length=70, pad=5, seed=3)
    chunks = [(0, 24), (24, 41), (41, 42), (42, 70)]
    logits = {}
    for attn in ("sdpa", "oscar"):
        model, c = tiny_model("llama", attn=attn), CACHES[cache]()
        logits[attn] = []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for a, z in chunks:
                out = model(input_ids=ids[:, a:z], attention_mask=mask[:, :z], past_key_values=c, use_cache=True)
                logits[attn].append(out.logits)
        assert c.layers[0].body_len > 0
    for fused, portable in zip(logits["oscar"], logits["sdpa"]):
        # padded query rows attend to nothing real; compare the rows of real tokens
        torch.testing.assert_close(fused[1], portable[1], atol=TOL, rtol=0)
        torch.testing.assert_close(fused[0, -1], portable[0, -1], atol=TOL, rtol=0)


# ------------------------------------------------------------------------------------------------ fallback, warnings
def test_other_cache_or_none_is_sdpa(tiny_model):
    from transformers import DynamicCache

    ids, mask = _left_padded()
    sdpa, oscar = tiny_model("qwen2"), tiny_model("qwen2", attn="oscar")
    with torch.no_grad():
        for kw in ({"use_cache": False}, {"past_key_values": DynamicCache()}):
            ref = sdpa(input_ids=ids, attention_mask=mask, **kw).logits
            out = oscar(input_ids=ids, attention_mask=mask, **{k: (DynamicCache() if k == "past_key_values" else v)
                                                                for k, v in kw.items()}).logits
            assert torch.equal(out, ref)
    a = _generate(sdpa, DynamicCache(), ids, mask, max_new_tokens=6)
    b = _generate(oscar, DynamicCache(), ids, mask, max_new_tokens=6)
    assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))


def test_portable_path_warns_once(tiny_model, monkeypatch):
    monkeypatch.setitem(steps._portable_warning, "issued", False)
    ids, mask = _left_padded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            tiny_model("llama").generate(ids, attention_mask=mask, past_key_values=CACHES["oscar"](),
                                         max_new_tokens=4, do_sample=False)
    ours = [w for w in caught if "portable attention path" in str(w.message)]
    assert len(ours) == 1 and 'attn_implementation="oscar"' in str(ours[0].message)

    monkeypatch.setitem(steps._portable_warning, "issued", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model("llama", attn="oscar").generate(ids, attention_mask=mask, past_key_values=CACHES["oscar"](),
                                                   max_new_tokens=4, do_sample=False)
    assert not [w for w in caught if "hf_kvint2" in str(w.message)]


def test_deferred_view_materializes_for_other_attention():
    """A layer switched to the fused path still gives other attention implementations the full view."""
    torch.manual_seed(0)
    layer = OscarLayer(oscar_recipe(sink_tokens=2, recent_tokens=4, group_size=8), 0)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    layer.update(k, v)
    layer.fused_attention = True
    k1, v1 = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    dk, dv = layer.update(k1, v1)
    assert isinstance(dk, steps.DeferredKV) and dk.shape == (1, 2, 21, 8)
    # past tokens as stored (body dequantized), the new token at full precision
    want_k = torch.cat([layer.sink_k, layer.key_body.dequantize(), layer.recent_k], dim=2)
    want_v = torch.cat([layer.sink_v, layer.value_body.dequantize(), layer.recent_v], dim=2)
    assert torch.equal(layer.recent_k[:, :, -1:], k1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(dk * 1, want_k, atol=0, rtol=0)
        torch.testing.assert_close(dv + 0, want_v, atol=0, rtol=0)


def test_features_only_sdpa_has_run_sdpa_on_the_view(monkeypatch):
    """A per-head mask or dropout is not implemented by the fused path: "oscar" runs SDPA on the layer's view."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    layer = OscarLayer(oscar_recipe(sink_tokens=2, recent_tokens=4, group_size=8), 0)
    layer.update(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8))
    layer.fused_attention = True
    dk, dv = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    want_k = torch.cat([layer.sink_k, layer.key_body.dequantize(), layer.recent_k], dim=2)
    want_v = torch.cat([layer.sink_v, layer.value_body.dequantize(), layer.recent_v], dim=2)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2

    def no_fused(*args, **kwargs):
        raise AssertionError("the fused path ran")

    monkeypatch.setattr(steps.LayerStep, "attend", no_fused)
    q = torch.randn(1, 4, 1, 8)
    per_head = torch.randn(1, 4, 1, 21)
    got, _ = attention.oscar_attention_forward(module, q, dk, dv, per_head, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, want_k, want_v, per_head, scaling=0.3)
    assert torch.equal(got, want)
    torch.manual_seed(1)
    got, _ = attention.oscar_attention_forward(module, q, dk, dv, None, dropout=0.5, scaling=0.3)
    torch.manual_seed(1)
    want, _ = sdpa_attention_forward(module, q, want_k, want_v, None, dropout=0.5, scaling=0.3)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ body kernels
LAYOUTS = {
    "token keys, centred": oscar_recipe(sink_tokens=0, recent_tokens=0, group_size=8,
                                        key_mean=torch.randn(2, 16), value_mean=torch.randn(2, 16)),
    "channel keys with norms": oscar_scaled_recipe(sink_tokens=0, recent_tokens=0, group_size=8),
    "channel values, normed token values": oscar_recipe(
        sink_tokens=0, recent_tokens=0, key_layout=GroupLayout("token", 16, None, True),
        value_layout=GroupLayout("channel", 4, None, True)),
    # value groups of 4 channels (one byte: four groups per vector of the Numba value loop) and of 2 (part of a
    # byte: its scalar loop)
    "small token groups": oscar_recipe(
        sink_tokens=0, recent_tokens=0, key_layout=GroupLayout("token", 4, None, False),
        value_layout=GroupLayout("token", 4, None, True)),
    "token values in half bytes": oscar_recipe(
        sink_tokens=0, recent_tokens=0, key_layout=GroupLayout("token", 8, None, False),
        value_layout=GroupLayout("token", 2, None, False)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("groups,query_len", [(2, 1), (7, 1), (2, 3), (2, 40)])
def test_body_kernels_agree(layout, groups, query_len):
    """Every registered CPU body backend (blocked PyTorch, Numba) == the one dense reference, every stored layout;
    80 query rows per KV head: the Numba backend's long-chunk path (dequantized blocks, flash attention)."""
    check_body_backends(LAYOUTS[layout], 16, groups, query_len)


@pytest.mark.parametrize("value_layout", [GroupLayout("token", 12, None, False), GroupLayout("channel", 8, None, False)])
def test_body_kernels_agree_at_head_dim_24(value_layout):
    """head_dim 24 (6 bytes of codes per token: no vector width of the Numba kernel's key and value loops divides
    it) with per-channel keys and 12-channel or per-channel value groups: the kernel's scalar loops."""
    rotation = torch.linalg.qr(torch.randn(24, 24, generator=torch.Generator().manual_seed(3)))[0]
    recipe = oscar_recipe(sink_tokens=0, recent_tokens=0, key_layout=GroupLayout("channel", 8, None, True),
                          value_layout=value_layout, key_rotation=rotation, value_rotation=rotation)
    check_body_backends(recipe, 24, 2, 1)


def check_body_backends(recipe, d, groups, query_len):
    torch.manual_seed(1)
    layer = OscarLayer(recipe, 0)
    for n in (24, 16):
        layer.update(torch.randn(2, 2, n, d), torch.randn(2, 2, n, d))
    n_tokens = layer.body_len - 3  # a cut inside a token group
    q = torch.randn(2, 2 * groups, query_len, d) @ layer.key_body.codec.rotation
    kml = torch.randn(2, 2 * groups, query_len)
    mask = torch.rand(2, 1, query_len, n_tokens) > 0.3
    args = {"scaling": 0.3, "key_mean_logits": kml, "mask": mask}
    kb, vb = layer.key_body.read(n_tokens), layer.value_body.read(n_tokens)
    ref = read_path.reference_body_partial(q, kb, vb, **args)
    blocked = read_path.body_partial_blocked(q, kb, vb, block_tokens=8, **args)
    dense = read_path.body_partial_dense(q, kb, vb, block_tokens=8, **args)
    cpu = [b for b in backends.BODY_BACKENDS.values() if b.device_type == "cpu" and b.available()]
    assert cpu or not cpu_kernels.available()
    for got in (blocked, dense, *[b.run(q, kb, vb, **args) for b in cpu]):
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)


def test_split_tokens_fills_the_threads_with_few_splits():
    """Split-K's split count: none on one thread, none for a short body or a long chunk; at batch 1 on two threads
    2 splits per KV head for SmolLM2's 3 KV heads (6 tasks, 3 per thread) and Gemma 3's 1, none for 8 KV heads;
    every split a whole number of per-channel groups and at least SPLIT_MIN_TOKENS long; splits only where a thread
    would be idle or the threads unbalanced, and not many more tasks than threads."""
    n = 8192 - 320
    assert cpu_kernels.split_tokens(n, 3, 3, 32, threads=1) == n
    assert cpu_kernels.split_tokens(2 * cpu_kernels.SPLIT_MIN_TOKENS - 1, 3, 3, 1, threads=2) == \
        2 * cpu_kernels.SPLIT_MIN_TOKENS - 1
    assert cpu_kernels.split_tokens(n, cpu_kernels.SPLIT_MAX_ROWS + 1, 3, 1, threads=2) == n
    for tasks, splits in ((3, 2), (1, 2), (8, 1), (23 * 3, 1)):
        split = cpu_kernels.split_tokens(n, 3, tasks, 32, threads=2)
        assert split % 32 == 0 or split == n
        assert -(-n // split) == splits, (tasks, split)
    for threads in (2, 3, 4, 8, 16):
        for tasks in (1, 2, 3, 4, 8):
            split = cpu_kernels.split_tokens(32768, 3, tasks, 64, threads=threads)
            assert split % 64 == 0 and split >= cpu_kernels.SPLIT_MIN_TOKENS
            splits = -(-32768 // split)
            assert splits > 1 or threads <= tasks, (threads, tasks, split)  # no thread idle
            assert splits == 1 or tasks % threads, (threads, tasks, split)  # split only for idle or unbalanced ones
            assert tasks * splits < 2 * (threads + tasks), (threads, tasks, split)  # and not many more tasks


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_numba_split_k_matches_unsplit(layout):
    """Split-K (tokens of the body in parallel splits, merged by log-sum-exp) == one split (fp32 rounding), with a
    masked split and a row that attends nothing; the default split of a batch-1 decode is used."""
    torch.manual_seed(2)
    layer = OscarLayer(LAYOUTS[layout], 0)
    tokens = 2 * cpu_kernels.SPLIT_MIN_TOKENS + 300
    layer.update(torch.randn(1, 2, tokens, 16), torch.randn(1, 2, tokens, 16))
    n_tokens = layer.body_len - 5
    kb, vb = layer.key_body.read(n_tokens), layer.value_body.read(n_tokens)
    q = torch.randn(1, 6, 1, 16) @ layer.key_body.codec.rotation
    kml = torch.randn(1, 6, 1)
    align = math.lcm(*[s.group for s in (kb, vb) if s.layout.axis == "channel"] or [1])
    split = cpu_kernels.split_tokens(n_tokens, 3, 2, align, threads=4)
    assert split < n_tokens and split % align == 0  # a batch-1 step on 4 threads is split
    mask = torch.ones(1, 1, 1, n_tokens, dtype=torch.bool)
    mask[..., split:2 * split] = False  # one split attends nothing
    for m in (None, mask):
        args = {"scaling": 0.3, "key_mean_logits": kml, "mask": m}
        one = cpu_kernels.body_attention(q, kb, vb, split=-(-n_tokens // align) * align, **args)  # one split
        for s in (split, align * 8):
            got = cpu_kernels.body_attention(q, kb, vb, split=s, **args)
            # fp32 in another summation order over ~1300 tokens of O(1) values (the output is a small difference of
            # them): errors of a few 1e-6, and which element lands where depends on the CPU's vector width
            torch.testing.assert_close(got[0], one[0], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(got[1], one[1], atol=1e-6, rtol=1e-6)
        ref = read_path.reference_body_partial(q, kb, vb, **args)
        torch.testing.assert_close(one[0], ref[0], atol=1e-5, rtol=1e-5)
    dead = torch.zeros(1, 1, 1, n_tokens, dtype=torch.bool)
    out, lse = cpu_kernels.body_attention(q, kb, vb, scaling=0.3, mask=dead, split=split)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="multiple of the per-channel group"):
        cpu_kernels.body_attention(q, kb, vb, scaling=0.3, split=align + 1 if align > 1 else 0)


# The body layouts above with full-precision windows around the body (sink, recent tokens; one without a sink)
STEP_LAYOUTS = {name: LAYOUTS[name].with_overrides(sink_tokens=sink, recent_tokens=recent) for name, sink, recent in
                [("token keys, centred", 3, 5), ("channel keys with norms", 0, 6),
                 ("channel values, normed token values", 2, 4), ("small token groups", 1, 3),
                 ("token values in half bytes", 0, 2)]}


def stepped_layer(recipe, query_len: int, seed: int):
    """An OscarLayer (batch 2, 2 KV heads, head_dim 16) fed 24, 16 and ``query_len`` tokens, read by "oscar": the
    layer and its last step (sink, body and a tail that ends with the last chunk)."""
    torch.manual_seed(seed)
    layer = OscarLayer(recipe, 0)
    layer.fused_attention = True
    for n in (24, 16, query_len):
        kv = layer.update(torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16))
    return layer, kv[0].step


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
@pytest.mark.parametrize("layout", sorted(STEP_LAYOUTS))
@pytest.mark.parametrize("groups,query_len", [(2, 1), (7, 1), (5, 1), (2, 3)])  # 2, 3, 4 and 1 rows per LANES
def test_numba_layer_step_matches_the_composition(layout, groups, query_len):
    """The read path's one composition (attend_segments) with the Numba backend runs the step as the backend's one
    whole-step call (query rotated, windows attended and merged inside the kernel), and that call == the
    composition with the dense reference body: every layout, GQA, several query positions, bool and float masks
    over all tokens, a row that attends nothing, no mask, the causal mask of a chunk; split-K over the body agrees
    too. Steps it does not serve (a long chunk, a query with gradients) are composed."""
    layer, step = stepped_layer(STEP_LAYOUTS[layout], query_len, seed=4)
    total = step.seq_len
    assert step.body_tokens and step.tail_k.shape[-2]
    kb, vb = layer.key_body.read(step.body_tokens), layer.value_body.read(step.body_tokens)
    before, after = [(step.sink_k, step.sink_v)], [(step.tail_k, step.tail_v)]
    q = torch.randn(2, 2 * groups, query_len, 16)
    dead = torch.rand(2, 1, query_len, total) > 0.3
    dead[1, 0, 0] = False
    numba = backends.BODY_BACKENDS["numba"]
    fused_calls = []

    def layer_step(*args, **kwargs):
        fused_calls.append(kwargs.get("split"))
        return numba.layer_step(*args, **kwargs)

    spied = dataclasses.replace(numba, layer_step=layer_step)
    causal = read_path.step_mask(None, range(total - query_len, total), range(total), q.device)
    assert (causal is None) == (query_len == 1)
    for mask in (None, dead, torch.randn(1, 1, 1, total), causal):
        want = read_path.attend_segments(q, before, kb, vb, after, 0.3, read_path.REFERENCE_BODY, mask)
        for split in (None, 8):
            got = read_path.attend_segments(q, before, kb, vb, after, 0.3, spied, mask, split=split)
            assert fused_calls[-1] == split
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if mask is dead:
            assert torch.equal(got[1, :, 0], torch.zeros_like(got[1, :, 0]))  # (0, -inf) merges to 0
    assert len(fused_calls) == 8
    long_chunk = torch.randn(2, 4, cpu_kernels.SPLIT_MAX_ROWS, 16)
    assert not numba.serves_layer_step(long_chunk, kb)
    with torch.enable_grad():
        assert not numba.serves_layer_step(q.clone().requires_grad_(), kb)
    composed = dataclasses.replace(spied, serves_layer_step=lambda query, key_body: False)  # the Numba body alone
    got = read_path.attend_segments(q, before, kb, vb, after, 0.3, composed, dead)
    assert len(fused_calls) == 8
    torch.testing.assert_close(got, read_path.attend_segments(q, before, kb, vb, after, 0.3,
                                                              read_path.REFERENCE_BODY, dead), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
def test_numba_layer_step_reads_windows_by_row():
    """``window_rows``: windows with rows of their own (a serving engine's slots: more rows than the batch, in any
    order, the recent window longer than a row holds) read in place == each batch row's own windows; a row index
    outside the windows is refused. ``after_tokens`` and ``body_tokens`` per row: each row's window and body
    lengths, the rest skipped == masked; a length past the windows' slots is refused."""
    layer, step = stepped_layer(STEP_LAYOUTS["token keys, centred"], 1, seed=6)
    kb, vb = layer.key_body.read(step.body_tokens), layer.value_body.read(step.body_tokens)
    q = torch.randn(2, 4, 1, 16)
    numba = backends.BODY_BACKENDS["numba"]
    want = numba.layer_step(q, (step.sink_k, step.sink_v), kb, vb, (step.tail_k, step.tail_v), scaling=0.3)
    rows = torch.tensor([3, 0])
    sink_k, sink_v = torch.randn(5, 2, step.sink_k.shape[2], 16), torch.randn(5, 2, step.sink_k.shape[2], 16)
    n_tail = step.tail_k.shape[2]
    tail_k, tail_v = torch.randn(5, 2, n_tail + 7, 16), torch.randn(5, 2, n_tail + 7, 16)
    sink_k[rows], sink_v[rows], tail_k[rows, :, :n_tail], tail_v[rows, :, :n_tail] = (
        step.sink_k, step.sink_v, step.tail_k, step.tail_v)
    got = numba.layer_step(q, (sink_k, sink_v), kb, vb, (tail_k, tail_v), scaling=0.3, window_rows=rows,
                           after_tokens=n_tail)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="window_rows"):
        numba.layer_step(q, (sink_k, sink_v), kb, vb, (tail_k, tail_v), scaling=0.3, window_rows=torch.tensor([5, 0]),
                         after_tokens=n_tail)
    # after_tokens per row (a row holding fewer window tokens): the rest not attended == masked
    n0, n = step.sink_k.shape[2], step.body_tokens
    fewer = torch.zeros(2, 1, 1, step.seq_len)
    fewer[1, ..., n0 + n + n_tail - 3:] = float("-inf")
    want = numba.layer_step(q, (sink_k, sink_v), kb, vb, (tail_k, tail_v), scaling=0.3, window_rows=rows,
                            after_tokens=n_tail, mask=fewer)
    got = numba.layer_step(q, (sink_k, sink_v), kb, vb, (tail_k, tail_v), scaling=0.3, window_rows=[3, 0],
                           after_tokens=[n_tail, n_tail - 3])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for wrong in ([n_tail, n_tail + 8], None):
        with pytest.raises(ValueError, match="after_tokens"):
            numba.layer_step(q, (sink_k, sink_v), kb, vb, (tail_k, tail_v), scaling=0.3, window_rows=rows,
                             after_tokens=wrong)
    # body_tokens: a row with a shorter body (its mask hides the rest) skips those tokens; splits past it are empty
    short = torch.zeros(2, 1, 1, step.seq_len)
    short[1, ..., n0 + 8:n0 + n] = float("-inf")
    for split in (None, 8):
        want = numba.layer_step(q, (step.sink_k, step.sink_v), kb, vb, (step.tail_k, step.tail_v), scaling=0.3,
                                mask=short, split=split)
        got = numba.layer_step(q, (step.sink_k, step.sink_v), kb, vb, (step.tail_k, step.tail_v), scaling=0.3,
                               mask=short, split=split, body_tokens=torch.tensor([n, 8]))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="body_tokens"):
        numba.layer_step(q, (step.sink_k, step.sink_v), kb, vb, (step.tail_k, step.tail_v), scaling=0.3,
                         body_tokens=torch.tensor([n + 1, 8]))


def paged_copy(body, page: int, blocks: torch.Tensor, num_blocks: int) -> PagedQuantizedBody:
    """``body`` [B, H, tokens, ...] copied into an arena of ``num_blocks`` pages of ``page`` tokens: batch row b's
    page i at block ``blocks[b, i]`` (the rest of the arena random bytes: never read)."""
    g = body.group if body.layout.axis == "channel" else 1
    gen = torch.Generator().manual_seed(5)

    def paged(t, rows):  # [B, H, R, C] -> [H, blocks, rows, C]
        out = torch.randint(-100, 100, (t.shape[1], num_blocks, rows, t.shape[-1]), generator=gen).to(t.dtype)
        for b in range(t.shape[0]):
            for i, block in enumerate(blocks[b].tolist()):
                part = t[b, :, i * rows:(i + 1) * rows]
                out[:, block, :part.shape[1]] = part
        return out

    norm = None
    if body.norm is not None:
        norm = paged(body.norm[:, None, :, None], page)[0, :, :, 0].contiguous()
    return PagedQuantizedBody(body.codec, paged(body.codes, page), paged(body.scale, page // g),
                              paged(body.lo, page // g), norm, body.tokens, blocks)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
@pytest.mark.parametrize("layout", [*sorted(LAYOUTS), "head_dim 24"])
def test_numba_reads_pages_in_place(layout):
    """Bodies read where they are stored, pages of an arena through a page table (a serving engine's decode step),
    == the same tokens gathered into [B, H, tokens, ...]: the body partial and the whole-layer step with each row's
    own body length (a last page partly filled, rows of different lengths, pages in any order), splits inside and
    across pages; a page table that names blocks outside the arena or too few pages is refused."""
    d = 24 if layout == "head_dim 24" else 16
    if layout == "head_dim 24":
        rotation = torch.linalg.qr(torch.randn(24, 24, generator=torch.Generator().manual_seed(3)))[0]
        recipe = oscar_recipe(sink_tokens=0, recent_tokens=0, key_layout=GroupLayout("channel", 8, None, True),
                              value_layout=GroupLayout("token", 12, None, False), key_rotation=rotation,
                              value_rotation=rotation)
    else:
        recipe = LAYOUTS[layout]
    torch.manual_seed(1)
    layer = OscarLayer(recipe, 0)
    for n in (40, 24):
        layer.update(torch.randn(2, 2, n, d), torch.randn(2, 2, n, d))
    n = layer.body_len - 8  # a last page partly filled
    kb, vb = layer.key_body.read(n), layer.value_body.read(n)
    page = 16
    pages = -(-n // page)
    blocks = torch.randperm(2 * pages + 3)[:2 * pages].view(2, pages)
    kp, vp = (paged_copy(body, page, blocks, 2 * pages + 3) for body in (kb, vb))
    q = torch.randn(2, 4, 1, d) @ kb.codec.rotation
    for split in (None, 8, 24):
        want, got = (cpu_kernels.body_attention(q, k, v, scaling=0.3, split=split) for k, v in ((kb, vb), (kp, vp)))
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    sink = (torch.randn(2, 2, 3, d), torch.randn(2, 2, 3, d))
    tail = (torch.randn(2, 2, 5, d), torch.randn(2, 2, 5, d))
    lengths = torch.tensor([n, n - 19])  # the second row ends inside an earlier page
    for split in (None, 8):
        want, got = (cpu_kernels.layer_step_attention(q, sink, k, v, tail, scaling=0.3, split=split,
                                                      body_tokens=lengths) for k, v in ((kb, vb), (kp, vp)))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for wrong in (blocks[:, :pages - 1], blocks + 100, blocks[:1]):
        with pytest.raises(ValueError, match="page table"):
            k, v = (dataclasses.replace(body, pages=wrong) for body in (kp, vp))
            cpu_kernels.layer_step_attention(q, sink, k, v, tail, scaling=0.3)
    with pytest.raises(ValueError, match="same pages"):
        cpu_kernels.layer_step_attention(q, sink, kp, vb, tail, scaling=0.3)


@pytest.mark.parametrize("layout", sorted(STEP_LAYOUTS))
@pytest.mark.parametrize("query_len", [2, 9, 40])
def test_a_chunk_over_its_own_tokens_needs_no_mask(layout, query_len):
    """A chunk attended as the queries' own tokens (``own``: causal among themselves, every other column before
    them) == the composition with the chunk in the window after the body under the causal mask over all columns:
    the dense reference body, the PyTorch one, the Numba body alone, the Numba whole-step call where it serves the
    query (short chunks: it takes the chunk with the causal rule as a mask), and a model mask over the earlier
    columns on top; GQA (the fused kernel's causal rule repeats the chunk's K/V per query head)."""
    layer, step = stepped_layer(STEP_LAYOUTS[layout], query_len, seed=5)
    total, past = step.seq_len, step.tail_k.shape[2] - query_len
    assert step.body_tokens and past >= 0
    kb, vb = layer.key_body.read(step.body_tokens), layer.value_body.read(step.body_tokens)
    before = [(step.sink_k, step.sink_v)]
    after, own = [(step.tail_k[:, :, :past], step.tail_v[:, :, :past])], (step.tail_k[:, :, past:],
                                                                         step.tail_v[:, :, past:])
    q = torch.randn(2, 6, query_len, 16)
    causal = read_path.step_mask(None, range(past + total - step.tail_k.shape[2], total), range(total), q.device)
    earlier = torch.zeros(2, 1, 1, total - query_len).masked_fill(torch.rand(2, 1, 1, total - query_len) > 0.7,
                                                                  float("-inf"))
    full_earlier = causal + torch.nn.functional.pad(earlier, (0, query_len))
    backends_used = [read_path.REFERENCE_BODY, read_path.TORCH_BODY]
    if cpu_kernels.available():
        numba = backends.BODY_BACKENDS["numba"]
        backends_used += [numba, dataclasses.replace(numba, serves_layer_step=lambda query, key_body: False)]
    for mask, want_mask in ((None, causal), (earlier, full_earlier)):
        want = read_path.attend_segments(q, before, kb, vb, [(step.tail_k, step.tail_v)], 0.3,
                                         read_path.REFERENCE_BODY, want_mask)
        for backend in backends_used:
            for fused in (False, True):
                got = read_path.attend_segments(q, before, kb, vb, after, 0.3, backend, mask, fused_dense=fused,
                                                own=own)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="own"):
        read_path.dense_partial(q, own[0][:, :, 1:], own[1][:, :, 1:], 0.3, None, causal=True)


def test_step_mask_is_every_path_s_mask():
    """read_path.step_mask: causal in positions without a model mask (None where nothing is masked: a decode step),
    the model's columns at the keys' positions (a slice, or any order), slots that hold no position and keys outside
    the window masked; a mask too short for the step is refused."""
    nothing = read_path.step_mask(None, range(9, 10), range(10), "cpu")
    assert nothing is None
    chunk = read_path.step_mask(None, range(7, 10), range(10), "cpu")
    allowed = torch.arange(10)[None, :] <= torch.arange(7, 10)[:, None]
    assert chunk.dtype == torch.float32 and chunk.shape == (1, 1, 3, 10)
    assert torch.equal(chunk[0, 0] == 0, allowed) and torch.isneginf(chunk[0, 0][~allowed]).all()
    model = torch.rand(2, 1, 3, 12) > 0.5
    sliced = read_path.step_mask(model, range(7, 10), range(10), "cpu")
    assert torch.equal(sliced, read_path.mask_to_additive(model[..., :10]))  # the model's mask decides
    keys = torch.tensor([4, 0, 11, 2])
    valid = torch.tensor([True, True, False, True])
    picked = read_path.step_mask(model, torch.arange(7, 10), keys, "cpu", valid=valid, window=6)
    want = read_path.mask_to_additive(model)[..., keys].clone()
    want[..., 2] = float("-inf")  # not a valid slot
    want[..., 1] = float("-inf")  # position 0: outside the window (6) of positions 7, 8 and 9
    want[..., 1:, 3] = float("-inf")  # position 2: outside that of 8 and 9
    assert torch.equal(picked, want)
    assert read_path.step_mask(None, range(9, 10), range(10), "cpu", causal=False) is None
    with pytest.raises(ValueError, match="has 8 key columns; this step reads positions 0..9"):
        read_path.step_mask(model[..., :8], range(9, 10), range(10), "cpu")
    with pytest.raises(ValueError, match="per-head masks"):
        read_path.step_mask(torch.ones(1, 2, 1, 10, dtype=torch.bool), range(9, 10), range(10), "cpu")


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
def test_window_arrays_are_kept_per_tensor_and_never_stale():
    """The layer step's windows as numpy arrays: a buffer's view is made once and serves each of its leading views;
    the sink (``whole``) is never read past its own length; anything else is a float32 copy; the view of a tensor
    leaves with it (a new tensor at a reused address gets its own)."""
    buf = torch.randn(1, 2, 8, 4)
    kept = cpu_calls._window_array(buf.narrow(2, 0, 3))
    assert kept is cpu_calls._window_array(buf.narrow(2, 0, 5)) and kept.shape == (1, 2, 8, 4)
    assert kept.ctypes.data == buf.data_ptr()
    buf[0, 0, 4] = 7.0  # appended in place: seen through the kept view
    assert (kept[0, 0, 4] == 7.0).all()
    sink = buf.narrow(2, 0, 3)
    assert cpu_calls._window_array(sink, whole=True).shape == (1, 2, 3, 4)
    for x in (buf.narrow(2, 2, 3), buf[:, :1, :3], buf.narrow(2, 0, 3).to(torch.bfloat16),
              buf.narrow(2, 0, 3).clone().requires_grad_()):  # not a leading view, other dtypes, gradients: copies
        got = cpu_calls._window_array(x, whole=True)
        assert got.shape == tuple(x.shape) and (got == x.detach().float().numpy()).all()
    for i in range(64):  # short-lived tensors, whose addresses are reused
        t = torch.full((1, 1, 2, 4), float(i))
        assert (cpu_calls._window_array(t, whole=True) == i).all()
        del t
    assert all(entry[0]() is not None for entry in cpu_calls._HELD_ARRAYS.values())
    assert len(cpu_calls._HELD_ARRAYS) < 64


def test_stream_read_is_kept_until_the_stream_changes():
    """``QuantizedStream.read``: the same body while the tokens and buffers are the same (a decode step reads every
    layer's streams), a new one once a demotion appends tokens or the buffers grow."""
    torch.manual_seed(0)
    layer = OscarLayer(STEP_LAYOUTS["token keys, centred"], 0)
    layer.fused_attention = True  # placeholders out of update: no portable view per step
    layer.update(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16))
    stream, n = layer.key_body, layer.body_len
    body = stream.read(n)
    assert stream.read(n) is body and stream.read() is body
    assert stream.read(n - 1).tokens == n - 1 and stream.read(n) is not body
    for _ in range(400):  # decode steps: demotions append tokens and grow the buffers
        layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    later = stream.read(layer.body_len)
    assert later.tokens == layer.body_len > n and later.codes is stream.codes.data
    assert torch.equal(later.codes[:, :, :n], body.codes[:, :, :n])

def test_dense_partial_fused_cpu_matches_separate_ops():
    """The fused CPU dense partial (flash attention with its log-sum-exp) == the separate ops, GQA, masks with a
    row that attends nothing, several query positions."""
    torch.manual_seed(3)
    for b, hq, hkv, lq, n in [(1, 9, 3, 1, 70), (2, 8, 2, 5, 40), (2, 4, 4, 3, 7)]:
        q, k, v = torch.randn(b, hq, lq, 16), torch.randn(b, hkv, n, 16), torch.randn(b, hkv, n, 16)
        mask = torch.zeros(b, 1, lq, n).masked_fill(torch.rand(b, 1, lq, n) > 0.6, float("-inf"))
        mask[-1, 0, 0] = float("-inf")
        for m in (None, mask, torch.zeros(1, 1, 1, n)):
            fused = read_path.dense_partial(q, k, v, 0.3, m, fused=True)
            with torch.enable_grad():  # gradients: the separate ops (as without fused)
                ops = read_path.dense_partial(q.clone().requires_grad_(), k, v, 0.3, m, fused=True)
            assert torch.equal(read_path.dense_partial(q, k, v, 0.3, m)[0], ops[0].detach())
            torch.testing.assert_close(fused[0], ops[0].detach(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(fused[1], ops[1].detach(), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ memory
class _LargestAllocation(TorchDispatchMode):
    """Largest storage (bytes) behind any tensor an aten op produces while active (views count their base)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_fused_decode_never_materializes_the_history(tiny_model, cache, cpu_kernel):
    """At 4k context, no op of a fused decode step creates a tensor as large as one layer's full-precision K
    (the portable path does: the control shows the measurement can fail)."""
    context = 4096
    ids = torch.randint(3, 128, (1, context + 1))
    largest = {}
    for attn in ("oscar", "sdpa"):
        model = tiny_model("llama", attn=attn)
        c = CACHES[cache]()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for a in range(0, context, 1024):
                model(input_ids=ids[:, a:a + 1024], past_key_values=c, use_cache=True)
            model(input_ids=ids[:, context:context + 1], past_key_values=c, use_cache=True)  # switches to fused
            with _LargestAllocation() as probe:
                model(input_ids=ids[:, :1], past_key_values=c, use_cache=True)
        largest[attn] = probe.largest
    history = 1 * 2 * (context + 2) * 16 * 4  # bytes of one layer's fp32 K: batch x kv_heads x tokens x head_dim
    assert largest["sdpa"] >= history
    assert largest["oscar"] < history / 3, largest


# ------------------------------------------------------------------------------------------------ SmolLM2
@pytest.mark.slow
@pytest.mark.parametrize("cache", ["oscar", "scaled"])
def test_smollm2_fused_matches_portable(smollm2, cache):
    from hf_kvint2.models import load_smollm2

    model, tok = smollm2
    fused, _ = load_smollm2(torch.float32, attn_implementation=hf_kvint2.ATTN_IMPLEMENTATION)
    make = {"oscar": lambda: OscarCache(sink_tokens=8, recent_tokens=16),
            "scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=32)}[cache]
    text = importlib.resources.files("hf_kvint2.data").joinpath("emma.txt").read_text()[5000:6000]
    batch = tok([text[:400], text[400:1000]], return_tensors="pt", padding=True, padding_side="left")
    ref = _generate(model, make(), batch.input_ids, batch.attention_mask, max_new_tokens=8)
    out = _generate(fused, make(), batch.input_ids, batch.attention_mask, max_new_tokens=8)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=TOL, rtol=0)
    assert torch.equal(out.sequences, ref.sequences)
