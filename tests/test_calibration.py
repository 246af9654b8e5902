"""OSCAR calibration: capture, streaming statistics, clip/layout fitting, determinism, the CLI (tiny models)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hf_kvint2 import OscarCache
from hf_kvint2.calibration import (
    DEFAULT_RANGE_CLIP_GRID,
    HeldOutLayer,
    LayerErrorProbe,
    LayerStatistics,
    capture_attention,
    collect_statistics,
    fit_layer,
    tokenize_texts,
)
from hf_kvint2.data import __file__ as _data_init
from hf_kvint2.transforms import check_orthogonal, hadamard_matrix

TEXT = (Path(_data_init).parent / "prideprejudice.txt").read_text(encoding="utf-8")[:20000]
SETTINGS = {"text_window": 256, "sink_tokens": 8, "recent_tokens": 32, "fit_queries": 64}  # small: a body of ~200 tokens


def char_tokenizer() -> PreTrainedTokenizerFast:
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(chars)} | {"[UNK]": len(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def tiny_llama(attn="sdpa"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(key_offset: float = 0.0):
    """Qwen2 has q/k/v biases; a large k bias gives the constant key offset that breaks per-token INT2."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).eval()
    if key_offset:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.copy_(key_offset * torch.linspace(-1, 1, layer.self_attn.k_proj.bias.numel()))
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def llama_cache(tokenizer):
    return OscarCache.calibrate(tiny_llama(), tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                **SETTINGS)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_capture_keeps_logits_and_restores_implementation(tokenizer, attn):
    model = tiny_llama(attn)
    ids = tokenizer(TEXT[:200], return_tensors="pt").input_ids
    seen = {}

    def record(module, q, k, v, kwargs):
        seen[module.layer_idx] = (q.shape, k.shape, v.shape)

    with torch.no_grad():
        before = model(ids).logits
        with capture_attention(model, record):
            during = model(ids).logits
        after = model(ids).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert model.config._attn_implementation == attn
    assert seen == {i: ((1, 4, ids.shape[1], 16), (1, 2, ids.shape[1], 16), (1, 2, ids.shape[1], 16)) for i in (0, 1)}


def test_capture_restores_implementation_on_error(tokenizer):
    model = tiny_llama()
    ids = tokenizer("abc", return_tensors="pt").input_ids

    def boom(*args):
        raise KeyError("inside")

    with pytest.raises(KeyError), torch.no_grad(), capture_attention(model, boom):
        model(ids)
    assert model.config._attn_implementation == "sdpa"


def _check_calibrated(cache, layers=2, kv_heads=2, d=16):
    assert len(cache.calibration.k_rotations) == len(cache.calibration.v_rotations) == len(cache.calibration.layer_layouts) == layers
    for i in range(layers):
        check_orthogonal(cache.calibration.k_rotations[i], "k")
        check_orthogonal(cache.calibration.v_rotations[i], "v")
        for mean in (cache.calibration.key_means[i], cache.calibration.value_means[i]):
            assert mean is None or mean.shape == (kv_heads, d)
        for ev in (cache.calibration.k_eigenvalues[i], cache.calibration.v_eigenvalues[i]):
            assert ev is None or (ev.shape == (d,) and (ev[:-1] >= ev[1:]).all() and (ev > -1e-6).all())
        kname = cache.calibration.layout_names[i].split()[0].removeprefix("key=")
        assert kname.split("+")[0] in ("spectral", "hadamard", "channel")
        key_layout = cache.calibration.layer_layouts[i][0]
        assert (key_layout.axis == "channel") == kname.startswith("channel")
        if kname.startswith("hadamard"):
            assert torch.equal(cache.calibration.k_rotations[i], hadamard_matrix(d))
    info = cache.calibration.info
    assert info["num_tokens"] == 1200 and info["statistics_tokens"] + info["held_out_tokens"] == 1200
    assert (info["num_layers"], info["num_key_value_heads"], info["head_dim"]) == (layers, kv_heads, d)
    assert all(math.isfinite(e) for e in info["attention_error"]["key"] + info["attention_error"]["value"])


def _decode_logits(model, cache, ids, chunk=32):
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            out.append(model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)


def test_tiny_llama_end_to_end(llama_cache, tokenizer):
    _check_calibrated(llama_cache)
    model = tiny_llama()
    ids = tokenizer(TEXT[5000:5300], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits
    got = _decode_logits(model, llama_cache, ids)
    assert llama_cache.layers[0].body_len > 0  # tokens really went through the INT2 body
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.5


def test_tiny_qwen2_with_key_offset_end_to_end(tokenizer):
    model = tiny_qwen2(key_offset=30.0)
    cache = OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                 **SETTINGS)
    _check_calibrated(cache)
    report = cache.calibration_report["choices"]
    for choice in report:
        # The large offset must not survive: the chosen key layout beats plain per-token (uncentred) layouts.
        plain = min(e for name, e in choice.errors.items() if name.startswith(("key:spectral@", "key:hadamard@")))
        assert choice.key_error < plain
    ids = tokenizer(TEXT[5000:5300], return_tensors="pt").input_ids
    assert torch.isfinite(_decode_logits(model, cache, ids)).all()


def _direct_value_metric(q, k, v, centered):
    """The value metric's token weights from all tokens at once: w_h[t] = k_t^T M_h k_t normalised to mean 1."""
    h = k.shape[0]
    qd = q.double().reshape(h, -1, q.shape[-1])
    m = qd.transpose(1, 2) @ qd / qd.shape[1]
    out = 0
    for i in range(h):
        kd, vd = k[i].double(), v[i].double()
        if centered:
            vd = vd - vd.mean(0)
        w = torch.einsum("td,de,te->t", kd, m[i], kd)
        w = w / w.mean()
        out = out + (vd.T * w) @ vd / len(w)
    return m.mean(0), out / h


@pytest.mark.parametrize("centered", [False, True])
def test_two_pass_value_metric_equals_direct(centered):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 300, 8, generator=g), torch.randn(2, 300, 8, generator=g), torch.randn(2, 300, 8, generator=g)
    k = k + 2.0  # offsets make the centred/uncentred difference visible
    v = v * torch.linspace(0.5, 3, 8) + 1.0
    stats = LayerStatistics(2, 8)
    chunks = [(0, 70), (70, 200), (200, 300)]
    for a, b in chunks:
        stats.add_pass1(q[:, a:b], k[:, a:b], v[:, a:b])
    stats.finish_pass1()
    for a, b in chunks:
        stats.add_pass2(k[:, a:b], v[:, a:b])
    sigma_k, sigma_v = _direct_value_metric(q, k, v, centered)
    torch.testing.assert_close(stats.key_metric(), sigma_k, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.value_metric(centered), sigma_v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.value_mean(), v.double().mean(1))


def test_statistics_state_does_not_grow_with_tokens(tokenizer):
    model = tiny_llama()
    sizes = []
    for num_tokens in (600, 1400):
        data = collect_statistics(model, tokenizer, [TEXT], num_tokens=num_tokens, progress=False, **SETTINGS)
        assert data.info["statistics_tokens"] == num_tokens - SETTINGS["text_window"]
        state = sum(t.numel() * t.element_size() for s in data.stats for t in s.state_tensors())
        held = sum(t.numel() * t.element_size() for w in data.held_out for layer in w
                   for t in (layer.q, layer.k, layer.v))
        sizes.append((state, held))
    assert sizes[0] == sizes[1]
    assert sizes[0][0] == 2 * (3 * 2 * 16 * 16 + 3 * 2 * 16 + 2) * 8  # float64 per layer: qq, wvv, M; 3 sums; w_sum


def test_determinism_bit_identical_artifact(llama_cache, tokenizer, tmp_path):
    again = OscarCache.calibrate(tiny_llama(), tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                 **SETTINGS)
    digests = []
    for i, cache in enumerate((llama_cache, again)):
        folder = cache.save_pretrained(tmp_path / str(i))
        files = sorted(p for p in Path(folder).iterdir() if p.is_file())
        assert {p.name for p in files} >= {"config.json", "model.safetensors"}
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    assert digests[0] == digests[1]


def _one_window_fit(q, k, v, positions, group, g):
    """Statistics over k/v (queries drawn from ``g``) and the error probe of one held-back window (sink 8, recent
    32) for fit_layer."""
    h, t, d = k.shape
    probe = LayerErrorProbe([HeldOutLayer(q, k, v, positions, d ** -0.5)], sink=8, recent=32,
                            scale_dtype=torch.float16)
    stats = LayerStatistics(h, d)
    stats.add_pass1(torch.randn(h * group, t, d, generator=g), k, v)
    stats.finish_pass1()
    stats.add_pass2(k, v)
    return stats, probe


def test_clip_fitting_beats_no_clipping_on_outliers():
    g = torch.Generator().manual_seed(0)
    h, t, d, group = 2, 512, 16, 2
    k = torch.randn(h, t, d, generator=g)
    v = torch.randn(h, t, d, generator=g)
    spikes = torch.rand(h, t, d, generator=g) < 0.01  # rare large outliers blow up every per-token range
    k, v = k + spikes * 25.0, v + spikes * 25.0
    positions = torch.arange(320, 512, 4)
    q = torch.randn(h * group, t, d, generator=g)[:, positions]
    stats, probe = _one_window_fit(q, k, v, positions, group, g)
    choice = fit_layer(stats, probe, d, layouts=("hadamard",), centering=(False,))
    for kind, cand, err in (("key", choice.key, choice.key_error), ("value", choice.value, choice.value_error)):
        unclipped = choice.errors[f"{kind}:hadamard@None"]
        assert cand.layout.clip is not None and cand.layout.clip < 1.0
        assert err < 0.9 * unclipped, (kind, err, unclipped)


def test_range_clip_fitting_narrows_per_channel_groups_with_rare_outliers():
    """Per-channel key groups whose range a few outlier tokens set: the fit narrows the range (a measured
    improvement over the full range) and records every fraction it tried; it does not narrow by default or
    without fit_clip."""
    g = torch.Generator().manual_seed(0)
    h, t, d, group = 1, 512, 16, 2
    k = torch.randn(h, t, d, generator=g)
    k = k + (torch.rand(h, t, d, generator=g) < 0.01) * 8.0
    v = torch.randn(h, t, d, generator=g)
    positions = torch.arange(320, 512, 4)
    q = torch.randn(h * group, t, d, generator=g)[:, positions]
    stats, probe = _one_window_fit(q, k, v, positions, group, g)
    choice = fit_layer(stats, probe, d, layouts=("channel",), centering=(False,), group_size=64,
                       range_clip_grid=DEFAULT_RANGE_CLIP_GRID)
    layout = choice.key.layout
    assert layout.axis == "channel" and layout.clip is None
    assert layout.range_clip is not None and layout.range_clip < 1.0
    assert choice.key_error < 0.9 * choice.errors["key:channel@None"]
    tried = {n for n in choice.errors if n.startswith("key:channel@range")}
    assert tried == {f"key:channel@range{r}" for r in DEFAULT_RANGE_CLIP_GRID if r < 1.0}
    for plain in (fit_layer(stats, probe, d, layouts=("channel",), centering=(False,), group_size=64),  # default
                  fit_layer(stats, probe, d, layouts=("channel",), centering=(False,), group_size=64, fit_clip=False,
                            range_clip_grid=DEFAULT_RANGE_CLIP_GRID)):
        assert plain.key.layout.range_clip is None and plain.key_error == choice.errors["key:channel@None"]


def test_narrowed_ranges_are_kept_only_where_the_held_back_loss_falls(tokenizer, monkeypatch):
    """With the model, per-channel streams may narrow their range and each that does is checked by the held-back
    loss of the whole cache (its body read by the PyTorch backend, which compiles nothing; the CPU kernel setting
    is restored after): kept where widening it would raise the loss, widened (back to the full range and its
    measured error) otherwise. Without the cache type to check them in no range is narrowed."""
    import os

    from hf_kvint2 import steps
    from hf_kvint2.backends import CPU_KERNEL_ENV
    from hf_kvint2.calibration import confirm_range_clips, fit_from_statistics, fit_layers

    chosen, select = [], steps.select_body_partial
    monkeypatch.setattr(steps, "select_body_partial", lambda *a, **kw: chosen.append(select(*a, **kw).name)
                        or select(*a, **kw))
    monkeypatch.setenv(CPU_KERNEL_ENV, "numba")

    model = tiny_llama()
    data = collect_statistics(model, tokenizer, [TEXT], num_tokens=1200, progress=False, **SETTINGS)
    kw = {"layouts": ("channel",), "centering": (False,), "sink_tokens": 8, "recent_tokens": 32, "group_size": 16}
    fitted = fit_layers(data, progress=False, range_clip_grid=DEFAULT_RANGE_CLIP_GRID, **kw)
    narrowed = [(i, kind) for i, c in enumerate(fitted) for kind in ("key", "value")
                if getattr(c, kind).layout.range_clip is not None]
    assert narrowed  # heavy-tailed activations of a random model: the probe narrows some streams
    final, check = confirm_range_clips(fitted, model, data.held_ids, cache_type=OscarCache, sink_tokens=8,
                                       recent_tokens=32, group_size=16, scale_dtype=torch.float16, head_dim=16,
                                       progress=False)
    assert chosen and set(chosen) == {"torch"} and os.environ[CPU_KERNEL_ENV] == "numba"
    nll = check["held_back_nll"]
    assert set(nll) == {"fitted"} | {f"{i}:{kind}" for i, kind in narrowed}
    for i, kind in narrowed:
        layout, name = getattr(final[i], kind).layout, f"{i}:{kind}"
        assert (name in check["widened"]) == (nll[name] < nll["fitted"]) != (name in check["kept"])
        if name in check["widened"]:
            assert layout.range_clip is None
            assert getattr(final[i], f"{kind}_error") == fitted[i].errors[f"{kind}:channel@None"]
        else:
            assert layout == getattr(fitted[i], kind).layout
    result = fit_from_statistics(data, model.config, bits_budget=None, progress=False, model=model,
                                 cache_type=OscarCache, **kw)
    info = result.calibration.info
    assert info["candidates"]["range_clip_grid"] == list(DEFAULT_RANGE_CLIP_GRID)
    assert [p[0].range_clip for p in result.calibration.layer_layouts] == [final[i].key.layout.range_clip
                                                                            for i in range(2)]
    assert info["range_clip_check"]["kept"] == check["kept"]
    plain = fit_from_statistics(data, model.config, bits_budget=None, progress=False, model=model, **kw)  # no check
    assert plain.calibration.info["candidates"]["range_clip_grid"] is None
    assert all(lay.range_clip is None for pair in plain.calibration.layer_layouts for lay in pair)
    assert "range_clip_check" not in plain.calibration.info


def test_bad_inputs_get_clear_errors(tokenizer):
    model = tiny_llama()
    with pytest.raises(ValueError, match="held-back window"):
        OscarCache.calibrate(model, tokenizer, [TEXT[:200]], num_tokens=1000, progress=False, verbose=False,
                             **SETTINGS)
    with pytest.raises(ValueError, match="layouts"):
        OscarCache.calibrate(model, tokenizer, [TEXT], layouts=("rotated",), progress=False, verbose=False)
    with pytest.raises(ValueError, match="non-empty"):
        tokenize_texts(tokenizer, [""], 10)
    with pytest.raises(ValueError, match="quantized body"):
        OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=600, text_window=64, sink_tokens=8, recent_tokens=64,
                             progress=False, verbose=False)


def _calibration_cli(tokenizer, tmp_path):
    """The calibration script as a module, a saved tiny Llama and a text file to run it on."""
    import importlib.util

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    script = Path(__file__).parents[1] / "calibration_scripts" / "calibrate_oscar.py"
    spec = importlib.util.spec_from_file_location("calibrate_oscar", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli, model_dir, text


def test_cli_writes_artifact(tokenizer, tmp_path, capsys):
    cli, model_dir, text = _calibration_cli(tokenizer, tmp_path)
    out = tmp_path / "artifact"
    assert cli.main(["--model", str(model_dir), "--text", str(text), "--num-tokens", "800", "--window", "256",
                     "--fit-windows", "2", "--sink-tokens", "8", "--recent-tokens", "32", "--no-fit-clip",
                     "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "artifact written to" in printed and str(out) in printed and "peak memory" in printed
    recorded = json.loads((out / "config.json").read_text())["calibration"]
    assert (recorded["window"], recorded["held_out_tokens"]) == (256, 512)  # --fit-windows 2 windows held back
    loaded = OscarCache.from_pretrained(out)
    assert loaded.settings.k_clip is not None
    assert len(loaded.calibration.k_rotations) == 2 and loaded.calibration.layout_names is not None


def test_python_and_the_script_calibrate_the_same_artifact(tokenizer, tmp_path, single_thread):
    """OscarCache.calibrate from Python and calibrate_oscar.py give the same artifact (same tensors, same config,
    byte for byte) from the same model, text and options, with the defaults left to the library: both narrow
    per-channel ranges and check them end to end on the held-back loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli, model_dir, text = _calibration_cli(tokenizer, tmp_path)
    assert cli.main(["--model", str(model_dir), "--text", str(text), "--num-tokens", "800", "--window", "256",
                     "--sink-tokens", "8", "--recent-tokens", "32", "--layouts", "channel",
                     "--output", str(tmp_path / "script")]) == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = OscarCache.calibrate(model, AutoTokenizer.from_pretrained(model_dir), [TEXT], num_tokens=800,
                                 text_window=256, sink_tokens=8, recent_tokens=32, layouts=("channel",),
                                 data_description=text.name, model_id=str(model_dir), progress=False, verbose=False)
    cache.save_pretrained(tmp_path / "python")
    info = cache.calibration.info
    assert info["candidates"]["range_clip_grid"] == list(DEFAULT_RANGE_CLIP_GRID) and info["range_clip_check"]
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "script" / name).read_bytes() == (tmp_path / "python" / name).read_bytes(), name


def test_script_help_states_the_library_defaults(tokenizer, tmp_path, monkeypatch):
    """calibrate_oscar.py leaves every fitting option it is not given to OscarCache.calibrate; the defaults its help
    states (written there so that --help prints before torch loads) are the library's."""
    import argparse

    from hf_kvint2.calibration import (
        DEFAULT_BITS_BUDGET,
        DEFAULT_FIT_WINDOWS,
        DEFAULT_GROUP_SIZES,
        DEFAULT_K_CLIP,
        DEFAULT_NUM_TOKENS,
        DEFAULT_TEXT_WINDOW,
        DEFAULT_V_CLIP,
        LAYOUTS,
    )
    from hf_kvint2.settings import OSCAR_DEFAULTS

    cli, _, _ = _calibration_cli(tokenizer, tmp_path)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda self, argv=None: self)
    parser = cli.parse_args([])
    helps = {action.option_strings[0]: " ".join(action.help.split()) for action in parser._actions
             if action.option_strings and action.help}
    stated = {"--num-tokens": f"(default {DEFAULT_NUM_TOKENS})", "--window": f"(default {DEFAULT_TEXT_WINDOW})",
              "--fit-windows": f"(default {DEFAULT_FIT_WINDOWS})",
              "--sink-tokens": f"(default {OSCAR_DEFAULTS.sink_tokens})",
              "--recent-tokens": f"(default {OSCAR_DEFAULTS.recent_tokens})",
              "--group-size": f"(default {OSCAR_DEFAULTS.group_size})",
              "--group-sizes": f"(default {','.join(map(str, DEFAULT_GROUP_SIZES))};",
              "--bits-budget": f"(default 'auto': {DEFAULT_BITS_BUDGET},",
              "--layouts": f"among {','.join(LAYOUTS)} (default: all",
              "--no-fit-clip": f"{DEFAULT_K_CLIP} (keys) / {DEFAULT_V_CLIP} (values)"}
    for option, text in stated.items():
        assert text in helps[option], (option, helps[option])
    for option in ("--num-tokens", "--window", "--fit-windows", "--sink-tokens", "--recent-tokens", "--group-size",
                   "--group-sizes", "--bits-budget", "--layouts"):
        assert parser.get_default(option.lstrip("-").replace("-", "_")) is None, option  # left to the library


def test_spilled_and_recomputed_value_pass_agree(tokenizer):
    model = tiny_llama()
    runs = [collect_statistics(model, tokenizer, [TEXT], num_tokens=900, progress=False, value_pass=mode,
                               **SETTINGS) for mode in ("spill", "recompute")]
    for a, b in zip(runs[0].stats, runs[1].stats):
        for x, y in zip(a.state_tensors(), b.state_tensors()):
            assert torch.equal(x, y)
    assert runs[0].stats[0].w_sum.gt(0).all()


def test_calibration_data_round_trip(tokenizer, tmp_path):
    data = collect_statistics(tiny_llama(), tokenizer, [TEXT], num_tokens=700, progress=False, **SETTINGS)
    data.save(tmp_path / "stats.safetensors")
    back = type(data).load(tmp_path / "stats.safetensors")
    for a, b in zip(data.stats, back.stats):
        assert (a.q_count, a.kv_count) == (b.q_count, b.kv_count)
        assert all(torch.equal(x, y) for x, y in zip(a.state_tensors(), b.state_tensors()))
    for a, b in zip(data.held_out[0], back.held_out[0]):
        assert a.scaling == b.scaling and torch.equal(a.k, b.k) and torch.equal(a.q, b.q)
    ids = tokenize_texts(tokenizer, [TEXT], 700)
    assert len(back.held_ids) == 1 and torch.equal(back.held_ids[0], ids[-256:])  # the held-back window's tokens
    choices = [fit_layer(s, LayerErrorProbe([h], 8, 32, torch.float16), 16) for s, h in
               zip(back.stats, back.held_out[0])]
    assert all(math.isfinite(c.key_error) for c in choices)


def tiny_hybrid_gemma3():
    """A tiny Gemma 3 with sliding-window layers 0, 1, 3 and full-attention layer 2 (window 64)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=64,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"], max_position_embeddings=1024, attn_implementation="sdpa")
    return Gemma3ForCausalLM(cfg).eval()


def test_hybrid_model_calibrates_only_the_quantized_layers(tokenizer, tmp_path):
    """Sliding-window layers keep transformers' window (not quantized), so calibration skips them; the artifact
    records which layers are calibrated and loads back into the same per-layer recipes."""
    import json

    from hf_kvint2.hub import ArtifactError

    model = tiny_hybrid_gemma3()
    cache = OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                 **SETTINGS)
    cal = cache.calibration
    assert cal.info["calibrated_layers"] == [2]
    assert cal.info["layer_types"][2] == "full_attention"
    assert [p is not None for p in cal.layer_layouts] == [False, False, True, False]
    assert cal.k_rotations[0] is None and cal.k_rotations[2] is not None
    folder = Path(cache.save_pretrained(tmp_path / "art") or tmp_path / "art")
    config = json.loads((folder / "config.json").read_text())
    assert config["calibrated_layers"] == [2]
    loaded = OscarCache.from_pretrained(folder, config=model.config)
    got, want = loaded.layers[2].recipe, cache.layers[2].recipe
    assert (got.key, got.value) == (want.key, want.value)
    assert torch.equal(got.key_rotation, want.key_rotation) and torch.equal(got.value_rotation, want.value_rotation)
    ids = tokenizer(TEXT[:400], return_tensors="pt").input_ids
    with torch.no_grad():
        a = model(ids, past_key_values=cache).logits
        b = model(ids, past_key_values=loaded).logits
    assert torch.equal(a, b)
    for bad, message in (([0, 2], "no calibrated layout"),
                         ([], "non-empty ascending"), ([2, 2], "non-empty ascending")):
        edited = dict(config, calibrated_layers=bad)
        (folder / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ArtifactError, match=message):
            OscarCache.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "calibrated_layers"}))
    with pytest.raises(ArtifactError, match="give all or none"):
        OscarCache.from_pretrained(folder)


def test_shipped_gemma3_artifact_calibrates_the_full_attention_layers():
    """The embedded Gemma 3 270M calibration (derived statistics only: rotations, means, layouts) loads offline,
    records its calibrated layers and leaves the 15 sliding-window layers uncalibrated."""
    from transformers import Gemma3TextConfig

    from hf_kvint2 import hub

    cache = OscarCache.from_pretrained(hub.GEMMA3_ARTIFACT_ID)
    cal = cache.calibration
    assert cal.info["calibrated_layers"] == [5, 11, 17]
    assert [i for i, p in enumerate(cal.layer_layouts) if p is not None] == [5, 11, 17]
    assert all(cal.k_rotations[i] is None for i in range(18) if i not in (5, 11, 17))
    config = Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    assert config.layer_types[5::6] == ["full_attention"] * 3  # transformers' default pattern: that of the model
    built = OscarCache.from_pretrained(hub.GEMMA3_ARTIFACT_ID, config=config)
    assert [i for i, layer in enumerate(built.layers) if hasattr(layer, "recipe")] == [5, 11, 17]


# ---------------------------------------------------------------------------------------------- group sizes
def _fake_choice(key_opts: dict, value_opts: dict):
    """A LayerChoice whose options are {group: error} (candidates built with that group, per channel)."""
    from hf_kvint2.calibration import Candidate, LayerChoice
    from hf_kvint2.recipes import GroupLayout

    def opts(errs):
        return {g: (Candidate(f"g{g}", GroupLayout("channel", g), torch.eye(4), None), e) for g, e in errs.items()}
    k, v = opts(key_opts), opts(value_opts)
    first = min(k), min(v)
    return LayerChoice(k[first[0]][0], v[first[1]][0], k[first[0]][1], v[first[1]][1], {}, {"key": k, "value": v})


def test_group_allocation_is_the_exact_optimum_within_the_budget():
    """The knapsack finds the least summed error within the mean bits/element budget (brute force agrees), ties
    go to fewer bits, and a budget below the cheapest choice is refused with the bits it would need."""
    import itertools

    from hf_kvint2.calibration import allocate_group_sizes, body_bits, stream_bits

    gen = torch.Generator().manual_seed(3)
    sizes = (32, 64, 128, 256)
    choices = []
    for _ in range(3):
        errs = [sorted(torch.rand(4, generator=gen).tolist()) for _ in range(2)]  # smaller groups: smaller error
        choices.append(_fake_choice(dict(zip(sizes, errs[0])), dict(zip(sizes, errs[1]))))
    choices.insert(1, None)  # a layer not calibrated is kept as it is
    streams = [(c, kind) for c in choices if c is not None for kind in ("key", "value")]
    for budget in (2.125, 2.2, 2.25, 2.35, 2.5, 3.0):
        got = allocate_group_sizes(choices, budget, head_dim=256)
        assert got[1] is None
        assert body_bits(got, 256) <= budget + 1e-12
        total = sum(c.key_error + c.value_error for c in got if c is not None)
        best = min(sum(c.options[kind][g][1] for (c, kind), g in zip(streams, pick))
                   for pick in itertools.product(sizes, repeat=len(streams))
                   if sum(stream_bits(g) for g in pick) / len(streams) <= budget + 1e-12)
        assert total == pytest.approx(best, abs=1e-12)
        for c in got:  # the chosen candidate and its error come from the options
            if c is not None:
                assert c.key_error == c.options["key"][c.key.layout.group_size][1]
    flat = [_fake_choice({32: 0.1, 64: 0.1}, {32: 0.1, 64: 0.1})]
    assert body_bits(allocate_group_sizes(flat, 3.0, 256), 256) == stream_bits(64)  # equal errors: fewer bits
    with pytest.raises(ValueError, match=r"bits_budget=2.1 is below .*\(2\.5000 bits/element"):
        allocate_group_sizes(flat, 2.1, 256)
    with pytest.raises(ValueError, match="no measured group-size options"):
        allocate_group_sizes([dataclasses_replace(flat[0], options={})], 2.5, 256)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_fit_layer_measures_every_group_size():
    """With group_sizes, every candidate is also measured at the other group sizes (per-token groups capped at
    head_dim; per-channel key groups only up to what the held-back window holds); the default-group choice is
    the one made without them."""
    g = torch.Generator().manual_seed(1)
    h, t, d = 1, 320, 16
    k, v = torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g)
    positions = torch.arange(200, 320, 8)
    q = torch.randn(2, t, d, generator=g)[:, positions]
    probe = LayerErrorProbe([HeldOutLayer(q, k, v, positions, d ** -0.5)], sink=8, recent=32,
                            scale_dtype=torch.float16)
    stats = LayerStatistics(h, d)
    stats.add_pass1(torch.randn(2, t, d, generator=g), k, v)
    stats.finish_pass1()
    stats.add_pass2(k, v)
    plain = fit_layer(stats, probe, d, group_size=128)
    sized = fit_layer(stats, probe, d, group_size=128, group_sizes=(8, 64, 256, 512))
    assert plain.options == {} and (sized.key_error, sized.value_error) == (plain.key_error, plain.value_error)
    assert sized.key.name == plain.key.name and sized.key.layout == plain.key.layout
    # per-token groups: 8 and 16 (= head_dim, the default 128 capped); per-channel: 8, 16, 64, 256 tokens (512 is
    # longer than the 312 tokens after the sink and is not a candidate)
    assert set(sized.options["key"]) <= {8, 16, 64, 256} and 512 not in sized.options["key"]
    assert {8, 16, 64, 256} == {int(n.rsplit("/g", 1)[1]) if "/g" in n else 16
                                for n in sized.errors if n.startswith("key:channel")}
    assert all(math.isfinite(e) for _, e in sized.options["value"].values())
    with pytest.raises(ValueError, match="group_sizes must be positive ints"):
        fit_layer(stats, probe, d, group_sizes=(0,))


def test_calibrate_with_bits_budget_records_the_group_sizes(tokenizer, tmp_path):
    """A budgeted calibration stays within the budget, records the allocation in the calibration info and each
    stream's group size in its layout; the artifact loads back into the same recipes."""
    from hf_kvint2.calibration import body_bits

    model = tiny_llama()
    cache = OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                 group_sizes=(4, 8, 16, 32), bits_budget=3.5, **SETTINGS)
    alloc = cache.calibration.info["group_allocation"]
    choices = cache.calibration_report["choices"]
    assert alloc["bits_budget"] == 3.5 and alloc["group_sizes"] == [4, 8, 16, 32]
    assert alloc["body_bits"] == body_bits(choices, 16) <= 3.5
    assert alloc["uniform_body_bits"] == 4.0  # groups of min(128, head_dim 16): 2 + 32 / 16
    groups = {p[s].group_for(16) for p in cache.calibration.layer_layouts for s in (0, 1)}
    assert groups <= {4, 8, 16, 32}
    folder = Path(cache.save_pretrained(tmp_path / "art") or tmp_path / "art")
    loaded = OscarCache.from_pretrained(folder, config=model.config)
    assert loaded.calibration.layer_layouts == cache.calibration.layer_layouts
    for i in range(2):
        assert (loaded.layers[i].recipe.key, loaded.layers[i].recipe.value) == \
            (cache.layers[i].recipe.key, cache.layers[i].recipe.value)
    uniform = OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                   bits_budget=None, **SETTINGS)
    assert "group_allocation" not in uniform.calibration.info
    assert all(p[0].group_for(16) == 16 and p[1].group_for(16) == 16 for p in uniform.calibration.layer_layouts)
    for bad, message in ((2.0, "bits_budget must be"), ("2.5", "bits_budget must be")):
        with pytest.raises(ValueError, match=message):
            OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                                 bits_budget=bad, **SETTINGS)
    with pytest.raises(ValueError, match="group_sizes must be"):
        OscarCache.calibrate(model, tokenizer, [TEXT], num_tokens=1200, progress=False, verbose=False,
                             group_sizes=(16, True), **SETTINGS)


def test_cli_refits_from_saved_statistics(tokenizer, tmp_path, capsys):
    """--from-statistics fits the same artifact as the run that saved the statistics (no model run), checks that
    the text is the one the statistics were collected on, refuses a --fit-windows the statistics do not have and a
    bad --bits-budget."""
    cli, model_dir, text = _calibration_cli(tokenizer, tmp_path)
    common = ["--model", str(model_dir), "--text", str(text), "--num-tokens", "800", "--window", "256",
              "--sink-tokens", "8", "--recent-tokens", "32", "--no-fit-clip", "--group-sizes", "8,16,32",
              "--bits-budget", "3.5"]
    stats = tmp_path / "stats.safetensors"
    assert cli.main([*common, "--output", str(tmp_path / "a"), "--save-statistics", str(stats)]) == 0
    assert cli.main([*common, "--output", str(tmp_path / "b"), "--from-statistics", str(stats)]) == 0
    assert "fitted from saved statistics" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    other = tmp_path / "other.txt"
    other.write_text(TEXT[100:], encoding="utf-8")
    bad_text = [*common, "--output", str(tmp_path / "c"), "--from-statistics", str(stats)]
    bad_text[bad_text.index(str(text))] = str(other)
    with pytest.raises(SystemExit, match="are not the first 800 tokens"):
        cli.main(bad_text)
    with pytest.raises(SystemExit, match="holds 1 held-back window.*not --fit-windows 2"):  # not silently ignored
        cli.main([*common, "--output", str(tmp_path / "e"), "--from-statistics", str(stats), "--fit-windows", "2"])
    with pytest.raises(SystemExit, match="--bits-budget 'lots'"):
        cli.main([*common[:-1], "lots", "--output", str(tmp_path / "d")])


def test_default_budget_never_goes_below_one_group_size_everywhere(llama_cache):
    """The default budget ("auto") is 2.35 bits/element, or what group_size everywhere costs where that is more:
    at head_dim 16 per-token groups hold at most 16 channels (4 bits/element), so the default keeps 4 bits and
    spends them where the held-back error says."""
    from hf_kvint2.calibration import DEFAULT_BITS_BUDGET, body_bits

    alloc = llama_cache.calibration.info["group_allocation"]
    assert alloc["budget_rule"] == "auto" and DEFAULT_BITS_BUDGET == 2.35
    assert alloc["bits_budget"] == alloc["uniform_body_bits"] == 4.0
    assert body_bits(llama_cache.calibration_report["choices"], 16) <= 4.0
