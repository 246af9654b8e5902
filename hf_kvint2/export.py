"""Export a decoder LM with a static INT2 Oscar cache: ``torch.export``, ``torch.compile``, ONNX Runtime.

Shaped like transformers' ``TorchExportableModuleWithStaticCache`` (``transformers.integrations.executorch``), so
pipelines built on it (optimum-executorch, optimum-onnx) can adopt it:

* :class:`OscarExportableModule` holds a :class:`~hf_kvint2.static_cache.StaticOscarCache` as non-persistent buffers
  and runs one step ``forward(input_ids, cache_position) -> logits``; :func:`export_decoder` returns its
  ``torch.export.ExportedProgram`` (the 1-token decode step) and :func:`generate` runs a greedy loop through it.
* The same module works with ``torch.compile(module, fullgraph=True)``.
* :class:`OscarOnnxDecoder` is the functional form, ``forward(input_ids, cache_position, *state) -> (logits,
  *new_state)``, with the packed cache (uint8 codes, scales, full-precision windows) as explicit graph inputs and
  outputs; :func:`export_onnx` writes it with ``torch.onnx.export(..., dynamo=True)`` and :func:`onnx_generate`
  runs it with ONNX Runtime.

How the attention finds the codes: the module binds each static layer to its attention module
(``module.oscar_static_layer``); the ``"oscar"`` attention then reads the layer's buffers (the fused, blocked path:
no full-precision copy of the body exists in the graph) and ``update`` returns only the step's own K/V. Binding
is a plain module attribute, which tracing handles; :meth:`OscarExportableModule.unbind` removes it, and
:func:`export_decoder` / :func:`export_onnx` unbind once the graph is captured.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .attention import ATTN_IMPLEMENTATION
from .cache import OscarCache
from .model_config import model_shape
from .read_path import BODY_BLOCK_TOKENS
from .static_cache import StaticOscarCache, static_cache_like
from .static_layer import StaticOscarLayer


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    """Attention modules by ``layer_idx`` (those transformers calls ``cache.update(..., layer_idx)`` from)."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and any(hasattr(module, p) for p in ("k_proj", "qkv_proj", "kv_proj")):
            found[idx] = module
    return found


def bind_static_cache(model, cache: StaticOscarCache) -> None:
    """Let the ``"oscar"`` attention of ``model`` read ``cache``'s static layers directly (the traceable route).

    Needs ``attn_implementation="oscar"``. While bound, the layers' ``update`` returns the step's K/V only, so the
    model must run with this cache: :func:`unbind_static_cache` before using another one.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"The model uses attn_implementation={model.config._attn_implementation!r}; binding a static "
                         "Oscar cache needs \"oscar\" (model.set_attn_implementation(\"oscar\") after import hf_kvint2).")
    modules = _attention_modules(model)
    missing = [i for i in range(len(cache.layers)) if i not in modules]
    if missing:
        raise ValueError(f"Could not find the attention modules of layers {missing} (modules with a layer_idx and "
                         "k_proj); this architecture is not supported by hf_kvint2.export.")
    for idx, layer in enumerate(cache.layers):
        modules[idx].oscar_static_layer = layer
        layer.bound = True


def unbind_static_cache(model, cache: StaticOscarCache | None = None) -> None:
    for module in _attention_modules(model).values():
        layer = module.__dict__.pop("oscar_static_layer", None)
        if layer is not None:
            layer.bound = False
    for layer in getattr(cache, "layers", ()):
        layer.bound = False


def _model_call_kwargs(model) -> tuple[str, bool]:
    """(name of the cache argument, whether ``cache_position`` is an argument): transformers >= 5.24 takes
    ``cache=`` and derives positions from the cache; earlier 5.x take ``past_key_values=`` and ``cache_position=``."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "cache_position" in params


class OscarExportableModule(torch.nn.Module):
    """A decoder LM with a static INT2 Oscar cache, one decode step per ``forward`` (``torch.export``-able).

    Args:
        model: a transformers causal LM; its attention implementation is set to ``"oscar"``.
        cache: an ``OscarCache`` / ``OscarScaledCache`` whose recipes (calibration, windows, layouts) to use, or a
            :class:`StaticOscarCache`; None: ``OscarCache()`` defaults.
        max_cache_len: positions the static cache holds (prompt + generated tokens).
        batch_size: rows per step (fixed).
        attention_block: body tokens dequantized at a time by the attention.

    ``forward(input_ids [B, 1] int64, cache_position [1] int64) -> logits [B, 1, vocab]``. Positions are
    absolute; a sequence starts at 0 and is fed in order (the cache needs no reset between sequences: everything
    a step reads was written by the same sequence). Prompts go token by token (as in transformers' recipe) or
    through :meth:`prefill` (eager, several tokens per forward) before the exported/compiled steps.
    """

    _state_as_buffers = True  # the functional ONNX form takes the state as inputs instead

    def __init__(self, model, cache=None, *, max_cache_len: int, batch_size: int = 1, device=None,
                 attention_block: int = BODY_BLOCK_TOKENS):
        super().__init__()
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.train(model.training)  # the wrapper is in the model's mode (exporters check the root module's)
        cache = OscarCache(config=model.config) if cache is None else cache
        self.static_cache = static_cache_like(cache, model.config, max_cache_len, attention_block)
        self.max_cache_len, self.batch_size = max_cache_len, batch_size
        shape = model_shape(model.config)
        device = device if device is not None else model.device
        for layer in self.static_cache.layers:
            if layer.is_initialized and (layer.batch_size != batch_size or layer.device != torch.device(device)):
                raise ValueError(f"The static cache was allocated for batch {layer.batch_size} on {layer.device}; "
                                 f"this module runs batch {batch_size} on {device}.")
        self.static_cache.early_initialization(batch_size, shape.num_key_value_heads, shape.head_dim, model.dtype,
                                              device)
        for i, layer in enumerate(self.static_cache.layers if self._state_as_buffers else ()):
            for name in layer.state_names():
                self.register_buffer(f"cache_{i}_{name}", getattr(layer, name), persistent=False)
            self.register_buffer(f"cache_{i}_cumulative_length", layer.cumulative_length, persistent=False)
        self._cache_kw, self._takes_cache_position = _model_call_kwargs(model)
        bind_static_cache(model, self.static_cache)

    def unbind(self) -> None:
        """Detach the cache from the model's attention modules (the model then works with other caches again)."""
        unbind_static_cache(self.model, self.static_cache)

    def bind(self) -> None:
        bind_static_cache(self.model, self.static_cache)

    @contextmanager
    def _layers_on_buffers(self):
        """Point every layer's state at this module's buffers while a step runs. Eagerly they are the same tensors;
        ``torch.export`` swaps the module's buffers for its own traced values, and the layers must read and write
        those (tensors reached only through the layers would be captured as constants: copied into the program,
        their writes lost)."""
        if not self._state_as_buffers:
            yield
            return
        saved = []
        for i, layer in enumerate(self.static_cache.layers):
            names = [*layer.state_names(), "cumulative_length"]
            saved.append((layer, [(name, getattr(layer, name)) for name in names]))
            for name in names:
                setattr(layer, name, getattr(self, f"cache_{i}_{name}"))
        try:
            yield
        finally:
            for layer, pairs in saved:
                for name, t in pairs:
                    setattr(layer, name, t)

    def _run_model(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        with self._layers_on_buffers():
            return self._run_model_on_layers(input_ids, cache_position)

    def _run_model_on_layers(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        b, n = input_ids.shape
        if b != self.batch_size:
            raise ValueError(f"input_ids has batch {b} but this module was built for batch_size={self.batch_size}.")
        if cache_position.dim() != 1 or cache_position.shape[0] != n:
            raise ValueError(f"cache_position must be 1-D with one position per input token ({n}), got shape "
                             f"{tuple(cache_position.shape)}.")
        for layer in self.static_cache.layers:
            layer._set_length(cache_position[0])
        kwargs = {self._cache_kw: self.static_cache, "use_cache": True, "attention_mask": None,
                  "position_ids": cache_position.unsqueeze(0).expand(b, -1)}
        if self._takes_cache_position:
            kwargs["cache_position"] = cache_position
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self._run_model(input_ids, cache_position)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Eager: store a whole prompt (positions ``0..n-1``) in one forward; returns its logits. The exported or
        compiled step then continues at position ``n`` (it shares this module's buffers)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self._run_model(input_ids, positions)


class OscarOnnxDecoder(OscarExportableModule):
    """Functional decode step for ONNX: ``forward(input_ids, cache_position, *state) -> (logits, *new_state)``.

    The state is every static layer's tensors in :attr:`state_names` order (writes are out of place in this
    mode), so the ONNX graph has the packed cache as explicit inputs and outputs and no hidden buffers.
    """

    _state_as_buffers = False

    @property
    def state_names(self) -> list[str]:
        return [f"layers.{i}.{name}" for i, layer in enumerate(self.static_cache.layers) for name in layer.state_names()]

    def initial_state(self) -> list[torch.Tensor]:
        """Zero state of the right shapes and dtypes (what a fresh sequence starts from)."""
        return [torch.zeros_like(t) for t in self.static_cache.state_tensors()]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, *state: torch.Tensor):
        layers: list[StaticOscarLayer] = self.static_cache.layers
        names = [layer.state_names() for layer in layers]
        expected = sum(len(n) for n in names)
        if len(state) != expected:
            raise ValueError(f"Expected {expected} state tensors ({', '.join(self.state_names[:4])}, ...), got "
                             f"{len(state)}.")
        saved = [(layer.state_tensors(), layer.cumulative_length) for layer in layers]
        it = iter(state)
        try:
            for layer, layer_names in zip(layers, names):
                layer.functional = True
                for name in layer_names:
                    setattr(layer, name, next(it))
            logits = self._run_model(input_ids, cache_position)
            new_state = [getattr(layer, name) for layer, layer_names in zip(layers, names) for name in layer_names]
        finally:
            for layer, layer_names, (tensors, length) in zip(layers, names, saved):
                layer.functional = False
                for name, t in zip(layer_names, tensors):
                    setattr(layer, name, t)
                layer.cumulative_length = length
        return (logits, *new_state)


def _example_inputs(module: OscarExportableModule):
    device = module.static_cache.layers[0].device
    ids = torch.zeros(module.batch_size, 1, dtype=torch.long, device=device)
    return ids, torch.zeros(1, dtype=torch.long, device=device)


def export_decoder(model, cache=None, *, max_cache_len: int, batch_size: int = 1, device=None,
                   attention_block: int = BODY_BLOCK_TOKENS, strict: bool = False,
                   module: OscarExportableModule | None = None) -> torch.export.ExportedProgram:
    """``torch.export`` the 1-token decode step of ``model`` with a static Oscar cache (see
    :class:`OscarExportableModule` for the arguments; ``module``: export an existing one instead). The program
    takes ``input_ids [B, 1]`` and ``cache_position [1]`` and mutates its cache buffers in place.

    Takes minutes on a real model, and longer with a larger ``max_cache_len`` (every buffer and the attention over
    the body are sized by it): SmolLM2-135M with ``max_cache_len=448`` took 43-56 s on one idle CPU thread, with
    1024 on a loaded 2-core machine about an hour. Start small; on a shared machine use one thread."""
    module = module or OscarExportableModule(model, cache, max_cache_len=max_cache_len, batch_size=batch_size,
                                             device=device, attention_block=attention_block)
    ids, pos = _example_inputs(module)
    module.bind()
    try:
        with torch.no_grad():
            program = torch.export.export(module, args=(), kwargs={"input_ids": ids, "cache_position": pos},
                                          strict=strict)
    finally:
        module.unbind()
    program.max_cache_len = module.max_cache_len  # read by generate()
    return program


def _step_fn(program):
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    return program


@torch.no_grad()
def generate(program, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
             max_cache_len: int | None = None) -> torch.Tensor:
    """Greedy decoding through an exported program (or an :class:`OscarExportableModule`, compiled or not).

    The prompt ``[B, n]`` is fed one token per step from position 0 (no parallel prefill), then the argmax token
    of each row, until ``max_new_tokens`` (or the cache's ``max_cache_len``, or ``eos_token_id`` in every row).
    Returns ``[B, n + generated]``."""
    step = _step_fn(program)
    if max_cache_len is None:
        max_cache_len = getattr(program, "max_cache_len", None)
    if max_cache_len is None:
        raise ValueError("Pass max_cache_len= to generate: this program does not record it (export_decoder's do).")
    b, n = prompt_ids.shape
    if n == 0:
        raise ValueError("generate needs at least one prompt token.")
    if n > max_cache_len:
        raise ValueError(f"The prompt has {n} tokens but the cache holds max_cache_len={max_cache_len}.")
    device = prompt_ids.device
    tokens = prompt_ids
    logits = None
    for pos in range(n):
        logits = step(input_ids=prompt_ids[:, pos:pos + 1], cache_position=torch.tensor([pos], device=device))
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(dim=-1)
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
            finished |= nxt == eos_token_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        pos = tokens.shape[1] - 1
        if bool(finished.all()) or pos >= max_cache_len:
            break
        logits = step(input_ids=nxt[:, None], cache_position=torch.tensor([pos], device=device))
    return tokens


# ---------------------------------------------------------------------------------------------------- ONNX
@dataclass
class OnnxDecoderSpec:
    """Names, shapes and dtypes of an exported ONNX decode step (see the README's export section)."""

    path: str
    input_names: list[str]
    output_names: list[str]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    max_cache_len: int = 0
    batch_size: int = 1

    @property
    def state_names(self) -> list[str]:
        return self.input_names[2:]


def export_onnx(model, path, cache=None, *, max_cache_len: int, batch_size: int = 1,
                attention_block: int = BODY_BLOCK_TOKENS, opset_version: int | None = None,
                optimize: bool = False) -> OnnxDecoderSpec:
    """Write the decode step as an ONNX graph (``torch.onnx.export(..., dynamo=True)``, pip install
    ``.[export]`` in a clone). Inputs: ``input_ids [B, 1]`` int64, ``cache_position [1]`` int64, then the state
    ``layers.<i>.<name>``; outputs: ``logits [B, 1, vocab]`` and ``present.layers.<i>.<name>`` (the new state,
    same shapes). A sequence starts from zero state at position 0. ``optimize=True`` runs onnxscript's graph
    optimizer: off by default, as it spent over 50 minutes on 30-layer SmolLM2 on a 2-core CPU, and ONNX Runtime
    applies its own graph optimizations when it loads the unoptimized graph. Takes minutes: 150-181 s for
    SmolLM2-135M with ``max_cache_len=448`` on one idle CPU thread, more with a larger ``max_cache_len``."""
    module = OscarOnnxDecoder(model, cache, max_cache_len=max_cache_len, batch_size=batch_size, device="cpu",
                              attention_block=attention_block)
    ids, pos = _example_inputs(module)
    state = module.initial_state()
    state_names = module.state_names
    input_names = ["input_ids", "cache_position", *state_names]
    output_names = ["logits", *[f"present.{n}" for n in state_names]]
    kwargs = {} if opset_version is None else {"opset_version": opset_version}
    module.bind()
    try:
        with torch.no_grad():
            program = torch.onnx.export(module, (ids, pos, *state), dynamo=True, input_names=input_names,
                                        output_names=output_names, optimize=optimize, verbose=False, **kwargs)
            logits = module(ids, pos, *state)[0]
    finally:
        module.unbind()
    program.save(str(path))
    shapes = {"input_ids": tuple(ids.shape), "cache_position": (1,), "logits": tuple(logits.shape)}
    dtypes = {"input_ids": "int64", "cache_position": "int64", "logits": str(logits.dtype).replace("torch.", "")}
    for name, t in zip(state_names, state):
        for key in (name, f"present.{name}"):
            shapes[key] = tuple(t.shape)
            dtypes[key] = str(t.dtype).replace("torch.", "")
    return OnnxDecoderSpec(str(path), input_names, output_names, shapes, dtypes, max_cache_len, batch_size)


def onnx_initial_state(spec: OnnxDecoderSpec) -> dict:
    """Zero numpy arrays for every state input of ``spec``."""
    import numpy as np

    return {name: np.zeros(spec.shapes[name], dtype=_numpy_dtype(spec.dtypes[name])) for name in spec.state_names}


def _numpy_dtype(name: str):
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def onnx_step(session, spec: OnnxDecoderSpec, state: dict, input_ids, position: int):
    """One decode step with ONNX Runtime: returns ``(logits, new_state)``."""
    import numpy as np

    feeds = {"input_ids": np.asarray(input_ids, dtype=np.int64).reshape(spec.batch_size, 1),
             "cache_position": np.array([position], dtype=np.int64), **state}
    outputs = session.run(spec.output_names, feeds)
    return outputs[0], dict(zip(spec.state_names, outputs[1:]))


def onnx_generate(session, spec: OnnxDecoderSpec, prompt_ids, max_new_tokens: int):
    """Greedy decoding with an ONNX Runtime session of :func:`export_onnx`'s graph; returns int64 ``[B, n + k]``."""
    import numpy as np

    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.shape[1] > spec.max_cache_len:
        raise ValueError(f"The prompt has {prompt.shape[1]} tokens but the graph holds {spec.max_cache_len}.")
    state = onnx_initial_state(spec)
    logits = None
    for pos in range(prompt.shape[1]):
        logits, state = onnx_step(session, spec, state, prompt[:, pos:pos + 1], pos)
    tokens = prompt
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)
        tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
        pos = tokens.shape[1] - 1
        if pos >= spec.max_cache_len:
            break
        logits, state = onnx_step(session, spec, state, nxt[:, None], pos)
    return tokens


# Each target's module builds on this one, so it is named here and imported only when the command runs it.
TARGETS = {"executorch": "hf_kvint2.export_executorch"}


def main(argv=None) -> int:
    """``python -m hf_kvint2.export --to executorch OUTPUT ...``: the command line of the exporters that write a
    file for another runtime; the arguments after ``--to TARGET`` are the target's (``--to executorch --help``)."""
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m hf_kvint2.export", add_help=False,
                                description="Write a decoder with a static INT2 cache as a program for another "
                                            "runtime. The other arguments are the target's: --to executorch --help.")
    p.add_argument("--to", choices=sorted(TARGETS), help="the runtime: executorch (an ExecuTorch .pte program)")
    args, rest = p.parse_known_args(argv)
    if args.to is None:
        if any(a in ("-h", "--help") for a in rest):
            p.print_help()
            return 0
        p.error(f"--to is required: one of {', '.join(TARGETS)}")
    import importlib

    return importlib.import_module(TARGETS[args.to]).main(rest, prog=f"{p.prog} --to {args.to}")


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["OnnxDecoderSpec", "OscarExportableModule", "OscarOnnxDecoder", "bind_static_cache", "export_decoder",
           "export_onnx", "generate", "main", "onnx_generate", "onnx_initial_state", "onnx_step", "unbind_static_cache"]
