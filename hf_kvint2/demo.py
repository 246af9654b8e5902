"""Side-by-side demo: greedy continuation of an Austen passage with a full-precision and two 2-bit KV caches.

Run ``python -m hf_kvint2.demo`` (or ``make demo``). Loads the bundled SmolLM2-135M-Instruct offline, feeds it
the opening of *Emma* (the evaluation text; the calibration text is *Pride and Prejudice*), and prints each
cache's continuation, KV bytes and bits per element.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from importlib.resources import files

# torch, transformers and the caches are imported after the arguments are parsed, so that --help prints at once.
DTYPES = ("bfloat16", "float16", "float32")
ATTN_IMPLEMENTATION = "oscar"  # hf_kvint2.attention.ATTN_IMPLEMENTATION, without importing transformers


def make_oscar_cache(model):
    """The OscarCache the demo runs: the calibration for SmolLM2 shipped inside the package (fitted on Pride and
    Prejudice; loads offline), validated against the model's config."""
    from .cache import OscarCache
    from .hub import SMOLLM2_ARTIFACT_ID

    return OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=model.config)


def austen_context(tokenizer, context_tokens: int):
    """The first ``context_tokens`` tokens of *Emma* (cut back to the last paragraph end), as ``[1, T]`` ids."""
    text = files("hf_kvint2.data").joinpath("emma.txt").read_text(encoding="utf-8")
    start = text.index("Emma Woodhouse, handsome")  # skip the title page
    ids = tokenizer(text[start:start + 12 * context_tokens], return_tensors="pt").input_ids[:, :context_tokens]
    if ids.shape[1] < context_tokens:
        raise ValueError(f"--context-tokens {context_tokens} is longer than the text slice; use a smaller value")
    # End at a paragraph boundary so the continuation starts a new paragraph rather than finishing a word.
    prompt = tokenizer.decode(ids[0], skip_special_tokens=True)
    cut = prompt.rfind("\n\n")
    if cut > len(prompt) // 2:
        ids = tokenizer(prompt[:cut + 2], return_tensors="pt").input_ids
    return ids


def kv_bytes_and_bits(cache) -> tuple[int, float]:
    """Bytes of K/V held by ``cache`` and the resulting bits per cached element."""
    import torch

    from .cache import OscarCacheBase

    if isinstance(cache, OscarCacheBase):
        total = cache.memory_report()["total"]
        return total["total_bytes"], total["bits_per_element"]
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, 8 * nbytes / sum(t.numel() for t in tensors)


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
    """generate's name for the cache: transformers >= 5.24 take ``cache=`` (and warn about the old name), earlier
    5.x only ``past_key_values=``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def run(model, tokenizer, input_ids, name: str, cache, max_new_tokens: int) -> dict:
    import torch
    from tqdm.auto import tqdm

    with tqdm(total=max_new_tokens, desc=f"{name:<17}", unit="tok", leave=True, file=sys.stderr) as bar:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **{cache_argument(model): cache},
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, streamer=token_progress(bar))
        seconds = time.perf_counter() - start
    new = out[0, input_ids.shape[1]:]
    nbytes, bits = kv_bytes_and_bits(cache)
    return {"name": name, "text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
            "bytes": nbytes, "bits": bits, "seconds": seconds}


def print_table(rows: list[dict], cached_tokens: int) -> None:
    baseline = rows[0]
    print(f"\nKV cache after {cached_tokens} tokens (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64):\n")
    print(f"{'cache':<18}{'KV bytes':>12}{'bits/elem':>11}{'vs ' + baseline['name']:>18}"
          f"{'same tokens':>13}{'time':>8}")
    for row in rows:
        agree = int((row["tokens"] == baseline["tokens"]).cumprod(0).sum())  # identical prefix length
        print(f"{row['name']:<18}{row['bytes']:>12,}{row['bits']:>11.2f}{baseline['bytes'] / row['bytes']:>17.1f}x"
              f"{agree:>7}/{len(baseline['tokens']):<5}{row['seconds']:>7.1f}s")
    for row in rows:
        print(f"\n--- {row['name']} ---\n{row['text'].strip()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per cache (default 48)")
    parser.add_argument("--context-tokens", type=int, default=1500,
                        help="prompt length from Emma (default 1500; above the windows, so most of it is 2-bit)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="model and full-precision cache dtype (default: bfloat16 on GPU, float32 on CPU, where "
                             "bfloat16 matmuls are slow without AVX512-BF16)")
    parser.add_argument("--attn-implementation", default=ATTN_IMPLEMENTATION,
                        help=f"'{ATTN_IMPLEMENTATION}' (default: fused INT2 attention; full-precision caches get "
                             "SDPA) or a transformers one such as 'sdpa' (the portable path: dequantize per step)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.context_tokens < 16:
        parser.error("--max-new-tokens must be >= 1 and --context-tokens >= 16")
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
    input_ids = austen_context(tokenizer, args.context_tokens).to(model.device)
    print(f"Prompt: the first {input_ids.shape[1]} tokens of Jane Austen's Emma, ending:\n"
          f"  ...{tokenizer.decode(input_ids[0, -40:]).strip()!r}", file=sys.stderr)

    caches = [("DynamicCache", DynamicCache()), ("OscarScaledCache", OscarScaledCache()),
              ("OscarCache", make_oscar_cache(model))]
    rows = [run(model, tokenizer, input_ids, name, cache, args.max_new_tokens) for name, cache in caches]
    # The last generated token is never fed back, so the cache holds one token fewer than prompt + generated.
    print_table(rows, input_ids.shape[1] + args.max_new_tokens - 1)


if __name__ == "__main__":
    main()
