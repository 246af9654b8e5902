"""The demo's pieces (``python -m hf_kvint2.demo``): the prompt it cuts from Emma, the perplexity it reports, the
no-repeat rule of its continuations and its argument checks; on a byte tokenizer and a tiny random model."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvint2 import demo


class Bytes:
    """UTF-8 bytes as token ids, called like a transformers tokenizer."""

    def __call__(self, text, return_tensors=None):
        return type("Encoded", (), {"input_ids": torch.tensor([list(text.encode("utf-8"))])})

    def decode(self, ids, skip_special_tokens=False):
        return bytes([ids] if isinstance(ids, int) else list(ids)).decode("utf-8", errors="replace")


def test_the_prompt_ends_at_a_paragraph_break_and_the_reference_is_the_next_text():
    tok = Bytes()
    prompt, reference = demo.austen_context(tok, 3000, 200)
    text = tok.decode(torch.cat([prompt, reference], dim=1)[0].tolist())
    assert text.startswith("Emma Woodhouse, handsome")  # the title page is skipped
    assert 1500 < prompt.shape[1] <= 3000 and reference.shape[1] == 200
    assert tok.decode(prompt[0].tolist()).endswith("\n\n")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def test_teacher_forced_perplexity_is_the_plain_forward_perplexity(tiny):
    ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(1))
    prompt, reference = ids[:, :50], ids[:, 50:]
    cache = DynamicCache()
    with torch.no_grad():
        tiny(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)
        logp = torch.log_softmax(tiny(input_ids=ids).logits[0, 49:-1], dim=-1)
    expected = math.exp(-logp.gather(-1, reference[0, :, None]).mean().item())
    assert demo.teacher_forced_perplexity(tiny, cache, prompt[:, -1:], reference, chunk=16) == pytest.approx(
        expected, rel=1e-4)
    assert cache.get_seq_length() == 89  # it reads through the cache it is given (the demo passes a copy)


def test_no_repeat_bans_only_ngrams_the_continuation_already_holds():
    rule = demo.no_repeat_in_continuation(prompt_length=4, ngram=3)
    prompt = [7, 8, 7, 8]  # the prompt's own repeats do not count
    scores = rule(torch.tensor([prompt + [1, 2, 3, 1, 2]]), torch.zeros(1, 10))
    assert scores[0, 3] == float("-inf")  # "1 2" was followed by 3 in the continuation: 3 is banned after it
    assert (scores[0, [0, 1, 2, 4, 5, 6, 7, 8, 9]] == 0).all()
    scores = rule(torch.tensor([prompt + [7, 8]]), torch.zeros(1, 10))
    assert (scores == 0).all()  # "7 8 7" is in the prompt only


@pytest.mark.parametrize("argv, message", [
    (["--context-tokens", "8000", "--reference-tokens", "256"], "8192 positions"),
    (["--no-repeat-ngram", "1"], "--no-repeat-ngram must be 0"),
    (["--reference-tokens", "1"], "--reference-tokens >= 2"),
])
def test_bad_arguments_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert message in capsys.readouterr().err
