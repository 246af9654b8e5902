"""Every fast read path against the one dense reference, on SmolLM2 and a tiny Gemma 3: the logits of the same
forward from the same cache state agree within a stated tolerance, and their top-k tokens are the same.

The reference is ``read_path.attend_segments`` with ``read_path.reference_body_partial`` (the whole body
dequantized, fp32 softmax) and the full-precision segments as separate ops. The paths under test:

* ``torch``: the blocked PyTorch body (``read_path.body_partial_blocked``) and the fused CPU flash attention for
  the full-precision segments, as ``HF_KVINT2_CPU_KERNEL=torch`` runs them;
* ``numba_body``: the Numba body kernel inside ``attend_segments``;
* ``numba_step``: the Numba whole-layer step where it serves (decode steps and short chunks), else the body kernel;
* ``portable``: ``attn_implementation="sdpa"`` reading the cache's dequantized K/V;
* the static (export) cache's eager step, against the same static state read with the reference body.

Each case prefills a cache, then runs decode steps and chunks; every path runs each forward from a copy of the
same cache state. Within one forward no path reads a token it quantized itself (demoted tokens were computed by
earlier forwards; the current chunk is attended at full precision), so the paths differ only by the order of
float32 sums, and the tolerance can be tight. Comparing free-running generations would instead let a 1-ulp
difference move a value across an INT2 rounding boundary in a later forward, an effect of quantization, not of
the read path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.resources
import os

import pytest
import torch

import hf_kvint2  # noqa: F401  (registers "oscar")
from hf_kvint2 import OscarCache, OscarScaledCache, backends, cpu_kernels, kernels, read_path, static_layer, steps
from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID

# The tolerance, relative to the largest |logit| of the reference row. A reordered float32 sum of n terms differs
# by ~sqrt(n) * 6e-8 relative; over the ~10^3 keys and 576 channels of a SmolLM2 layer and 30 layers of residual
# stream that is up to ~1e-5 of the logits' scale. Measured on every path: at most 3.0e-6 (SmolLM2, Numba, shipped
# calibration), 1.9e-6 (tiny Gemma 3), 8e-7 (Triton, interpreted). What the read path computes is far larger:
# reading the INT2 body instead of the full-precision history moves SmolLM2's logits by 4e-2 of their scale, and a
# read that skips one body token of 384 by 2.1e-4 (the control test below). 5e-5 is 17x above the float noise
# measured and 4x below a one-token error.
RTOL_OF_MAX = 5e-5
TOP_K = 10  # the tokens sampling and greedy decoding draw from

PATHS = ("torch", "numba_body", "numba_step", "portable")
REFERENCE = backends.BodyBackend("reference", None, lambda: True, read_path.reference_body_partial)


def _backend(path: str) -> backends.BodyBackend:
    if path == "triton":
        return backends.BODY_BACKENDS["triton"]
    if path == "torch":
        return backends.BODY_BACKENDS["torch"]
    if path == "numba_body":
        return dataclasses.replace(backends.BODY_BACKENDS["numba"], layer_step=None)
    return backends.BODY_BACKENDS["numba"]


@contextlib.contextmanager
def reading_with(model, path: str, body: backends.BodyBackend = REFERENCE):
    """Run ``model``'s forwards on the read path ``path`` ("reference" or one of PATHS); ``body``: the body
    backend of the reference."""
    if path.startswith("numba") and not cpu_kernels.available():
        pytest.skip("the Numba kernel: pip install 'hf-kvint2[cpu]'")
    if path == "triton" and not (kernels.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the Triton kernels on CPU tensors: Triton's interpreter (TRITON_INTERPRET=1, no GPU)")
    with pytest.MonkeyPatch.context() as mp:
        if path in ("reference", "portable"):
            mp.setattr(steps, "select_body_partial", lambda *a, **k: body)
            mp.setattr(read_path, "_fused_cpu_eligible", lambda q, k: False)
            mp.setattr(static_layer.StaticOscarLayer, "body_backend", read_path.BodyBackend(
                body.name, None, lambda: True, lambda *a, block_tokens=None, **k: body.run(*a, **k)))
        else:
            chosen = _backend(path)
            mp.setattr(steps, "select_body_partial", lambda *a, **k: chosen)
        model.set_attn_implementation("sdpa" if path == "portable" else "oscar")
        try:
            yield
        finally:
            model.set_attn_implementation("oscar")


def assert_agree(got: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """``got`` within the tolerance of ``ref`` (rows of logits [positions, vocab]) and the same top-k tokens
    per row; returns the largest error relative to the row's largest |logit|."""
    got, ref = got.float(), ref.float()
    scale = ref.abs().amax(dim=-1, keepdim=True)
    rel = ((got - ref).abs() / scale).amax().item()
    assert rel <= RTOL_OF_MAX, f"{what}: logits differ by {rel:.3g} of their scale (tolerance {RTOL_OF_MAX})"
    for i, (g, r) in enumerate(zip(got, ref)):
        top = r.topk(TOP_K + 1)
        # a near-tie at the k-th place of the reference may swap within the tolerance: compare one place fewer
        k = TOP_K if (top.values[TOP_K - 1] - top.values[TOP_K]) > 2 * RTOL_OF_MAX * scale[i] else TOP_K - 1
        assert set(g.topk(k).indices.tolist()) == set(top.indices[:k].tolist()), f"{what}, row {i}: top-{k} differ"
    return rel


# ------------------------------------------------------------------------------------------------ dynamic caches
def forward(model, ids, cache) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]


def compare_paths(model, ids, make_cache, prompt: int, chunks: tuple[int, ...],
                  paths: tuple[str, ...] = PATHS) -> dict[str, float]:
    """Prefill ``prompt`` tokens on the reference, then for each chunk length: every path from a copy of the
    cache, the reference last (it advances the cache). Returns the largest relative error per path."""
    cache = make_cache()
    with reading_with(model, "reference"):
        forward(model, ids[:, :prompt], cache)
    worst = dict.fromkeys(paths, 0.0)
    pos = prompt
    for n in chunks:
        x = ids[:, pos:pos + n]
        got = {}
        for path in paths:
            with reading_with(model, path):
                got[path] = forward(model, x, copy.deepcopy(cache))
        with reading_with(model, "reference"):
            ref = forward(model, x, cache)
        for path in paths:
            worst[path] = max(worst[path], assert_agree(got[path], ref, f"{path}, {n} tokens at {pos}"))
        pos += n
    quantized = [layer for layer in cache.layers if hasattr(layer, "body_len")]
    assert quantized and all(layer.body_len > 0 for layer in quantized)  # every quantized layer read its body
    return worst


@pytest.fixture(scope="module")
def smollm2_oscar(module_single_thread):
    from hf_kvint2.models import load_smollm2

    model, tok = load_smollm2(torch.float32, attn_implementation="oscar")
    text = importlib.resources.files("hf_kvint2.data").joinpath("emma.txt").read_text()[400:8000]
    return model, tok(text, return_tensors="pt").input_ids[:, :720]


SMOLLM2_CACHES = {
    "oscar_shipped": lambda config: OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=config),
    "oscar_scaled": lambda config: OscarScaledCache(),
}


# Decode steps, a short chunk (the Numba whole-layer step serves it) and a long one (it does not).
CHUNKS = (1, 1, 5, 1, 80)


@pytest.mark.slow
@pytest.mark.parametrize("cache_name", sorted(SMOLLM2_CACHES))
def test_smollm2_paths_match_reference(smollm2_oscar, cache_name):
    model, ids = smollm2_oscar
    compare_paths(model, ids, lambda: SMOLLM2_CACHES[cache_name](model.config), prompt=600, chunks=CHUNKS)


@pytest.mark.slow
def test_tolerance_catches_a_one_token_error(smollm2_oscar):
    """Control: a body read that skips the oldest body token fails the comparison (the tolerance is tight enough
    to see a small read-path error)."""
    model, ids = smollm2_oscar
    cache = OscarScaledCache()
    with reading_with(model, "reference"):
        forward(model, ids[:, :600], cache)
        ref = forward(model, ids[:, 600:601], copy.deepcopy(cache))

    def skip_first(q_rot, key_body, value_body, *, mask=None, **kw):
        keep = torch.ones(key_body.tokens, dtype=torch.bool)
        keep[0] = False
        mask = keep if mask is None else read_path.mask_to_additive(mask) + read_path.mask_to_additive(keep)
        return read_path.reference_body_partial(q_rot, key_body, value_body, mask=mask, **kw)

    broken = backends.BodyBackend("broken", None, lambda: True, skip_first)
    with reading_with(model, "reference", body=broken):
        got = forward(model, ids[:, 600:601], copy.deepcopy(cache))
    with pytest.raises(AssertionError, match="logits differ"):
        assert_agree(got, ref, "one body token skipped")


@pytest.fixture(scope="module")
def gemma3_tiny(module_single_thread):
    from test_gemma3 import tiny_gemma3

    model = tiny_gemma3()
    model.set_attn_implementation("oscar")
    return model, torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(2))


GEMMA3_CACHES = {
    "oscar": lambda config: OscarCache(config=config, sink_tokens=4, recent_tokens=32),
    "oscar_scaled": lambda config: OscarScaledCache(config=config, recent_tokens=32),
}


@pytest.mark.parametrize("cache_name", sorted(GEMMA3_CACHES))
def test_tiny_gemma3_paths_match_reference(gemma3_tiny, cache_name):
    """Hybrid sliding / full attention, head_dim 64, one KV head; the full-attention layers settle their key
    basis (per-channel groups in the model's basis) at the first demotion."""
    model, ids = gemma3_tiny
    compare_paths(model, ids, lambda: GEMMA3_CACHES[cache_name](model.config), prompt=200, chunks=CHUNKS)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter warns about the inf it casts
@pytest.mark.parametrize("cache_name", sorted(GEMMA3_CACHES))
def test_tiny_gemma3_triton_body_matches_reference(gemma3_tiny, cache_name):
    """The Triton body kernel in the model's read path, in Triton's interpreter (a decode step and a short chunk:
    the interpreter runs each kernel program in Python; tests/test_kernels.py covers the kernels' shapes)."""
    model, ids = gemma3_tiny
    compare_paths(model, ids, lambda: GEMMA3_CACHES[cache_name](model.config), prompt=200, chunks=(1, 5),
                  paths=("triton",))


# ------------------------------------------------------------------------------------------------ static cache
@pytest.mark.slow
@pytest.mark.parametrize("cache_name", sorted(SMOLLM2_CACHES))
def test_smollm2_static_step_matches_reference(smollm2_oscar, cache_name):
    """The static cache's eager step (what torch.export traces: blocked body in blocks of 128 tokens) against
    the same static state read with the reference body."""
    from hf_kvint2.export import OscarExportableModule

    model, ids = smollm2_oscar
    module = OscarExportableModule(model, SMOLLM2_CACHES[cache_name](model.config), max_cache_len=620,
                                   attention_block=128)
    try:
        with torch.no_grad():
            module.prefill(ids[:, :600])
            for t in range(600, 604):
                state = [s.clone() for s in module.static_cache.state_tensors()]
                position = torch.tensor([t])
                with reading_with(model, "reference"):
                    ref = module(ids[:, t:t + 1], position)[0]
                for dst, src in zip(module.static_cache.state_tensors(), state):
                    dst.copy_(src)
                got = module(ids[:, t:t + 1], position)[0]
                assert_agree(got, ref, f"static step at {t}")
        assert module.static_cache.layers[0]._body_tokens_now() > 0
    finally:
        module.unbind()
