"""SmolLM2-135M with the shipped calibration, exported with torch.export, against eager execution of the same static
cache: bit for bit (a promise: export changes no result).

torch.compile of the 30-layer step takes ~10 minutes on a 2-core CPU and its ONNX export ~3 minutes, so those two
are measured on SmolLM2 by ``benchmarks/export_smollm2.py`` (docs/export.md, within 1e-4 of eager), not here; the
tiny-model tests (tests/test_export.py) compile and run ONNX Runtime in CI.
"""

from __future__ import annotations

import importlib.resources

import pytest
import torch

import hf_kvint2  # noqa: F401  (registers "oscar")
from hf_kvint2 import OscarCache
from hf_kvint2.export import OscarExportableModule, export_decoder
from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID

pytestmark = pytest.mark.slow

TOL = 1e-4
# 64 sink + 256 recent tokens at full precision, the rest of the prompt (280+ tokens) in the INT2 body.
PROMPT, STEPS, BLOCK = 600, 16, 128
MAX_LEN = PROMPT + STEPS


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
