"""Export check on SmolLM2-135M: exported program, torch.compile (inductor) and ONNX Runtime vs eager.

Protocol: the shipped calibration (``OscarCache.from_pretrained``, per-token and per-channel layouts mixed across
layers) and ``OscarScaledCache()`` as static caches; a prompt from Emma is stored eagerly, then the same 32 tokens
are fed one step at a time. For each backend: the largest logit difference from eager when every step starts from
the eager cache state ("synced", the check that matters), and when the backend runs freely from the prefilled cache
("free"). Then a greedy loop through the exported program from position 0 (prompt fed token by token).

    python benchmarks/export_smollm2.py [--prompt-tokens 400] [--steps 32] [--threads 1] [--skip compile,onnx]
    python benchmarks/export_smollm2.py --model tiny --prompt-tokens 20 --attention-block 16 --threads 1

Writes ``benchmarks/results/export_<model>.json``. Time: on SmolLM2 with the defaults, 15-20 minutes per cache on
one idle CPU thread (torch.export ~1 min, first torch.compile call ~10 min, ONNX export ~3 min); the tiny model
takes a few minutes. Export cost grows with max_cache_len (= prompt + steps + margin).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from importlib.resources import files
from pathlib import Path

# torch and hf_kvint2's modules are imported where used, so that --help prints at once.

ARTIFACT = "hf-kvint2/SmolLM2-135M-Instruct-oscar"


def _states(module):
    return [t.clone() for t in module.static_cache.state_tensors()]


def _set_states(module, states):
    for dst, src in zip(module.static_cache.state_tensors(), states):
        dst.copy_(src)


def _compare(step_fn, module, ids, start, states, eager):
    """(synced, free) max |logits - eager| over the steps."""
    import torch

    synced = free = 0.0
    with torch.no_grad():
        for i, t in enumerate(range(start, start + len(eager))):
            _set_states(module, states[i])
            got = step_fn(ids[:, t:t + 1], torch.tensor([t]))
            synced = max(synced, (got - eager[i]).abs().max().item())
        _set_states(module, states[0])
        for i, t in enumerate(range(start, start + len(eager))):
            got = step_fn(ids[:, t:t + 1], torch.tensor([t]))
            free = max(free, (got - eager[i]).abs().max().item())
    return synced, free


def run_cache(name, model, make_cache, ids, args, save=lambda row: None):
    import torch

    from hf_kvint2.export import OscarExportableModule, export_decoder, export_onnx, generate, onnx_step

    n_prompt, steps = args.prompt_tokens, args.steps
    max_len = n_prompt + steps + args.margin
    row = {"cache": name, "max_cache_len": max_len, "attention_block": args.attention_block}
    module = OscarExportableModule(model, make_cache(), max_cache_len=max_len, attention_block=args.attention_block)
    layer0 = module.static_cache.layers[0]
    row["body_capacity"] = layer0.body_capacity
    row["memory_bytes"] = module.static_cache.memory_report()["total"]
    states, eager = [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        module.prefill(ids[:, :n_prompt])
        row["prefill_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        for t in range(n_prompt, n_prompt + steps):
            states.append(_states(module))
            eager.append(module(ids[:, t:t + 1], torch.tensor([t])))
    row["eager_step_ms"] = round(1000 * (time.perf_counter() - t0) / steps, 1)
    row["body_tokens_after"] = [layer0._body_tokens_now()]  # layer 0, after the eager steps

    t0 = time.perf_counter()
    program = export_decoder(model, module=module, max_cache_len=max_len)
    row["export_s"] = round(time.perf_counter() - t0, 1)
    step = program.module()
    synced, free = _compare(lambda i, p: step(input_ids=i, cache_position=p), module, ids, n_prompt, states, eager)
    row["exported"] = {"max_abs_diff_synced": synced, "max_abs_diff_free": free}
    print(name, "exported", row["exported"], flush=True)
    save(row)

    if "generate" not in args.skip:
        prompt = ids[:, : args.generate_prompt]
        t0 = time.perf_counter()
        tokens = generate(program, prompt, max_new_tokens=args.generate_tokens)
        row["greedy_loop"] = {"prompt_tokens": prompt.shape[1], "new_tokens": tokens.shape[1] - prompt.shape[1],
                              "seconds": round(time.perf_counter() - t0, 1)}
        print(name, "greedy loop", row["greedy_loop"], flush=True)
        save(row)

    if "compile" not in args.skip:
        module.bind()
        compiled = torch.compile(module, fullgraph=True)
        _set_states(module, states[0])
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(ids[:, n_prompt:n_prompt + 1], torch.tensor([n_prompt]))
        row["compile_first_call_s"] = round(time.perf_counter() - t0, 1)
        synced, free = _compare(compiled, module, ids, n_prompt, states, eager)
        row["compiled"] = {"max_abs_diff_synced": synced, "max_abs_diff_free": free}
        print(name, "compiled", row["compiled"], row["compile_first_call_s"], flush=True)
        save(row)
    module.unbind()

    if "onnx" not in args.skip:
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            spec = export_onnx(model, Path(tmp) / "decoder.onnx", make_cache(), max_cache_len=max_len,
                               attention_block=args.attention_block, optimize=args.onnx_optimize)
            row["onnx_export_s"] = round(time.perf_counter() - t0, 1)
            row["onnx_file_mb"] = round(Path(spec.path).stat().st_size / 2**20, 1)
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            session = ort.InferenceSession(spec.path, options, providers=["CPUExecutionProvider"])
            synced, t0 = 0.0, time.perf_counter()
            for i, t in enumerate(range(n_prompt, n_prompt + steps)):
                feeds = {n: s.numpy() for n, s in zip(spec.state_names, states[i])}
                logits, _ = onnx_step(session, spec, feeds, ids[:, t:t + 1].numpy(), t)
                synced = max(synced, float(abs(logits - eager[i].numpy()).max()))
            row["onnx_step_ms"] = round(1000 * (time.perf_counter() - t0) / steps, 1)
            free, state = 0.0, {n: s.numpy() for n, s in zip(spec.state_names, states[0])}
            for i, t in enumerate(range(n_prompt, n_prompt + steps)):
                logits, state = onnx_step(session, spec, state, ids[:, t:t + 1].numpy(), t)
                free = max(free, float(abs(logits - eager[i].numpy()).max()))
        row["onnx_runtime"] = {"max_abs_diff_synced": synced, "max_abs_diff_free": free}
        print(name, "onnx", row["onnx_runtime"], flush=True)
    return row


def tiny_llama():
    """The tests' tiny random Llama (2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_kvint2  # noqa: F401  (registers "oscar")

    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="oscar").eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=400,
                        help="prompt tokens stored eagerly before the compared steps (default 400)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps compared with eager (default 32)")
    parser.add_argument("--margin", type=int, default=16,
                        help="max_cache_len = prompt tokens + steps + margin (default 16)")
    parser.add_argument("--attention-block", type=int, default=128,
                        help="body tokens the static attention reads per block (default 128)")
    parser.add_argument("--generate-prompt", type=int, default=16,
                        help="prompt tokens of the greedy loop through the exported program (default 16)")
    parser.add_argument("--generate-tokens", type=int, default=16,
                        help="tokens that greedy loop generates (default 16)")
    # 2-thread OpenMP was ~8x slower on the shared 2-core machine
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                        help="the bundled SmolLM2-135M or the tests' tiny random Llama (default smollm2)")
    parser.add_argument("--caches", default=None,
                        help="comma-separated: oscar_calibrated, oscar_scaled for smollm2; oscar, oscar_scaled for "
                             "tiny (default: all for the model)")
    parser.add_argument("--skip", default="", help="comma-separated: compile, onnx, generate")
    parser.add_argument("--onnx-optimize", action="store_true", help="run onnxscript's optimizer (slow on SmolLM2)")
    parser.add_argument("--output", default=None, help="default benchmarks/results/export_<model>.json")
    args = parser.parse_args()
    args.skip = {s for s in args.skip.split(",") if s}
    unknown = args.skip - {"compile", "onnx", "generate"}
    if unknown:
        parser.error(f"--skip: unknown stage(s) {sorted(unknown)}; use compile, onnx, generate")
    args.output = args.output or str(Path(__file__).parent / "results" / f"export_{args.model}.json")
    import torch

    from hf_kvint2 import OscarCache, OscarScaledCache
    from hf_kvint2.models import load_smollm2

    torch.set_num_threads(args.threads)
    if args.model == "tiny":  # small windows so that 20 prompt tokens already reach the INT2 body
        model = tiny_llama()
        ids = torch.randint(3, 128, (1, args.prompt_tokens + args.steps), generator=torch.Generator().manual_seed(0))
        makers = {"oscar": lambda: OscarCache(sink_tokens=4, recent_tokens=8, group_size=16),
                  "oscar_scaled": lambda: OscarScaledCache(recent_tokens=8, group_size=8)}
        name = "tiny random Llama (2 layers, head_dim 16)"
    else:
        model, tokenizer = load_smollm2(torch.float32, attn_implementation="oscar")
        text = files("hf_kvint2.data").joinpath("emma.txt").read_text()[400:20000]
        ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt_tokens + args.steps]
        makers = {"oscar_calibrated": lambda: OscarCache.from_pretrained(ARTIFACT, config=model.config),
                  "oscar_scaled": lambda: OscarScaledCache()}
        name = "SmolLM2-135M-Instruct"
    caches = args.caches or ",".join(makers)
    rows = []
    result = {"model": name, "dtype": "float32", "prompt_tokens": args.prompt_tokens,
              "steps": args.steps, "threads": args.threads, "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "machine": platform.machine(),
              "tolerance": 1e-4, "results": rows}

    def save(row=None):  # after every stage: a long run that is stopped keeps what it measured
        Path(args.output).write_text(json.dumps(dict(result, results=rows + ([row] if row else [])), indent=2) + "\n")

    for c in caches.split(","):
        rows.append(run_cache(c, model, makers[c], ids, args, save))
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
