"""Tensor parallelism with real torch.distributed: 2 CPU ranks (gloo) under torchrun, tiny Llama and Qwen2 loaded
with tp_plan="auto", each rank holding one of the two KV heads; compared with one process running the same caches
(the scenarios live in tests/dist_worker.py). One launch serves every test here."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import dist_worker
import pytest
import torch
from safetensors.torch import load_file

from hf_kvint2 import OscarScaledCache
from hf_kvint2.distributed import TensorParallelShard, resolve_shard, tp_group

WORLD = 2
LAUNCH_TIMEOUT_S = 300  # a hung collective must not stall CI
MODELS = ("llama", "qwen2")
KINDS = ("oscar", "scaled")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process tensors, info) and per-rank (tensors, info) from one 2-rank torchrun launch."""
    root = tmp_path_factory.mktemp("tp")
    dist_worker.save_tiny_models(str(root / "models"))
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(dist_worker.__file__)), str(root / "models"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # The single-process reference first: it compiles the CPU kernels (or loads them) into the disk cache, from
    # which the ranks then load them, instead of three processes compiling the same kernels at once.
    dirs = {name: str(root / "models" / name) for name in MODELS}
    reference = dist_worker.run_scenarios(dirs, tensor_parallel=False)
    calib = dist_worker.calibration_scenario(dirs["llama"], False, str(root / "calib_single"))
    reference[0].update(calib[0])
    reference[1]["calibration"] = calib[1]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    failures = [p.read_text() for p in out.glob("rank*.failed")]
    assert proc.returncode == 0 and not failures, f"torchrun failed:\n{''.join(failures) or log[-5000:]}"
    ranks = [(load_file(out / f"rank{r}.safetensors"), json.loads((out / f"rank{r}.json").read_text()))
             for r in range(WORLD)]
    return reference, ranks


def assert_ranks_match(runs, name: str, tol: float) -> None:
    """Every rank's tensor ``name`` is within ``tol`` (max abs) of the single-process one."""
    (ref, _), ranks = runs
    for rank, (tensors, _) in enumerate(ranks):
        err = (tensors[name] - ref[name]).abs().max().item()
        assert err <= tol, f"{name}: rank {rank} differs from one process by {err:.2e} (> {tol:g})"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_tp_without_quantization_matches_single_process(runs, model, kind):
    assert_ranks_match(runs, f"{model}.{kind}.exact.logits", 1e-5)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_tp_quantized_matches_single_process(runs, model, kind):
    (ref, _), ranks = runs
    tag = f"{model}.{kind}.quant"
    assert ref[f"{tag}.logits"].shape[0] == dist_worker.PROMPT_TOKENS + dist_worker.STEPS
    assert_ranks_match(runs, f"{tag}.logits", 1e-3)  # teacher-forced
    for rank, (tensors, _) in enumerate(ranks):
        # Each rank stores its heads of the single-process body; codes may flip only where the last bits of the
        # hidden states (the all-reduce sums in another order) move a value across a rounding boundary. How many
        # depends on the versions' kernels: 0.16% of layer 1's values with transformers 5.24 / torch 2.13 (under
        # 0.1% before), so the bound is 0.5%; the teacher-forced logits above are the end-to-end check.
        for name in [k for k in ref if k.startswith(f"{tag}.body_")]:
            whole, shard = ref[name], tensors[name]
            heads = whole.shape[1] // WORLD
            assert shard.shape[1] == heads and shard.shape[2] == whole.shape[2] > 0, name
            moved = ((shard - whole[:, rank * heads:(rank + 1) * heads]).abs() > 1e-3).float().mean().item()
            assert moved < 5e-3, f"{name}: {moved:.2%} of rank {rank}'s body differs from the single process"


@pytest.mark.parametrize("kind", KINDS)
def test_tp_fused_oscar_attention_matches_single_process(runs, kind):
    (ref, _), _ranks = runs
    tag = f"llama.{kind}.quant_fused.logits"
    assert_ranks_match(runs, tag, 1e-3)
    # and the fused path computes what the portable path computes
    assert (ref[tag] - ref[f"llama.{kind}.quant.logits"]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_tp_generate_end_to_end(runs, model, kind):
    (ref, _), ranks = runs
    tag = f"{model}.{kind}.quant"
    for tensors, _ in ranks:
        tokens = tensors[f"{tag}.generate"]
        assert tokens.shape == ref[f"{tag}.generate"].shape
        assert torch.equal(tokens, ref[f"{tag}.generate"]), f"{tag}: TP generate differs from one process"


@pytest.mark.parametrize("kind", KINDS)
def test_tp_accounting_local_and_global(runs, kind):
    (_, ref_info), ranks = runs
    tag = f"llama.{kind}.quant"
    single = ref_info[f"{tag}.report"]["total"]
    assert ref_info[f"{tag}.report"]["by_device"] == {"cpu": single["total_bytes"]}
    local_bytes = 0
    for rank, (_, info) in enumerate(ranks):
        local, glob = info[f"{tag}.report"], info[f"{tag}.report_global"]
        assert local["tensor_parallel"] == {"rank": rank, "world_size": WORLD, "kv_heads": 1, "global_view": False}
        assert local["total"]["elements"] * WORLD == single["elements"]
        # the whole model as one process holds it: same bytes and bits; replicated token norms counted once
        assert glob["total"]["elements"] == single["elements"]
        assert glob["total"]["total_bytes"] == single["total_bytes"]
        assert info[f"{tag}.bits_global"] == pytest.approx(ref_info[f"{tag}.bits"], abs=1e-12)
        assert glob["tensor_parallel"]["replicated_bytes"] == local["total"]["norms"] * (WORLD - 1)
        assert glob["by_device"] == {f"rank{r}:cpu": ranks[r][1][f"{tag}.report"]["by_device"]["cpu"]
                                     for r in range(WORLD)}
        local_bytes += local["total"]["total_bytes"]
    assert local_bytes == single["total_bytes"] + ranks[0][1][f"{tag}.report_global"]["tensor_parallel"][
        "replicated_bytes"]
    if kind == "scaled":  # the omni-token norms are replicated on both ranks
        assert ranks[0][1][f"{tag}.report"]["total"]["norms"] > 0


def test_tp_calibration_matches_single_process(runs):
    (ref, ref_info), ranks = runs
    names = sorted(k for k in ref if k.startswith("calib."))
    assert any(".k_rotations." in k for k in names) and any(".key_means." in k for k in names)
    for rank, (tensors, info) in enumerate(ranks):
        # every rank ends with the whole artifact: all KV heads, the same choices; only rank 0 writes it
        assert info["calibration"]["wrote"] == (rank == 0)
        assert {k: v for k, v in info["calibration"].items() if k != "wrote"} == \
            {k: v for k, v in ref_info["calibration"].items() if k != "wrote"}
        assert sorted(k for k in tensors if k.startswith("calib.")) == names
        for name in names:
            assert torch.equal(tensors[name], ranks[0][0][name]), f"{name}: ranks disagree"
            if name.endswith(".0"):
                # Layer 0 sees the same activations under TP (q/k/v are column-sharded: no reduction): gathering
                # the per-head statistics is exact, so the artifact is bit-identical to the single process.
                assert torch.equal(tensors[name], ref[name]), f"{name}: TP gather is not exact"
            else:
                # Later layers see activations after layer 0's row-parallel all-reduce (o_proj, down_proj), which
                # sums in another order: their float32 inputs differ in the last bits (measured: 5e-7 on rotations).
                torch.testing.assert_close(tensors[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_tp_bad_setups_raise_clear_errors(runs):
    _, ranks = runs
    for _, info in ranks:
        errors = info["errors"]
        assert "3 KV heads, which do not divide across 2 tensor-parallel ranks" in errors["kv_heads_not_divisible"]
        assert "key_means[0] of the calibration has 3 KV heads, which do not divide" in \
            errors["calibration_heads_not_divisible"]
        assert "tp_group has 1 ranks but the model was sharded over 2" in errors["tp_group_size_mismatch"]
        assert "this rank holds 2 KV heads" in errors["sharding_mismatch_at_use"]


# ---------------------------------------------------------------------------- single process, no launch
def test_unsharded_model_has_no_shard(tmp_path):
    model = dist_worker.load(dist_worker.save_tiny_models(str(tmp_path))["llama"], tensor_parallel=False)
    assert tp_group(model) is None and resolve_shard(model.config) is None
    assert OscarScaledCache(model.config).shard is None


def test_head_slices_cover_heads_in_rank_order():
    shards = [TensorParallelShard(group=None, rank=r, world_size=4, global_kv_heads=8) for r in range(4)]
    assert [s.head_slice(8, "means") for s in shards] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(ValueError, match="6 KV heads, which do not divide across the 4"):
        shards[0].head_slice(6, "means")
    with pytest.raises(ValueError, match="has 4 KV heads but the model has 8"):
        shards[0].head_slice(4, "means")


def test_storage_lives_on_the_kv_device_and_report_groups_by_device():
    cache = OscarScaledCache(sink_tokens=0, recent_tokens=32)
    k = torch.randn(1, 2, 80, 32)
    cache.update(k, k.clone(), 0)
    layer = cache.layers[0]
    held = [layer.sink_k, layer.recent_k] + [b.data for s in (layer.key_body, layer.value_body) for b in s.buffers()]
    assert all(t.device == k.device for t in held) and layer.key_body.codec.rotation.device == k.device
    report = cache.memory_report()
    assert report["by_device"] == {"cpu": report["total"]["total_bytes"]} and report["layers"][0]["device"] == "cpu"
    assert "tensor_parallel" not in report
