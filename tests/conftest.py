"""Shared fixtures: tiny random Llama / Qwen2 / Mistral models built from configs, and the bundled SmolLM2."""

from __future__ import annotations

import functools
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (tests/test_kernels.py). Triton reads
# TRITON_INTERPRET when it is first imported (torch._dynamo imports it early), so set it before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``make test`` runs two workers) each worker gets its share of the cores as intra-op threads:
# two workers with every core each would spin against each other.
# (Tests that need two threads set them: test_cpu_kernels.)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The longest test files first (one to four minutes each on the 2-core CI machine): pytest-xdist hands files to the
# workers in collection order, so the long ones start early and the two workers finish together. The two that
# compile the CPU kernels for the tiny models' and SmolLM2's head_dims in their own process lead, so that the docs'
# examples, each run in a fresh interpreter, find them in the disk cache. Order only: every file still runs, the
# rest in their usual order.
SLOWEST_FIRST = ("test_cpu_kernels.py", "test_hardening.py", "test_docs.py", "test_attention.py", "test_perplexity.py",
                 "test_export.py", "test_hybrid.py", "test_export_smollm2.py", "test_distributed.py",
                 "test_triton_aot.py", "test_cache_contract.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: the rest keep their order


TINY_ARCHS = ("llama", "qwen2", "mistral")
TINY_VOCAB = 128


def tiny_config(arch: str, **overrides):
    """A 2-layer config (hidden 64, 4 query heads, 2 KV heads, head_dim 16) of the given architecture."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kwargs = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              # a wider init than the default 0.02 gives peaked attention and logits, so that quantization
              # errors show up in the outputs instead of vanishing in near-uniform softmaxes
              "initializer_range": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None}
    if arch == "mistral":
        kwargs["sliding_window"] = None  # every layer full attention (sliding windows are tested separately)
    kwargs.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    return cls(**kwargs)


@functools.cache
def _tiny_model(arch: str, dtype: torch.dtype, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype, attn_implementation=attn)
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(arch, dtype=torch.float32, attn="sdpa")``: a cached tiny random model in eval mode."""

    def make(arch: str = "llama", dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
        return _tiny_model(arch, dtype, attn)

    return make


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the bundled SmolLM2-135M-Instruct in float32, loaded once per session."""
    from hf_kvint2.models import load_smollm2

    return load_smollm2(torch.float32, attn_implementation="sdpa")


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: for tiny tensors, thread start-up and spinning cost far more than the
    work (measured 3-8 ms vs 100+ ms per tiny-model forward on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def module_single_thread():
    """:func:`single_thread` for every test of a module (``pytestmark = pytest.mark.usefixtures(...)``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
