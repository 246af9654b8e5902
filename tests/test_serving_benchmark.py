"""benchmarks/serving.py: the KV budget each contender gets, and what its probe counts in transformers' continuous
batching engine (steps, first tokens, concurrency, preemptions), on a tiny random model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving
from conftest import tiny_config

pytestmark = pytest.mark.usefixtures("module_single_thread")


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    config = tiny_config("llama")  # 2 layers, 2 KV heads, head_dim 16
    assert serving.kv_bytes_per_token(config) == 2 * 2 * 2 * 16 * 4
    assert serving.kv_bytes_per_token(config, element_bytes=2) == 2 * 2 * 2 * 16 * 2


def test_paged_num_blocks_is_what_transformers_builds_within_the_budget():  # its reserved blocks included
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper
    from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

    config = tiny_config("llama")
    per_token, page = serving.kv_bytes_per_token(config), 16
    budget = 12 * page * per_token + page * per_token - 1  # one byte short of 13 blocks
    blocks = serving.paged_num_blocks(budget, page, per_token)
    assert blocks == 12 - serving.ENGINE_RESERVED_BLOCKS
    cb = resolve_continuous_batching_config(config, ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                                                             max_batch_tokens=64), None, False,
                                            device=torch.device("cpu"))
    cache = PagedAttentionCache(config, cb, "cpu", DistributedHelper(None, None), dtype=torch.float32)
    assert sum(a.bytes_per_block for a in cache.cache_allocators.values()) == page * per_token
    assert cache.num_blocks == blocks
    assert cache.cache_tensor.nbytes == (blocks + serving.ENGINE_RESERVED_BLOCKS) * page * per_token <= budget


def test_paged_num_blocks_refuses_a_budget_below_one_block():
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        serving.paged_num_blocks((1 + serving.ENGINE_RESERVED_BLOCKS) * 16 * 512 - 1, 16, 512)
    assert serving.paged_num_blocks((1 + serving.ENGINE_RESERVED_BLOCKS) * 16 * 512, 16, 512) == 1


def test_static_batches_are_the_largest_that_fit_in_arrival_order():
    lengths, new, per_token, budget = [100, 300, 120, 80, 400, 50, 60], 20, 8, 8 * 1000
    batches = serving.static_batches(lengths, new, budget, per_token)
    assert [i for batch in batches for i in batch] == list(range(len(lengths)))
    for k, batch in enumerate(batches):
        assert len(batch) * (max(lengths[i] for i in batch) + new) * per_token <= budget
        if k + 1 < len(batches):  # the next request would not have fitted (padding to the longer prompt included)
            grown = [*batch, batches[k + 1][0]]
            assert len(grown) * (max(lengths[i] for i in grown) + new) * per_token > budget
    assert batches == [[0, 1, 2], [3, 4], [5, 6]]  # 3 * (300 + 20) tokens fit 1000; 3 * (400 + 20) do not


def test_static_batches_refuse_a_request_longer_than_the_budget():
    with pytest.raises(ValueError, match="request 1 .*does not fit the KV budget"):
        serving.static_batches([10, 200], 10, 8 * 100, 8)


def serve_tiny(prompts, new_tokens, budget_blocks, page):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    per_token = serving.kv_bytes_per_token(model.config)
    budget = (budget_blocks + serving.ENGINE_RESERVED_BLOCKS) * page * per_token
    args = argparse.Namespace(new_tokens=new_tokens, threads=1, page_size=page, max_batch_tokens=256, budget=budget,
                              progress=None)
    trace = serving.paged_fp(model, prompts, args, warmup_prompts=[[5] * 8, [6] * 8])
    return model, trace


def greedy_alone(model, prompt, new_tokens):
    from transformers import DynamicCache

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=serving.generation_config(new_tokens),
                             past_key_values=DynamicCache(config=model.config))
    return out[0, len(prompt):].tolist()


def test_probe_counts_steps_first_tokens_and_concurrency_of_the_engine():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (40,), generator=g).tolist() for _ in range(3)]
    # 40 + 4 tokens take 3 blocks of 16: a budget of 3 blocks serves one request at a time
    model, trace = serve_tiny(prompts, new_tokens=4, budget_blocks=3, page=16)
    assert trace.engine["engine_num_blocks"] == 3
    assert sorted(trace.first_token) == [0, 1, 2] and all(len(t) == 4 for t in trace.tokens.values())
    assert max(s.active for s in trace.steps) == 1 and trace.preemptions == 0
    # each request: one prefill step (its first token), then three decode-only steps
    assert sum(s.decode_rows for s in trace.steps if not s.prefill_tokens) == 3 * 3
    assert sum(s.prefill_tokens for s in trace.steps) == 3 * 40
    for i, prompt in enumerate(prompts):
        assert trace.tokens[i] == greedy_alone(model, prompt, 4)
    summary = serving.summarize(trace, prompts)
    assert summary["peak_concurrent_requests"] == 1 and summary["generated_tokens"] == 12
    assert summary["ttft_p50_s"] <= summary["ttft_p95_s"] <= summary["wall_s"]


def test_probe_counts_the_requests_the_engine_preempts():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 128, (30,), generator=g).tolist() for _ in range(2)]
    # both 30-token prompts fit (2 blocks each of 5), but not their growth to 40 tokens (3 blocks each)
    model, trace = serve_tiny(prompts, new_tokens=10, budget_blocks=5, page=16)
    assert max(s.active for s in trace.steps) == 2
    assert trace.preemptions >= 1
    for i, prompt in enumerate(prompts):  # a preempted request is served again from its prompt and tokens
        assert trace.tokens[i] == greedy_alone(model, prompt, 10)


def test_token_check_replays_each_request_alone_in_the_engines_chunks():
    """--check-tokens: each request of an INT2 contender served again alone, its prompt in the chunks the engine ran
    (prompts longer than max_batch_tokens are cut), its greedy tokens equal to the engine's."""
    pytest.importorskip("hf_kvint2.serving")
    import transformers
    from transformers import AutoModelForCausalLM

    from hf_kvint2 import OscarScaledCache
    from hf_kvint2.serving.engine import TESTED_TRANSFORMERS

    if not any(transformers.__version__.startswith(v) for v in TESTED_TRANSFORMERS):
        pytest.skip("the INT2 engine refuses this transformers version")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (150, 90, 210)]
    args = argparse.Namespace(new_tokens=6, threads=1, page_size=None, max_batch_tokens=128, budget=8 << 20,
                              progress=None, prompt_tokens=[90, 210], check_tokens=True)
    serve = serving.paged_int2(lambda model, args: OscarScaledCache(sink_tokens=4, recent_tokens=32))
    trace = serve(model, prompts, args, warmup_prompts=[[5] * 8, [6] * 8])
    check = trace.check()
    assert check["equal"] == 3 and check["different"] == check["near_tie"] == check["recomputed"] == 0, check
    chunks = [[n for p, n in trace.forwards[trace.request_ids[i]] if p < len(prompt)] for i, prompt in
              enumerate(prompts)]
    assert [sum(c) for c in chunks] == [150, 90, 210] and any(len(c) > 1 for c in chunks)
