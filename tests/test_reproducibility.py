"""Bit-identity where it is a promise to users: the shipped artifacts load to the same tensors every time, and the
same generation gives the same bits in two fresh processes. (The exported program equals its eager step bit for
bit: tests/test_export.py and tests/test_export_smollm2.py.)

The Numba CPU kernels are left out of the cross-process check: a kernel JIT-compiled in a process and the same
kernel loaded from Numba's disk cache may differ in the last bits, which tests/test_numerics.py bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_kvint2 import OscarCache, hub
from hf_kvint2.settings import OscarCalibration


def _tensors(calibration: OscarCalibration) -> dict[str, torch.Tensor]:
    out = {}
    for field in ("k_rotations", "v_rotations", "key_means", "value_means", "k_eigenvalues", "v_eigenvalues"):
        for i, t in enumerate(getattr(calibration, field) or ()):
            if t is not None:
                out[f"{field}.{i}"] = t
    return out


@pytest.mark.parametrize("artifact_id", sorted(hub.EMBEDDED_ARTIFACTS))
def test_from_pretrained_is_deterministic(artifact_id, tmp_path):
    """Two loads of a shipped artifact: the same settings, the same calibration tensors bit for bit, and they save
    to the same bytes."""
    a, b = OscarCache.from_pretrained(artifact_id), OscarCache.from_pretrained(artifact_id)
    assert a.settings == b.settings and a.calibration.layer_layouts == b.calibration.layer_layouts
    ta, tb = _tensors(a.calibration), _tensors(b.calibration)
    assert ta and sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    saved_a, saved_b = a.save_pretrained(tmp_path / "a"), b.save_pretrained(tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (saved_a / name).read_bytes() == (saved_b / name).read_bytes(), name


# Run in a fresh interpreter: greedy generation on SmolLM2 with the shipped calibration through the "oscar"
# attention (PyTorch body) and with OScaR through the portable path (SDPA), windows small enough that a 320-token
# prompt reaches the INT2 body; prints the SHA-256 of each step's logits bytes and the generated ids. One intra-op
# thread in each process, so that the two run side by side.
_GENERATE = r"""
import hashlib, importlib.resources, json, sys, warnings
import torch
import hf_kvint2
from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID
from hf_kvint2.models import load_smollm2

warnings.simplefilter("ignore")
torch.set_num_threads(1)
model, tok = load_smollm2(torch.float32)
text = importlib.resources.files("hf_kvint2.data").joinpath("emma.txt").read_text()[3000:6000]
ids = tok(text, return_tensors="pt").input_ids[:, :320]
cases = {"oscar": lambda: OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=model.config, sink_tokens=4,
                                                     recent_tokens=32),
         "sdpa": lambda: OscarScaledCache(config=model.config, recent_tokens=32)}
out = {}
for attn, make in cases.items():
    model.set_attn_implementation(attn)
    cache = make()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                             max_new_tokens=4, output_logits=True, return_dict_in_generate=True)
    assert all(layer.body_len > 0 for layer in cache.layers)
    out[attn] = {"ids": gen.sequences[0, 320:].tolist(), "logits": [
        hashlib.sha256(step.float().contiguous().numpy().tobytes()).hexdigest() for step in gen.logits]}
json.dump(out, sys.stdout)
"""


@pytest.mark.slow
def test_generation_is_bit_identical_across_processes():
    env = dict(os.environ, HF_KVINT2_CPU_KERNEL="torch")
    procs = [subprocess.Popen([sys.executable, "-c", _GENERATE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout))
    first, second = results
    assert sorted(first) == ["oscar", "sdpa"]
    for case in first:
        assert len(first[case]["logits"]) == 4
        assert first[case] == second[case], f"{case}: the two processes' logits differ"
