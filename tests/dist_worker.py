"""Tensor-parallel scenarios for tests/test_distributed.py.

Imported by the test (single-process reference) and launched by it under ``torchrun --nproc_per_node 2`` (gloo,
CPU), where every rank loads the same tiny checkpoints with ``tp_plan="auto"`` and writes what it computed to
``<out>/rank<r>.safetensors`` and ``<out>/rank<r>.json``. Usage: ``torchrun ... tests/dist_worker.py MODELS_DIR OUT``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hf_kvint2 import GroupLayout, OscarCache, OscarScaledCache

PROMPT_TOKENS, STEPS, CHUNK = 600, 16, 150
VOCAB = 256


def tiny_configs() -> dict:
    common = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    return {
        "llama": LlamaConfig(**common, head_dim=32),
        "qwen2": Qwen2Config(**common),  # QKV bias: keys carry per-head offsets (exercises the centering means)
        "llama_kv3": LlamaConfig(**{**common, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
                                 head_dim=16),
    }


def save_tiny_models(root: str) -> dict[str, str]:
    dirs = {}
    for name, config in tiny_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if name == "qwen2":  # random-init biases are zero: give the keys a real per-head offset
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.k_proj.bias.normal_(0, 2.0)
                    layer.self_attn.v_proj.bias.normal_(0, 0.5)
        dirs[name] = os.path.join(root, name)
        model.save_pretrained(dirs[name])
    return dirs


def load(model_dir: str, tensor_parallel: bool, attn: str = "sdpa"):
    kwargs = {"attn_implementation": attn}
    if tensor_parallel:
        try:
            from transformers.distributed import DistributedConfig
            kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
        except ImportError:  # older transformers: the standalone argument
            kwargs["tp_plan"] = "auto"
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def calibration_like(config, seed: int = 1):
    """Fixed random orthogonal rotations and per-head means, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    text = config.get_text_config(decoder=True)
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    h, n = text.num_key_value_heads, text.num_hidden_layers
    rot = [torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float() for _ in range(2 * n)]
    means = [torch.randn(h, d, generator=g) * 2 for _ in range(2 * n)]
    return {"k_rotations": rot[:n], "v_rotations": rot[n:], "key_means": means[:n], "value_means": means[n:]}


def make_cache(kind: str, quantize: bool, config):
    if kind == "scaled":
        window = 32 if quantize else 10_000
        return OscarScaledCache(config, sink_tokens=0, recent_tokens=window)
    if not quantize:
        return OscarCache(config, sink_tokens=16, recent_tokens=10_000)
    per_token = (GroupLayout("token", 128, 0.96), GroupLayout("token", 128, 0.92))
    # last layer: per-channel keys with omni-token scaling (a layout calibration may choose): the norm all-reduce
    scaled = (GroupLayout("channel", 32, None, token_scaling=True), GroupLayout("token", 32, 0.92))
    layouts = [per_token] * (config.num_hidden_layers - 1) + [scaled]
    return OscarCache(config, sink_tokens=16, recent_tokens=64, layer_layouts=layouts, **calibration_like(config))


def token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT_TOKENS + STEPS), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def teacher_forced(model, cache, prompt_tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    """Logits [prompt + steps, vocab]: the prompt in chunks, then one token per step."""
    ids = token_ids()[:, :prompt_tokens + STEPS]
    bounds = list(range(0, prompt_tokens, CHUNK)) + list(range(prompt_tokens, prompt_tokens + STEPS + 1))
    if bounds[-1] != ids.shape[1]:
        bounds.append(ids.shape[1])
    logits = []
    for a, b in itertools.pairwise(bounds):
        out = model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True)
        logits.append(out.logits[0].float())
    return torch.cat(logits)


def run_scenarios(model_dirs: dict[str, str], tensor_parallel: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Everything the test compares, keyed the same way for the single process and each rank."""
    tensors, info = {}, {}
    for model_name in ("llama", "qwen2"):
        model = load(model_dirs[model_name], tensor_parallel)
        for kind in ("oscar", "scaled"):
            for quantize in (False, True):
                tag = f"{model_name}.{kind}.{'quant' if quantize else 'exact'}"
                cache = make_cache(kind, quantize, model.config)
                # without quantization every token is exact: a short prompt shows it as well
                tensors[f"{tag}.logits"] = teacher_forced(model, cache, PROMPT_TOKENS if quantize else CHUNK)
                for idx, layer in enumerate(cache.layers):
                    body_k, body_v = layer.dequantized_body()
                    tensors[f"{tag}.body_k.{idx}"], tensors[f"{tag}.body_v.{idx}"] = body_k.float(), body_v.float()
                info[f"{tag}.report"] = cache.memory_report()
                if tensor_parallel:
                    info[f"{tag}.report_global"] = cache.memory_report(global_view=True)
                    info[f"{tag}.bits_global"] = cache.bits_per_element(global_view=True)
                info[f"{tag}.bits"] = cache.bits_per_element()
                if quantize:
                    prompt = token_ids(seed=1)[:, :160]  # longer than the caches' full-precision windows
                    out = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                         past_key_values=make_cache(kind, quantize, model.config))
                    tensors[f"{tag}.generate"] = out[0]
        del model
    # the fused "oscar" attention reads each rank's INT2 codes directly
    model = load(model_dirs["llama"], tensor_parallel, attn="oscar")
    for kind in ("oscar", "scaled"):
        tensors[f"llama.{kind}.quant_fused.logits"] = teacher_forced(model, make_cache(kind, True, model.config))
    return tensors, info


def calibration_scenario(model_dir: str, tensor_parallel: bool, save_dir: str) -> tuple[dict, dict]:
    """OscarCache.calibrate on the tiny Llama (2 layouts x centering, fixed clips: small but every code path that
    gathers heads); the artifact tensors as this process holds them, and whether save_pretrained wrote."""
    from test_calibration import SETTINGS, TEXT, char_tokenizer

    model = load(model_dir, tensor_parallel)
    cache = OscarCache.calibrate(model, char_tokenizer(), [TEXT], num_tokens=800, fit_clip=False,
                                 layouts=("spectral", "channel"), progress=False, verbose=False, **SETTINGS)
    tensors = {}
    for name in ("k_rotations", "v_rotations", "key_means", "value_means", "k_eigenvalues", "v_eigenvalues"):
        for idx, t in enumerate(getattr(cache.calibration, name)):
            if t is not None:
                tensors[f"calib.{name}.{idx}"] = t.float()
    folder = cache.save_pretrained(save_dir)
    info = {"layout_names": list(cache.calibration.layout_names),
            "clips": [list(cache.settings.k_clip), list(cache.settings.v_clip)],
            "num_key_value_heads": cache.calibration.info["num_key_value_heads"],
            "wrote": (Path(folder) / "config.json").exists()}
    return tensors, info


def error_scenarios(model_dirs: dict[str, str]) -> dict[str, str]:
    """Bad tensor-parallel setups; returns the error message each raised (or 'no error')."""
    import torch.distributed as dist

    def message(fn) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e)
        return "no error"

    errors = {}
    kv3_config = load(model_dirs["kv3"], tensor_parallel=True).config  # transformers loads it; a forward fails
    errors["kv_heads_not_divisible"] = message(lambda: OscarScaledCache(kv3_config))
    model = load(model_dirs["llama"], tensor_parallel=True)
    three_heads = [torch.zeros(3, 32)] * model.config.num_hidden_layers
    errors["calibration_heads_not_divisible"] = message(lambda: OscarCache(model.config, key_means=three_heads))
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    errors["tp_group_size_mismatch"] = message(
        lambda: OscarCache(model.config, tp_group=singles[dist.get_rank()]))
    # a cache told that the model is sharded over 2 ranks, used with a whole (unsharded) model
    whole = load(model_dirs["llama"], tensor_parallel=False)
    cache = OscarScaledCache(model.config, sink_tokens=0, recent_tokens=32)
    errors["sharding_mismatch_at_use"] = message(lambda: whole(input_ids=token_ids()[:, :8], past_key_values=cache))
    return errors


def main() -> None:
    models_root, out = sys.argv[1], sys.argv[2]
    dirs = {name: os.path.join(models_root, name) for name in ("llama", "qwen2")}
    dirs["kv3"] = os.path.join(models_root, "llama_kv3")
    rank = int(os.environ["RANK"])
    try:
        tensors, info = run_scenarios(dirs, tensor_parallel=True)
        calib_tensors, info["calibration"] = calibration_scenario(dirs["llama"], True, os.path.join(out, f"calib{rank}"))
        tensors.update(calib_tensors)
        info["errors"] = error_scenarios(dirs)
    except Exception:
        with open(os.path.join(out, f"rank{rank}.failed"), "w") as f:
            f.write(traceback.format_exc())
        raise
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, f"rank{rank}.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
