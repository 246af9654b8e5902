"""ExecuTorch programs (``.pte``) of the static INT2 decode step, and a runner that generates from them.

:func:`export_executorch` lowers :class:`~hf_kvint2.export.OscarExportableModule` (the 1-token decode step over a
:class:`~hf_kvint2.static_cache.StaticOscarCache`: INT2 codes, scales and full-precision windows as buffers the
program mutates in place) to an ExecuTorch program, in the shape transformers' ``TorchExportableModuleWithStaticCache``
and optimum-executorch give theirs: ``forward(input_ids [1, 1], cache_position [1]) -> logits [1, 1, vocab]`` plus
constant methods with the metadata (``get_max_seq_len``, ``get_vocab_size``, ...). The model's linear layers go to
XNNPACK; everything else, the INT2 write and read paths included, runs on ExecuTorch's portable kernels.
:func:`export_executorch_baseline` does the same for transformers' float ``StaticCache`` (the comparison), and
:class:`ExecutorchRunner` loads either program with ``executorch.runtime``, checks what it is given and generates.

Needs ``pip install executorch`` (the ``[executorch]`` extra). Two things the lowering works around:

* ExecuTorch's portable ``remainder`` kernel rounds integer quotients toward zero (``-12 % 9`` gives ``-3``, PyTorch
  ``6``), and the static cache computes ring slots as ``(position - sink) % ring``, negative before the window
  fills; :func:`_floor_remainders` rewrites integer ``remainder`` as ``x - floor(x / r) * r``.
* Mutable buffers start undefined in ExecuTorch; the runtimes (Python and the C++ ``Module``) allocate the planned
  arenas zero-filled, which is the state a fresh cache starts from, and every read masks what a sequence has not
  written yet.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import models
from .cache import OscarCache, OscarScaledCache
from .code_matmul import body_partial_codes
from .export import OscarExportableModule, export_decoder
from .model_config import WINDOWED, layer_plan, model_shape
from .read_path import TORCH_BODY, BodyBackend
from .static_cache import static_cache_like
from .static_layer import StaticOscarLayer

FORMAT = "hf_kvint2.executorch"
FORMAT_VERSION = 1
INT2_KIND, BASELINE_KIND = "int2", "static_fp"
# Constant methods of every program this module writes (read back by ExecutorchRunner).
METADATA_PREFIX = "hf_kvint2_"


@dataclass
class ExecutorchProgramInfo:
    """What :func:`export_executorch` / :func:`export_executorch_baseline` wrote, and its sizes."""

    path: str
    kind: str
    max_cache_len: int
    pte_bytes: int
    kv_buffer_bytes: int  # the mutable cache buffers (planned inside the program's memory arenas)
    planned_bytes: int  # every planned arena: cache buffers, activations, inputs and outputs
    buffers: dict[str, int] = field(default_factory=dict)  # name -> bytes
    seconds: dict[str, float] = field(default_factory=dict)  # export / lower / serialize
    delegated_ops: int = 0  # nodes in XNNPACK partitions

    def to_dict(self) -> dict:
        return asdict(self)


def _require_executorch():
    try:
        import executorch  # noqa: F401
        from executorch.runtime import Runtime  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("ExecuTorch export needs the executorch package: pip install \"hf-kvint2[executorch]\" "
                          "(or pip install executorch).") from e


# ------------------------------------------------------------------------------------------------ fingerprints
def recipe_fingerprint(static_cache) -> str:
    """A short hash of what a static cache's layers do with K/V (layouts, windows, rotations, means, ring sizes):
    two caches with the same fingerprint store and read tokens alike. Recorded in each INT2 program, so a runner
    given another calibration can say so."""
    h = hashlib.sha256()
    for layer in static_cache.layers:
        if isinstance(layer, StaticOscarLayer):
            r = layer.recipe
            h.update(repr((r.key, r.value, r.sink_tokens, r.recent_tokens, str(r.scale_dtype), r.hadamard_block,
                           r.demotion_block, layer.max_cache_len)).encode())
            for t in (r.key_rotation, r.value_rotation, r.key_mean, r.value_mean):
                h.update(b"-" if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        else:
            h.update(f"window {layer.ring_size}".encode())
    return h.hexdigest()[:16]


def _model_metadata(config, max_cache_len: int, kind: str) -> dict:
    shape = model_shape(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    eos = getattr(text, "eos_token_id", None)
    eos = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    meta = {
        # the names transformers' and optimum-executorch's runners read
        "get_max_seq_len": max_cache_len, "get_max_batch_size": 1, "get_vocab_size": int(text.vocab_size),
        "get_n_layers": shape.num_layers, "get_n_kv_heads": shape.num_key_value_heads, "get_head_dim": shape.head_dim,
        "use_kv_cache": True, "enable_dynamic_shape": False,
        f"{METADATA_PREFIX}format": FORMAT, f"{METADATA_PREFIX}format_version": FORMAT_VERSION,
        f"{METADATA_PREFIX}kind": kind,
        f"{METADATA_PREFIX}model": getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", "") or "",
        f"{METADATA_PREFIX}model_type": getattr(text, "model_type", "") or "",
    }
    if eos:
        meta["get_eos_ids"] = eos
    return meta


# ------------------------------------------------------------------------------------------------ lowering
def _floor_remainders(graph_module: torch.fx.GraphModule):
    """Rewrite integer ``remainder`` as ``x - floor_div(x, r) * r`` (PyTorch's sign convention on every runtime), in
    place on an edge-dialect graph (a graph edit: re-tracing a real model's graph takes minutes)."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from torch._guards import detect_fake_mode
    from torch.fx.passes.infra.pass_base import PassResult

    edge = exir_ops.edge.aten
    scalar, tensor = edge.remainder.Scalar, edge.remainder.Tensor
    changed = False
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in (scalar, tensor):
            continue
        x, r = node.args
        val = node.meta.get("val")
        if val is None or val.dtype.is_floating_point:
            continue
        div = edge.div.Scalar_mode if node.target is scalar else edge.div.Tensor_mode
        mul = edge.mul.Scalar if node.target is scalar else edge.mul.Tensor
        r_val = r.meta["val"] if isinstance(r, torch.fx.Node) else r
        with graph_module.graph.inserting_before(node), detect_fake_mode([x.meta["val"]]):
            q = graph_module.graph.call_function(div, (x, r), {"rounding_mode": "floor"})
            q.meta = {**node.meta, "val": div(x.meta["val"], r_val, rounding_mode="floor")}
            m = graph_module.graph.call_function(mul, (q, r))
            m.meta = {**node.meta, "val": mul(q.meta["val"], r_val)}
            out = graph_module.graph.call_function(edge.sub.Tensor, (x, m))
            out.meta = {**node.meta, "val": edge.sub.Tensor(x.meta["val"], m.meta["val"])}
        node.replace_all_uses_with(out)
        graph_module.graph.erase_node(node)
        changed = True
    if changed:
        graph_module.recompile()
    return PassResult(graph_module, changed)


def _schedule_near_use(graph_module: torch.fx.GraphModule):
    """Reorder a (functional, edge-dialect) graph so that each operator runs just before the first one that needs
    it: a depth-first walk back from the outputs that visits an operator's deepest input first (the one behind the
    longest chain of operators), so a short side chain (a layer's write path and the float codes it gathers from
    buffers alone) comes right before its use and not at the start of the step.

    Why: delegating the linear layers re-sorts the graph (ExecuTorch's partitioner, a breadth-first topological
    sort), which pulls every layer's buffer-only computations to the front; the memory planner must then keep
    each layer's gathered float codes alive until that layer's attention runs, one block of every layer at once
    (12.6 MB per SmolLM2 layer at ``max_cache_len`` 8192, where the ordering a decoder is written in needs one). A
    topological order that only moves operators keeps the graph's meaning; it runs before the in-place rewrite
    of the buffer writes, which then checks them against this order."""
    from torch.fx.passes.infra.pass_base import PassResult

    graph = graph_module.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    depth = {}
    for n in nodes:
        depth[n] = 1 + max((depth[a] for a in n.all_input_nodes), default=0)
    movable = {n for n in nodes if n.op == "call_function"}

    def inputs(n):  # deepest first; equal depths in the graph's order
        return sorted((a for a in n.all_input_nodes if a in movable), key=lambda a: (-depth[a], index[a]))

    order, placed = [], set()
    output = next(n for n in reversed(nodes) if n.op == "output")
    stack = [(output, iter(inputs(output)))]
    while stack:  # post-order without recursion (graphs have tens of thousands of nodes)
        node, pending = stack[-1]
        nxt = next((a for a in pending if a not in placed), None)
        if nxt is None:
            stack.pop()
            if node is not output:
                placed.add(node)
                order.append(node)
        else:  # (an operator being walked cannot be reached again from its own inputs: the graph is acyclic)
            stack.append((nxt, iter(inputs(nxt))))
    # operators no output depends on (assertions) keep their relative order, after everything they could read
    order += [n for n in nodes if n in movable and n not in placed]
    changed = any(a is not b for a, b in zip(order, [n for n in nodes if n in movable]))
    if changed:
        for n in order:
            output.prepend(n)
        graph.lint()
        graph_module.recompile()
    return PassResult(graph_module, changed)


def _lower(program: torch.export.ExportedProgram, metadata: dict, xnnpack: bool):
    """ATen program -> ExecuTorch program manager: XNNPACK for the linear layers, portable kernels for the rest,
    in-place buffer writes, the mutable buffers named (the runtime can show them)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower

    partitioner = []
    if xnnpack:  # imported only then: the backend's import alone takes seconds
        if importlib.util.find_spec("torchao") is None:
            raise ImportError("ExecuTorch's XNNPACK backend needs torchao: `pip install torchao`, or lower with "
                              "portable kernels only (xnnpack=False, --no-xnnpack on the command line).")
        from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        # one partition per linear layer (per_op_mode): merging partitions (CapabilityBasedPartitioner) first builds
        # each node's set of every node downstream of it, memory quadratic in the graph's size: over 8 GB for the
        # ~20k nodes of a 30-layer INT2 step, whose write and read paths are ~600 portable operators per layer
        partitioner = [XnnpackPartitioner(configs=[LinearConfig], per_op_mode=True)]
    edge = to_edge_transform_and_lower(
        program, partitioner=partitioner, transform_passes=[_floor_remainders], constant_methods=metadata,
        compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True))
    edge = edge.transform([_schedule_near_use])
    return edge.to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True, emit_mutable_buffer_names=True))


def _check_kernels(manager) -> None:
    """Every operator the program calls must have a kernel in this ExecuTorch runtime (else it fails to load)."""
    from executorch.runtime import Runtime

    available = set(Runtime.get().operator_registry.operator_names)
    plan = manager.executorch_program.execution_plan[0]
    needed = {f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators}
    missing = sorted(n for n in needed if n not in available)
    if missing:
        raise RuntimeError(f"The lowered program calls operators this ExecuTorch runtime has no kernel for: "
                           f"{', '.join(missing)}. Use an ExecuTorch build that includes them.")


def _buffer_bytes(program: torch.export.ExportedProgram) -> dict[str, int]:
    """Bytes of every buffer a (functionalized) program mutates, its cache state, by name."""
    sig = program.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    out = {}
    for node in program.graph.nodes:
        name = sig.inputs_to_buffers.get(node.name) if node.op == "placeholder" else None
        if name in mutated:
            val = node.meta["val"]
            out[name] = val.numel() * val.element_size()
    return out


def _delegated_nodes(manager) -> int:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    count = 0
    for module in manager.exported_program().graph_module.modules():
        if isinstance(module, LoweredBackendModule):
            count += sum(n.op == "call_function" for n in module.original_module.graph.nodes)
    return count


def _write(program, path, metadata: dict, kind: str, max_cache_len: int, xnnpack: bool, seconds: dict):
    import time

    t0 = time.perf_counter()
    manager = _lower(program, metadata, xnnpack)
    seconds["lower"] = round(time.perf_counter() - t0, 1)
    _check_kernels(manager)
    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        manager.write_to_file(f)
    seconds["serialize"] = round(time.perf_counter() - t0, 1)
    buffers = _buffer_bytes(manager.exported_program())
    planned = sum(manager.executorch_program.execution_plan[0].non_const_buffer_sizes)
    return ExecutorchProgramInfo(str(path), kind, max_cache_len, path.stat().st_size, sum(buffers.values()), planned,
                                 buffers, seconds, _delegated_nodes(manager) if xnnpack else 0)


READ_PATHS = {"codes": BodyBackend("codes", None, lambda: True, body_partial_codes), "blocked": TORCH_BODY}
DEFAULT_ATTENTION_BLOCK = 2048  # body tokens per block in a program (fewer, larger blocks: a smaller graph)


def executorch_module(model, cache=None, *, max_cache_len: int, attention_block: int = DEFAULT_ATTENTION_BLOCK,
                      read: str = "codes") -> OscarExportableModule:
    """The module :func:`export_executorch` exports (batch 1, CPU), usable eagerly: the program's eager twin.
    ``read``: the body read of the INT2 layers, ``"codes"`` (:func:`hf_kvint2.code_matmul.body_partial_codes`,
    matrix products over the codes: few passes over the body, what portable kernels need) or ``"blocked"``
    (:func:`hf_kvint2.read_path.body_partial_blocked`, the eager static cache's)."""
    if read not in READ_PATHS:
        raise ValueError(f"read must be one of {sorted(READ_PATHS)}, got {read!r}.")
    module = OscarExportableModule(model, cache, max_cache_len=max_cache_len, batch_size=1, device="cpu",
                                   attention_block=attention_block)
    for layer in module.static_cache.layers:
        if isinstance(layer, StaticOscarLayer):
            layer.body_backend = READ_PATHS[read]
    return module


def export_executorch(model, path: str | os.PathLike, cache=None, *, max_cache_len: int,
                      attention_block: int = DEFAULT_ATTENTION_BLOCK, read: str = "codes",
                      xnnpack: bool = True) -> ExecutorchProgramInfo:
    """Write the INT2 decode step of ``model`` as an ExecuTorch program at ``path`` (a ``.pte``).

    ``cache``: an ``OscarCache`` / ``OscarScaledCache`` (e.g. ``OscarCache.from_pretrained(artifact, config=...)``)
    whose recipes the static cache takes, or a :class:`~hf_kvint2.static_cache.StaticOscarCache`; None:
    ``OscarCache()`` defaults. Sliding-window layers (Gemma 2/3) are full-precision rings of the window. The program
    takes ``input_ids [1, 1]`` int64 and ``cache_position [1]`` int64 (positions from 0, in order; a new sequence
    starts again at 0) and returns ``logits [1, 1, vocab]``. ``attention_block``: body tokens read at a time (the
    largest float K/V temporary); ``read``: see :func:`executorch_module`. ``xnnpack``: delegate the linear layers
    to XNNPACK.

    Takes minutes on a real model (torch.export, then ExecuTorch's passes over every node; see docs/export.md).
    Batch size 1 (what ExecuTorch's LLM runners run).
    """
    import time

    _require_executorch()
    seconds = {}
    t0 = time.perf_counter()
    module = executorch_module(model, cache, max_cache_len=max_cache_len, attention_block=attention_block, read=read)
    try:
        program = export_decoder(model, module=module, max_cache_len=max_cache_len)
    finally:
        module.unbind()
    seconds["export"] = round(time.perf_counter() - t0, 1)
    metadata = _model_metadata(model.config, max_cache_len, INT2_KIND)
    metadata[f"{METADATA_PREFIX}recipe"] = recipe_fingerprint(module.static_cache)
    info = getattr(cache, "artifact_info", None) or {}
    metadata[f"{METADATA_PREFIX}artifact_base_model"] = info.get("base_model") or ""
    return _write(program, path, metadata, INT2_KIND, max_cache_len, xnnpack, seconds)


def export_executorch_baseline(model, path: str | os.PathLike, *, max_cache_len: int,
                               xnnpack: bool = True) -> ExecutorchProgramInfo:
    """The comparison program: ``model`` with transformers' ``StaticCache`` (K/V in the model's dtype) through
    ``transformers.integrations.executorch.TorchExportableModuleWithStaticCache``, SDPA attention, lowered like
    :func:`export_executorch` (same inputs, outputs and metadata). Models with sliding-window layers are refused:
    that wrapper turns them into full-attention layers, another model."""
    import time

    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    _require_executorch()
    if any(plan.storage == WINDOWED for plan in layer_plan(model.config, "export_executorch_baseline")):
        raise ValueError("This model has sliding-window layers, which transformers' StaticCache export wrapper turns "
                         "into full-attention layers; the baseline program supports full-attention models only.")
    seconds = {}
    t0 = time.perf_counter()
    attn, gen = model.config._attn_implementation, model.generation_config
    saved = (gen.cache_implementation, gen.use_cache)
    model.set_attn_implementation("sdpa")
    gen.cache_implementation, gen.use_cache = "static", True
    try:
        module = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_cache_len,
                                                      device=torch.device("cpu"))
        ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            program = torch.export.export(module, args=(), kwargs={"input_ids": ids, "cache_position": pos},
                                          strict=True)
    finally:
        gen.cache_implementation, gen.use_cache = saved
        model.set_attn_implementation(attn)
    seconds["export"] = round(time.perf_counter() - t0, 1)
    metadata = _model_metadata(model.config, max_cache_len, BASELINE_KIND)
    return _write(program, path, metadata, BASELINE_KIND, max_cache_len, xnnpack, seconds)


# ------------------------------------------------------------------------------------------------ runner
class ExecutorchRunner:
    """Greedy generation from a program of :func:`export_executorch` or :func:`export_executorch_baseline`.

    ``config``: the model the caller means (its shapes and vocabulary must be the program's); ``cache``: for an INT2
    program, the cache whose recipes the caller means (e.g. ``OscarCache.from_pretrained(artifact)``): a program
    exported with another calibration is refused. The program is stateful (its cache lives in its buffers): the
    runner feeds positions in order from 0 and refuses positions at or past ``max_cache_len`` before anything runs.
    ``threads``: XNNPACK's thread pool (None: leave it); ``etdump``: record ExecuTorch's per-operator profile
    (``self.program.write_etdump_result_to_file``).
    """

    def __init__(self, path: str | os.PathLike, *, config=None, cache=None, threads: int | None = None,
                 etdump: bool = False):
        _require_executorch()
        from executorch.runtime import Runtime

        self.path = str(path)
        runtime = Runtime.get()
        if threads is not None:
            from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

            _unsafe_reset_threadpool(threads)
        self.program = runtime.load_program(self.path, enable_etdump=etdump)
        names = self.program.method_names
        if "forward" not in names or f"{METADATA_PREFIX}format" not in names:
            raise ValueError(f"{self.path} is not a program written by hf_kvint2.export_executorch (its methods: "
                             f"{sorted(names)}); export it with export_executorch / export_executorch_baseline.")
        self.metadata = {name: self._constant(name) for name in sorted(names) if name != "forward"}
        if self.metadata[f"{METADATA_PREFIX}format_version"] != FORMAT_VERSION:
            raise ValueError(f"{self.path} has format version {self.metadata[f'{METADATA_PREFIX}format_version']}; "
                             f"this hf_kvint2 reads version {FORMAT_VERSION}: export the program again.")
        self.kind = self.metadata[f"{METADATA_PREFIX}kind"]
        self.max_cache_len = int(self.metadata["get_max_seq_len"])
        self.vocab_size = int(self.metadata["get_vocab_size"])
        if config is not None:
            self._check_config(config)
        if cache is not None:
            self._check_cache(cache, config)
        self.method = self.program.load_method("forward")
        self.next_position = 0

    def _constant(self, name: str):
        out = self.program.load_method(name).execute(())
        return out[0] if len(out) == 1 else list(out)

    def _built_for(self) -> str:
        m = self.metadata
        return (f"{m[f'{METADATA_PREFIX}model'] or m[f'{METADATA_PREFIX}model_type']} (num_layers={m['get_n_layers']}, "
                f"num_key_value_heads={m['get_n_kv_heads']}, head_dim={m['get_head_dim']}, "
                f"vocab_size={m['get_vocab_size']})")

    def _check_config(self, config) -> None:
        shape = model_shape(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        have = {"get_n_layers": shape.num_layers, "get_n_kv_heads": shape.num_key_value_heads,
                "get_head_dim": shape.head_dim, "get_vocab_size": int(text.vocab_size)}
        wrong = {k: v for k, v in have.items() if int(self.metadata[k]) != v}
        if wrong:
            raise ValueError(f"{self.path} was built for {self._built_for()}, but the model config has "
                             + ", ".join(f"{k[4:]}={v}" for k, v in wrong.items())
                             + ": export the program for this model.")

    def _check_cache(self, cache, config) -> None:
        if self.kind != INT2_KIND:
            raise ValueError(f"{self.path} is a {self.kind} program (no INT2 cache); pass cache= only with a program "
                             "of export_executorch.")
        if config is None:
            raise ValueError("Pass config= (the model's config) with cache=, to build the static cache it describes.")
        info = getattr(cache, "artifact_info", None) or {}
        want = recipe_fingerprint(static_cache_like(cache, config, self.max_cache_len))
        got = self.metadata[f"{METADATA_PREFIX}recipe"]
        if want != got:
            built = self.metadata.get(f"{METADATA_PREFIX}artifact_base_model") or "another calibration"
            given = info.get("base_model") or type(cache).__name__
            raise ValueError(f"{self.path} was exported with another cache recipe ({built}, fingerprint {got}) than "
                             f"the cache given ({given}, fingerprint {want}): export the program with this "
                             "cache, or run it with the cache it was built with.")

    # ------------------------------------------------------------------ stepping
    def step(self, token_id: int, position: int) -> torch.Tensor:
        """Run one token at ``position`` (0 starts a new sequence, else the next position); returns logits
        ``[1, 1, vocab]``."""
        if not isinstance(position, int) or position < 0 or position >= self.max_cache_len:
            raise ValueError(f"cache position {position!r} is outside this program's cache (max_cache_len="
                             f"{self.max_cache_len}): export the program with a larger max_cache_len.")
        if position not in (0, self.next_position):
            raise ValueError(f"cache position {position} skips or repeats positions (next is {self.next_position}); "
                             "the program's cache is filled in order: continue at the next position or restart at 0.")
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the program's vocabulary (vocab_size={self.vocab_size}); "
                             "use the tokenizer of the model the program was built for.")
        ids = torch.tensor([[int(token_id)]], dtype=torch.long)
        logits = self.method.execute((ids, torch.tensor([position], dtype=torch.long)))[0]
        self.next_position = position + 1
        return logits

    def generate(self, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None,
                 return_logits: bool = False):
        """Greedy decoding: the prompt token by token from position 0 (the program takes one token per call), then
        the argmax token, ``max_new_tokens`` times (or until ``eos_token_id``). Returns the new tokens (a list), and
        with ``return_logits`` also the logits that chose them ``[k, vocab]``."""
        prompt = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        if not prompt:
            raise ValueError("generate needs at least one prompt token.")
        if len(prompt) + max_new_tokens - 1 > self.max_cache_len:
            raise ValueError(f"The prompt has {len(prompt)} tokens and {max_new_tokens} new tokens were asked for, "
                             f"but the program's cache holds max_cache_len={self.max_cache_len} positions: export it "
                             "with a larger max_cache_len or shorten the prompt.")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the program's vocabulary (vocab_size={self.vocab_size}); "
                             "use the tokenizer of the model the program was built for.")
        for pos, tok in enumerate(prompt):
            logits = self.step(tok, pos)
        new, chosen = [], []
        for i in range(max_new_tokens):
            row = logits[0, -1]
            nxt = int(row.argmax())
            new.append(nxt)
            chosen.append(row)
            if nxt == eos_token_id or i == max_new_tokens - 1:
                break
            logits = self.step(nxt, len(prompt) + i)
        return (new, torch.stack(chosen)) if return_logits else new

    # ------------------------------------------------------------------ memory
    def buffer_bytes(self) -> list[int]:
        """Bytes of each of the program's mutable buffers (its cache), as the runtime's method metadata gives them."""
        meta = self.method.metadata
        return [meta.attribute_tensor_meta(i).nbytes() for i in range(meta.num_attributes())]

    def memory(self) -> dict[str, int]:
        """``cache_bytes``: the mutable buffers (:meth:`buffer_bytes`); ``planned_bytes``: the memory arenas the
        runtime allocates for the method (the buffers, activations, inputs and outputs), as the program sizes them."""
        from executorch.exir._serialize._program import deserialize_pte_binary

        with open(self.path, "rb") as f:
            plans = deserialize_pte_binary(f.read()).program.execution_plan
        plan = next(p for p in plans if p.name == "forward")
        return {"cache_bytes": sum(self.buffer_bytes()), "planned_bytes": sum(plan.non_const_buffer_sizes)}


def main(argv=None, prog: str = "python -m hf_kvint2.export --to executorch") -> int:
    """The command line (``python -m hf_kvint2.export --to executorch OUTPUT --max-cache-len N ...``): loads the
    model and its cache, writes the program, prints :class:`ExecutorchProgramInfo` as JSON."""
    import argparse

    p = argparse.ArgumentParser(
        prog=prog,
        description="Write the static INT2 decode step (or the float StaticCache baseline) as an ExecuTorch .pte.")
    p.add_argument("output", help="path of the .pte to write")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' / 'gemma3' (the bundled models) or a Hub id / local folder (default smollm2)")
    p.add_argument("--cache", default="artifact", choices=("artifact", "oscar", "oscar-scaled", "static"),
                   help="artifact: the OscarCache of --artifact (default: the calibration shipped for the bundled "
                        "model); oscar / oscar-scaled: uncalibrated defaults; static: transformers' StaticCache "
                        "(the float baseline)")
    p.add_argument("--artifact", default=None, help="calibration artifact (Hub id, local folder or shipped id)")
    p.add_argument("--max-cache-len", type=int, required=True, help="positions the program's cache holds")
    p.add_argument("--attention-block", type=int, default=DEFAULT_ATTENTION_BLOCK,
                   help="body tokens read at a time by the attention")
    p.add_argument("--read", default="codes", choices=sorted(READ_PATHS), help="the INT2 body read (see docs)")
    p.add_argument("--no-xnnpack", action="store_true", help="portable kernels only (no XNNPACK delegation)")
    p.add_argument("--threads", type=int, default=None, help="torch threads while exporting")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    shipped = {"smollm2": "hf-kvint2/SmolLM2-135M-Instruct-oscar", "gemma3": "hf-kvint2/gemma-3-270m-oscar"}
    if args.model in shipped:
        model, _ = (models.load_smollm2 if args.model == "smollm2" else models.load_gemma3)(torch.float32)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    if args.cache == "static":
        info = export_executorch_baseline(model, args.output, max_cache_len=args.max_cache_len,
                                          xnnpack=not args.no_xnnpack)
    else:
        if args.cache == "artifact":
            artifact = args.artifact or shipped.get(args.model)
            if artifact is None:
                p.error("--cache artifact needs --artifact for a model other than the bundled ones")
            cache = OscarCache.from_pretrained(artifact, config=model.config)
        else:
            cache = (OscarCache if args.cache == "oscar" else OscarScaledCache)(config=model.config)
        info = export_executorch(model, args.output, cache, max_cache_len=args.max_cache_len,
                                 attention_block=args.attention_block, read=args.read, xnnpack=not args.no_xnnpack)
    print(json.dumps(info.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["ExecutorchProgramInfo", "ExecutorchRunner", "executorch_module", "export_executorch",
           "export_executorch_baseline", "main", "recipe_fingerprint"]
