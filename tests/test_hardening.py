"""Hostile artifacts, bad inputs and grad mode: each case refuses cleanly or works, never corrupts,
never escapes the artifact's folder, never allocates without bound."""

from __future__ import annotations

import ast
import copy
import gc
import io
import json
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import threading
import warnings
import zipfile
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_kvint2  # noqa: F401  (registers the "oscar" attention)
from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.hub import ArtifactError, safety
from hf_kvint2.layers import OscarLayer
from hf_kvint2.settings import oscar_recipe
from hf_kvint2.static_cache import StaticOscarCache
from hf_kvint2.transforms import check_orthogonal

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


# Tiny tensors: thread start-up dominates, and on a loaded 2-core machine extra threads make it 50x slower.
pytestmark = pytest.mark.usefixtures("module_single_thread")


def tiny_config(head_dim=HEAD_DIM):
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=head_dim,
                       max_position_embeddings=256, initializer_range=0.1)


@pytest.fixture(scope="module")
def models():
    """The same tiny Llama with the "oscar" and the "sdpa" attention."""
    torch.manual_seed(0)
    oscar = LlamaForCausalLM._from_config(tiny_config(), attn_implementation="oscar").eval()
    sdpa = LlamaForCausalLM._from_config(tiny_config(), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(oscar.state_dict())
    return oscar, sdpa


IDS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))


def run_chunks(model, cache, ids=IDS, chunk=8):
    return torch.cat([model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
                      for s in range(0, ids.shape[1], chunk)], dim=1)


def calibrated_oscar(**kw):
    g = torch.Generator().manual_seed(3)
    rots = [torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=g, dtype=torch.float64))[0].float()
            for _ in range(2 * LAYERS)]
    return OscarCache(k_rotations=rots[:LAYERS], v_rotations=rots[LAYERS:], sink_tokens=2, recent_tokens=4,
                      key_means=[torch.randn(KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)], **kw)


CACHES = {"oscar": lambda: OscarCache(sink_tokens=2, recent_tokens=4),
          "oscar-calibrated": calibrated_oscar,
          "oscar-scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=4, group_size=8)}


# ---------------------------------------------------------------------------------------------- 1 grad mode
@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_forward_with_gradients_enabled_works_and_matches_no_grad(models, kind, kernel, monkeypatch):
    oscar, _ = models
    monkeypatch.setenv("HF_KVINT2_CPU_KERNEL", kernel)
    prefilled = CACHES[kind]()
    with torch.no_grad():
        run_chunks(oscar, prefilled, IDS[:, :24])
    assert prefilled.layers[0].body_len > 0
    # From one cache state, decode steps with gradients enabled (the differentiable readers) and without (the fused
    # ones). Fewer steps than the recent window holds: the tokens they write stay in full precision, so both runs
    # read the same INT2 codes and differ only by summation order. (Over a longer run such a difference moves an
    # INT2 code of a later layer at a rounding boundary, which no tolerance on logits can bound.)
    steps = IDS[:, 24:27]
    with torch.no_grad():
        expected = run_chunks(oscar, copy.deepcopy(prefilled), steps, chunk=1)
    cache = copy.deepcopy(prefilled)
    logits = run_chunks(oscar, cache, steps, chunk=1)  # gradients enabled: used to fail in the Numba kernel
    assert logits.requires_grad
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-4, atol=1e-4)
    oscar.zero_grad()
    logits[:, -1].logsumexp(-1).sum().backward()
    grads = [p.grad for p in oscar.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    for layer in cache.layers:  # the INT2 body is data: no autograd graph is kept in the cache's buffers
        for stream in (layer.key_body, layer.value_body):
            assert not any(b.data.requires_grad for b in stream.buffers())


def test_static_cache_forward_with_gradients_enabled(models):
    oscar, _ = models
    ids = IDS[:1, :24]
    static = StaticOscarCache.from_cache(OscarScaledCache(sink_tokens=0, recent_tokens=4, group_size=4), oscar.config, 64)
    with torch.no_grad():
        expected = StaticOscarCache.from_cache(OscarScaledCache(sink_tokens=0, recent_tokens=4, group_size=4), oscar.config, 64)
        expected = torch.cat([oscar(ids[:, :12], past_key_values=expected).logits]
                             + [oscar(ids[:, i:i + 1], past_key_values=expected).logits for i in range(12, 24)], 1)
    logits = torch.cat([oscar(ids[:, :12], past_key_values=static).logits]
                       + [oscar(ids[:, i:i + 1], past_key_values=static).logits for i in range(12, 24)], 1)
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-4, atol=1e-4)
    logits[:, -1].logsumexp(-1).sum().backward()
    body = [n for n, t in zip(static.layers[0].state_names(), static.layers[0].state_tensors())
            if t.requires_grad and not n.startswith(("ring", "sink"))]
    assert body == []  # the INT2 body holds data only


# ---------------------------------------------------------------------------------------------- 2 norm overflow
def test_token_norm_overflow_is_refused_and_the_cache_is_unchanged():
    cache = OscarScaledCache(sink_tokens=0, recent_tokens=0, group_size=8)
    ok = torch.randn(1, 2, 8, 16)
    cache.update(ok, ok, 0)
    before = cache.layers[0].memory_bytes()
    # every value fits fp16, but the omni-token norm (over 2 heads x 16 channels) is 30000 * sqrt(32) > 65504
    big = torch.full((1, 2, 8, 16), 30000.0)
    with pytest.raises(ValueError, match=r"token norms .* scale_dtype=torch.float16 .*torch.bfloat16"):
        cache.update(big, big, 0)
    assert cache.layers[0].memory_bytes() == before and cache.get_seq_length() == 8
    k, v = cache.layers[0].dequantized_body()
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    wide = OscarScaledCache(sink_tokens=0, recent_tokens=0, group_size=8, scale_dtype=torch.bfloat16)  # the suggested fix
    wide.update(big, big, 0)
    k, _ = wide.layers[0].dequantized_body()
    assert torch.isfinite(k).all() and (k - big).abs().max() < 0.1 * 30000


# ---------------------------------------------------------------------------------------------- 3 clipping
@pytest.mark.parametrize("value", [0.5, -3.0])
def test_clipping_never_erases_a_constant_token(value):
    cache = OscarCache(sink_tokens=0, recent_tokens=0)
    x = torch.full((1, 2, 3, 64), value)
    cache.update(x, x, 0)
    k, v = cache.layers[0].dequantized_body()
    for stored in (k, v):  # used to come back as zeros (clipped to the quantile of the all-zero rest)
        assert (stored.sign() == x.sign()).all()
        assert (stored - x).abs().max() <= 0.5 * abs(value) + 1e-3


# ---------------------------------------------------------------------------------------------- 4 paths
@contextmanager
def deadline(seconds):
    def fail(*_):
        raise TimeoutError(f"took longer than {seconds}s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def saved(tmp_path):
    return calibrated_oscar().save_pretrained(tmp_path / "artifact", base_model="tiny/llama")


@pytest.mark.parametrize("subfolder", ["../other", "sub/../../other", "/abs/other"])
def test_subfolder_cannot_leave_the_folder(saved, tmp_path, subfolder):
    other = tmp_path / "other"
    calibrated_oscar().save_pretrained(other)
    sub = subfolder if not subfolder.startswith("/abs") else str(other)
    with pytest.raises(ArtifactError, match="subfolder=.* leaves the artifact's folder"):
        OscarCache.from_pretrained(saved, subfolder=sub)
    assert safety.safe_subfolder("./a//b/") == "a/b"


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "directory", "outside-link"])
def test_artifact_files_must_be_regular_files_inside_the_folder(saved, tmp_path, special):
    config = saved / "config.json"
    config.unlink()
    if special == "fifo":
        os.mkfifo(config)
    elif special == "dev-zero":
        config.symlink_to("/dev/zero")
    elif special == "directory":
        config.mkdir()
    else:
        secret = tmp_path / "secret.json"
        secret.write_text("{}")
        config.symlink_to(secret)
    with deadline(20), pytest.raises(ArtifactError, match="not a regular file|outside the artifact's folder"):
        OscarCache.from_pretrained(saved)


def test_config_size_and_nesting_are_bounded(saved):
    config = saved / "config.json"
    config.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ArtifactError, match="nests deeper than"):
        OscarCache.from_pretrained(saved)
    config.write_bytes(b" " * (safety.MAX_CONFIG_BYTES + 1))
    with pytest.raises(ArtifactError, match="larger than"):
        OscarCache.from_pretrained(saved)


def test_save_pretrained_replaces_symlinks_instead_of_writing_through_them(saved, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("config.json", "model.safetensors", "README.md"):
        (clone / name).symlink_to(victim)
    calibrated_oscar().save_pretrained(clone)
    assert victim.read_text() == "precious"
    assert not any((clone / n).is_symlink() for n in ("config.json", "model.safetensors", "README.md"))
    OscarCache.from_pretrained(clone)
    # no tensors to write: a stale symlinked model.safetensors is removed, its target untouched
    (clone / "model.safetensors").unlink()
    (clone / "model.safetensors").symlink_to(victim)
    OscarScaledCache().save_pretrained(clone)
    assert victim.read_text() == "precious" and not (clone / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------- 5 allocation
def _deflated(buffer: bytes) -> bytes:
    src, out = zipfile.ZipFile(io.BytesIO(buffer)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


@pytest.mark.parametrize("with_config", [True, False])
def test_rotation_zoo_sizes_are_checked_before_loading(tmp_path, monkeypatch, with_config):
    buffer = io.BytesIO()
    torch.save({"layers": {0: {"rotation": torch.zeros(4096, 4096)}}}, buffer)  # 64 MB of zeros
    small = _deflated(buffer.getvalue())
    assert len(small) < 1 << 20
    for kind, method in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
        (tmp_path / f"{kind}_rotation_{method}.pt").write_bytes(small)

    def no_load(*a, **k):
        raise AssertionError("torch.load ran on an oversized file")
    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(ArtifactError, match="declares a 67108864-byte tensor"):
        OscarCache.from_rotation_zoo(tmp_path, config=tiny_config() if with_config else None)


def test_safetensors_header_is_checked_before_loading(saved, monkeypatch):
    config = json.loads((saved / "config.json").read_text())
    config["head_dim"] = 2048  # within the sanity bound, but not what the tensors declare
    (saved / "config.json").write_text(json.dumps(config))
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("tensors were loaded"))
    with pytest.raises(ArtifactError, match=r"shape \(\d+, 16\), expected \(\d+, 2048\)"):
        OscarCache.from_pretrained(saved)
    with pytest.raises(ArtifactError, match="head_dim=2048, but the model config"):
        OscarCache.from_pretrained(saved, config=tiny_config())


@pytest.mark.parametrize("key,value", [("recent_tokens", 10**9), ("sink_tokens", -1), ("group_size", 1 << 20)])
def test_artifact_settings_are_bounded_at_load(saved, key, value):
    config = json.loads((saved / "config.json").read_text())
    config["settings"][key] = value
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=f"settings.{key} must be an integer in"):
        OscarCache.from_pretrained(saved)


@pytest.mark.parametrize("make", [lambda: OscarScaledCache(sink_tokens=0, recent_tokens=200_000, group_size=4096),
                                  lambda: OscarCache(sink_tokens=2, recent_tokens=10_000, group_size=16)])
def test_static_cache_allocation_is_bounded_by_max_cache_len(models, make):
    oscar, _ = models
    static = StaticOscarCache.from_cache(make(), oscar.config, max_cache_len=64)
    static.early_initialization(1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    fp_bytes_per_position = 2 * KV_HEADS * HEAD_DIM * 4
    # max_cache_len positions at full precision (sink + ring) plus at most one INT2 block
    assert static.memory_report()["total"]["total_bytes"] <= 2 * LAYERS * 64 * fp_bytes_per_position
    # nothing leaves the window within 64 positions: same logits as the dynamic cache
    ids = IDS[:1, :20]
    with torch.no_grad():
        expected = run_chunks(oscar, make(), ids, chunk=20)
        got = torch.cat([oscar(ids[:, :12], past_key_values=static).logits]
                        + [oscar(ids[:, i:i + 1], past_key_values=static).logits for i in range(12, 20)], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- 7 unclear crashes
@pytest.mark.parametrize("shape", [(0, 2, 4, 16), (1, 0, 4, 16)])
def test_empty_batch_or_heads_are_refused(shape):
    x = torch.zeros(shape)
    with pytest.raises(ValueError, match="empty batch, kv_heads or head_dim"):
        OscarScaledCache().update(x, x, 0)


def test_meta_tensors_are_refused():
    x = torch.zeros(1, 2, 4, 16, device="meta")
    with pytest.raises(ValueError, match="meta tensors"):
        OscarCache().update(x, x, 0)


def test_non_power_of_two_head_dim_names_the_fix_of_each_cache():
    x = torch.randn(1, 2, 4, 12)
    with pytest.raises(ValueError, match=r"head_dim=12 .*k_rotations") as oscar:
        OscarCache(sink_tokens=0, recent_tokens=0).update(x, x, 0)
    assert "hadamard_block" not in str(oscar.value)
    with pytest.raises(ValueError, match="hadamard_block=4"):
        OscarScaledCache(sink_tokens=0, recent_tokens=0, group_size=4).update(x, x, 0)


@pytest.mark.parametrize("rotation,message", [
    (torch.zeros(0, 0), "non-empty square"),
    (torch.eye(16).to_sparse(), "sparse"),
    (torch.eye(16, dtype=torch.complex64), "real floating-point"),
    (torch.eye(16, dtype=torch.int64), "real floating-point"),
])
def test_bad_rotations_get_clear_errors(rotation, message):
    with pytest.raises(ValueError, match=message):
        check_orthogonal(rotation, "rotation")
    layer = OscarLayer(oscar_recipe(key_rotation=rotation), 0)
    x = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=rf"{message}|is \(0, 0\) but the model's head_dim is 16"):
        layer.update(x, x)


def test_huge_mean_in_an_artifact_blames_the_artifact(saved):
    from safetensors.torch import load_file, save_file

    tensors = load_file(saved / "model.safetensors")
    tensors["layers.1.key_mean"][0, 0] = 1e30
    save_file(tensors, saved / "model.safetensors")
    with pytest.raises(ArtifactError, match="'layers.1.key_mean' has values up to 1e.30.*corrupt"):
        OscarCache.from_pretrained(saved)


# ---------------------------------------------------------------------------------------------- 8 pickle
@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("clone", ["pickle", "deepcopy"])
def test_caches_pickle_and_deepcopy_and_continue_identically(models, kind, clone):
    oscar, _ = models
    cache = CACHES[kind]()
    with torch.no_grad():
        run_chunks(oscar, cache, IDS[:, :24])
        copied = pickle.loads(pickle.dumps(cache)) if clone == "pickle" else copy.deepcopy(cache)
        a = run_chunks(oscar, cache, IDS[:, 24:])
        b = run_chunks(oscar, copied, IDS[:, 24:])
    assert torch.equal(a, b)


@pytest.mark.parametrize("clone", ["pickle", "deepcopy"])
def test_a_copied_token_buffer_writes_into_its_own_tensor(clone):
    """TokenBuffer.array() (the numpy view compiled writers fill) belongs to one tensor: a copy of the buffer makes
    its own from the copied tensor instead of carrying a copy of the old array (which writes would never reach)."""
    from hf_kvint2.storage import TokenBuffer

    for dtype in (torch.float32, torch.float16):
        buf = TokenBuffer(2)
        buf.append(torch.zeros(1, 2, 3, 4, dtype=dtype))
        buf.array()  # made before the copy
        copied = pickle.loads(pickle.dumps(buf)) if clone == "pickle" else copy.deepcopy(buf)
        copied.reserve(1)[0, 0, 3, 0] = 1.0
        copied.array()[0, 1, 0, 0] = 15360  # 1.0 as float16 bits, or a float32 denormal-free nonzero
        copied.advance(1)
        assert copied.data[0, 0, 3, 0] == 1 and copied.data[0, 1, 0, 0] != 0
        assert not buf.data.any()


# ---------------------------------------------------------------------------------------------- 9 memory after crop
def held_bytes(layer) -> int:
    """Bytes of every storage a layer references (what it keeps alive), each storage once."""
    seen, total = set(), 0
    tensors = [layer.sink_k, layer.sink_v, layer.recent_k, layer.recent_v]
    tensors += [b.data for s in (layer.key_body, layer.value_body) for b in s.buffers() if b.data is not None]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def test_crop_inside_a_key_group_keeps_no_dequantized_copy_of_the_body():
    cache = OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=32)
    x = torch.randn(1, 2, 2000, 64)
    cache.update(x, x * 0.5, 0)
    layer = cache.layers[0]
    cache.crop(-993)  # to 1007 tokens: inside a group of 32 body tokens
    assert cache.get_seq_length() == 1007
    report = cache.memory_report()["total"]
    assert held_bytes(layer) <= 2 * report["allocated"], (held_bytes(layer), report)
    k, _ = layer.dequantized_body()
    full = torch.cat([k, layer.recent_k], dim=2)
    assert (full - x[:, :, :1007]).abs().mean() < 0.5  # the kept tokens are the stored ones


# ---------------------------------------------------------------------------------------------- 10 artifacts, cards
_LIMITED_LOAD = """
import json, resource, sys
import torch
from transformers import LlamaConfig
from hf_kvint2 import OscarCache
torch.set_num_threads(1)
kind, path = sys.argv[1:]
config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # what it may map, at most
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    if kind == "artifact":
        OscarCache.from_pretrained(path)
    else:
        OscarCache.from_rotation_zoo(path, config=config if kind == "zoo+config" else None)
    outcome = "loaded"
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
print(json.dumps({"outcome": outcome, "grown_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
"""


def load_with_limited_memory(kind: str, path) -> dict:
    """Load in a fresh process that may map at most 1 GiB more than after its imports: the outcome (exception type
    and message) and how much its peak RSS grew (KB)."""
    probe = subprocess.run([sys.executable, "-c", _LIMITED_LOAD, kind, str(path)], capture_output=True, text=True,
                           timeout=300, check=False)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("deflate,layers,with_config", [(True, 48, False), (True, 48, True), (False, 9, False)],
                         ids=["deflated", "deflated-config", "stored"])
def test_rotation_zoo_allocation_is_bounded_by_the_zip_index(tmp_path, deflate, layers, with_config):
    """A RotationZoo of all-zero float64 [2048, 2048] rotations: 48 deflated ones in a 1.5 MiB file (1.5 GiB once
    inflated), or 9 stored ones (288 MiB, a sparse file). Refused from the zip index, in a process whose peak
    memory grows by a few MB (without config= it allocated every rotation before the first orthogonality check)."""
    from test_artifact_fuzz import write_zoo_archive

    for kind, method in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
        write_zoo_archive(tmp_path / f"{kind}_rotation_{method}.pt", [2048] * layers, deflate)
    if deflate:
        assert (tmp_path / "k_rotation_qqt_r_h_pbr.pt").stat().st_size < 2 << 20
    result = load_with_limited_memory("zoo+config" if with_config else "zoo", tmp_path)
    expected = ("declares a 33554432-byte tensor .* larger than a \\[16, 16\\]" if with_config else
                "stores archive/data/0 compressed" if deflate else
                "declares \\d+ bytes of data, more than the \\d+ bytes an import reads without the model's config")
    assert result["outcome"].startswith("ArtifactError") and re.search(expected, result["outcome"]), result
    assert result["grown_kb"] < 32 << 10, result  # KB: no storage was read


def _edited(saved, tmp_path, edit=None, raw=None):
    """A copy of the saved artifact with config.json edited (``edit`` on the dict) or replaced by ``raw`` text."""
    folder = tmp_path / "edited"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((saved / name).read_bytes())
    if edit is not None:
        config = json.loads((saved / "config.json").read_text())
        edit(config)
        raw = json.dumps(config)
    if raw is not None:
        (folder / "config.json").write_text(raw)
    return folder


INJECTION = 'x")\nimport os; os.system("echo pwned")  #'


def _snippet(card: str) -> ast.Module:
    return ast.parse(card.split("```python\n", 1)[1].split("```", 1)[0])


@pytest.mark.parametrize("key", ["base_model", "base_model_revision"])
def test_identifiers_a_card_quotes_are_checked_at_load_and_save(saved, tmp_path, key):
    folder = _edited(saved, tmp_path, lambda c: c.update({key: INJECTION}))
    with pytest.raises(ArtifactError, match=rf"config\.json: {key} must be a Hub repo id such as 'org/name'.*got "
                                            r"'x\"\)\\nimport os"):
        OscarCache.from_pretrained(folder)
    with pytest.raises(ArtifactError, match=f"{key} must be a Hub repo id"):
        calibrated_oscar().save_pretrained(tmp_path / "out", **{key: INJECTION})


def test_card_renders_artifact_strings_as_text_and_its_snippet_as_the_expected_code(saved, tmp_path):
    hostile = {"cache": "<img src=x onerror=alert(1)>", "note": "a | b\n| injected | row |",
               "link": "[click](javascript:alert(1))", "code": "`x`"}

    def edit(config):
        config["quality"] = [hostile, {"cache": "OscarCache", "perplexity": 30.1}]
        config["calibration"] = {"data": "<script>alert(1)</script>\n# heading", "num_tokens": "*1*", "window": "|"}
        config["layers"][0]["layout"] = "spectral | <b>bold</b>"
    cache = OscarCache.from_pretrained(_edited(saved, tmp_path, edit))
    repo_id, subfolder = 'me/repo"); import os; ("', "a b\"'"  # passed to save_pretrained: quoted, never code
    card = (cache.save_pretrained(tmp_path / "again", repo_id=repo_id, subfolder=subfolder) / "README.md").read_text()
    for markup in ("<img", "<script", "<b>", "\n# heading", "| injected | row |"):
        assert markup not in card, markup
    assert not re.search(r"(?<!\\)\]\(javascript", card)  # a link, unless its bracket is escaped
    assert "&lt;img src=x onerror=alert(1)&gt;" in card and "\\[click\\]" in card and "\\`x\\`" in card
    quality = [line for line in card.splitlines() if line.startswith("| ") and "OscarCache" in line or "&lt;img" in line]
    assert len(quality) == 2 and all(line.replace("\\|", "").count("|") == 6 for line in quality), quality
    tree = _snippet(card)
    assert not any(isinstance(node, ast.Import) for node in tree.body)
    call = tree.body[-3].value  # cache = OscarCache.from_pretrained(<repo_id>, subfolder=<subfolder>, config=...)
    assert ast.literal_eval(call.args[0]) == repo_id and ast.literal_eval(call.keywords[0].value) == subfolder


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(quality=[1, 2]), r"quality\[0\] must be an object .* got 1 \(int\)"),
    (lambda c: c.update(quality=[{"cache": "x"}, "row"]), r"quality\[1\] must be an object"),
    (lambda c: c.update(calibration={"data": "text \udc80"}),
     r"key calibration\.data holds a string with a lone surrogate"),
    (lambda c: c["layers"][1].update(layout="\ud800"), r"key layers\[1\]\.layout holds a string with a lone surrogate"),
    (lambda c: c.update(quality=[{"\udfff": 1}]), r"key quality\[0\]\.'\\udfff' holds a string with a lone surrogate"),
], ids=["quality-ints", "quality-string-row", "surrogate-value", "surrogate-layout", "surrogate-key"])
def test_what_cannot_be_saved_again_is_refused_at_load(saved, tmp_path, edit, message):
    """These loaded, then failed at save_pretrained with a TypeError or a UnicodeEncodeError."""
    with pytest.raises(ArtifactError, match=message):
        OscarCache.from_pretrained(_edited(saved, tmp_path, edit))


def test_an_integer_python_will_not_read_names_the_file(saved, tmp_path):
    text = (saved / "config.json").read_text().replace('"num_layers": 2', '"num_layers": ' + "9" * 5000, 1)
    with pytest.raises(ArtifactError, match=r"config\.json holds a number Python refuses to read \(Exceeds the limit"):
        OscarCache.from_pretrained(_edited(saved, tmp_path, raw=text))
    folder = tmp_path / "edited"  # the same in the safetensors header
    raw = (saved / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[' + b"1" * 5000 + b",", 1)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    (folder / "config.json").write_bytes((saved / "config.json").read_bytes())
    with pytest.raises(ArtifactError, match=r"model\.safetensors is not a readable safetensors file \(unreadable "
                                            r"header: ValueError\)"):
        OscarCache.from_pretrained(folder)


def test_safetensors_header_over_the_limit_is_called_that(saved, tmp_path):
    folder = _edited(saved, tmp_path)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", safety.MAX_SAFETENSORS_HEADER_BYTES + 1))
        f.truncate(64 << 20)  # the file holds the declared header: not truncated
    with pytest.raises(ArtifactError, match=rf"declares a {safety.MAX_SAFETENSORS_HEADER_BYTES + 1}-byte header, "
                                            rf"more than the {safety.MAX_SAFETENSORS_HEADER_BYTES} bytes"):
        OscarCache.from_pretrained(folder)


@pytest.mark.parametrize("damage,message", [
    ("sparse-tail", r"has 68719476736 bytes after its last tensor"),
    ("gap", r"starts at data byte \d+, but the tensors before it end at \d+ \(a gap or an overlap\)"),
])
def test_safetensors_bytes_outside_the_tensors_are_refused(saved, tmp_path, damage, message):
    """Refused by the header check, before the loader maps the file: with a long sparse tail and an address-space
    limit, mapping it failed as a bare MemoryError."""
    folder = _edited(saved, tmp_path)
    path = folder / "model.safetensors"
    if damage == "sparse-tail":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size + (64 << 30))
    else:  # the last tensor moved 4 bytes on, into 4 new bytes at the end
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        start, end = header[last]["data_offsets"]
        header[last]["data_offsets"] = [start + 4, end + 4]
        text = json.dumps(header).encode()
        body = raw[8 + n:]
        path.write_bytes(struct.pack("<Q", len(text)) + text + body[:start] + bytes(4) + body[start:])
    with pytest.raises(ArtifactError, match=message):
        OscarCache.from_pretrained(folder)
    if damage == "sparse-tail":
        result = load_with_limited_memory("artifact", folder)
        assert result["outcome"].startswith("ArtifactError") and re.search(message, result["outcome"]), result


def test_bundled_gemma3_copy_is_named_as_the_model_its_artifact_was_calibrated_for(tmp_path, monkeypatch):
    """The bundled Gemma 3 loads from a local copy (transformers names it by the copy's folder, gemma3-270m): with
    its bundled artifact it used to warn that the artifact was calibrated for another model."""
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from hf_kvint2 import hub, models

    torch.manual_seed(0)  # the shapes and layer plan of Gemma 3 270M, tiny otherwise
    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=18,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=256, sliding_window=32)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path / "gemma3-270m")
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)  # no tokenizer saved
    model, _ = models.load_gemma3()
    assert model.config.name_or_path == models.GEMMA3_MODEL_ID
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OscarCache.from_pretrained(hub.GEMMA3_ARTIFACT_ID, config=model.config)


def test_errors_say_how_hf_kvint2_is_really_updated(saved, tmp_path, monkeypatch):
    """hf_kvint2 is not on PyPI: the advice is to update or reinstall it from its source."""
    from hf_kvint2 import hub

    with pytest.raises(ArtifactError) as newer:
        OscarCache.from_pretrained(_edited(saved, tmp_path, lambda c: c.update(format_version=2)))
    monkeypatch.setitem(hub.EMBEDDED_ARTIFACTS, "hf-kvint2/missing", tmp_path / "not-installed")
    with pytest.raises(OSError) as missing:
        OscarCache.from_pretrained("hf-kvint2/missing")
    for error in (newer, missing):
        message = str(error.value)
        assert "pip install -U" not in message and "hf-kvint2 " not in message
        assert "hf_kvint2 from the source you installed it from" in message, message


def test_portable_path_warning_waits_until_the_attention_could_claim_the_layer(models, monkeypatch):
    """A static cache's first step goes out before the "oscar" attention has claimed its layers: on a model loaded
    with attn_implementation="oscar" it used to warn that it should be loaded so. Another attention still gets
    the warning, at the step after."""
    from hf_kvint2 import steps

    oscar, sdpa = models
    for model, warns in ((oscar, False), (sdpa, True)):
        monkeypatch.setitem(steps._portable_warning, "issued", False)
        static = StaticOscarCache.from_cache(OscarScaledCache(sink_tokens=0, recent_tokens=4, group_size=4),
                                             model.config, 64)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(IDS[:1, :12], past_key_values=static)  # 12 tokens: the body holds 8 after this first step
            assert static.layers[0]._body_tokens_now() > 0
            model(IDS[:1, 12:13], past_key_values=static)
        ours = [str(w.message) for w in caught if "portable attention path" in str(w.message)]
        assert len(ours) == warns, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["oscar", "oscar-scaled"])
def test_float32_scales_work_with_the_fused_attention(models, kind, dtype):
    """scale_dtype=torch.float32 (documented, and what the float16-overflow error recommends) with the fused "oscar"
    attention: every step reads the INT2 body through the CPU kernel on float32 scales, for every model dtype, and
    agrees with the portable path (the same stored body, read by PyTorch)."""
    oscar, sdpa = (copy.deepcopy(m).to(dtype) for m in models)
    make = {"oscar": lambda: OscarCache(sink_tokens=2, recent_tokens=4, scale_dtype=torch.float32),
            "oscar-scaled": lambda: OscarScaledCache(sink_tokens=0, recent_tokens=4, group_size=8,
                                                     scale_dtype=torch.float32)}[kind]
    with torch.no_grad():
        got, want = run_chunks(oscar, make(), chunk=1), run_chunks(sdpa, make(), chunk=1)
    # 16-bit models round each layer's attention output to their dtype, where the two paths' float32 sums (taken in
    # another order) may land on neighbouring 16-bit values, and the difference travels through the rest of the model:
    # with the default float16 scales too, up to 0.12 (bfloat16) and 0.06 (float16) on logits of magnitude ~3
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.1}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------- autocast
@pytest.mark.parametrize("attn", ["sdpa", "oscar"])
@pytest.mark.parametrize("kind", sorted(CACHES))
def test_cpu_autocast_works_as_with_dynamic_cache(models, kind, attn):
    """Under CPU autocast (bfloat16) the keys leave the rotary embedding in float32 and the values the projection
    in bfloat16. DynamicCache stores each as it comes; an Oscar layer keeps both in float32 (the wider) and
    quantizes with autocast off. With windows covering every token, DynamicCache's logits; quantized (dynamic and
    static), about as far from them as without autocast (tiny windows: INT2 errors of ~1 logit here)."""
    model = models[0] if attn == "oscar" else models[1]
    ids = IDS[:, :24]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = run_chunks(model, DynamicCache(), ids)
        unquantized = run_chunks(model, OscarScaledCache(recent_tokens=1000) if "scaled" in kind else
                                 OscarCache(recent_tokens=1000), ids)
        cache = CACHES[kind]()
        quantized = run_chunks(model, cache, ids)
        static = run_chunks(model, StaticOscarCache.from_cache(CACHES[kind](), model.config, 64), ids)
    with torch.no_grad():
        error = (run_chunks(model, CACHES[kind](), ids) - run_chunks(model, DynamicCache(), ids)).abs().max()
    assert torch.equal(unquantized, want)
    layer = cache.layers[0]
    assert layer.dtype == layer.sink_v.dtype == torch.float32 and layer.body_len > 0
    for got in (quantized, static):
        assert (got - want).abs().max() < 1.25 * error + 0.1


# ---------------------------------------------------------------------------------------------- position ids
@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("positions,problem", [
    (torch.tensor([[0.0, 1.0, 2.0, float("nan")]]), "contain NaN or Inf"),
    (torch.ones(1, 4, dtype=torch.bool), "have dtype torch.bool"),
    (torch.arange(4, device="meta")[None], "are meta tensors"),
], ids=["nan", "bool", "meta"])
def test_position_ids_that_hold_no_positions_are_refused(kind, positions, problem):
    """The first chunk's position ids tell a layer its batch's left padding: NaN, boolean or meta ones are refused
    by name (the layer left empty), also through a model, whose NaN positions make NaN keys."""
    k = torch.randn(1, KV_HEADS, 4, HEAD_DIM)
    cache = CACHES[kind]()
    with pytest.raises(ValueError, match=f"layer 0: the position_ids passed with the K/V {problem}.*torch.long"):
        cache.update(k, k, 0, kwargs={"position_ids": positions})
    assert cache.get_seq_length() == 0
    cache.update(k, k, 0, kwargs={"position_ids": torch.arange(4.0)[None]})  # float positions are positions
    if positions.device.type != "meta":  # (transformers' rotary embedding refuses meta positions itself)
        model = LlamaForCausalLM._from_config(tiny_config(), attn_implementation="oscar").eval()
        with pytest.raises(ValueError, match=problem), torch.no_grad():
            model(IDS[:1, :4], position_ids=positions, past_key_values=CACHES[kind]())


# ---------------------------------------------------------------------------------------------- memory after crop
def storage_bytes_reachable(root) -> int:
    """Bytes of every tensor storage ``root`` keeps alive through its attributes, each storage once, found by
    walking the object graph (not by naming attributes); the recipes and codecs (rotations, means: not K/V storage)
    are left out."""
    from hf_kvint2.recipes import LayerRecipe
    from hf_kvint2.stream import StreamCodec

    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, LayerRecipe, StreamCodec, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif type(obj).__module__ != "numpy":  # numpy views share a tensor's memory
            stack.extend(gc.get_referents(obj))
    return sum(storages.values())


@pytest.mark.parametrize("kind", ["oscar", "scaled"])
@pytest.mark.parametrize("crop", [-1, -30, -100, -200, -318])
def test_memory_report_after_crop_counts_what_the_cache_holds(kind, crop):
    """memory_report()["allocated"] is the storage the layers keep alive, each storage once, also after a crop that
    leaves the windows as views of larger buffers (it counted the views' tokens: up to a recent window less)."""
    make = OscarCache if kind == "oscar" else OscarScaledCache
    cache = make(sink_tokens=8, recent_tokens=64)
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, 2, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g), 0)
    for _ in range(20):
        cache.update(torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g), 0)
    cache.crop(crop)
    assert cache.get_seq_length() == 320 + crop
    assert cache.memory_report()["total"]["allocated"] == storage_bytes_reachable(cache.layers)
    cache.update(torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g), 0)
    cache.batch_select_indices(torch.tensor([0]))
    assert cache.memory_report()["total"]["allocated"] == storage_bytes_reachable(cache.layers)


# ---------------------------------------------------------------------------------------------- threads
def _in_thread(fn):
    """Run ``fn`` in another thread; its exception (or None)."""
    box = []

    def target():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (handed back to the test)
            box.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return box[0] if box else None


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_two_threads_updating_one_cache_are_refused_until_reset(models, static):
    """Caches are not thread-safe (nor is DynamicCache): an update while another thread is inside one, or a thread
    that joins another's forward midway, is refused by name (and every later update, until reset(): the contents
    are undefined), instead of layers of different lengths and NaN attention. One thread after another, at forward
    boundaries, is fine."""
    oscar, _ = models

    def make():
        if static:
            return StaticOscarCache.from_cache(OscarScaledCache(sink_tokens=0, recent_tokens=4, group_size=8),
                                               oscar.config, 64)
        return OscarScaledCache(oscar.config, sink_tokens=0, recent_tokens=4, group_size=8)

    cache = make()
    with torch.no_grad():
        oscar(IDS[:1, :8], past_key_values=cache)  # this thread
        assert _in_thread(lambda: oscar(IDS[:1, 8:9], past_key_values=cache)) is None  # the next forward: fine
        k = torch.randn(1, KV_HEADS, 1, HEAD_DIM)
        cache.update(k, k, 0)  # this thread starts a forward (layer 0 of 0..1) ...
        error = _in_thread(lambda: cache.update(k, k, 0))  # ... and another thread starts one too
        assert isinstance(error, RuntimeError) and "used by two threads at once" in str(error)
        with pytest.raises(RuntimeError, match="give each thread its own cache.*cache.reset"):
            cache.update(k, k, 1)  # the first thread's forward goes on: refused as well
        cache.reset()
        oscar(IDS[:1, :8], past_key_values=cache)

    # an update that begins while another is in progress (here: its layer waits inside update)
    cache = make()
    layer = cache.layers[0]
    entered, release = threading.Event(), threading.Event()
    original = type(layer).update

    def slow_update(self, *args, **kwargs):
        entered.set()
        release.wait(30)
        return original(self, *args, **kwargs)

    layer.update = slow_update.__get__(layer)
    k = torch.randn(1, KV_HEADS, 3, HEAD_DIM)
    worker = threading.Thread(target=lambda: cache.update(k, k, 0))
    worker.start()
    assert entered.wait(30)
    with pytest.raises(RuntimeError, match="began while another update was in progress"):
        cache.update(k, k, 1)
    release.set()
    worker.join(30)
    assert cache.get_seq_length() == 3  # the first update completed; the refused one stored nothing
