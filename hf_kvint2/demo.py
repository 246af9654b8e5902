"""Side-by-side demo: greedy continuation of an Austen passage with a full-precision and two 2-bit KV caches.

Run ``python -m hf_kvint2.demo`` (or ``make demo``). Loads the bundled SmolLM2-135M-Instruct offline, feeds it
the opening of *Emma* (the evaluation text; the calibration text is *Pride and Prejudice*), and prints each
cache's continuation, KV bytes and bits per element.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from importlib.resources import files

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from .attention import ATTN_IMPLEMENTATION
from .cache import OscarCache, OscarCacheBase, OscarScaledCache
from .hub import SMOLLM2_ARTIFACT_ID
from .models import load_smollm2

# Newer transformers 5.x rename generate's `past_key_values` to `cache` and warn; 5.17 knows only the old name.
warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_oscar_cache(model) -> OscarCache:
    """The OscarCache the demo runs: the calibration for SmolLM2 shipped inside the package (fitted on Pride and
    Prejudice; loads offline), validated against the model's config."""
    return OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=model.config)


def austen_context(tokenizer, context_tokens: int) -> torch.Tensor:
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
    if isinstance(cache, OscarCacheBase):
        total = cache.memory_report()["total"]
        return total["total_bytes"], total["bits_per_element"]
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, 8 * nbytes / sum(t.numel() for t in tensors)


class TokenProgress(BaseStreamer):
    """Advances a tqdm bar by one per generated token (``generate`` first puts the prompt, which is skipped)."""

    def __init__(self, bar: tqdm):
        self.bar, self.seen_prompt = bar, False

    def put(self, value):
        if self.seen_prompt:
            self.bar.update(1)
        self.seen_prompt = True

    def end(self):
        pass


def run(model, tokenizer, input_ids: torch.Tensor, name: str, cache, max_new_tokens: int) -> dict:
    with tqdm(total=max_new_tokens, desc=f"{name:<17}", unit="tok", leave=True, file=sys.stderr) as bar:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, streamer=TokenProgress(bar))
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per cache (default 48)")
    parser.add_argument("--context-tokens", type=int, default=1500,
                        help="prompt length from Emma (default 1500; above the windows, so most of it is 2-bit)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="model and full-precision cache dtype (default: bfloat16 on GPU, float32 on CPU, where "
                             "bfloat16 matmuls are slow without AVX512-BF16)")
    parser.add_argument("--attn-implementation", default=ATTN_IMPLEMENTATION,
                        help=f"'{ATTN_IMPLEMENTATION}' (default: fused INT2 attention; full-precision caches get "
                             "SDPA) or a transformers one such as 'sdpa' (the portable path: dequantize per step)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.context_tokens < 16:
        parser.error("--max-new-tokens must be >= 1 and --context-tokens >= 16")

    print("Loading SmolLM2-135M-Instruct (the first run converts the bundled GGUF to safetensors, ~40 s) ...",
          file=sys.stderr)
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if torch.cuda.is_available() else torch.float32
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
