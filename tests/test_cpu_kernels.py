"""The Numba CPU kernels (hf_kvint2.cpu_kernels) against their references.

* Each vector intrinsic against the NumPy loop it replaces (its docstring's semantics), at every lane width it
  supports (4, 8, 16) and every query-row count (1-4): bit for bit, since both take the same operations in the
  same order.
* The fused kernel, body partial and whole-layer step, against hf_kvint2.read_path's reference (the dense body and
  ``attend_segments``) at head_dim 64, 128 and 256, for every key/value layout the recipes and the shipped artifacts
  use, batch 1 and 8, a decode step and a masked chunk, one split and several.
* The same bits from a kernel compiled in a process and from the same kernel loaded from the disk cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_kvint2 import cpu_kernels, read_path
from hf_kvint2.cpu_kernels.bits import fma_reference, stored_value
from hf_kvint2.cpu_kernels.key_scores import channel_key_scores_reference
from hf_kvint2.cpu_kernels.lanes import dot_reference
from hf_kvint2.cpu_kernels.value_sums import accumulate_values_reference
from hf_kvint2.recipes import GroupLayout
from hf_kvint2.stream import QuantizedStream, StreamCodec
from hf_kvint2.transforms import block_hadamard_matrix

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba"),
              pytest.mark.usefixtures("module_single_thread")]
ROOT = Path(__file__).resolve().parents[1]

if cpu_kernels.available():
    import numba

    from hf_kvint2.cpu_kernels.bits import float32_bits, float32_from_bits, float32_from_half_bits, fma, two_bit_code
    from hf_kvint2.cpu_kernels.key_scores import channel_key_scores
    from hf_kvint2.cpu_kernels.lanes import dot
    from hf_kvint2.cpu_kernels.value_sums import accumulate_values

    # The intrinsics take literal widths: these wrappers are compiled once per width they are called with.
    @numba.njit
    def run_scalar_intrinsics(a, b, c, codes, half_bits, shifted):
        """Each scalar intrinsic of hf_kvint2.cpu_kernels.bits over arrays, element by element."""
        fused, bits, back = np.empty_like(a), np.empty(len(a), np.uint32), np.empty_like(a)
        for i in range(len(a)):
            fused[i] = fma(a[i], b[i], c[i])
            bits[i] = float32_bits(a[i])
            back[i] = float32_from_bits(bits[i])
        halves, code = np.empty(len(half_bits), np.float32), np.empty((len(codes), 4), np.float32)
        for i in range(len(half_bits)):
            halves[i] = float32_from_half_bits(half_bits[i])
        for i in range(len(codes)):
            for j in range(4):
                code[i, j] = two_bit_code(codes[i], 2 * j)
        stored = np.empty(len(shifted), np.float32)
        for i in range(len(shifted)):
            stored[i] = stored_value(shifted[i], 2)
        return fused, bits, back, halves, code, stored

    @numba.njit
    def run_dot(x, y, n, width):
        numba.literally(width)
        return dot(x, 3, y, 1, n, width)

    @numba.njit
    def run_accumulate_values(acc, codes, weights, stride, scales, offsets, sums, n, d4, width, group_bytes, rows):
        numba.literally(d4)
        numba.literally(width)
        numba.literally(group_bytes)
        accumulate_values(acc, 2, codes, weights, 1, stride, scales, offsets, sums, 3, n, d4, width, group_bytes, rows)

    @numba.njit
    def run_channel_key_scores(scores, stride, codes, q_planes, q_rows, scale, lo, norm, bias, n, d4, width, rows):
        numba.literally(d4)
        numba.literally(width)
        full = n // width * width  # as the kernel calls it: blocks of `width` tokens, then one token at a time
        channel_key_scores(scores, 1, stride, codes, q_planes, q_rows, 2, scale, lo, 5, norm, 0, bias, 1, full, d4,
                           width, width, rows)
        channel_key_scores(scores, 1 + full * stride, stride, codes[full * d4:], q_planes, q_rows, 2, scale, lo, 5,
                           norm, full, bias, 1, n - full, d4, width, 1, rows)


def _floats(gen: np.random.Generator, n: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return gen.uniform(low, high, n).astype(np.float32)


# --------------------------------------------------------------------------------------------------- intrinsics
def test_scalar_intrinsics_are_their_numpy_expressions():
    """fma, the bit casts, the float16 widening, the 2-bit code of a byte and a float32 stored value, each against
    the NumPy expression its docstring gives, bit for bit (every finite float16 bit pattern for the widening)."""
    gen = np.random.default_rng(0)
    a, b, c = (_floats(gen, 4096, -100.0, 100.0) for _ in range(3))
    codes = np.arange(256, dtype=np.uint8)
    half = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    half = half[np.isfinite(half.view(np.float16))]
    fused, bits, back, halves, code, stored = run_scalar_intrinsics(a, b, c, codes, half, c)
    np.testing.assert_array_equal(fused.view(np.int32), fma_reference(a, b, c).view(np.int32))
    np.testing.assert_array_equal(bits, a.view(np.uint32))
    np.testing.assert_array_equal(back.view(np.int32), a.view(np.int32))
    np.testing.assert_array_equal(halves.view(np.int32), half.view(np.float16).astype(np.float32).view(np.int32))
    want_code = np.stack([(codes >> (2 * j)) & 3 for j in range(4)], axis=1).astype(np.float32)
    np.testing.assert_array_equal(code, want_code)
    np.testing.assert_array_equal(stored.view(np.int32), np.array([stored_value(x, 2) for x in c]).view(np.int32))


@pytest.mark.parametrize("width", [4, 8, 16])
def test_dot_is_its_numpy_loop(width):
    gen = np.random.default_rng(width)
    for chunks in (1, 2, 5):
        n = chunks * width
        x, y = _floats(gen, n + 3), _floats(gen, n + 1)
        want = dot_reference(x[3:], y[1:], width)
        assert np.float32(run_dot(x, y, n, width)).view(np.int32) == want.view(np.int32), (width, chunks)


# (width, bytes per group): a group of two vectors, a vector of four groups, a group of one vector
@pytest.mark.parametrize("width,group_bytes", [(4, 8), (8, 2), (16, 16)])
def test_accumulate_values_is_its_numpy_loop(width, group_bytes):
    gen = np.random.default_rng(width)
    d4, n, stride = 2 * max(width, group_bytes), 7, 6  # weights of token t, row r at 1 + t * stride + r
    groups = d4 // group_bytes
    for rows in (1, 2, 3, 4):
        codes = gen.integers(0, 256, n * d4).astype(np.uint8)
        weights = _floats(gen, 1 + n * stride, 0.0, 1.0)
        scales, offsets = _floats(gen, n * groups, 0.1, 1.0), _floats(gen, n * groups)
        acc, sums = _floats(gen, 2 + 4 * 4 * d4), _floats(gen, 3 + 4 * (groups + 1))
        want_acc, want_sums = acc.copy(), sums.copy()
        accumulate_values_reference(want_acc, 2, codes, weights, 1, stride, scales, offsets, want_sums, 3, n, d4,
                                    width, group_bytes, rows)
        run_accumulate_values(acc, codes, weights, stride, scales, offsets, sums, n, d4, width, group_bytes, rows)
        np.testing.assert_array_equal(acc.view(np.int32), want_acc.view(np.int32), err_msg=f"rows={rows}")
        np.testing.assert_array_equal(sums.view(np.int32), want_sums.view(np.int32), err_msg=f"rows={rows}")


@pytest.mark.parametrize("width", [4, 8, 16])
def test_channel_key_scores_is_its_numpy_loop(width):
    gen = np.random.default_rng(width)
    d4, n, stride = 2 * width, 2 * width + 3, 5  # two blocks of `width` tokens and three single tokens
    d = 4 * d4
    for rows in (1, 2, 3, 4):
        codes = gen.integers(0, 256, n * d4).astype(np.uint8)
        q_rows = _floats(gen, 2 + 4 * d)
        q_planes = np.zeros_like(q_rows)  # the same rows in the codes' plane order (channel 4j + i at i * d4 + j)
        for r in range(4):
            row = q_rows[2 + r * d:2 + (r + 1) * d]
            q_planes[2 + r * d:2 + (r + 1) * d] = row.reshape(d4, 4).T.reshape(-1)
        scale, lo = _floats(gen, 5 + d, 0.1, 1.0), _floats(gen, 5 + d)
        norm, bias = _floats(gen, n, 0.5, 2.0), _floats(gen, 1 + 4)
        scores = np.full(1 + n * stride, np.nan, np.float32)
        want = scores.copy()
        channel_key_scores_reference(want, 1, stride, codes, q_planes, q_rows, 2, scale, lo, 5, norm, 0, bias, 1, n,
                                     d4, width, width, rows)
        run_channel_key_scores(scores, stride, codes, q_planes, q_rows, scale, lo, norm, bias, n, d4, width, rows)
        np.testing.assert_array_equal(scores.view(np.int32), want.view(np.int32), err_msg=f"rows={rows}")


# ------------------------------------------------------------------------------------------ kernel vs reference
def _orthogonal(d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=gen))[0].contiguous()


# key layout, value layout, calibrated (random orthogonal rotations and means instead of the Hadamard) for head_dim d:
# the recipes' defaults (OSCAR, OScaR), the shipped artifacts' per-layer layouts (per-token groups of 32 channels,
# per-channel groups of 32-256 tokens on keys and values, keys in the model's basis), token norms on values, and
# groups the kernel runs with its general loops (no unrolled variant)
def _layouts(d: int) -> dict[str, tuple[GroupLayout, GroupLayout, bool]]:
    token, channel = (lambda g, clip=None, norm=False: GroupLayout("token", min(g, d), clip, norm),
                      lambda g, norm=False: GroupLayout("channel", g, None, norm))
    return {"OSCAR default": (token(128, 0.96), token(128, 0.92), False),
            "OSCAR calibrated, groups of 32": (token(32, 0.89), token(32, 0.96), True),
            "OScaR default": (channel(32, norm=True), token(32), False),
            "channel keys and values": (channel(128), channel(256), True),
            "token keys, channel values": (token(d, 0.86), channel(64), True),
            "normed token values": (token(128), token(32, norm=True), False),
            "general loops": (token(16), token(8), False)}


def _body(layout: GroupLayout, d: int, batch: int, heads: int, calibrated: bool, gen: torch.Generator):
    group = layout.group_for(d)
    rotation = _orthogonal(d, gen) if calibrated else block_hadamard_matrix(d)
    mean = torch.randn(heads, d, generator=gen) if calibrated else None
    stream = QuantizedStream(StreamCodec(layout, group, rotation, mean, torch.float16))
    for n in (512, 256):  # a first append, then one into the buffers (whole per-channel groups, as demoted)
        stream.append(torch.randn(batch, heads, n, d, generator=gen))
    return stream.read(765)  # the last 3 tokens held but not read (the last per-channel group read in part)


def _columns(add):
    """Columns a .. z of an additive mask (None: no mask)."""
    return (lambda a, z: None) if add is None else (lambda a, z: add[..., a:z])


# Differences from the reference: float32 sums taken in another order (the reference dequantizes and uses matmuls):
# the body's tokens, and head_dim products per rotated channel (the query's rotation, the output's de-rotation).
# Their rounding errors grow with the number of terms; measured up to 2.6e-5 at head_dim 256 on outputs of magnitude
# ~1 (weighted means of values <= ~4) and log-sum-exps of ~1-10. 5e-5 is ~400 float32 ulps at 1: loose enough for
# another summation order on any CPU, far below a wrong code, scale or weight (errors of 1e-2 and more).
TOL = {"atol": 5e-5, "rtol": 1e-5}


@pytest.fixture
def intra_op_threads():
    """``intra_op_threads(n)``: run the rest of the test on n intra-op threads (the kernels use as many)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("d,threads", [(64, 1), (64, 2), (128, 1), (256, 2)])
def test_kernel_matches_the_reference(d, threads, intra_op_threads):
    """Body partial (body_attention vs reference_body_partial) and whole-layer step (layer_step_attention vs
    attend_segments with the reference body), every layout, batch 1 and 8 (GQA 3: three query rows per KV head),
    a decode step without a mask and a 5-token chunk with a bool mask over sink, body and recent tokens, the
    body in one split and in splits of 256 tokens (whole per-channel groups); on one thread and on two (the
    parallel regions' work split between threads)."""
    intra_op_threads(threads)
    gen = torch.Generator().manual_seed(d)
    heads, groups, scaling = 2, 3, d ** -0.5
    for name, (key_layout, value_layout, calibrated) in _layouts(d).items():
        for batch in (1, 8):
            kb = _body(key_layout, d, batch, heads, calibrated, gen)
            vb = _body(value_layout, d, batch, heads, calibrated, gen)
            n = kb.tokens
            sink = (torch.randn(batch, heads, 4, d, generator=gen), torch.randn(batch, heads, 4, d, generator=gen))
            recent = (torch.randn(batch, heads, 9, d, generator=gen), torch.randn(batch, heads, 9, d, generator=gen))
            for query_len in (1, 5):
                q = torch.randn(batch, heads * groups, query_len, d, generator=gen)
                cols = 4 + n + 9
                mask = None if query_len == 1 else torch.rand(batch, 1, query_len, cols, generator=gen) > 0.2
                part = _columns(read_path.mask_to_additive(mask))
                qr, kml = q @ kb.codec.rotation, kb.codec.mean_logits(q, groups)
                want_body = read_path.reference_body_partial(qr, kb, vb, scaling=scaling, key_mean_logits=kml,
                                                             mask=part(4, 4 + n))
                want_step = read_path.attend_segments(q, [sink], kb, vb, [recent], scaling, read_path.REFERENCE_BODY,
                                                      mask)
                for split in (None, 256):
                    where = f"{name}, batch {batch}, {query_len} query rows, split {split}"
                    got_body = cpu_kernels.body_attention(qr, kb, vb, scaling=scaling, key_mean_logits=kml,
                                                          mask=part(4, 4 + n), split=split)
                    got_step = cpu_kernels.layer_step_attention(q, sink, kb, vb, recent, scaling=scaling, mask=mask,
                                                                split=split)
                    for got, want in zip((*got_body, got_step), (*want_body, want_step)):
                        torch.testing.assert_close(got, want, **TOL, msg=lambda m, where=where: f"{where}: {m}")


# ------------------------------------------------------------------------------------ compiled == loaded from cache
_RUN_KERNELS = """
import sys
import numpy as np
import torch
from hf_kvint2 import cpu_kernels
from hf_kvint2.layers import OscarLayer
from hf_kvint2.settings import oscar_recipe, oscar_scaled_recipe

def run_kernels(path):
    torch.manual_seed(0)
    outs = []
    for recipe in (oscar_recipe(sink_tokens=4, recent_tokens=8), oscar_scaled_recipe(sink_tokens=4, recent_tokens=8)):
        layer = OscarLayer(recipe, 0)
        layer.fused_attention = True
        for n in (300, 3):
            kv = layer.update(torch.randn(2, 3, n, 64), torch.randn(2, 3, n, 64))
        step = kv[0].step
        kb, vb = layer.key_body.read(step.body_tokens), layer.value_body.read(step.body_tokens)
        q = torch.randn(2, 9, 3, 64)
        outs.append(cpu_kernels.layer_step_attention(q, (step.sink_k, step.sink_v), kb, vb,
                                                     (step.tail_k, step.tail_v), scaling=0.125))
        outs += cpu_kernels.body_attention(q @ kb.codec.rotation, kb, vb, scaling=0.125, split=64)
        outs += [kb.codes[:, :, :kb.tokens], vb.codes[:, :, :vb.tokens]]  # (the buffers' spare rows: undefined)
    np.save(path, np.concatenate([o.contiguous().numpy().reshape(-1).view(np.uint8) for o in outs]))

torch.set_num_threads(1)
"""
_COMPILE = _RUN_KERNELS + """
from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID
from hf_kvint2.precompile import precompile

precompile([SMOLLM2_ARTIFACT_ID])
run_kernels(sys.argv[1])
"""
_LOAD = _RUN_KERNELS + """
import warnings
from hf_kvint2 import OscarCache
from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID

run_kernels(sys.argv[1])
warnings.simplefilter("ignore")  # (built without a model config: it says it cannot tell sliding-window layers)
cache = OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID)  # every layer of the shipped artifact: a fused decode step
layers = range(cache.artifact_info["num_layers"])
for idx in layers:  # a prefill past the windows and the largest per-channel group
    cache.update(torch.randn(1, 3, 700, 64), torch.randn(1, 3, 700, 64), idx)
for idx in layers:
    cache.layers[idx].fused_attention = True
    keys, _ = cache.update(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), idx)
    assert keys.step.body_tokens > 0
    keys.step.attend(torch.randn(1, 9, 1, 64), None, 0.125, True)
"""


def test_precompiled_kernels_load_from_the_cache_with_the_same_bits(tmp_path):
    """With an empty Numba cache, a process runs the precompile command for the shipped SmolLM2 artifact, then the
    layer step and body partial of both default caches' layouts (and stores codes); a second process with that
    cache runs the same, then a fused decode step of every layer of the shipped artifact. The second compiles
    nothing (the artifact's layouts were precompiled) and computes the same bits as the first (compiled in the
    process or loaded from the cache: the same results). The first says once that it compiles."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NUMBA_NUM_THREADS": "1"}
    outputs, logs = [], []
    for script in (_COMPILE, _LOAD):
        out = tmp_path / f"{len(outputs)}.npy"
        proc = subprocess.run([sys.executable, "-c", script, str(out)], env=env, cwd=ROOT, capture_output=True,
                              text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(np.load(out))
        logs.append(proc.stderr)
    assert logs[0].count("compiling the CPU kernels") == 1, logs[0][-3000:]
    assert "compiling" not in logs[1] and "Numba" not in logs[1], logs[1][-3000:]
    np.testing.assert_array_equal(outputs[0], outputs[1])


_FIRST_CALL = """
import sys
import numpy as np
from numba.core import event
from hf_kvint2.cpu_kernels import finite
from hf_kvint2.cpu_kernels.jit import first_call

compiled = []

class Compiles(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"] is finite._count_nonfinite)

    def on_end(self, ev):
        pass

event.register("numba:compile", Compiles())
bits = np.zeros((1, 2, 3, 4), np.int16)
print("ready", flush=True)
sys.stdin.readline()
count = first_call(("lock-test", "count_nonfinite"), finite._count_nonfinite, bits, bits, 0x7C00)
print(any(compiled), count, flush=True)
"""


def test_processes_starting_together_compile_a_kernel_once(tmp_path):
    """Two processes call the same uncompiled kernel at the same moment (an empty disk cache): one compiles it, the
    other waits for that compile (``first_call``'s lock in the cache dir) and loads it, where without the lock both
    would compile (test workers, tensor-parallel ranks, server workers starting together)."""
    from hf_kvint2.cpu_kernels.jit import compile_lock

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_CALL], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        with compile_lock("lock-test-count_nonfinite"):  # held until both have been told to go
            for proc in procs:
                assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
        results = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), [err[-3000:] for _, err in results]
    lines = sorted(out.strip().splitlines()[-1] for out, _ in results)
    assert lines == ["False 0", "True 0"], lines


def test_precompile_lists_every_layout_of_the_shipped_artifacts():
    """The precompile command's list comes from the shipped artifacts themselves: every quantized layer's key and
    value layouts (their groups for the head_dim), and the default caches' at each head_dim."""
    from dataclasses import replace

    from hf_kvint2 import OscarCache
    from hf_kvint2.hub import EMBEDDED_ARTIFACTS
    from hf_kvint2.precompile import shipped_recipes
    from hf_kvint2.settings import OscarCalibration, OscarScaledSettings, OscarSettings, oscar_layer_recipe

    listed = shipped_recipes()
    defaults = [oscar_layer_recipe(OscarSettings(), OscarCalibration(), 0), OscarScaledSettings().recipe()]
    for artifact_id in EMBEDDED_ARTIFACTS:
        cache = OscarCache.from_pretrained(artifact_id)
        d = cache.artifact_info["head_dim"]
        pairs = {tuple(replace(x, group_size=x.group_for(d)) for x in pair)
                 for pair in cache.calibration.layer_layouts if pair is not None}
        pairs |= {tuple(replace(x, group_size=x.group_for(d)) for x in (r.key, r.value)) for r in defaults}
        assert len(pairs) > 2 and pairs <= set(listed[(d, cache.settings.scale_dtype)]), artifact_id


@pytest.mark.parametrize("module", ["hf_kvint2.precompile", "hf_kvint2.backends"])
def test_command_help_compiles_nothing(module, tmp_path):
    """``--help`` of the precompile command (and of the backends listing, which once was it) prints its usage and
    compiles nothing."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", module, "--help"], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: python -m {module}"), out.stderr
    assert not list(tmp_path.rglob("*.nb*")) and "compiling" not in out.stderr  # Numba's index and data files
