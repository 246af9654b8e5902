"""Ahead-of-time compilation of the Triton kernels for NVIDIA GPUs, on a machine without one.

The launches come from the dispatchers themselves: :func:`capture_launches` calls the kernel wrappers
(``quantize_tokens``, ``body_attention``) for one :class:`KernelConfig` with the kernel objects
replaced by recorders, so block sizes, constexprs and ``num_warps`` are exactly what the wrapper launches on a GPU
with that many SMs. Each launch is specialised the way Triton's JIT specialises arguments (pointers and integers
divisible by 16 get the divisibility hint, integers equal to 1 become constants), compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` - LLVM and the ``ptxas`` bundled in the
Triton wheel, no driver needed - and its cubin's resources read with the bundled ``cuobjdump``.

Triton must be imported without ``TRITON_INTERPRET=1`` (interpreted kernels cannot be compiled): tests and the
benchmark run this module in a subprocess (``python -m hf_kvint2.kernels.aot``, see :func:`main`).
Works with Triton 3.2 (``ASTSource(fn, signature, constants, AttrsDescriptor)``) and 3.3+ (signature entries
``"constexpr"``, ``attrs`` keyed by argument index).

Over 400 lines because configurations, launch capture, specialisation, compilation and the resource report are
one pipeline that only benchmarks/triton_aot.py and its test use; split, each part would be imported only by the
next.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from hf_kvint2.recipes import GroupLayout
from hf_kvint2.settings import oscar_recipe, oscar_scaled_recipe
from hf_kvint2.stream import QuantizedStream, StreamCodec

from . import decode_attention, quantize_pack
from .decode_attention import _TL_DOT_DTYPE

# Targets: compute capability -> (name, SMs of the GPU the launch grid is sized for, per-SM limits). Limits from
# NVIDIA's CUDA occupancy tables: registers per SM, max warps, max blocks, shared memory per SM (bytes, including
# the 1 KiB the runtime reserves per block), register allocation unit (per warp).
TARGETS = {
    80: {"gpu": "A100", "sms": 108, "regs": 65536, "warps": 64, "blocks": 32, "smem": 167936, "smem_block": 166912},
    90: {"gpu": "H100/H200", "sms": 132, "regs": 65536, "warps": 64, "blocks": 32, "smem": 233472,
         "smem_block": 232448},
}
_REG_UNIT, _SMEM_RESERVED = 256, 1024


# ------------------------------------------------------------------------------------------------ configurations
class KernelConfig(NamedTuple):
    """One configuration the caches hand to the kernels (what :mod:`hf_kvint2.kernels.aot` compiles)."""

    cache: str  # the cache / recipe that stores these layouts
    key_layout: object  # GroupLayout
    value_layout: object
    centred: bool  # key and value means subtracted before the rotation (calibrated OSCAR)
    dtype: torch.dtype  # the model's K/V dtype: quantize input, decode dot operands
    head_dim: int
    gqa: int  # query heads per KV head
    kv_heads: int = 8
    scale_dtype: torch.dtype = torch.float16  # the caches' default
    mask: str = "none"  # "none" | "bool" | "additive"
    shapes: tuple = ((1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072))  # (batch, context)

    @property
    def name(self) -> str:
        return (f"{self.cache}{'_centred' if self.centred else ''}_{str(self.dtype).split('.')[-1]}"
                f"_d{self.head_dim}_gqa{self.gqa}")


def dispatch_configurations(head_dims=(64, 128, 256), gqa_groups=(1, 4, 8)) -> list[KernelConfig]:
    """Every layout the caches can store, for each K/V dtype the decode dispatcher maps (``_TL_DOT_DTYPE``), head_dim
    and GQA group: OSCAR's per-token groups (``oscar_recipe``), centred or not, with OScaR's key token scaling
    added (``evaluation.with_key_token_scaling``); calibration's per-channel candidate (``calibration.fit_layer``:
    ``GroupLayout("channel", min(group_size, head_dim))``, keys on a narrowed range); OScaR's per-channel keys with and without token norms
    (``oscar_scaled_recipe``). The block sizes and constexprs are not listed here: :func:`aot.capture_launches` runs
    the wrappers to get them."""
    def layouts(head_dim):
        oscar, scaled = oscar_recipe(), oscar_scaled_recipe()
        channel = GroupLayout("channel", min(oscar.key.group_size, head_dim))
        yield "oscar", oscar.key, oscar.value, (False, True)
        yield "oscar_key_token_scaling", replace(oscar.key, token_scaling=True), oscar.value, (False, True)
        # keys on a narrowed group range (calibration's range_clip), values on the full one: both quantize variants
        yield "oscar_calibrated_channel", replace(channel, range_clip=0.9), channel, (False, True)
        yield "oscar_scaled", scaled.key, scaled.value, (False,)
        no_norm = oscar_scaled_recipe(token_scaling=False)
        yield "oscar_scaled_no_token_scaling", no_norm.key, no_norm.value, (False,)

    return [KernelConfig(cache, k, v, centred, dtype, d, g)
            for d in head_dims for cache, k, v, centring in layouts(d) for centred in centring
            for dtype in _TL_DOT_DTYPE for g in gqa_groups]


# ------------------------------------------------------------------------------------------------ capture
@dataclass
class Launch:
    """One kernel launch as a wrapper issues it: the kernel, its argument values by name, its launch options."""

    kernel: str
    fn: object
    args: dict
    options: dict


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` records instead of launching."""

    def __init__(self, fn, sink: list):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.fn.arg_names
            bound = dict(zip(names, args))
            options = {k: v for k, v in kwargs.items() if k not in names}
            bound.update({k: v for k, v in kwargs.items() if k in names})
            for v in bound.values():  # outputs are read after the launch (e.g. the fp16 overflow check)
                if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.is_floating_point():
                    v.zero_()
            self.sink.append(Launch(self.fn.__name__.strip("_").removesuffix("_kernel"), self.fn, bound, options))

        return launch


@contextlib.contextmanager
def recording(sms: int):
    """Within the block, kernel launches of the wrappers are recorded (and returned in the yielded list), and the
    split-K heuristics see a GPU with ``sms`` multiprocessors. Works under the interpreter too (no compiling)."""
    from . import decode_attention, quantize_pack

    sink: list[Launch] = []
    saved = {}
    patches = [(decode_attention, "_body_attention_kernel"), (decode_attention, "_merge_splits_kernel"),
               (quantize_pack, "_quantize_pack_kernel")]
    for mod, name in patches:
        saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, _Recorder(saved[(mod, name)], sink))
    saved[(decode_attention, "_sm_count")] = decode_attention._sm_count
    decode_attention._sm_count = lambda device: sms
    try:
        yield sink
    finally:
        for (mod, name), value in saved.items():
            setattr(mod, name, value)


def _stream(layout, head_dim, kv_heads, batch, tokens, scale_dtype, mean: bool, device):
    """A QuantizedStream of ``tokens`` stored tokens (zeros: only shapes and dtypes matter here)."""
    group = layout.group_for(head_dim)
    rot = torch.eye(head_dim, device=device)
    mu = torch.zeros(kv_heads, head_dim, device=device) if mean else None
    s = QuantizedStream(StreamCodec(layout, group, rot, mu, scale_dtype))
    rows, cols = (tokens, head_dim // group) if layout.axis == "token" else (tokens // group, head_dim)
    s.codes.append(torch.zeros(batch, kv_heads, tokens, head_dim // 4, dtype=torch.uint8, device=device))
    s.scale.append(torch.zeros(batch, kv_heads, rows, cols, dtype=scale_dtype, device=device))
    s.lo.append(torch.zeros(batch, kv_heads, rows, cols, dtype=scale_dtype, device=device))
    if s.norm is not None:
        s.norm.append(torch.zeros(batch, tokens, dtype=scale_dtype, device=device))
    return s


def capture_launches(config, sms: int, quantize: bool = True) -> list[Launch]:
    """Every kernel launch the wrappers issue for ``config`` on a GPU with ``sms`` SMs: quantize-and-pack of K and
    V (one demoted token and a prefill chunk), and decode attention at each (batch, context) of the config (split-K
    with the merge, and a single split)."""
    d, hkv, hq = config.head_dim, config.kv_heads, config.kv_heads * config.gqa
    quantizes = list(_quantize_launches(config.key_layout, config.value_layout, config.centred, config.dtype, d, hkv,
                                        config.scale_dtype)) if quantize else []
    with recording(sms) as sink:
        meta = torch.device("meta")
        for batch, context in config.shapes:
            kb = _stream(config.key_layout, d, hkv, batch, context, config.scale_dtype, config.centred, meta).read()
            vb = _stream(config.value_layout, d, hkv, batch, context, config.scale_dtype, False, meta).read()
            q_rot = torch.zeros(batch, hq, 1, d, device=meta)
            qmu = torch.zeros(batch, hq, 1, device=meta) if config.centred else None
            mask = None
            if config.mask != "none":
                mask = torch.zeros(batch, 1, 1, context, device=meta,
                                   dtype=torch.bool if config.mask == "bool" else torch.float32)
            for splits in (None, 1):  # the dispatcher's split-K choice, and one split (no merge)
                decode_attention.body_attention(q_rot, kb, vb, scaling=d ** -0.5, key_mean_logits=qmu, mask=mask,
                                                num_splits=splits, dot_dtype=config.dtype)
    return quantizes + sink


@functools.cache
def _quantize_launches(key_layout, value_layout, centred, dtype, d, hkv, scale_dtype) -> tuple:
    """The quantize-and-pack launches of K and V (they do not depend on the GQA group: cached across configs)."""
    with recording(1) as sink:
        for layout, mean in ((key_layout, centred), (value_layout, centred)):
            group = layout.group_for(d)
            counts = (1, 256) if layout.axis == "token" else (2 * group,)
            for n in counts:
                x = torch.zeros(1, hkv, n, d, dtype=dtype)
                quantize_pack.quantize_tokens(
                    x, torch.eye(d), torch.zeros(hkv, d) if mean else None, axis=layout.axis, group_size=group,
                    clip=layout.clip, token_scaling=layout.token_scaling, scale_dtype=scale_dtype,
                    range_clip=layout.range_clip)
    return tuple(sink)


# ------------------------------------------------------------------------------------------------ specialisation
def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])


@dataclass(frozen=True)
class Specialisation:
    """What Triton's JIT compiles for a launch: argument types, constants, 16-divisible arguments, options."""

    kernel: str
    types: tuple  # (name, type string or "constexpr")
    constants: tuple  # (name, value) - constexprs and integer arguments equal to 1
    divisible: tuple  # indices of arguments divisible by 16 (pointers: aligned; integers: multiples)
    options: tuple  # (name, value) launch options (num_warps, ...)

    @property
    def key(self) -> str:
        constants = tuple((n, v if isinstance(v, (bool, int, float)) else str(v)) for n, v in self.constants)
        return hashlib.sha1(repr((self.kernel, self.types, constants, self.divisible, self.options))
                            .encode()).hexdigest()[:16]

    def describe(self) -> dict:
        """The constexprs and launch options, readable (for the report)."""
        out = {name: str(v) if not isinstance(v, (bool, int, float)) else v for name, v in self.constants}
        out.update(dict(self.options))
        return out


def _tensor_type(t: torch.Tensor) -> str:
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
             torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
    return "*" + names[t.dtype]


def specialise(launch: Launch) -> Specialisation:
    """The JIT's specialisation of a recorded launch (``triton.runtime.jit``: tensors -> typed pointers, aligned
    when their address is a multiple of 16 - always, for CUDA allocations and meta tensors; ints equal to 1 ->
    constants; other ints -> i32/i64, divisible when a multiple of 16; floats -> fp32)."""
    if decode_attention._interpreting():
        raise RuntimeError("Ahead-of-time compilation needs Triton imported without TRITON_INTERPRET=1.")
    types, constants, divisible = [], [], []
    for i, (name, value) in enumerate(launch.args.items()):
        param = launch.fn.params[i]
        if param.is_constexpr:
            types.append((name, "constexpr"))
            constants.append((name, value))
        elif isinstance(value, torch.Tensor):
            types.append((name, _tensor_type(value)))
            if not param.do_not_specialize_on_alignment and (value.device.type == "meta" or value.data_ptr() % 16 == 0):
                divisible.append(i)
        elif isinstance(value, bool):
            types.append((name, "i1"))
        elif isinstance(value, int) and param.do_not_specialize:
            types.append((name, "i32" if -2**31 <= value < 2**31 else "i64"))
        elif isinstance(value, int):
            if value == 1:
                types.append((name, "constexpr"))
                constants.append((name, 1))
            else:
                types.append((name, "i32" if -2**31 <= value < 2**31 else "i64"))
                if value % 16 == 0:
                    divisible.append(i)
        elif isinstance(value, float):
            types.append((name, "fp32"))
        else:
            raise TypeError(f"{launch.kernel}: cannot specialise argument {name}={value!r}.")
    options = tuple(sorted({"num_warps": 4, **launch.options}.items()))
    return Specialisation(launch.kernel, tuple(types), tuple(constants), tuple(divisible), options)


def _ast_source(spec: Specialisation, fn):
    """``ASTSource`` in the form of the installed Triton (3.2, or 3.3 and later)."""
    from triton.compiler import ASTSource

    if _triton_version() >= (3, 3):
        signature = dict(spec.types)
        attrs = {(i,): [["tt.divisibility", 16]] for i in spec.divisible}
        return ASTSource(fn, signature, dict(spec.constants), attrs)
    from triton.backends.compiler import AttrsDescriptor

    # 3.2: the signature lists the non-constexpr arguments; integers equal to 1 are constants *and* stay in it.
    constexpr_names = {n for (n, t), p in zip(spec.types, fn.params) if p.is_constexpr}
    signature = {n: ("i32" if t == "constexpr" else t) for n, t in spec.types if n not in constexpr_names}
    ones = [i for i, (n, t) in enumerate(spec.types) if t == "constexpr" and n not in constexpr_names]
    attrs = AttrsDescriptor.from_dict({"arg_properties": {"tt.divisibility": list(spec.divisible),
                                                          "tt.equal_to": ones}, "cls": "AttrsDescriptor"})
    return ASTSource(fn, signature, dict(spec.constants), attrs)


# ------------------------------------------------------------------------------------------------ compile + report
def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton wheel does not bundle the CUDA tools.")
    return str(path)


def cubin_resources(cubin: bytes) -> dict:
    """Registers per thread, stack and local (spill) bytes per thread, static shared memory of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "local_bytes": int(fields["LOCAL"]),
            "static_shared_bytes": int(fields["SHARED"])}


def _ptxas(arch: int) -> str:
    """The ptxas Triton uses for ``sm_<arch>`` (3.3+ may bundle a newer one for sm_90 and later)."""
    from triton.backends.nvidia import compiler as nvidia

    if hasattr(nvidia, "get_ptxas"):
        return nvidia.get_ptxas(arch).path
    return _tool("ptxas")


def _ptxas_extra_options() -> list[str]:
    """Register-allocation options Triton passes to ptxas (3.9 adds --regAllocOptLevel=2), so the rerun matches."""
    import inspect

    from triton.backends.nvidia.compiler import CUDABackend

    return ["--regAllocOptLevel=2"] if "regAllocOptLevel=2" in inspect.getsource(CUDABackend.make_cubin) else []


def spill_bytes(ptx: str, arch: int) -> tuple[int, int]:
    """(spill stores, spill loads) in bytes, from ``ptxas -v`` on the kernel's PTX (what Triton ran, same options)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        run = subprocess.run([_ptxas(arch), "-v", "-lineinfo", *_ptxas_extra_options(), f"--gpu-name={gpu}",
                              str(src), "-o",
                              str(Path(tmp) / "k.o")], check=False, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas -v failed: {run.stderr[-1000:]}")
    log = run.stderr
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def occupancy(registers: int, shared_bytes: int, num_warps: int, arch: int) -> dict:
    """Blocks and warps per SM that registers, shared memory and the hardware limits allow (CUDA occupancy
    calculator rules: registers allocated per warp in units of 256)."""
    t = TARGETS[arch]
    regs_per_warp = -(-registers * 32 // _REG_UNIT) * _REG_UNIT
    by_regs = t["regs"] // (regs_per_warp * num_warps) if registers else t["blocks"]
    by_smem = t["smem"] // (shared_bytes + _SMEM_RESERVED) if shared_bytes <= t["smem_block"] else 0
    by_warps = t["warps"] // num_warps
    blocks = min(by_regs, by_smem, by_warps, t["blocks"])
    limiter = min((("registers", by_regs), ("shared memory", by_smem), ("warps", by_warps),
                   ("blocks", t["blocks"])), key=lambda x: x[1])[0]
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
            "occupancy": blocks * num_warps / t["warps"], "limited_by": limiter}


def compile_specialisation(spec: Specialisation, fn, arch: int) -> dict:
    """Compile for ``sm_<arch>``; the report of registers, spills, shared memory and occupancy (or the error)."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    try:
        kernel = triton.compile(_ast_source(spec, fn), target=GPUTarget("cuda", arch, 32), options=dict(spec.options))
    except Exception as e:  # noqa: BLE001 - reported per configuration; the caller fails on any
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "compile_s": time.perf_counter() - start}
    res = cubin_resources(kernel.asm["cubin"])
    shared = int(kernel.metadata.shared) + res["static_shared_bytes"]
    out = {"ok": True, "compile_s": time.perf_counter() - start, **res, "shared_bytes": shared,
           "num_warps": int(kernel.metadata.num_warps), "num_stages": int(kernel.metadata.num_stages)}
    # Spills live in local memory: the cubin's LOCAL is 0 without them; only then is ptxas rerun for the bytes.
    spilled = res["local_bytes"] > 0 or res["stack_bytes"] > 0
    out["spill_store_bytes"], out["spill_load_bytes"] = spill_bytes(kernel.asm["ptx"], arch) if spilled else (0, 0)
    out.update(occupancy(res["registers"], shared, out["num_warps"], arch))
    if shared > TARGETS[arch]["smem_block"]:  # Triton's launcher raises OutOfResources: as good as a compile error
        out.update(ok=False, error=f"needs {shared} bytes of shared memory; sm_{arch} allows "
                                   f"{TARGETS[arch]['smem_block']} per block")
    return out


# ------------------------------------------------------------------------------------------------ the matrix
def kernel_source_hash(fn) -> str:
    """Hash of what a compile reads from the source: the kernel's code and that of every ``@triton.jit`` function
    outside Triton it calls (transitively), as ASTs without positions, comments or docstrings, and the
    module-level constants they read. Triton's own ``fn.cache_key`` adds each function's starting line, so an edit
    that only moves a kernel down its file would invalidate every committed result; this hash does not change then.
    Triton's version is recorded next to it (the report's ``triton``), and its library functions (``tl.sum`` ...)
    belong to that version."""
    parts: list[str] = []
    _source_parts(fn, parts, set())
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _source_parts(fn, parts: list, seen: set) -> None:
    import ast
    import inspect
    import textwrap

    py = fn.fn  # the Python function under JITFunction (or the interpreter's wrapper)
    if py in seen:
        return
    seen.add(py)
    tree = ast.parse(textwrap.dedent(inspect.getsource(py)))
    for node in ast.walk(tree):  # docstrings are not code
        if isinstance(node, ast.FunctionDef) and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    parts.append(ast.dump(tree))
    globals_ = py.__globals__
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id not in globals_:
            continue
        value = globals_[node.id]
        if callable(getattr(value, "fn", None)) and not value.fn.__module__.startswith("triton"):
            _source_parts(value, parts, seen)  # a @triton.jit function (not one of Triton's library)
        elif isinstance(value, (bool, int, float, str)) or type(value).__name__ == "constexpr":
            parts.append(f"{node.id}={value!r}")


def collect(configs, archs) -> tuple[dict, dict]:
    """Specialisations of every configuration on every target: ``({arch: {key: (spec, fn)}}, {config name:
    {arch: [keys]}})``. Configurations that launch identical specialisations share one compile."""
    unique, by_config = {}, {}
    for arch in archs:
        unique[arch] = {}
        for config in configs:
            keys = []
            for launch in capture_launches(config, TARGETS[arch]["sms"]):
                spec = specialise(launch)
                unique[arch].setdefault(spec.key, (spec, launch.fn))
                if spec.key not in keys:
                    keys.append(spec.key)
            by_config.setdefault(config.name, {})[f"sm_{arch}"] = keys
    return unique, by_config


def _compile_job(job):
    module, name, spec, arch = job
    import importlib

    fn = getattr(importlib.import_module(module), name)
    return spec.key, arch, compile_specialisation(spec, fn, arch)


def compile_all(unique: dict, workers: int = 2, known: dict | None = None, progress=print, on_result=None) -> dict:
    """Compile every specialisation in ``unique`` (from :func:`collect`) in ``workers`` processes; results by
    ``(key, arch)``. ``known``: results of an earlier run by the same key - reused when the kernel source, Triton
    version and target are the same (a compile is a pure function of those), and not recompiled. ``on_result(key,
    arch, result)`` is called as each compile finishes (a checkpoint). The 16-bit decode kernels and the smaller
    head_dims go first, the IEEE-fp32 decode kernels (the slowest to compile) last."""
    import concurrent.futures
    import multiprocessing
    import time

    results, jobs = {}, []
    for arch, specs in unique.items():
        for key, (spec, fn) in specs.items():
            prior = (known or {}).get((key, arch))
            if prior is not None:
                results[(key, arch)] = {**prior, "reused": True}
            else:
                jobs.append((fn.__module__, fn.__name__, spec, arch))

    def order(job):
        c = dict(job[2].constants)
        return (str(c.get("DOT_DTYPE", "")) == "fp32", c.get("D", 0), job[2].kernel, job[3], job[2].key)

    jobs.sort(key=order)
    start = time.perf_counter()
    if jobs:
        ctx = multiprocessing.get_context("spawn")  # no state shared with a parent that may hold an interpreter
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = [pool.submit(_compile_job, job) for job in jobs]
            for i, future in enumerate(concurrent.futures.as_completed(futures)):
                key, arch, res = future.result()
                results[(key, arch)] = res
                if on_result:
                    on_result(key, arch, res)
                if progress and (i + 1) % 25 == 0:
                    progress(f"  compiled {i + 1}/{len(jobs)} in {time.perf_counter() - start:.0f} s")
    return results
