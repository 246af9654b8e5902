"""Pinned SmolLM2 logits: the recorded values and their comparison, shared by tests/test_exactness.py
and tests/test_export_smollm2.py. See tests/test_exactness.py for what is recorded and how to re-record."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import platform
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

RECORD = os.environ.get("HF_KVINT2_RECORD_EXACTNESS") == "1"
PINNED = Path(__file__).parent / "data" / "exactness_smollm2.safetensors"
ARTIFACT = "hf-kvint2/SmolLM2-135M-Instruct-oscar"
PROMPT, STEPS, TOP = 600, 16, 32
STATIC_LEN, STATIC_BLOCK = PROMPT + STEPS, 128  # the static cache of the pinned export
# Another platform sums in another order, which moves a few values across INT2 rounding boundaries: logits differ
# by ~1e-3 relative (AVX2 against AVX512, either way: at most 0.023, 1.2e-3 relative; tests/test_exactness.py).
CROSS_PLATFORM = {"rtol": 3e-3, "atol": 1e-3}


def platform_fingerprint() -> dict:
    import numpy

    try:
        import numba
        numba_version = numba.__version__
    except ImportError:
        numba_version = "none"
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "numpy": numpy.__version__, "numba": numba_version}


def digest(row: torch.Tensor) -> dict:
    row = row.detach().float().contiguous().reshape(-1)
    values, indices = row.topk(TOP)
    return {"sha256": hashlib.sha256(row.numpy().tobytes()).hexdigest(), "values": values, "indices": indices}


def smollm2_ids(tokenizer) -> torch.Tensor:
    """The pinned token ids: PROMPT + STEPS tokens of the bundled text."""
    text = importlib.resources.files("hf_kvint2.data").joinpath("emma.txt").read_text()[400:12000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : PROMPT + STEPS]
    assert ids.shape[1] == PROMPT + STEPS
    return ids


def load_pinned() -> dict:
    """``{"tensors": ..., "meta": ...}`` of the recorded file."""
    from safetensors import safe_open

    if not PINNED.exists():
        pytest.fail(f"{PINNED} is missing; record it with HF_KVINT2_RECORD_EXACTNESS=1 (see tests/test_exactness.py).")
    with safe_open(PINNED, "pt") as f:
        meta = f.metadata()
    return {"tensors": load_file(PINNED), "meta": meta}


def save_pinned(store: dict) -> None:
    PINNED.parent.mkdir(exist_ok=True)
    meta = dict(store["meta"], fingerprint=json.dumps(platform_fingerprint(), sort_keys=True))
    save_file(store["tensors"], PINNED, metadata=meta)


def check(pinned, case: str, rows: list[torch.Tensor]) -> None:
    """Record ``rows`` (one logits row per forward) under ``case``, or compare them with the recorded ones."""
    digests = [digest(r) for r in rows]
    if RECORD:
        pinned["tensors"][f"{case}.values"] = torch.stack([d["values"] for d in digests])
        pinned["tensors"][f"{case}.indices"] = torch.stack([d["indices"] for d in digests])
        pinned["meta"][f"{case}.sha256"] = ",".join(d["sha256"] for d in digests)
        return
    want_values, want_indices = pinned["tensors"][f"{case}.values"], pinned["tensors"][f"{case}.indices"]
    want_sha = pinned["meta"][f"{case}.sha256"].split(",")
    assert len(rows) == len(want_sha)
    same_platform = json.loads(pinned["meta"]["fingerprint"]) == platform_fingerprint()
    for step, (row, d) in enumerate(zip(rows, digests)):
        at_recorded = row.float().reshape(-1)[want_indices[step]]
        if same_platform:
            assert torch.equal(d["indices"], want_indices[step]) and torch.equal(d["values"], want_values[step]) \
                and d["sha256"] == want_sha[step], (
                f"{case}, forward {step}: logits changed (max top-{TOP} difference "
                f"{(at_recorded - want_values[step]).abs().max().item():.3g}; the full row's hash differs)")
        else:
            where = f"{case}, forward {step} (another platform than the recording, compared within {CROSS_PLATFORM})"
            torch.testing.assert_close(at_recorded, want_values[step], **CROSS_PLATFORM,
                                       msg=lambda m, where=where: f"{where}: {m}")
    if not same_platform:
        import warnings

        warnings.warn(f"test_exactness: recorded on {pinned['meta']['fingerprint']}, running on "
                      f"{platform_fingerprint()}: compared the top-{TOP} logits within {CROSS_PLATFORM}, not bit "
                      "for bit.",
                      stacklevel=2)


