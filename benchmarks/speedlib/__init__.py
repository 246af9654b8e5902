"""The one harness of the speed benchmarks (bench_decode, bench_interleaved, bench_prefill, bench_threads,
bench_throughput, bench_jit, bench_gpu, bench_tp_allreduce, profile_decode): how they take arguments, run cases in
worker processes, interleave what they compare, and write their results.

* Arguments: :func:`add_shared_options` (``--model``, ``--threads``, ``--out`` and the hidden ``--worker``),
  :func:`add_step_options` (``--steps``, ``--warmup``): the same names, defaults and help in every script.
* Worker processes: :func:`worker_env`, :func:`run_worker`: one case per fresh interpreter, so that its peak RSS,
  compiled kernels and thread pools are its own; the worker prints one JSON row, which the parent collects.
* Interleaving: :func:`interleaved_rounds` calls every compared variant once per round, back to back, so that a
  noisy host's drift reaches all of them alike; :func:`interleaved_cpu_steps` does it for decode steps, and
  :func:`ratio_summary` reduces per-round times to the ratios the results report (total, median, quartiles).
* Output: :func:`run_meta` (machine, versions, command, date and load of the run), :func:`write_results` (JSON and
  a PNG of the same name).
* Models and caches: :func:`load_model` (the bundled SmolLM2-135M, or ``"synthetic"``: a Llama with its shapes and
  random weights with ``max_position_embeddings=32768``, for contexts past 8192; :func:`synthetic_config`),
  :func:`make_cache`, :func:`fill_cache` (random K/V: decode speed does not depend on the values, and a real 8k x
  batch prefill takes many minutes on 2 cores), :func:`cache_bytes` (every tensor storage a cache holds, the same
  measure for every cache class), :func:`time_decode_steps`.

Only the standard library is imported at module level, so that every script prints ``--help`` at once and
bench_gpu can import it before it has made torch and Triton importable.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CACHES = ("dynamic", "hqq", "oscar", "scaled")
MODELS = ("smollm2", "synthetic")
RESULTS = Path(__file__).resolve().parents[1] / "results"


def set_threads(threads: int) -> None:
    """One intra-op thread count for torch and the Numba kernel (NUMBA_NUM_THREADS must be set before import)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def synthetic_config(**overrides):
    """The ``"synthetic"`` model's LlamaConfig (SmolLM2-135M's shapes, 32k positions), with ``overrides``."""
    from transformers import LlamaConfig

    shapes = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 32768,
              "rope_theta": 100000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
    return LlamaConfig(**{**shapes, **overrides})


def load_model(name: str, attn_implementation: str):
    import torch

    if name == "smollm2":
        from hf_kvint2.models import load_smollm2

        model, _ = load_smollm2(torch.float32, attn_implementation=attn_implementation)
        return model
    if name != "synthetic":
        raise ValueError(f"unknown model {name!r}: use smollm2 or synthetic")
    from transformers import LlamaForCausalLM

    import hf_kvint2  # noqa: F401  (registers "oscar")

    config = synthetic_config()
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def make_cache(kind: str, config):
    from transformers import DynamicCache, QuantizedCache

    import hf_kvint2

    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "hqq":
        return QuantizedCache(backend="hqq", config=config, nbits=2)
    if kind == "oscar":
        return hf_kvint2.OscarCache(config=config)
    if kind == "scaled":
        return hf_kvint2.OscarScaledCache(config=config)
    raise ValueError(f"unknown cache {kind!r}: use one of {CACHES}")


def fill_cache(cache, config, batch: int, context: int, fused: bool, chunk: int = 1024, seed: int = 0,
               generator=None) -> float:
    """Random K/V for ``context`` tokens: layer 0 by ``update`` in chunks, then a copy of it in every layer.

    The values come from ``generator`` if given (bench_decode draws from torch's global one, seeded before the model
    load), else from a fresh one seeded with ``seed``. Returns the seconds the updates and copies took (``fill_s``).
    """
    import torch

    from hf_kvint2.layers import OscarLayer

    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, OscarLayer):  # the fill discards update()'s return value: skip building the full view
            layer.fused_attention = True
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            cache.update(torch.randn(batch, kv_heads, n, head_dim, generator=g),
                         torch.randn(batch, kv_heads, n, head_dim, generator=g), 0)
        for idx in range(1, config.num_hidden_layers):  # quantizing every layer would take minutes
            layer = copy.deepcopy(cache.layers[0])
            if hasattr(layer, "layer_idx"):
                layer.layer_idx = idx
            if idx < len(cache.layers):
                cache.layers[idx] = layer
            else:
                cache.layers.append(layer)
    seconds = time.perf_counter() - t0
    for layer in cache.layers:  # portable configurations read the full view; fused ones read the codes
        if isinstance(layer, OscarLayer):
            layer.fused_attention = fused
    return seconds


def cache_bytes(cache) -> int:
    """Bytes of all tensor storages reachable from ``cache`` (each storage once, its whole allocation)."""
    import torch

    seen_storage, seen_obj, total = set(), set(), 0
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen_storage and storage.nbytes():
                seen_storage.add(key)
                total += storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s))
    return total


def time_decode_steps(model, cache, tokens, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Greedy decode steps from ``tokens``: ``warmup`` untimed (the first compiles the Numba kernel), then ``steps``
    timed ones. Returns the wall and the process CPU seconds of each timed step (CPU time is what a shared machine
    disturbs less, with one thread)."""
    import torch

    times, cpu_times = [], []
    with torch.no_grad():
        for i in range(warmup + steps):
            t, c = time.perf_counter(), time.process_time()
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
            tokens = logits[:, -1:].argmax(-1)
            if i >= warmup:
                times.append(time.perf_counter() - t)
                cpu_times.append(time.process_time() - c)
    return times, cpu_times


def interleaved_rounds(calls: dict, rounds: int, warmup: int, clock=time.process_time, desc: str | None = None,
                       before=None) -> dict:
    """Call every entry of ``calls`` (name -> a function of no arguments) once per round, in order: ``warmup``
    untimed rounds, then ``rounds`` timed ones; ``before(name)``, if given, runs untimed before each call (e.g. a
    thread count to set). Returns each name's seconds per timed call by ``clock`` (process CPU time by default: with
    one thread it is the time the call needs, and the host's load inflates it less than wall time). A round's calls
    run within moments of each other, so the host's drift reaches every variant alike: the ratios a noisy machine
    moves least."""
    from tqdm import tqdm

    times = {name: [] for name in calls}
    for r in tqdm(range(warmup + rounds), desc=desc, leave=False, disable=desc is None):
        for name, call in calls.items():
            if before is not None:
                before(name)
            t0 = clock()
            call()
            if r >= warmup:
                times[name].append(clock() - t0)
    return times


def interleaved_cpu_steps(runs: dict, rounds: int, warmup: int, desc: str) -> dict[str, list[float]]:
    """:func:`interleaved_rounds` of greedy decode steps (``runs``: name -> ``{"model", "cache", "tokens"}``;
    ``tokens`` is advanced in place). Returns each run's process CPU seconds per timed step."""
    import torch

    def step(run):
        def call():
            logits = run["model"](input_ids=run["tokens"], past_key_values=run["cache"], use_cache=True).logits
            run["tokens"] = logits[:, -1:].argmax(-1)
        return call

    with torch.no_grad():
        return interleaved_rounds({name: step(run) for name, run in runs.items()}, rounds, warmup, desc=desc)


def ratio_summary(baseline: list[float], times: list[float], work: float = 1.0, baseline_work: float = 1.0) -> dict:
    """How much faster ``times`` are than ``baseline`` (seconds per round of the same rounds; ``work``: what one call
    does, e.g. the tokens of a batch): ``total``, the ratio of the rates over all rounds (the headline: a cache that
    pays for a demotion in one step of 16 is charged for it), and the ``median`` and ``quartiles`` of the per-round
    ratios."""
    import statistics

    ratios = [(work / t) / (baseline_work / b) for b, t in zip(baseline, times)]
    return {"total": (work / sum(times)) / (baseline_work / sum(baseline)), "median": statistics.median(ratios),
            "quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios}


def add_shared_options(ap: argparse.ArgumentParser, *, out_name: str, model_default: str | None = None,
                       threads_default: int | None = 1, worker_metavar: tuple[str, ...] | None = None) -> None:
    """``--out`` (under benchmarks/results by default), and where the script has them ``--model``, ``--threads``
    (``threads_default`` None: a script that fixes its thread counts) and the hidden ``--worker`` by which the parent
    hands one case to a worker process: the same names, choices and help in every speed benchmark."""
    if model_default is not None:
        ap.add_argument("--model", default=model_default, choices=MODELS,
                        help="smollm2: the bundled SmolLM2-135M; synthetic: a Llama with its shapes, random weights "
                             f"and 32k positions, for contexts past 8192 (default {model_default})")
    if threads_default is not None:
        ap.add_argument("--threads", type=int, default=threads_default,
                        help="intra-op threads, torch and Numba; 0: torch's default; on a shared machine use 1 "
                             f"(default {threads_default})")
    ap.add_argument("--out", type=Path, default=RESULTS / out_name,
                    help=f"result JSON; a PNG of the same name next to it (default results/{out_name})")
    if worker_metavar:
        ap.add_argument("--worker", nargs=len(worker_metavar), metavar=worker_metavar, help=argparse.SUPPRESS)


def add_step_options(ap: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    """``--steps`` and ``--warmup`` of the decode benchmarks (see :func:`time_decode_steps`)."""
    ap.add_argument("--steps", type=int, default=steps, help=f"timed decode steps; the median is reported "
                                                             f"(default {steps})")
    ap.add_argument("--warmup", type=int, default=warmup, help=f"untimed decode steps before them (default {warmup})")


def worker_env(threads: int, *, omp: bool, **extra: str) -> dict[str, str]:
    """The environment of a case's worker process. Numba reads NUMBA_NUM_THREADS only when it is imported, so the
    count must be set before the worker starts (torch's is set inside it by :func:`set_threads`); with ``omp``,
    OMP_NUM_THREADS too. ``threads`` 0 leaves both at their defaults. ``extra``: more variables (NUMBA_CACHE_DIR)."""
    env = dict(os.environ, **extra)
    if threads:
        env["NUMBA_NUM_THREADS"] = str(threads)
        if omp:
            env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_worker(script: str, worker_args: list, options: dict, env: dict[str, str], label: str, *,
               show_stderr: bool = False) -> dict:
    """Run one case as ``script --worker ARGS OPTION VALUE ...`` in a fresh interpreter (so that its peak RSS, its
    compiled kernels and its thread pools are its own) and return the JSON row it prints last; on failure raise
    with ``label`` and the end of its stderr. ``show_stderr``: the worker's stderr also goes to this process's as it
    comes (its progress bars, for cases that run for minutes)."""
    cmd = [sys.executable, script, "--worker", *map(str, worker_args)]
    for name, value in options.items():  # a list value: one argument per item (an nargs="+" option); True: a flag
        if value is True:
            cmd.append(name)
        else:
            cmd += [name, *map(str, value)] if isinstance(value, (list, tuple)) else [name, str(value)]
    if show_stderr:
        returncode, stdout, stderr = _run_showing_stderr(cmd, env)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    if returncode:
        raise RuntimeError(f"{label} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _run_showing_stderr(cmd: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """``cmd``'s exit status, stdout and stderr, its stderr copied to ours chunk by chunk as it comes (a progress
    bar redraws a line without ending it)."""
    import codecs
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    decoder, seen = codecs.getincrementaldecoder("utf-8")(errors="replace"), []

    def forward():
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            text = decoder.decode(chunk)
            seen.append(text)
            sys.stderr.write(text)
            sys.stderr.flush()

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    stdout = proc.stdout.read().decode("utf-8", errors="replace")
    returncode = proc.wait()
    thread.join()
    return returncode, stdout, "".join(seen)


def machine() -> str:
    """The machine a result was measured on, as the docs quote it: the CPU's model name, its cores and widest vector
    instruction set (AVX512 or AVX2: the Numba kernel's speed depends on it), and the GPU where torch sees one."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:  # not Linux: platform's name only
        pass
    isa = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    parts = [name, f"{os.cpu_count()} cores", *([isa] if isa else [])]
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        parts.append(sys.modules["torch"].cuda.get_device_name())
    return ", ".join(parts)


def run_meta(load_average_at_start: float) -> dict:
    """The run's context every result JSON records: machine, torch version, the command, the date, and the load
    average at start and at end (on a shared machine it says how far the timings can be trusted)."""
    import torch

    return {"machine": machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "load_average_at_start": load_average_at_start, "load_average_at_end": os.getloadavg()[0],
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def write_results(out: Path, meta: dict, results, plot=None) -> None:
    """``{"meta", "results"}`` to ``out`` and, given ``plot``, ``plot(results, png)`` to the PNG of the same name
    next to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if plot is None:
        print(f"wrote {out}")
        return
    png = out.with_suffix(".png")
    plot(results, png)
    print(f"wrote {out} and {png}")
