"""Side-by-side demo: a full-precision and two 2-bit KV caches over the first ~4000 tokens of Jane Austen's Emma.

Run ``python -m hf_kvint2.demo`` (or ``make demo``). Loads the bundled SmolLM2-135M-Instruct offline and, for each
cache (``DynamicCache``, ``OscarScaledCache``, ``OscarCache`` with the calibration shipped for SmolLM2): stores the
prompt, measures how well the model predicts the text that really follows it through that cache (perplexity of
Austen's next paragraphs), and continues the prompt. Prints each cache's memory, bits per element, perplexity and
continuation, and what each column means.

A few thousand tokens, because that is where a KV cache's memory matters and where the INT2 body outweighs the
caches' full-precision windows (64 sink tokens and the last 128-271 tokens); on a prompt of a few hundred tokens
those windows are most of what is stored and the bits per element are far above 2.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math
import sys
import time
from importlib.resources import files

# torch, transformers and the caches are imported after the arguments are parsed, so that --help prints at once.
DTYPES = ("bfloat16", "float16", "float32")
ATTN_IMPLEMENTATION = "oscar"  # hf_kvint2.attention.ATTN_IMPLEMENTATION, without importing transformers
# Teacher-forced scoring feeds the reference text this many tokens at a time: short chunks are read like decode
# steps (the fused CPU step serves them), and every chunk sees the stored prompt, not a full-precision copy of it.
SCORE_CHUNK = 16


def make_oscar_cache(model):
    """The OscarCache the demo runs: the calibration for SmolLM2 shipped inside the package (fitted on Pride and
    Prejudice; loads offline), validated against the model's config."""
    from .cache import OscarCache
    from .hub import SMOLLM2_ARTIFACT_ID

    return OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=model.config)


def austen_context(tokenizer, context_tokens: int, reference_tokens: int):
    """Token ids of *Emma* from its first chapter: ``(prompt [1, P], reference [1, R])``. The prompt is at most
    ``context_tokens`` long and ends at a paragraph break (so the continuation starts a paragraph instead of
    finishing a word); the reference is the ``reference_tokens`` that follow it in the book. Both come from one
    tokenization of the text, so the reference is exactly what the model would read next."""
    text = files("hf_kvint2.data").joinpath("emma.txt").read_text(encoding="utf-8")
    start = text.index("Emma Woodhouse, handsome")  # skip the title page
    wanted = context_tokens + reference_tokens
    ids = tokenizer(text[start:start + 12 * wanted], return_tensors="pt").input_ids[:, :wanted]
    if ids.shape[1] < wanted:
        raise ValueError(f"--context-tokens {context_tokens} is longer than the text slice; use a smaller value")
    pieces = [tokenizer.decode(i) for i in ids[0, :context_tokens].tolist()]
    breaks = [n for n in range(context_tokens // 2, context_tokens + 1) if "".join(pieces[n - 2:n]).endswith("\n\n")]
    cut = breaks[-1] if breaks else context_tokens  # no paragraph break in the second half: cut where asked
    return ids[:, :cut], ids[:, cut:cut + reference_tokens]


def kv_bytes(cache) -> tuple[int, int, int]:
    """``(bytes held, of which full-precision window bytes, K/V elements)`` of ``cache``: for the INT2 caches their
    ``memory_report`` (codes, scales, norms, full-precision sink and recent windows), for a transformers cache its
    K/V tensors (all full precision)."""
    import torch

    from .cache import OscarCacheBase

    if isinstance(cache, OscarCacheBase):
        total = cache.memory_report()["total"]
        return total["total_bytes"], total["full_precision"], total["elements"]
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, nbytes, sum(t.numel() for t in tensors)


def teacher_forced_perplexity(model, cache, last_prompt_token, reference, chunk: int = SCORE_CHUNK) -> float:
    """Perplexity of ``reference`` [1, R] read after the prompt stored in ``cache`` (which holds every prompt token
    but ``last_prompt_token`` [1, 1]), fed ``chunk`` tokens at a time: how well the model predicts the book's own
    next tokens from what the cache stores. Appends to ``cache``: pass a copy."""
    import torch

    inputs = torch.cat([last_prompt_token, reference[:, :-1]], dim=1)
    nll = 0.0
    with torch.inference_mode():
        for i in range(0, inputs.shape[1], chunk):
            logits = model(input_ids=inputs[:, i:i + chunk], **{cache_argument(model): cache}, use_cache=True).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
            nll -= logp.gather(-1, reference[:, i:i + chunk, None]).sum().item()
    return math.exp(nll / reference.shape[1])


def no_repeat_in_continuation(prompt_length: int, ngram: int):
    """A logits processor that bans, within the generated continuation only, any ``ngram``-gram it has already
    produced. transformers' ``no_repeat_ngram_size`` also counts the prompt, and over a few thousand tokens of a
    novel that bans most common phrases; a 135M model decoded greedily without any such rule tends to repeat one
    phrase, and a repetition penalty over the prompt makes it leave the story."""
    from transformers import LogitsProcessor

    class NoRepeatInContinuation(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for row, ids in enumerate(input_ids[:, prompt_length:].tolist()):
                if len(ids) < ngram:
                    continue
                tail = ids[len(ids) - ngram + 1:]
                banned = [ids[i + ngram - 1] for i in range(len(ids) - ngram + 1) if ids[i:i + ngram - 1] == tail]
                scores[row, banned] = float("-inf")
            return scores

    return NoRepeatInContinuation()


def token_progress(bar):
    """A streamer that advances a tqdm bar by one per generated token (``generate`` first puts the prompt, which is
    skipped)."""
    from transformers.generation.streamers import BaseStreamer

    class TokenProgress(BaseStreamer):
        def __init__(self):
            self.seen_prompt = False

        def put(self, value):
            if self.seen_prompt:
                bar.update(1)
            self.seen_prompt = True

        def end(self):
            pass

    return TokenProgress()


def cache_argument(model) -> str:
    """The cache's keyword for ``generate`` and the forward: transformers >= 5.24 take ``cache=`` (and warn about
    the old name), earlier 5.x only ``past_key_values=``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def run(model, tokenizer, prompt, reference, name: str, cache, max_new_tokens: int, ngram: int) -> dict:
    """Store ``prompt`` in ``cache``, score ``reference`` on a copy of it, then continue ``prompt`` greedily."""
    import torch
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=prompt[:, :-1], **{cache_argument(model): cache}, use_cache=True)  # generate feeds the last
        nbytes, window_bytes, elements = kv_bytes(cache)
        perplexity = teacher_forced_perplexity(model, copy.deepcopy(cache), prompt[:, -1:], reference)
        processors = LogitsProcessorList([no_repeat_in_continuation(prompt.shape[1], ngram)] if ngram else [])
        with tqdm(total=max_new_tokens, desc=f"{name:<17}", unit="tok", leave=True, file=sys.stderr) as bar:
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **{cache_argument(model): cache},
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                 logits_processor=processors, pad_token_id=tokenizer.pad_token_id,
                                 streamer=token_progress(bar))
    new = out[0, prompt.shape[1]:]
    return {"name": name, "text": tokenizer.decode(new, skip_special_tokens=True), "bytes": nbytes,
            "window_bytes": window_bytes, "bits": 8 * nbytes / elements, "perplexity": perplexity,
            "seconds": time.perf_counter() - start}


def print_report(rows: list[dict], prompt_tokens: int, reference_tokens: int, dtype_bits: int, ngram: int) -> None:
    import textwrap

    baseline = rows[0]
    print(f"\nKV cache after storing the prompt ({prompt_tokens - 1} tokens; generate feeds the last one),\n"
          f"SmolLM2-135M: 30 layers, 3 KV heads of 64 channels, {dtype_bits}-bit K/V:\n")
    print(f"{'cache':<18}{'KV memory':>11}{'bits/element':>14}{'smaller':>9}{'perplexity':>12}{'time':>8}")
    for row in rows:
        print(f"{row['name']:<18}{row['bytes'] / 2**20:>7.1f} MiB{row['bits']:>14.2f}"
              f"{baseline['bytes'] / row['bytes']:>8.1f}x{row['perplexity']:>12.2f}{row['seconds']:>7.0f}s")
    windows = ", ".join(f"{row['name']} {100 * row['window_bytes'] / row['bytes']:.0f}%" for row in rows[1:])
    columns = {
        "KV memory": "what the cache stores for the prompt. The INT2 caches store 2-bit codes with fp16 scales and "
                     "offsets (and OScaR's token norms), and keep some tokens in full precision: the first 64 (the "
                     "sink) and the most recent ones (OscarScaledCache 128, OscarCache 256-271).",
        "bits/element": f"KV memory in bits per cached key or value number ({baseline['name']}: {dtype_bits}). The "
                        f"full-precision tokens are part of it ({windows} of the bytes here); they are a fixed "
                        "number of tokens, so the bits per element fall as the context grows, and with 16-bit K/V "
                        "they cost half as much (README.md, \"Bits per element\").",
        "smaller": f"{baseline['name']}'s KV memory divided by the cache's.",
        "perplexity": f"of the {reference_tokens} tokens that follow the prompt in the book, read through the cache "
                      f"({SCORE_CHUNK} at a time, teacher forcing): what storing the prompt in 2 bits costs the "
                      f"model's predictions. Lower is better; {baseline['name']} is the full-precision reference.",
        "time": "seconds to store the prompt, score and generate, on this machine; a first run also compiles the "
                "CPU kernel.",
    }
    print()
    for name, text in columns.items():
        print(textwrap.fill(text, 116, initial_indent=f"  {name:<14}", subsequent_indent=" " * 16))
    rule = f", no {ngram}-gram repeated within a continuation" if ngram else ""
    print(f"\nContinuations (greedy{rule}):")
    for row in rows:
        print(f"\n--- {row['name']} ---\n{row['text'].strip()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=4000,
                        help="prompt length from Emma, cut back to a paragraph break (default 4000; SmolLM2 reads "
                             "at most 8192 tokens)")
    parser.add_argument("--reference-tokens", type=int, default=256,
                        help="tokens of the book after the prompt whose perplexity is measured (default 256)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per cache (default 48)")
    parser.add_argument("--no-repeat-ngram", type=int, default=3,
                        help="ban any n-gram a continuation already contains (default 3; 0: plain greedy)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="model and full-precision cache dtype (default: bfloat16 on GPU, float32 on CPU, where "
                             "bfloat16 matmuls are slow without AVX512-BF16)")
    parser.add_argument("--attn-implementation", default=ATTN_IMPLEMENTATION,
                        help=f"'{ATTN_IMPLEMENTATION}' (default: fused INT2 attention; full-precision caches get "
                             "SDPA) or a transformers one such as 'sdpa' (the portable path: dequantize per step)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.context_tokens < 16 or args.reference_tokens < 2:
        parser.error("--max-new-tokens must be >= 1, --context-tokens >= 16 and --reference-tokens >= 2")
    if args.context_tokens + args.reference_tokens + args.max_new_tokens > 8192:
        parser.error(f"--context-tokens + --reference-tokens + --max-new-tokens must fit SmolLM2's 8192 positions "
                     f"(got {args.context_tokens + args.reference_tokens + args.max_new_tokens}); shorten one")
    if args.no_repeat_ngram < 0 or args.no_repeat_ngram == 1:
        parser.error(f"--no-repeat-ngram must be 0 (off) or >= 2, got {args.no_repeat_ngram}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import DynamicCache

    from .cache import OscarScaledCache
    from .models import load_smollm2

    print("Loading SmolLM2-135M-Instruct (the first run converts the bundled GGUF to safetensors, ~40 s) ...",
          file=sys.stderr)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model, tokenizer = load_smollm2(dtype=dtype, attn_implementation=args.attn_implementation)
    if torch.cuda.is_available():
        model.to("cuda")
    prompt, reference = (t.to(model.device) for t in austen_context(tokenizer, args.context_tokens,
                                                                     args.reference_tokens))
    tail = " ".join(tokenizer.decode(prompt[0, -40:]).split())
    print(f"Prompt: the first {prompt.shape[1]} tokens of Jane Austen's Emma, ending:\n  ... {tail}")

    caches = [("DynamicCache", DynamicCache()), ("OscarScaledCache", OscarScaledCache()),
              ("OscarCache", make_oscar_cache(model))]
    rows = [run(model, tokenizer, prompt, reference, name, cache, args.max_new_tokens, args.no_repeat_ngram)
            for name, cache in caches]
    print_report(rows, prompt.shape[1], reference.shape[1], torch.finfo(dtype).bits, args.no_repeat_ngram)


if __name__ == "__main__":
    main()
