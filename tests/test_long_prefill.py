"""A long prompt's prefill is quantized in bounded blocks: peak memory stays a small multiple of the input, and
blocking changes no stored value."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_kvint2 import OscarCache, OscarScaledCache, layers

# One layer of a 32k-token prompt: 8 KV heads x head_dim 128, bf16 (134 MB of K and V). Run in a fresh process so
# that its peak RSS is this prefill's; inputs are drawn directly in bf16 (no float32 staging copy), and a small
# warm-up update first loads the code paths.
MEASURE = textwrap.dedent("""
    import gc, json, sys, torch
    from hf_kvint2 import OscarCache, OscarScaledCache
    torch.set_num_threads(1)
    tokens, path, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    make = OscarScaledCache if kind == "scaled" else OscarCache
    def status(field):  # bytes
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))
    def rss():
        return status("VmRSS")
    def peak():  # since the last reset_peak(); ru_maxrss would include the parent's RSS at fork
        return status("VmHWM")
    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    warm = make()
    warm.update(torch.zeros(1, 8, 600, 128, dtype=torch.bfloat16), torch.ones(1, 8, 600, 128, dtype=torch.bfloat16), 0)
    del warm
    g = torch.Generator().manual_seed(0)
    k = torch.empty(1, 8, tokens, 128, dtype=torch.bfloat16).normal_(generator=g)
    v = torch.empty(1, 8, tokens, 128, dtype=torch.bfloat16).normal_(generator=g)
    gc.collect()
    cache = make()
    if path == "fused":  # as under the "oscar" attention: update() returns zero-storage placeholders
        cache.update(k[:, :, :1], v[:, :, :1], 0)
        cache.reset()
        cache.layers[0].fused_attention = True
    reset_peak()
    before = rss()
    assert peak() < before + (8 << 20), "the peak did not reset; the measurement would be biased"
    out = cache.update(k, v, 0)
    print(json.dumps({"input": 2 * k.numel() * k.element_size(), "extra_peak": peak() - before,
                      "stored": cache.memory_report()["layers"][0]["allocated"]}))
""")


@pytest.mark.parametrize(("kind", "path"), [("scaled", "portable"), ("oscar", "fused")])
def test_prefill_of_32k_tokens_peaks_under_three_times_the_input_above_the_stored_cache(kind, path):
    run = subprocess.run([sys.executable, "-c", MEASURE, "32768", path, kind], check=False, capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # portable path: the returned full-precision K/V (1x input) is part of the peak, as it is of any attention's
    extra = got["extra_peak"] - got["stored"]
    assert extra < 3 * got["input"], f"{kind}/{path}: {extra / 1e6:.0f} MB above the stored cache for an input " \
                                     f"of {got['input'] / 1e6:.0f} MB"


@pytest.mark.parametrize("make", [OscarCache, OscarScaledCache], ids=["oscar", "scaled"])
def test_blocked_quantization_stores_what_one_block_would(make, monkeypatch):
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 1500, 64, generator=g)
    v = torch.randn(2, 2, 1500, 64, generator=g)
    whole = make(sink_tokens=8, recent_tokens=32)
    whole.update(k, v, 0)
    monkeypatch.setattr(layers, "QUANTIZE_BLOCK_TOKENS", 128)
    blocked = make(sink_tokens=8, recent_tokens=32)
    blocked.update(k, v, 0)
    a, b = whole.layers[0], blocked.layers[0]
    assert a.body_len == b.body_len > 1024
    for sa, sb in ((a.key_body, b.key_body), (a.value_body, b.value_body)):
        for ba, bb in zip(sa.buffers(), sb.buffers()):
            assert torch.equal(ba.view(), bb.view())
    assert torch.equal(a.recent_k, b.recent_k) and torch.equal(a.sink_v, b.sink_v)
