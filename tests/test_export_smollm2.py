"""SmolLM2-135M with the shipped calibration, exported with torch.export and to ONNX, against eager execution of
the same static cache: the exported program bit for bit (a promise: export changes no result), ONNX Runtime within
1e-4 (another runtime, its own kernels).

torch.compile of the 30-layer step takes ~10 minutes on a 2-core CPU, so it is measured by
``benchmarks/export_smollm2.py`` (README "Export"), not here; the tiny-model tests compile in CI.
"""

from __future__ import annotations

import importlib.resources

import pytest
import torch

import hf_kvint2  # noqa: F401  (registers "oscar")
from hf_kvint2 import OscarCache
from hf_kvint2.export import OscarExportableModule, export_decoder, export_onnx, onnx_step
from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID

pytestmark = pytest.mark.slow

TOL = 1e-4
# 64 sink + 256 recent tokens at full precision, the rest of the prompt (280+ tokens) in the INT2 body.
PROMPT, STEPS, BLOCK = 600, 16, 128
MAX_LEN = PROMPT + STEPS
ONNX_STEPS = 8  # ONNX Runtime steps checked (each ~1 s per 100 positions on 2 cores); the program checks all


@pytest.fixture(scope="module")
def setup():
    """Eager reference steps. One intra-op thread here and in the tests: a matmul split over another number of
    threads sums in another order, and the exported program is compared bit for bit."""
    from hf_kvint2.models import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_smollm2(torch.float32, attn_implementation="oscar")
    text = importlib.resources.files("hf_kvint2.data").joinpath("emma.txt").read_text()[400:12000]
    ids = tok(text, return_tensors="pt").input_ids[:, :MAX_LEN]
    make_cache = lambda: OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=model.config)
    module = OscarExportableModule(model, make_cache(), max_cache_len=MAX_LEN, attention_block=BLOCK)
    states, eager = [], []
    with torch.no_grad():
        module.prefill(ids[:, :PROMPT])
        for t in range(PROMPT, PROMPT + STEPS):
            states.append([s.clone() for s in module.static_cache.state_tensors()])
            eager.append(module(ids[:, t:t + 1], torch.tensor([t])))
    assert module.static_cache.layers[0]._body_tokens_now() > 0
    yield model, make_cache, module, ids, states, eager
    torch.set_num_threads(threads)


def _load_state(module, state):
    for dst, src in zip(module.static_cache.state_tensors(), state):
        dst.copy_(src)


def test_smollm2_exported_program_matches_eager(setup):
    """Bit for bit against the eager steps."""
    model, _, module, ids, states, eager = setup
    step = export_decoder(model, module=module, max_cache_len=MAX_LEN).module()
    _load_state(module, states[0])
    with torch.no_grad():
        for i, t in enumerate(range(PROMPT, PROMPT + STEPS)):  # runs freely from the prefilled cache
            got = step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t]))
            assert torch.equal(got, eager[i]), (t, (got - eager[i]).abs().max().item())


def test_smollm2_onnx_runtime_matches_eager(setup, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="pip install 'hf-kvint2[export]'")
    model, make_cache, _, ids, states, eager = setup
    spec = export_onnx(model, tmp_path / "decoder.onnx", make_cache(), max_cache_len=MAX_LEN, attention_block=BLOCK)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(spec.path, options, providers=["CPUExecutionProvider"])
    worst = 0.0
    for i, t in enumerate(range(PROMPT, PROMPT + ONNX_STEPS)):  # each from the eager state (the acceptance check)
        feeds = {n: s.numpy() for n, s in zip(spec.state_names, states[i])}
        logits, _ = onnx_step(session, spec, feeds, ids[:, t:t + 1].numpy(), t)
        worst = max(worst, float(abs(logits - eager[i].numpy()).max()))
    assert worst < TOL, worst
