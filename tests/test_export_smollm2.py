"""Export on the real model: SmolLM2-135M with the shipped calibration, exported with torch.export
and to ONNX, against eager execution of the same static cache (fp32, tolerance 1e-4).

torch.compile of the 30-layer step takes ~10 minutes on a 2-core CPU, so it is measured by
``benchmarks/export_smollm2.py`` (README "Export"), not here; the tiny-model tests compile in CI.
"""

from __future__ import annotations

import pytest
import torch
from pinned_logits import ARTIFACT, PROMPT, RECORD, STATIC_BLOCK, STATIC_LEN, STEPS, check, load_pinned, smollm2_ids

import hf_kvint2  # noqa: F401  (registers "oscar")
from hf_kvint2 import OscarCache
from hf_kvint2.export import OscarExportableModule, export_decoder, export_onnx, onnx_step

pytestmark = pytest.mark.slow

TOL = 1e-4
# The setup of the pinned logits (tests/pinned_logits.py): 64 sink + 256 recent tokens full, 280+ in the INT2 body.
MAX_LEN = STATIC_LEN
ONNX_STEPS = 8  # ONNX Runtime steps checked (each ~1 s per 100 positions on 2 cores); the program checks all


@pytest.fixture(scope="module")
def setup():
    """Eager reference steps. One intra-op thread here and in the tests: a matmul split over another number of
    threads sums in another order, and the exported program is compared bit for bit."""
    from hf_kvint2.models import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_smollm2(torch.float32, attn_implementation="oscar")
    ids = smollm2_ids(tok)
    # demotion_tokens=1: one-token demotions, as the pinned logits were recorded (tests/test_exactness.py)
    make_cache = lambda: OscarCache.from_pretrained(ARTIFACT, config=model.config, demotion_tokens=1)
    module = OscarExportableModule(model, make_cache(), max_cache_len=MAX_LEN, attention_block=STATIC_BLOCK)
    states, eager = [], []
    with torch.no_grad():
        prefill = module.prefill(ids[:, :PROMPT])
        for t in range(PROMPT, PROMPT + STEPS):
            states.append([s.clone() for s in module.static_cache.state_tensors()])
            eager.append(module(ids[:, t:t + 1], torch.tensor([t])))
    assert module.static_cache.layers[0]._body_tokens_now() > 0
    yield model, make_cache, module, ids, states, eager, prefill
    torch.set_num_threads(threads)


def _load_state(module, state):
    for dst, src in zip(module.static_cache.state_tensors(), state):
        dst.copy_(src)


def test_smollm2_exported_program_matches_eager(setup):
    """Bit for bit against the eager steps, and against the pinned logits (tests/pinned_logits.py)."""
    model, _, module, ids, states, eager, prefill = setup
    step = export_decoder(model, module=module, max_cache_len=MAX_LEN).module()
    _load_state(module, states[0])
    with torch.no_grad():
        for i, t in enumerate(range(PROMPT, PROMPT + STEPS)):  # runs freely from the prefilled cache
            got = step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t]))
            assert torch.equal(got, eager[i]), (t, (got - eager[i]).abs().max().item())
    if not RECORD:  # tests/test_exactness.py records
        check(load_pinned(), "static_export.oscar_shipped", [prefill[0, -1]] + [e[0, -1] for e in eager])


def test_smollm2_onnx_runtime_matches_eager(setup, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="pip install 'hf-kvint2[export]'")
    model, make_cache, _, ids, states, eager, _ = setup
    spec = export_onnx(model, tmp_path / "decoder.onnx", make_cache(), max_cache_len=MAX_LEN, attention_block=STATIC_BLOCK)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(spec.path, options, providers=["CPUExecutionProvider"])
    worst = 0.0
    for i, t in enumerate(range(PROMPT, PROMPT + ONNX_STEPS)):  # each from the eager state (the acceptance check)
        feeds = {n: s.numpy() for n, s in zip(spec.state_names, states[i])}
        logits, _ = onnx_step(session, spec, feeds, ids[:, t:t + 1].numpy(), t)
        worst = max(worst, float(abs(logits - eager[i].numpy()).max()))
    assert worst < TOL, worst
