"""The HTTP server (hf_kvint2.serve) on a tiny random Llama, on 127.0.0.1 and a port the system picks.

16 concurrent streamed chat completions through the ``openai`` client; 4 are cancelled (the client closes the
stream) after their first text. The 12 others' texts equal what ``model.generate_batch`` gives offline for the same
prompts (greedy, same continuous batching settings), and once the cancelled requests are gone the KV cache's free
memory is back where it started. The cancelled requests ask for tens of thousands of tokens: only a cancellation
frees their pages while the test waits.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import urllib.request

import pytest
import torch
from conftest import TINY_VOCAB, tiny_config

from hf_kvint2.serve import ServedModel, parse_bytes, running_server

MODEL_ID = "tiny-llama"
NEW_TOKENS = 24  # of each request that runs to its end
CANCELLED = (2, 7, 11, 14)  # indices of the requests cancelled mid-stream
CANCELLED_NEW_TOKENS = 60_000  # more than the test could wait for: only the cancellation ends them
PAGE_SIZE = 16
# Room for a cancelled request's whole length, which the INT2 engine checks at admission (2048 stock blocks)
KV_BUDGET = 16 * 2**20
# The cancellations reach the engine within a second; running the cancelled requests to their end would take minutes
FREED_WITHIN_S = 30
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer(vocab_size: int):
    """A character-level fast tokenizer with a chat template whose every id decodes (the tiny model's vocabulary):
    the special tokens, newline, printable ASCII, then Latin-1 letters up to ``vocab_size``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    chars += [chr(0xC0 + i) for i in range(vocab_size - len(SPECIAL_TOKENS) - len(chars))]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>",
                                        additional_special_tokens=SPECIAL_TOKENS[4:])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size
    return tokenizer


def messages(index: int) -> list[dict]:
    """Request ``index``'s chat: prompts of mixed lengths (about 30 to 130 tokens with the template)."""
    text = f"Request {index}: " + "the quick brown fox jumps over the lazy dog; "[: 5 + 7 * index] * (1 + index % 3)
    return [{"role": "user", "content": text}]


def tiny_llama():
    """The tiny Llama of conftest with room for positions far past what the test runs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", max_position_embeddings=65_536),
                                             attn_implementation="sdpa")
    model.generation_config.pad_token_id = 0
    return model.eval()


def served_and_offline(method: str, prompts: list[list[int]]):
    """``(ServedModel, offline texts of prompts, ContinuousBatchingConfig)`` for ``method``: the offline texts from
    ``generate_batch`` on the same model and engine."""
    from transformers import GenerationConfig

    model, tokenizer = tiny_llama(), char_tokenizer(TINY_VOCAB)
    served = ServedModel.from_model(model, tokenizer, model_id=MODEL_ID, method=method, kv_budget_bytes=KV_BUDGET,
                                    num_threads=1)
    page_size = PAGE_SIZE if method == "none" else None  # the INT2 engine chooses its pages
    offline_model = model
    if method != "none":
        offline_model = copy.deepcopy(model)
        from hf_kvint2.serve import enable_int2_engine

        enable_int2_engine(offline_model, served.cache_factory(offline_model.config), KV_BUDGET)
    outputs = offline_model.generate_batch(
        prompts, generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False),
        continuous_batching_config=served.continuous_batching_config(page_size=page_size, max_batch_tokens=256))
    generated = [output.generated_tokens for output in sorted(outputs.values(), key=lambda o: int(o.request_id[4:]))]
    assert all(len(tokens) == NEW_TOKENS for tokens in generated)
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in generated]
    return served, texts, served.continuous_batching_config(page_size=page_size, max_batch_tokens=256)


async def chat(client, index: int) -> dict:
    """Request ``index``, streamed: its text, finish reason and usage; a cancelled one closes its stream after its
    first text."""
    cancel = index in CANCELLED
    stream = await client.chat.completions.create(
        model=MODEL_ID, messages=messages(index), stream=True, temperature=0, stream_options={"include_usage": True},
        max_tokens=CANCELLED_NEW_TOKENS if cancel else NEW_TOKENS)
    parts, finish, usage = [], None, None
    async with stream:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            if cancel and "".join(parts):
                break  # leaving the block closes the connection: the server cancels the request
    return {"text": "".join(parts), "finish": finish, "usage": usage}


async def chat_all(base_url: str) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as client:
        return await asyncio.gather(*(chat(client, index) for index in range(16)))


def kv_cache(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/v1/kv_cache", timeout=30) as response:
        return json.load(response)


def held_blocks(state: dict) -> int:
    return sum(group["held_blocks"] for group in state["attention_types"].values())


@pytest.mark.parametrize("method", ["none", "oscar-scaled"])
def test_streamed_chats_equal_offline_and_cancelled_requests_free_their_pages(method, single_thread):
    if method != "none":
        pytest.importorskip("hf_kvint2.serving", reason="the INT2 paged engine (hf_kvint2.serving) is not installed")
    tokenizer = char_tokenizer(TINY_VOCAB)
    kept = [index for index in range(16) if index not in CANCELLED]
    prompts = [tokenizer.apply_chat_template(messages(index), add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for index in kept]
    served, offline, cb_config = served_and_offline(method, prompts)

    with running_server(served, cb_config=cb_config) as base_url:
        assert base_url.startswith("http://127.0.0.1:")
        start = kv_cache(base_url)
        assert held_blocks(start) == 0 and 0 < start["total_bytes"] + start.get("window_bytes", 0) <= KV_BUDGET
        assert start["free_bytes"] + start["reusable_bytes"] == start["total_bytes"]

        results = asyncio.run(chat_all(base_url))

        for index in CANCELLED:  # cut mid-stream: some text, no end
            assert results[index]["text"] and results[index]["finish"] is None, results[index]
        for index, text in zip(kept, offline):
            result = results[index]
            assert result["finish"] == "length" and result["usage"].completion_tokens == NEW_TOKENS, result
            assert result["text"] == text, f"request {index}: served {result['text']!r}, offline {text!r}"

        deadline = time.monotonic() + FREED_WITHIN_S
        state = kv_cache(base_url)
        while held_blocks(state) and time.monotonic() < deadline:
            time.sleep(0.2)
            state = kv_cache(base_url)
        assert held_blocks(state) == 0, f"requests still hold pages after their cancellation: {state}"
        assert state["free_bytes"] + state["reusable_bytes"] == start["free_bytes"] + start["reusable_bytes"]
        assert state["total_bytes"] == start["total_bytes"]
        if method != "none":
            assert state["free_window_slots"] == start["free_window_slots"] == start["window_slots"]


def test_kv_budget_sizes_and_bad_values():
    assert parse_bytes("536870912") == parse_bytes("512MiB") == parse_bytes("0.5 GiB") == 512 * 2**20
    assert parse_bytes("500MB") == 500 * 10**6
    for bad in ("512 MiBs", "-3MiB", "lots"):
        with pytest.raises(ValueError, match="Cannot read"):
            parse_bytes(bad)
    model, tokenizer = tiny_llama(), char_tokenizer(TINY_VOCAB)
    block = PAGE_SIZE * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x KV heads x head_dim x fp32 bytes
    served = ServedModel.from_model(model, tokenizer, method="none", kv_budget_bytes=10 * block + block // 2)
    assert served.continuous_batching_config(page_size=PAGE_SIZE).num_blocks == 10
    with pytest.raises(ValueError, match="holds no block"):
        ServedModel.from_model(model, tokenizer, method="none",
                               kv_budget_bytes=block - 1).continuous_batching_config(page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="not one of"):
        ServedModel.from_model(model, tokenizer, method="int4")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ServedModel.from_model(model, tokenizer, method="none")


def test_the_int2_engine_takes_the_expected_request_length():
    """``--expected-request-tokens`` / ``expected_request_tokens`` reach the INT2 engine's budget plan (its window
    slots); a length below one token is refused."""
    from hf_kvint2 import OscarScaledCache
    from hf_kvint2.serve import enable_int2_engine, parse_args
    from hf_kvint2.serving import disable_paged_int2, plan_budget

    assert parse_args(["--expected-request-tokens", "300"]).expected_request_tokens == 300
    assert parse_args([]).expected_request_tokens is None
    with pytest.raises(SystemExit):
        parse_args(["--expected-request-tokens", "0"])
    model, template = tiny_llama(), OscarScaledCache(sink_tokens=4, recent_tokens=32)
    slots = []
    try:
        for tokens in (100, 3000):
            layout = enable_int2_engine(model, template, KV_BUDGET, tokens)
            slots.append(layout.window_slots)
            assert slots[-1] == plan_budget(model, template, KV_BUDGET, expected_request_tokens=tokens).window_slots
    finally:
        disable_paged_int2(model)
    assert slots[0] > slots[1]


def test_an_untested_transformers_release_is_refused(monkeypatch):
    import transformers

    from hf_kvint2.serve import TESTED_TRANSFORMERS, check_transformers

    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    with pytest.raises(RuntimeError, match=rf"tested on transformers {TESTED_TRANSFORMERS[0]}.*this is transformers "
                                           r"5\.99\.0\. Install transformers~="):
        check_transformers()
