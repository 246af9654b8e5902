"""ExecuTorch programs of the static INT2 decode step (hf_kvint2.export_executorch) on tiny models built from configs.

A tiny hybrid Gemma 3 (a sliding-window layer kept as a full-precision ring, a full-attention layer in INT2 with
per-channel, token-scaled keys and two per-token value groups) is lowered once (portable kernels) and run with the
ExecuTorch runtime: greedy tokens, logits and the cache buffers against the program's eager twin fed the same
tokens; the runner's refusals; the float StaticCache baseline on a tiny Llama, its linear layers on XNNPACK. The
real models (INT2 with XNNPACK) are in benchmarks/executorch_decode.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("executorch.runtime", reason="the [executorch] extra (make setup installs it)")

import hf_kvint2  # noqa: F401  (registers "oscar")
from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.export import main as export_main
from hf_kvint2.export_executorch import (
    ExecutorchRunner,
    executorch_module,
    export_executorch,
    export_executorch_baseline,
)

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_LEN, BLOCK, PROMPT, NEW = 40, 16, 12, 24
TOL = 1e-4  # fp32 logits: XNNPACK's and the portable kernels' sums against PyTorch's


def tiny_hybrid():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                              query_pre_attn_scalar=16, attn_implementation="oscar")
    return Gemma3ForCausalLM(config).eval()


def hybrid_cache(config):
    return OscarScaledCache(config=config, sink_tokens=2, recent_tokens=4, group_size=8)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """(model, path, info) of the tiny hybrid's INT2 program."""
    model = tiny_hybrid()
    path = tmp_path_factory.mktemp("pte") / "tiny_int2.pte"
    info = export_executorch(model, path, hybrid_cache(model.config), max_cache_len=MAX_LEN, attention_block=BLOCK,
                             xnnpack=False)  # XNNPACK's linear layers: tested with the baseline (lowering time)
    return model, path, info


def _prompt(n=PROMPT, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _state(runner, module):
    """The program's cache buffers, read from the runtime, by the eager module's buffer names."""
    names = [name for name, _ in module.named_buffers() if name.startswith("cache_")]
    return {name: runner.method._method.get_attribute(name).clone() for name in names}


# ------------------------------------------------------------------------------------------------ building blocks
def test_integer_remainder_follows_pytorch_in_the_program():
    """The runtime's portable remainder rounds toward zero on integers; the lowering rewrites it (ring slots of
    positions before the window fills are negative numbers modulo the ring)."""
    from hf_kvint2.export_executorch import _lower

    class Slots(torch.nn.Module):
        def forward(self, x):
            return x % 9, torch.remainder(x, torch.tensor([4]))

    x = torch.tensor([-12, -3, -1, 0, 5, 20])
    manager = _lower(torch.export.export(Slots(), (x,)), {}, xnnpack=False)
    from executorch.runtime import Runtime

    got = Runtime.get().load_program(manager.buffer).load_method("forward").execute((x,))
    for a, b in zip(got, Slots()(x)):
        assert torch.equal(a, b)


def test_operators_are_scheduled_next_to_their_use():
    """A chain that reads only an input (as each layer's buffer reads once XNNPACK's partitioner has re-sorted the
    graph) runs just before the operator that uses it, after the long chain; the graph computes the same."""
    from hf_kvint2.export_executorch import _schedule_near_use

    class Chains(torch.nn.Module):
        def forward(self, x, b):
            side = torch.exp(b * 2)  # needs only b: written first, used last
            h = x
            for _ in range(3):
                h = torch.tanh(h + 1)
            return h * side

    gm = torch.fx.symbolic_trace(Chains())
    x, b = torch.randn(4), torch.randn(4)
    want = gm(x, b)
    assert _schedule_near_use(gm).modified
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert names[-3:] == ["mul", "exp", "mul_1"] and names[0] == "add"
    assert torch.equal(gm(x, b), want)
    assert not _schedule_near_use(gm).modified  # already in that order


# ------------------------------------------------------------------------------------------------ the program
def test_program_generates_as_its_eager_twin(program):
    """Prompt token by token, then greedy: the same tokens as the eager module fed the same way, logits within TOL
    at every step, and afterwards the same INT2 codes and scales in the program's buffers (read from the runtime)."""
    model, path, info = program
    assert info.kind == "int2" and info.pte_bytes == path.stat().st_size
    assert info.kv_buffer_bytes == sum(info.buffers.values()) > 0
    runner = ExecutorchRunner(path, config=model.config, cache=hybrid_cache(model.config), threads=1)
    assert runner.kind == "int2" and runner.max_cache_len == MAX_LEN and runner.metadata["get_vocab_size"] == 128
    assert sorted(runner.buffer_bytes()) == sorted(info.buffers.values())
    assert runner.memory() == {"cache_bytes": info.kv_buffer_bytes, "planned_bytes": info.planned_bytes}
    prompt = _prompt()
    tokens, logits = runner.generate(prompt, NEW, return_logits=True)

    module = executorch_module(model, hybrid_cache(model.config), max_cache_len=MAX_LEN, attention_block=BLOCK)
    try:
        want, want_logits = [], []
        with torch.no_grad():
            for pos in range(PROMPT + NEW - 1):
                tok = prompt[0, pos] if pos < PROMPT else want[-1]
                row = module(torch.tensor([[int(tok)]]), torch.tensor([pos]))[0, -1]
                if pos >= PROMPT - 1:
                    want.append(int(row.argmax()))
                    want_logits.append(row)
        state = _state(runner, module)
        for name, buf in module.named_buffers():
            if not name.startswith("cache_"):
                continue
            if buf.dtype == torch.uint8 or name.endswith(("_scale", "_lo", "cumulative_length")):
                assert torch.equal(state[name], buf), name  # the same codes, scales and position
            else:
                torch.testing.assert_close(state[name], buf, atol=TOL, rtol=0)
    finally:
        module.unbind()
    layer_kinds = {type(layer).__name__ for layer in module.static_cache.layers}
    assert layer_kinds == {"StaticWindowLayer", "StaticOscarLayer"}  # a ring and an INT2 layer
    assert tokens == want and len(tokens) == NEW
    assert (logits - torch.stack(want_logits)).abs().max().item() < TOL


def test_runner_refuses_bad_input(program):
    """A position past max_cache_len, a skipped position, a prompt longer than the cache, an unknown token id, a
    program built for another model or another calibration: clear errors, and the refused calls write nothing."""
    from transformers import LlamaConfig

    model, path, _ = program
    runner = ExecutorchRunner(path, threads=1)
    module = executorch_module(model, hybrid_cache(model.config), max_cache_len=MAX_LEN, attention_block=BLOCK)
    module.unbind()
    runner.generate(_prompt(6), 2)
    before = _state(runner, module)
    with pytest.raises(ValueError, match=f"cache position {MAX_LEN} is outside.*max_cache_len={MAX_LEN}"):
        runner.step(5, MAX_LEN)
    with pytest.raises(ValueError, match="cache position 12 skips or repeats positions \\(next is 7\\)"):
        runner.step(5, 12)
    with pytest.raises(ValueError, match="token id 128 is outside the program's vocabulary \\(vocab_size=128\\)"):
        runner.step(128, 7)
    with pytest.raises(ValueError, match=f"The prompt has {MAX_LEN + 1} tokens.*max_cache_len={MAX_LEN}"):
        runner.generate(_prompt(MAX_LEN + 1), 1)
    after = _state(runner, module)
    assert all(torch.equal(before[k], after[k]) for k in before)
    other = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="was built for gemma3_text.*num_key_value_heads=1.*the model config has "
                                         "n_kv_heads=2: export the program for this model"):
        ExecutorchRunner(path, config=other)
    with pytest.raises(ValueError, match="exported with another cache recipe"):
        ExecutorchRunner(path, config=model.config, cache=OscarCache(config=model.config))
    assert runner.generate(_prompt(6), 2) == runner.generate(_prompt(6), 2)  # a new sequence restarts at 0


def test_float_static_cache_baseline_from_the_command_line(tmp_path, tiny_model, capsys):
    """transformers' StaticCache program written by ``python -m hf_kvint2.export --to executorch`` from a local
    model folder, its linear layers on XNNPACK where that backend's dependency torchao is installed (make setup
    leaves it out: transformers imports torchao whenever it is installed): the tokens of the eager model (SDPA,
    DynamicCache), greedy."""
    xnnpack = importlib.util.find_spec("torchao") is not None
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    assert export_main(["--to", "executorch", str(tmp_path / "base.pte"), "--model", str(tmp_path / "model"),
                        "--cache", "static", "--max-cache-len", "24", *([] if xnnpack else ["--no-xnnpack"])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "static_fp"
    # every linear layer on XNNPACK, or none
    assert info["delegated_ops"] >= 7 * 2 + 1 if xnnpack else info["delegated_ops"] == 0
    assert info["kv_buffer_bytes"] >= 2 * 2 * 2 * 24 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    assert info["pte_bytes"] == (tmp_path / "base.pte").stat().st_size
    prompt = _prompt(8)
    got = ExecutorchRunner(info["path"], config=model.config).generate(prompt, 8)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, 8:].tolist()
    assert got == want
    with pytest.raises(ValueError, match="pass cache= only with a program of export_executorch"):
        ExecutorchRunner(info["path"], config=model.config, cache=OscarCache())
    with pytest.raises(ValueError, match="sliding-window layers"):
        export_executorch_baseline(tiny_hybrid(), tmp_path / "hybrid.pte", max_cache_len=24)


def test_command_line_names_its_targets(capsys):
    """``python -m hf_kvint2.export`` without ``--to`` names the targets; ``--to executorch --help`` is the
    ExecuTorch exporter's help."""
    with pytest.raises(SystemExit):
        export_main(["out.pte", "--max-cache-len", "8"])
    assert "--to is required: one of executorch" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        export_main(["--to", "executorch", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hf_kvint2.export --to executorch") and "--max-cache-len" in out
