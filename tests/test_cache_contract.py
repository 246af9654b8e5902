"""The transformers cache contract on tiny random Llama / Qwen2 / Mistral models: exactness with the
windows covering every token, every generation mode, reuse across generate calls, the batch/crop operations,
sliding-window layer types, bad input, and bits/memory accounting against the tensors actually held."""

import pytest
import torch
from conftest import TINY_ARCHS, TINY_VOCAB, tiny_config
from transformers import AutoModelForCausalLM, DynamicCache

from hf_kvint2 import OscarCache, OscarScaledCache, OscarScaledSettings, OscarSettings, SettingsError
from hf_kvint2.layers import OscarLayer

KINDS = ("scaled", "oscar")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_TOKENS = 4096  # a recent window longer than any sequence here: quantization disabled

pytestmark = pytest.mark.usefixtures("single_thread")


def full_precision_cache(kind, **kw):
    return OscarScaledCache(sink_tokens=0, recent_tokens=ALL_TOKENS, **kw) if kind == "scaled" else OscarCache(
        recent_tokens=ALL_TOKENS, **kw)


def quantized_cache(kind, **kw):
    """Small windows so that a few dozen tokens already fill the INT2 body (OScaR: blocks of 8 tokens; OSCAR:
    demotions of 4 tokens, so that decode steps both append to the window only and demote)."""
    if kind == "scaled":
        return OscarScaledCache(**{"sink_tokens": 0, "recent_tokens": 8, "group_size": 8, **kw})
    return OscarCache(**{"sink_tokens": 4, "recent_tokens": 8, "demotion_tokens": 4, **kw})


def prompt(batch=1, length=24, seed=0):
    return torch.randint(2, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def stored_kv(layer: OscarLayer):
    """What later tokens attend to: sink, dequantized body, recent window, in the model dtype."""
    bk, bv = layer.dequantized_body()
    return (torch.cat([layer.sink_k, bk, layer.recent_k], dim=-2), torch.cat([layer.sink_v, bv, layer.recent_v], dim=-2))


def replay_into_dynamic(cache) -> DynamicCache:
    """A DynamicCache holding exactly the K/V an Oscar cache presents to the next forward."""
    dyn = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        dyn.update(*stored_kv(layer), idx)
    return dyn


@torch.no_grad()
def forward(model, ids, cache, **kw):
    return model(ids, past_key_values=cache, use_cache=True, **kw).logits.float()


def assert_body_filled(cache):
    for layer in cache.layers:
        assert layer.body_len > 0 and layer.key_body.codes.rows > 0, f"nothing was quantized in {layer}"


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_windows_covering_all_tokens_reproduce_dynamic_cache(tiny_model, kind, arch, dtype):
    model = tiny_model(arch, dtype)
    ids = prompt(batch=2, length=30)
    ours, ref = full_precision_cache(kind), DynamicCache()
    # prefill, single-token decode steps, then a multi-token chunk (as assisted decoding sends)
    for chunk in (slice(0, 16), slice(16, 17), slice(17, 18), slice(18, 19), slice(19, 30)):
        got, want = forward(model, ids[:, chunk], ours), forward(model, ids[:, chunk], ref)
        tol = 1e-5 if dtype is torch.float32 else 0.0  # same K/V, same kernels: bit-identical in half precision
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert ours.get_seq_length() == ref.get_seq_length() == 30
    assert all(layer.body_len == 0 for layer in ours.layers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_decode_tracks_dynamic_cache(tiny_model, kind, arch, dtype):
    """Teacher-forced decode with a filled INT2 body: the prefill is exact (the chunk is attended at full
    precision), later steps stay close (tiny random models at INT2: 67-95% top-1 agreement, logit error ~0.3)."""
    model = tiny_model(arch, dtype)
    ids = prompt(batch=2, length=40, seed=1)
    ours, ref = quantized_cache(kind), DynamicCache()
    torch.testing.assert_close(forward(model, ids[:, :16], ours), forward(model, ids[:, :16], ref), atol=0, rtol=0)
    got = torch.cat([forward(model, ids[:, j:j + 1], ours) for j in range(16, 40)], 1)
    want = torch.cat([forward(model, ids[:, j:j + 1], ref) for j in range(16, 40)], 1)
    assert_body_filled(ours)
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    rel = ((got - want).norm() / want.norm()).item()
    assert agreement >= 0.5 and rel < 0.5, f"top-1 agreement {agreement:.2f}, relative logit error {rel:.3f}"


# ---------------------------------------------------------------------------------------------- generation
MODES = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 1.0},
    "beam3": {"num_beams": 3, "do_sample": False},
    "prompt_lookup": {"prompt_lookup_num_tokens": 3, "do_sample": False},
}


def repetitive_prompt(length=24):
    """Repeated n-grams, so prompt-lookup decoding finds candidates (and has to crop rejected ones)."""
    return torch.tensor([[5, 9, 17, 33, 65, 3, 7, 11] * (length // 8)])


def left_padded_batch():
    ids = prompt(batch=2, length=20, seed=2)
    mask = torch.ones_like(ids)
    ids[0, :7], mask[0, :7] = 0, 0  # row 0 is 13 tokens long, left-padded
    return ids, mask


def generate(model, cache, mode, ids, mask=None, new=8, seed=0):
    torch.manual_seed(seed)
    kw = {} if mask is None else {"attention_mask": mask}
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, **MODES[mode], **kw)


def _mode_inputs(mode):
    if mode == "left_padded":
        return ("greedy", *left_padded_batch())
    if mode == "prompt_lookup":
        return mode, repetitive_prompt(), None
    return mode, prompt(length=20, seed=3), None


@pytest.mark.parametrize("mode", [*MODES, "left_padded"])
@pytest.mark.parametrize("kind", KINDS)
def test_generation_with_full_windows_matches_dynamic_cache(tiny_model, kind, mode):
    model = tiny_model("llama")
    gen_mode, ids, mask = _mode_inputs(mode)
    want = generate(model, DynamicCache(), gen_mode, ids, mask)
    cache = full_precision_cache(kind)
    got = generate(model, cache, gen_mode, ids, mask)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == got.shape[1] - 1


@pytest.mark.parametrize("mode", [*MODES, "left_padded"])
@pytest.mark.parametrize("kind", KINDS)
def test_generation_with_quantization(tiny_model, kind, mode):
    """Every mode runs with a filled INT2 body; the first new token (prefill logits are exact) matches DynamicCache,
    and the cache ends up holding exactly the tokens generated (prompt lookup crops rejected candidates)."""
    model = tiny_model("llama")
    gen_mode, ids, mask = _mode_inputs(mode)
    cache = quantized_cache(kind)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    got = generate(model, cache, gen_mode, ids, mask, new=12)
    assert got.shape == (ids.shape[0], ids.shape[1] + 12) and torch.equal(got[:, : ids.shape[1]], ids)
    assert cache.get_seq_length() == got.shape[1] - 1
    assert all(layer.seq_len == got.shape[1] - 1 == stored_kv(layer)[0].shape[-2] for layer in cache.layers)
    assert_body_filled(cache)
    if gen_mode in ("greedy", "prompt_lookup"):  # (beam search may later drop the first step's best token)
        want = generate(model, DynamicCache(), gen_mode, ids, mask, new=1)
        assert torch.equal(got[:, : ids.shape[1] + 1], want)
    if mode == "prompt_lookup":  # transformers' QuantizedCache raises NotImplementedError here
        assert any(n < 0 for n in crops), f"no candidate was rejected: crop calls {crops}"


@pytest.mark.parametrize("kind", KINDS)
def test_one_cache_across_generate_calls(tiny_model, kind):
    model = tiny_model("qwen2")
    first = prompt(length=20, seed=4)
    follow_up = prompt(length=6, seed=5)
    # continuing a conversation: the second call only feeds the tokens the cache has not seen
    outs = {}
    for name, cache in (("ours", full_precision_cache(kind)), ("dynamic", DynamicCache())):
        a = generate(model, cache, "greedy", first)
        b = generate(model, cache, "greedy", torch.cat([a, follow_up], 1))
        assert cache.get_seq_length() == b.shape[1] - 1
        outs[name] = b
    assert torch.equal(outs["ours"], outs["dynamic"])
    cache = quantized_cache(kind)
    a = generate(model, cache, "greedy", first)
    b = generate(model, cache, "greedy", torch.cat([a, follow_up], 1))
    assert cache.get_seq_length() == b.shape[1] - 1 and torch.equal(b[:, : a.shape[1]], a)
    # after reset() the same cache object behaves exactly like a fresh one
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_report()["total"]["total_bytes"] == 0
    again = generate(model, cache, "greedy", follow_up.repeat(1, 4))
    fresh = generate(model, quantized_cache(kind), "greedy", follow_up.repeat(1, 4))
    assert torch.equal(again, fresh)


# ---------------------------------------------------------------------------------------------- contract methods
def _filled(model, kind, batch=3, length=29, seed=6, rows=None):
    """A quantized cache after a 20-token prefill and single-token steps; ``rows`` reorders the prompts first."""
    cache = quantized_cache(kind)
    ids = prompt(batch=batch, length=length, seed=seed)
    if rows is not None:
        ids = ids[rows]
    forward(model, ids[:, :20], cache)
    for j in range(20, length):
        forward(model, ids[:, j:j + 1], cache)
    assert_body_filled(cache)
    return cache, ids


@pytest.mark.parametrize("kind", KINDS)
def test_seq_length_and_mask_sizes(tiny_model, kind):
    model = tiny_model("llama")
    cache = quantized_cache(kind)
    assert cache.get_seq_length() == 0
    ids = prompt(length=30)
    forward(model, ids[:, :21], cache)
    assert cache.get_seq_length() == 21
    forward(model, ids[:, 21:22], cache)
    assert cache.get_seq_length() == 22 and cache.get_seq_length(1) == 22
    assert cache.get_mask_sizes(1, 0) == (23, 0) and cache.get_mask_sizes(5, 1) == (27, 0)
    layer = cache.layers[0]
    assert layer.sink_k.shape[-2] + layer.body_len + layer.recent_k.shape[-2] == 22


def test_scaled_default_keeps_the_first_64_tokens_in_full_precision():
    """OScaR's default sink (64 tokens, as OSCAR's): attention-sink tokens are stored exactly, the body starts after
    them in whole key groups, and the window holds the rest."""
    cache = OscarScaledCache()
    assert cache.settings.sink_tokens == 64
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 300, 16, generator=g), torch.randn(2, 2, 300, 16, generator=g)
    cache.update(k[:, :, :290], v[:, :, :290], 0)
    for t in range(290, 300):
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
    layer = cache.layers[0]
    assert torch.equal(layer.sink_k, k[:, :, :64]) and torch.equal(layer.sink_v, v[:, :, :64])
    assert layer.body_len > 0 and layer.body_len % 32 == 0
    assert 64 + layer.body_len + layer.recent_k.shape[-2] == 300 and layer.recent_k.shape[-2] >= 128
    assert torch.equal(layer.recent_k, k[:, :, 64 + layer.body_len:])
    seen_k, seen_v = stored_kv(layer)
    body = slice(64, 64 + layer.body_len)
    assert not torch.equal(seen_k[:, :, body], k[:, :, body]) and not torch.equal(seen_v[:, :, body], v[:, :, body])
    assert (seen_k[:, :, body] - k[:, :, body]).abs().max() < 2  # INT2, not garbage


@pytest.mark.parametrize("kind", KINDS)
def test_reorder_cache(tiny_model, kind):
    """Beam search's reorder: the cache then continues exactly like one built from the reordered rows."""
    model = tiny_model("llama")
    beam_idx = torch.tensor([2, 0, 0])
    cache, _ = _filled(model, kind)
    cache.reorder_cache(beam_idx)
    ref, _ = _filled(model, kind, rows=beam_idx)
    nxt = prompt(batch=3, length=1, seed=7)
    torch.testing.assert_close(forward(model, nxt, cache), forward(model, nxt, ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_select_indices(tiny_model, kind):
    model = tiny_model("llama")
    cache, _ = _filled(model, kind)
    full, _ = _filled(model, kind)
    nxt = prompt(batch=3, length=2, seed=8)
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert all(layer.batch_size == 2 for layer in cache.layers)
    torch.testing.assert_close(forward(model, nxt[[0, 2]], cache), forward(model, nxt, full)[[0, 2]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_repeat_interleave_then_forward(tiny_model, kind):
    """transformers' QuantizedCache fails at the forward after batch_repeat_interleave; here every repeated row
    continues exactly like the original row."""
    model = tiny_model("llama")
    cache, _ = _filled(model, kind, batch=2)
    single, _ = _filled(model, kind, batch=2)
    cache.batch_repeat_interleave(3)
    assert all(layer.batch_size == 6 for layer in cache.layers)
    assert cache.get_seq_length() == single.get_seq_length()
    nxt = prompt(batch=2, length=3, seed=9)
    got = forward(model, nxt.repeat_interleave(3, 0), cache)
    want = forward(model, nxt, single).repeat_interleave(3, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # and a further decode step still works on the grown batch
    step = forward(model, got[:, -1:].argmax(-1), cache)
    assert step.shape == (6, 1, TINY_VOCAB) and cache.get_seq_length() == 33


def _crop_cases():
    # (kind, cache kwargs, tokens held before the crop, target length, where the cut falls)
    return [
        ("oscar", {"sink_tokens": 4, "recent_tokens": 8}, 30, 26, "recent"),
        ("oscar", {"sink_tokens": 4, "recent_tokens": 8}, 30, 13, "per-token body"),
        ("oscar", {"sink_tokens": 4, "recent_tokens": 8}, 30, 3, "sink"),
        ("scaled", {"recent_tokens": 8, "group_size": 8}, 30, 27, "recent"),
        ("scaled", {"recent_tokens": 8, "group_size": 8}, 30, 16, "block boundary in the body"),
        ("scaled", {"recent_tokens": 8, "group_size": 8}, 30, 13, "inside a per-channel block"),
        ("scaled", {"sink_tokens": 4, "recent_tokens": 8, "group_size": 8}, 30, 2, "sink"),
    ]


@pytest.mark.parametrize("kind,kw,held,target,where", _crop_cases(), ids=lambda c: str(c) if isinstance(c, str) else "")
def test_crop(tiny_model, kind, kw, held, target, where):
    """After crop the cache presents exactly the kept prefix of what it stored, and the next forward equals a
    DynamicCache holding those same K/V. (transformers' QuantizedCache raises on crop.)"""
    model = tiny_model("llama")
    cache = quantized_cache(kind, **kw)
    ids = prompt(batch=2, length=held + 4, seed=10)
    forward(model, ids[:, :18], cache)
    for j in range(18, held):
        forward(model, ids[:, j:j + 1], cache)
    before = [stored_kv(layer) for layer in cache.layers]
    cache.crop(target - held)
    assert cache.get_seq_length() == target
    for layer, (k, v) in zip(cache.layers, before):
        k2, v2 = stored_kv(layer)
        assert torch.equal(k2, k[:, :, :target]) and torch.equal(v2, v[:, :, :target])
        assert layer.body_len % layer.recipe.group_block == 0  # per-channel groups stay whole
    dyn = replay_into_dynamic(cache)
    nxt = ids[:, held:held + 3]
    torch.testing.assert_close(forward(model, nxt, cache), forward(model, nxt, dyn), atol=1e-5, rtol=0)
    # decoding continues, re-filling the body from the new position
    for j in range(8):
        forward(model, ids[:, j:j + 1], cache)
    assert cache.get_seq_length() == target + 3 + 8


@pytest.mark.parametrize("attn", ["sdpa", "oscar"])
@pytest.mark.parametrize("demotion", [5, 16])
def test_oscar_tokens_leave_the_window_demotion_tokens_at_a_time(tiny_model, demotion, attn):
    """The recent window holds recent_tokens .. recent_tokens + demotion_tokens - 1 tokens after every step and the
    body grows by whole demotions. Against one-token demotions: the same codes for the same tokens (up to a rare
    flip at a rounding boundary: the rotation of a block sums in another order than that of one token), and
    decoding as close to a full-precision cache (more tokens stay in the window)."""
    model = tiny_model("llama", torch.float32, attn)
    sink, recent = 4, 8
    cache = OscarCache(sink_tokens=sink, recent_tokens=recent, demotion_tokens=demotion)
    single = OscarCache(sink_tokens=sink, recent_tokens=recent, demotion_tokens=1)
    exact = full_precision_cache("oscar")
    ids = prompt(length=60, seed=21)
    for c in (cache, single, exact):
        forward(model, ids[:, :20], c)
    errors, errors_single = [], []
    for j in range(20, 60):
        got, one, want = (forward(model, ids[:, j:j + 1], c) for c in (cache, single, exact))
        errors.append((got - want).abs().mean())
        errors_single.append((one - want).abs().mean())
        for layer in cache.layers:
            assert recent <= layer.recent_k.shape[-2] < recent + demotion
            assert layer.body_len == (j + 1 - sink - recent) // demotion * demotion
            assert layer.key_body.tokens == layer.value_body.tokens == layer.body_len
    for idx, (layer, ref) in enumerate(zip(cache.layers, single.layers)):
        # the same K/V: layer 0's for every token; deeper layers' only for the prompt's (decoded tokens' K/V depend
        # on earlier layers' attention, which read different windows)
        n = layer.body_len if idx == 0 else min(layer.body_len, 20 - sink)
        assert n > 0
        for mine, theirs in ((layer.key_body, ref.key_body), (layer.value_body, ref.value_body)):
            same = (mine.codes.data[:, :, :n] == theirs.codes.data[:, :, :n]).float().mean()
            assert same > 0.99, same
    assert torch.stack(errors).mean() <= torch.stack(errors_single).mean() * 1.05


@pytest.mark.parametrize("kind", KINDS)
def test_recent_window_appends_in_place_and_keeps_earlier_views(kind):
    """Decode steps write the new token into the recent window's buffer (no new buffer between demotions); a window
    a step handed out keeps its tokens when later steps append or demote; after a crop, a batch reorder or a failed
    update the window is rebuilt rather than written through a stale buffer; memory_report counts the spare room
    as allocated."""
    torch.manual_seed(3)
    cache = quantized_cache(kind)
    h, d = 2, 8
    cache.update(torch.randn(1, h, 20, d), torch.randn(1, h, 20, d), 0)
    layer = cache.layers[0]
    handed, in_place = [], 0
    for _ in range(30):
        k, v = torch.randn(1, h, 1, d), torch.randn(1, h, 1, d)
        body_before, buffer_before = layer.body_len, layer._recent_buffers
        cache.update(k, v, 0)
        assert torch.equal(layer.recent_k[:, :, -1:], k) and torch.equal(layer.recent_v[:, :, -1:], v)
        if layer.body_len == body_before and buffer_before is not None:  # no demotion: the same buffer, written
            assert layer._recent_buffers[0] is buffer_before[0] and layer.recent_k._base is buffer_before[0]
            in_place += 1
        handed.append((layer.recent_k, layer.recent_k.clone()))
    assert in_place >= 30 - 2 * (30 // layer.recipe.demotion_block + 1)
    for view, copy_ in handed:
        assert torch.equal(view, copy_)  # later appends and demotions left earlier windows as they were
    report = layer.memory_bytes()
    assert report["allocated"] > report["codes"] + report["scales"] + report["norms"] + report["full_precision"]
    n = layer.recent_k.shape[-2]
    cache.crop(-1)  # the window is now a shorter view of the buffer: the next append must not write through it
    kept = layer.recent_k.clone()
    k, v = torch.randn(1, h, 1, d), torch.randn(1, h, 1, d)
    cache.update(k, v, 0)
    assert layer.recent_k.shape[-2] in (n, n - layer.recipe.demotion_block)
    assert torch.equal(layer.recent_k[:, :, -1:], k)
    if layer.recent_k.shape[-2] == n:
        assert torch.equal(layer.recent_k[:, :, :-1], kept)
    cache.batch_repeat_interleave(2)
    k2, v2 = torch.randn(2, h, 1, d), torch.randn(2, h, 1, d)
    cache.update(k2, v2, 0)
    assert torch.equal(layer.recent_k[:, :, -1:], k2)
    before = layer.recent_k
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.update(torch.full((2, h, 1, d), float("nan")), v2, 0)
    assert layer.recent_k is before


def test_crop_of_nothing_and_of_everything(tiny_model):
    model = tiny_model("llama")
    cache, _ = _filled(model, "scaled", batch=1)
    before = [stored_kv(layer) for layer in cache.layers]
    cache.crop(0)
    assert all(torch.equal(stored_kv(layer)[0], k) for layer, (k, _) in zip(cache.layers, before))
    cache.crop(-cache.get_seq_length())
    assert cache.get_seq_length() == 0 and cache.memory_report()["total"]["codes"] == 0
    forward(model, prompt(length=5), cache)
    assert cache.get_seq_length() == 5


@pytest.mark.parametrize("kind", KINDS)
def test_crop_takes_a_negative_count_as_dynamic_cache_does(tiny_model, kind):
    """crop(-n) removes the newest n tokens; a positive value (the length to keep, which older transformers took)
    is refused as DynamicCache refuses it, naming the call that keeps a given length."""
    model = tiny_model("llama")
    cache, reference = quantized_cache(kind), DynamicCache()
    ids = prompt(length=24, seed=3)
    forward(model, ids, cache)
    forward(model, ids, reference)
    with pytest.raises(ValueError, match="positive"):
        reference.crop(5)
    with pytest.raises(ValueError, match=r"crop\(5\): .*negative .*cache.crop\(L - cache.get_seq_length\(\)\)"):
        cache.crop(5)
    assert cache.get_seq_length() == 24
    cache.crop(5 - cache.get_seq_length())
    assert cache.get_seq_length() == 5


class _FakeStream:
    """Stands in for the CUDA streams of transformers' offloading on a CPU-only machine (no-op waits)."""

    def wait_stream(self, other):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Offloaded:
    """What an offloaded layer's storage looks like to this test: anything that reads it fails."""

    def __getattr__(self, name):
        raise AssertionError(f"read the offloaded layer's {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_offloading_as_dynamic_cache_with_the_oscar_attention(tiny_model, kind, monkeypatch):
    """offloading=True is taken as DynamicCache takes it (transformers' CUDA offloading: each layer leaves the
    device as soon as its update returns and is prefetched before its next one). The "oscar" attention reads a layer
    after its update returned, from what the update's step holds, so it never reads the offloaded layer (here its
    storage is made unreadable while offloaded); the logits are those without offloading."""
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: _FakeStream())
    model = tiny_model("llama", attn="oscar")
    ids = prompt(length=30, seed=4)
    reference = quantized_cache(kind)
    want = [forward(model, ids[:, :20], reference)] + [forward(model, ids[:, t:t + 1], reference) for t in range(20, 30)]
    cache = quantized_cache(kind, offloading=True)
    assert cache.offloading and not cache.only_non_sliding  # DynamicCache's default: every layer is offloaded
    cache.prefetch_stream = _FakeStream()
    names = ("sink_k", "sink_v", "recent_k", "recent_v", "key_body", "value_body")
    away, moves = {}, []

    def offload(layer):
        away[layer.layer_idx] = {name: getattr(layer, name) for name in names}
        for name in names:
            setattr(layer, name, _Offloaded())
        moves.append(("offload", layer.layer_idx))

    def prefetch(layer):
        for name, value in away.pop(layer.layer_idx, {}).items():
            setattr(layer, name, value)

    monkeypatch.setattr(OscarLayer, "offload", offload)
    monkeypatch.setattr(OscarLayer, "prefetch", prefetch)
    got = [forward(model, ids[:, :20], cache)] + [forward(model, ids[:, t:t + 1], cache) for t in range(20, 30)]
    assert moves.count(("offload", 0)) == moves.count(("offload", 1)) == 11
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cache.layers[0].body_len > 0 and cache.layers[0].fused_attention


@pytest.mark.parametrize("kind", KINDS)
def test_layer_keys_are_given_where_no_dequantization_is_needed_and_refused_after(kind):
    """transformers' layer.keys / .values: None before the first update (as DynamicLayer's), every token while
    all are in the full-precision windows, and once tokens are INT2 codes a clear error naming dequantized_kv()
    and DynamicCache, not None (code that reads a layer's tensors would go on without them)."""
    cache = quantized_cache(kind)
    k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    assert cache.update(k, v, 0) is not None
    layer = cache.layers[0]
    assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    cache.update(torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16), 0)
    assert layer.body_len > 0
    for name in ("keys", "values"):
        with pytest.raises(NotImplementedError, match=f"INT2 codes, not as a {name} tensor.*dequantized_kv.*"
                                                      "DynamicCache"):
            getattr(layer, name)
    got_k, got_v = layer.dequantized_kv()
    want_k, want_v = stored_kv(layer)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and got_k.shape[-2] == 36
    with pytest.raises(NotImplementedError, match="cannot be assigned"):
        layer.keys = k
    layer.reset()
    assert layer.keys is None and layer.values is None


def test_static_layer_keys_are_refused_once_it_holds_tokens():
    """A static layer keeps its K/V in fixed-size buffers by slot: layer.keys / .values are None before the first
    update (as transformers' layers) and afterwards a clear error naming state_tensors() and StaticCache, not None."""
    from hf_kvint2.static_cache import StaticOscarCache

    cache = StaticOscarCache.from_cache(quantized_cache("scaled"), tiny_config("llama"), 64)
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    k = torch.randn(1, 2, 6, 16)
    cache.update(k, k, 0)
    for name in ("keys", "values"):
        with pytest.raises(NotImplementedError, match=f"holds its {name} in fixed-size buffers.*state_tensors.*"
                                                      "StaticCache"):
            getattr(cache.layers[0], name)


# ---------------------------------------------------------------------------------------------- layer types
def _sliding_config(layer_types, **kw):
    return tiny_config("qwen2", layer_types=layer_types, sliding_window=6, use_sliding_window=True, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_sliding_window_layers_stay_full_precision(kind):
    config = _sliding_config(["full_attention", "sliding_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = prompt(length=24, seed=11)
    cache = full_precision_cache(kind, config=config)
    assert [type(layer).__name__ for layer in cache.layers] == ["OscarLayer", "WindowLayer"]
    ref = DynamicCache(config=config)
    for chunk in (slice(0, 16), slice(16, 17), slice(17, 24)):
        torch.testing.assert_close(forward(model, ids[:, chunk], cache), forward(model, ids[:, chunk], ref),
                                   atol=1e-5, rtol=0)
    quant = quantized_cache(kind, config=config)
    out = model.generate(ids, past_key_values=quant, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    report = quant.memory_report()
    kinds = [(row["kind"], row["storage"]) for row in report["layers"]]
    assert kinds == [("OscarLayer", "quantized"), ("WindowLayer", "windowed")]
    sliding = report["layers"][1]
    assert sliding["codes"] == 0 and sliding["full_precision"] > 0 and sliding["bits_per_element"] == 32.0
    assert report["layers"][0]["codes"] > 0
    assert quant.get_seq_length() == out.shape[1] - 1


def test_unknown_layer_type_is_rejected_by_name():
    config = _sliding_config(["full_attention", "sliding_attention"])
    config.layer_types = ["full_attention", "linear_attention"]
    for make in (OscarScaledCache, OscarCache):
        with pytest.raises(ValueError, match="Layer 1 .* 'linear_attention'"):
            make(config=config)


# ---------------------------------------------------------------------------------------------- bad input
def _kv(b=1, h=2, t=3, d=16, dtype=torch.float32):
    return torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, h, t, d, dtype=dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_errors_name_the_problem(kind):
    cache = quantized_cache(kind)
    with pytest.raises(ValueError, match="layer 0: expected key/value states of rank 4"):
        cache.update(torch.randn(2, 3, 16), torch.randn(2, 3, 16), 0)
    with pytest.raises(ValueError, match="unsupported K/V dtype torch.float64"):
        cache.update(*_kv(dtype=torch.float64), 0)
    cache.update(*_kv(), 0)
    with pytest.raises(ValueError, match="kv_heads=3,.* kv_heads=2.*reset"):
        cache.update(*_kv(h=3), 0)
    with pytest.raises(ValueError, match="batch=2.* batch=1"):
        cache.update(*_kv(b=2), 0)
    with pytest.raises(ValueError, match="dtype changed from torch.float32 to torch.bfloat16"):
        cache.update(*_kv(dtype=torch.bfloat16), 0)
    k, v = _kv()
    with pytest.raises(ValueError, match="differ in shape"):
        cache.update(k, v[:, :, :2], 0)
    for d in (18, 1):  # INT2 packs four channels per byte; the error names the cache that stores any head_dim
        with pytest.raises(ValueError, match=f"head_dim={d} is not supported: .*multiple of 4.*DynamicCache"):
            quantized_cache(kind).update(*_kv(d=d), 0)
    assert cache.get_seq_length() == 3  # rejected calls left the cache untouched
    cache.reset()
    cache.update(*_kv(b=2, h=3), 0)  # after reset a different shape is fine
    assert cache.layers[0].batch_size == 2


def test_rotation_and_calibration_shape_errors():
    with pytest.raises(ValueError, match="key rotation of layer 0 is \\(8, 8\\) but the model's head_dim is 16"):
        OscarCache(k_rotations=[torch.eye(8)], v_rotations=[torch.eye(16)]).update(*_kv(), 0)
    with pytest.raises(ValueError, match="value rotation of layer 0 is not orthogonal"):
        OscarCache(v_rotations=[2 * torch.eye(16)]).update(*_kv(), 0)
    with pytest.raises(ValueError, match="key mean of layer 0 is \\(3, 16\\), expected \\(kv_heads=2, head_dim=16\\)"):
        OscarCache(key_means=[torch.zeros(3, 16)]).update(*_kv(), 0)
    with pytest.raises(ValueError, match="k_rotations has 1 entries but the model has a layer 1"):
        OscarCache(k_rotations=[torch.eye(16)]).update(*_kv(), 1)
    with pytest.raises(ValueError, match="k_rotations has 1 entries but the model has 2 layers"):
        OscarCache(config=tiny_config("llama"), k_rotations=[torch.eye(16)])
    with pytest.raises(ValueError, match=r"k_clip must be a clip ratio in \(0, 1\]"):
        OscarCache(k_clip=1.5)
    with pytest.raises(ValueError, match="recent_tokens must be a non-negative int"):
        OscarScaledCache(sink_tokens=0, recent_tokens=-1)


@pytest.mark.parametrize("make,expected", [
    (lambda: OscarScaledCache(token_scaling="false"), "token_scaling must be a bool"),
    (lambda: OscarScaledCache(group_size=True), "group_size must be a positive int"),
    (lambda: OscarScaledCache(key_group_size=8.0), "key_group_size must be a positive int or None"),
    (lambda: OscarCache(sink_tokens="64"), "sink_tokens must be a non-negative int"),
    (lambda: OscarCache(v_clip=[0.9, "0.8"]), "v_clip must be a clip ratio"),
    (lambda: OscarCache(scale_dtype=torch.int8), "scale_dtype must be one of"),
])
def test_settings_are_type_checked(make, expected):
    """One validation for every setting: a value of the wrong type names the setting and the expected type."""
    with pytest.raises(SettingsError, match=expected):
        make()


def test_settings_dict_round_trip_and_errors():
    settings = OscarSettings(k_clip=[0.9, None], recent_tokens=32, scale_dtype=torch.bfloat16)
    as_dict = settings.to_dict()
    assert as_dict["k_clip"] == [0.9, None] and as_dict["scale_dtype"] == "bfloat16"
    assert OscarSettings.from_dict(as_dict) == settings and OscarSettings.from_dict({}) == OscarSettings()
    assert OscarScaledSettings.from_dict(OscarScaledSettings(group_size=16).to_dict()).group_size == 16
    with pytest.raises(SettingsError, match=r"unknown settings \['window'\]"):
        OscarSettings.from_dict({"window": 3})
    with pytest.raises(SettingsError, match="settings version 2"):
        OscarSettings.from_dict({}, version=2)
    with pytest.raises(SettingsError, match="token_scaling must be a bool"):
        OscarScaledSettings.from_dict({"token_scaling": "false"})
    narrow = OscarScaledSettings(sliding_window_dtype=torch.bfloat16)
    assert narrow.to_dict()["sliding_window_dtype"] == "bfloat16" and OscarScaledSettings().to_dict()[
        "sliding_window_dtype"] is None
    assert OscarScaledSettings.from_dict(narrow.to_dict()) == narrow
    assert OscarSettings.from_dict({"sliding_window_dtype": None}) == OscarSettings()
    assert narrow.recipe() == OscarScaledSettings().recipe()  # a cache-level setting: the INT2 layers are the same
    with pytest.raises(SettingsError, match="sliding_window_dtype 'int8' is not one of"):
        OscarSettings.from_dict({"sliding_window_dtype": "int8"})
    with pytest.raises(SettingsError, match="sliding_window_dtype must be None or one of"):
        OscarSettings(sliding_window_dtype=torch.int8)
    with pytest.raises(TypeError, match="recent_tokenz"):
        OscarScaledCache(recent_tokenz=3)
    cache = OscarScaledCache(settings=OscarScaledSettings(group_size=16), sink_tokens=0, recent_tokens=8)
    assert cache.settings == OscarScaledSettings(group_size=16, sink_tokens=0, recent_tokens=8)


# ---------------------------------------------------------------------------------------------- accounting
def _held_bytes(layer: OscarLayer) -> dict:
    """Bytes of the tensors a layer holds, found by walking its attributes (independent of memory_bytes)."""
    out = {"codes": 0, "scales": 0, "norms": 0, "full_precision": 0}
    for t in (layer.sink_k, layer.sink_v, layer.recent_k, layer.recent_v):
        out["full_precision"] += t.numel() * t.element_size()
    for stream in (layer.key_body, layer.value_body):
        for kind, buf in (("codes", stream.codes), ("scales", stream.scale), ("scales", stream.lo),
                          ("norms", stream.norm)):
            view = None if buf is None else buf.view()
            if view is not None:
                out[kind] += view.numel() * view.element_size()
    return out


def _expected_bytes(kind, b, h, d, tokens, sink, recent, group, elt, demotion=1):
    """Bytes from the storage formula (2-bit codes; scales and lo in fp16, norms fp16 per token and batch row);
    OSCAR's tokens leave the window ``demotion`` at a time."""
    if kind == "oscar":
        body = max(tokens - sink - recent, 0) // demotion * demotion
        g = min(group, d)
        codes = 2 * b * h * body * d // 4
        scales = 2 * 2 * b * h * body * (d // g) * 2
        norms = 0
    else:
        body = max(tokens - sink - recent, 0) // group * group
        codes = 2 * b * h * body * d // 4
        key_scales = 2 * b * h * (body // group) * d * 2
        value_scales = 2 * b * h * body * (d // min(group, d)) * 2
        scales, norms = key_scales + value_scales, b * body * 2
    fp = 2 * b * h * (tokens - body) * d * elt
    return {"codes": codes, "scales": scales, "norms": norms, "full_precision": fp}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_memory_report_counts_the_bytes_held(tiny_model, kind, dtype):
    model = tiny_model("mistral", dtype)
    cache = quantized_cache(kind)
    ids = prompt(batch=2, length=45, seed=12)
    forward(model, ids[:, :30], cache)
    for j in range(30, 45):
        forward(model, ids[:, j:j + 1], cache)
    report = cache.memory_report()
    total_bits, total_elements = 0, 0
    sink, recent, group = (0, 8, 8) if kind == "scaled" else (4, 8, 128)
    for idx, layer in enumerate(cache.layers):
        held = _held_bytes(layer)
        row = report["layers"][idx]
        for key in held:
            assert row[key] == held[key], (key, row, held)
        assert held == _expected_bytes(kind, 2, 2, 16, 45, sink, recent, group, dtype.itemsize,
                                       demotion=layer.recipe.demotion_block)
        elements = 2 * 2 * 2 * 16 * 45
        assert row["elements"] == elements
        assert row["bits_per_element"] == pytest.approx(8 * sum(held.values()) / elements)
        assert cache.bits_per_element(idx) == pytest.approx(row["bits_per_element"])
        total_bits += 8 * sum(held.values())
        total_elements += elements
    assert cache.bits_per_element() == pytest.approx(total_bits / total_elements)
    assert report["total"]["total_bytes"] * 8 == total_bits


def _fill_long(cache, tokens=131072, d=128, chunk=32768):
    g = torch.Generator().manual_seed(0)
    for start in range(0, tokens, chunk):
        k = torch.randn(1, 1, chunk, d, generator=g).to(torch.bfloat16)
        v = torch.randn(1, 1, chunk, d, generator=g).to(torch.bfloat16)
        cache.update(k, v, 0)
    return cache


@pytest.mark.parametrize("kind", KINDS)
def test_bits_per_element_at_128k_tokens(kind):
    """At 131072 tokens, head_dim 128, bf16, default settings, OSCAR stores 2.25-2.30 bits per
    element and OScaR about 3 (3 for codes + scales, plus the key norms and the full-precision window)."""
    tokens, d = 131072, 128
    cache = _fill_long(OscarCache() if kind == "oscar" else OscarScaledCache(), tokens, d)
    layer = cache.layers[0]
    assert layer.seq_len == tokens
    held = _held_bytes(layer)
    bits = cache.bits_per_element()
    assert bits == pytest.approx(8 * sum(held.values()) / (2 * tokens * d))
    if kind == "oscar":  # sink 64 + recent 256 in bf16, 2 + 32/128 bits per element elsewhere
        formula = ((tokens - 320) * (2 + 32 / 128) + 320 * 16) / tokens
        assert 2.25 <= bits <= 2.30
    else:  # sink 64 + recent 128 in bf16; body: keys 2 + 32/32 + 16/128 (norm), values 2 + 32/32
        formula = ((tokens - 192) * (3 + 16 / 128 / 2) + 192 * 16) / tokens
        assert 3.0 <= bits <= 3.1
    assert bits == pytest.approx(formula, rel=1e-12)
