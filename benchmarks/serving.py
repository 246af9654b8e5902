"""Serving at equal KV memory on CPU: the same requests served by each contender with the same KV budget in bytes.

Workload: ``--requests`` prompts of ``--prompt-tokens`` tokens (uniform between the two bounds, seeded), each cut at
a random offset from the bundled evaluation texts (so that no two prompts share a prefix), ``--new-tokens`` greedy
tokens each (EOS ignored: every request generates them all). All requests arrive at once. SmolLM2-135M, fp32.

Contenders (``CONTENDERS``; one entry each, a function that serves the workload and returns a :class:`Trace`):

* ``paged_fp``: transformers' continuous batching (``init_continuous_batching``) with its own paged cache of fp32
  pages, attention "sdpa"; ``num_blocks = budget // bytes per block - 2`` (a block: ``page_size`` tokens of K and
  V in every layer; the engine allocates two more for padding tokens, counted in the budget as the INT2 engine
  counts its own), checked against the cache the engine built.
* ``static``: ``model.generate`` with ``DynamicCache``, left-padded batches in arrival order, each as large as fits
  the budget (``batch * (longest prompt + new tokens) * fp32 K/V bytes per token <= budget``), batch after batch.
* ``paged_int2_oscar``, ``paged_int2_scaled``: the same engine on INT2 pages through
  ``hf_kvint2.serving.enable_paged_int2(model, cache, kv_budget_bytes=budget, expected_request_tokens=...)`` (the
  window slots sized for the workload's mean request) with ``OscarCache`` (the shipped
  SmolLM2 calibration) or ``OscarScaledCache`` as the template. Skipped, with a message and no numbers, where
  ``hf_kvint2.serving`` is not importable. :func:`paged_int2` forwards keyword arguments to ``enable_paged_int2``.
* ``engine_unquantized``: the same engine with quantization off (``OscarScaledCache`` with a recent window longer
  than any request: every token stays at full precision in its request's window slot), a full-precision contender
  that separates the gain of INT2 from the gain of the engine.

Reported per contender, each in a fresh worker process (its RSS its own) after an untimed warm-up of two short
requests through the same engine: end-to-end generated tokens/s (all generated tokens / wall time from submitting
the requests to the last result; also per CPU-second of the process), decode tokens/s (tokens produced by decode
rows / time of the engine steps that hold only decode rows: prefill-free steps, scheduling included), TTFT p50 / p95
(first token - submission), preemptions (requests the engine evicted to make room: transformers'
``OffloadingManager.offload_requests``), peak concurrent requests (the scheduler's active requests, which hold KV),
and the peak RSS growth over the RSS before the engine or cache was built (sampled every 10 ms; measured after the
model's first forward and, for the INT2 contenders, a short generate that loads their compiled kernels: costs a
process pays once, not with the requests it serves), beside it the peak growth of its anonymous part (allocations, not
libraries' code paged in). Ratios are against the best full-precision contender of the same round; ``--rounds`` > 1
runs every contender once per round, in turn.

    python benchmarks/serving.py                                 # the default workload -> results/serving_cpu.*
    python benchmarks/serving.py --requests 4 --prompt-tokens 256 256 --new-tokens 8 --out /tmp/serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, run_meta, run_worker, worker_env, write_results

TEXTS = ("emma.txt", "sensesensibility.txt")  # the evaluation texts, never the calibration text
FP32_BYTES = 4
# transformers' paged cache allocates two blocks beyond num_blocks, never given to a request (padding tokens write
# there); the budget holds them, as it holds the INT2 engine's
ENGINE_RESERVED_BLOCKS = 2
WARMUP_TOKENS = 640  # longer than every cache's sink and recent window: the warm-up reaches the INT2 body's kernels


# ---------------------------------------------------------------------------------------------------- budget
def kv_bytes_per_token(config, element_bytes: int = FP32_BYTES) -> int:
    """Bytes of one token's K and V in every layer at full precision."""
    from hf_kvint2.model_config import model_shape

    shape = model_shape(config)
    return shape.num_layers * 2 * shape.num_key_value_heads * shape.head_dim * element_bytes


def paged_num_blocks(budget: int, page_size: int, bytes_per_token: int) -> int:
    """The most blocks of ``page_size`` tokens (K and V of every layer) a paged cache can offer requests within
    ``budget`` bytes, its ``ENGINE_RESERVED_BLOCKS`` included."""
    blocks = budget // (page_size * bytes_per_token) - ENGINE_RESERVED_BLOCKS
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {page_size} tokens "
                         f"({page_size * bytes_per_token} bytes) beside the engine's {ENGINE_RESERVED_BLOCKS} "
                         "reserved ones: raise --budget-mib or lower --page-size")
    return blocks


def static_batches(lengths: list[int], new_tokens: int, budget: int, bytes_per_token: int) -> list[list[int]]:
    """Requests (indices into ``lengths``, in order) grouped into left-padded batches, each as large as fits
    ``budget``: a batch holds ``len(batch) * (its longest prompt + new_tokens)`` tokens of K/V."""
    batches, batch, longest = [], [], 0
    for i, length in enumerate(lengths):
        if (length + new_tokens) * bytes_per_token > budget:
            raise ValueError(f"request {i} ({length} + {new_tokens} tokens, "
                             f"{(length + new_tokens) * bytes_per_token} bytes) does not fit the KV budget of "
                             f"{budget} bytes: raise --budget-mib or shorten --prompt-tokens")
        wider = max(longest, length)
        if batch and (len(batch) + 1) * (wider + new_tokens) * bytes_per_token > budget:
            batches.append(batch)
            batch, wider = [], length
        batch.append(i)
        longest = wider
    return batches + [batch] if batch else batches


# ---------------------------------------------------------------------------------------------------- workload
def workload(tokenizer, requests: int, prompt_tokens: tuple[int, int], seed: int) -> list[list[int]]:
    """``requests`` prompts, lengths uniform in ``prompt_tokens`` (inclusive), each from a random offset of the
    evaluation texts."""
    import random

    from hf_kvint2.evaluation import encode, load_text

    ids = [token for name in TEXTS for token in encode(tokenizer, load_text(name))]
    lo, hi = prompt_tokens
    if not 1 <= lo <= hi <= len(ids):
        raise ValueError(f"--prompt-tokens {lo} {hi}: need 1 <= low <= high <= {len(ids)} (the texts' tokens)")
    rng = random.Random(seed)
    prompts = []
    for _ in range(requests):
        length = rng.randint(lo, hi)
        start = rng.randrange(len(ids) - length + 1)
        prompts.append(ids[start:start + length])
    return prompts


# ---------------------------------------------------------------------------------------------------- measurement
def rss_bytes() -> tuple[int, int]:
    """(resident, file-backed resident) bytes: statm's resident and shared pages (shared: pages of mapped files,
    libraries' code included, and shared memory); their difference is the anonymous memory the process allocated."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page = os.sysconf("SC_PAGE_SIZE")
    return int(fields[1]) * page, int(fields[2]) * page


class RssSampler:
    """The peak resident set size while it runs, sampled every ``interval`` seconds by a daemon thread; beside it,
    the peak of its anonymous part (resident minus file-backed: allocations, not libraries' code paged in)."""

    def __init__(self, interval: float = 0.01):
        resident, shared = rss_bytes()
        self.start_bytes = self.peak_bytes = resident
        self.start_anon_bytes = self.peak_anon_bytes = resident - shared
        self._interval, self._stop = interval, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self):
        resident, shared = rss_bytes()
        self.peak_bytes = max(self.peak_bytes, resident)
        self.peak_anon_bytes = max(self.peak_anon_bytes, resident - shared)

    def _run(self):
        while not self._stop.wait(self._interval):
            self._sample()

    def stop(self) -> int:
        """Stops sampling; returns the peak growth over the RSS at start."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak_bytes - self.start_bytes

    @property
    def anon_growth_bytes(self) -> int:
        return self.peak_anon_bytes - self.start_anon_bytes


@dataclass
class Step:
    """One forward of the engine: when it ran (wall and process CPU seconds, scheduling included), its decode rows
    (one query token of a request that has generated before), its prefill tokens, and the requests holding KV."""

    wall_s: float
    cpu_s: float
    decode_rows: int
    prefill_tokens: int
    active: int
    end: float  # perf_counter at its end


@dataclass
class Trace:
    """What a contender's serving run leaves: its steps, each request's first-token time and tokens, preemptions and
    what the contender says about its KV memory."""

    start: float = 0.0  # perf_counter when the requests were submitted
    cpu_start: float = 0.0
    end: float = 0.0  # when the last result arrived
    cpu_end: float = 0.0
    steps: list[Step] = field(default_factory=list)
    first_token: dict = field(default_factory=dict)  # request index -> perf_counter of its first token
    tokens: dict = field(default_factory=dict)  # request index -> generated token ids
    forwards: dict = field(default_factory=dict)  # request id -> [(past length, query tokens)] of its forwards
    request_ids: dict = field(default_factory=dict)  # request index -> the engine's request id
    check: Callable | None = None  # an untimed check to run after the RSS sampling, returning its counts
    preemptions: int = 0
    engine: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def summarize(trace: Trace, prompts: list[list[int]]) -> dict:
    """The reported numbers of one run (see the module docstring)."""
    generated = sum(len(t) for t in trace.tokens.values())
    decode_steps = [s for s in trace.steps if s.decode_rows and not s.prefill_tokens]
    mixed = [s for s in trace.steps if s.decode_rows and s.prefill_tokens]
    decode_tokens = sum(s.decode_rows for s in decode_steps)
    decode_wall = sum(s.wall_s for s in decode_steps)
    decode_cpu = sum(s.cpu_s for s in decode_steps)
    ttft = [trace.first_token[i] - trace.start for i in sorted(trace.first_token)]
    wall, cpu = trace.end - trace.start, trace.cpu_end - trace.cpu_start
    return {
        "requests": len(prompts), "completed": len(trace.tokens), "generated_tokens": generated,
        "prompt_tokens": sum(len(p) for p in prompts), "wall_s": wall, "cpu_s": cpu,
        "tokens_per_s": generated / wall, "tokens_per_cpu_s": generated / cpu if cpu else float("nan"),
        "decode_tokens_per_s": decode_tokens / decode_wall if decode_wall else float("nan"),
        "decode_tokens_per_cpu_s": decode_tokens / decode_cpu if decode_cpu else float("nan"),
        "decode_only_steps": len(decode_steps), "decode_only_steps_s": decode_wall,
        "decode_tokens_in_decode_only_steps": decode_tokens, "mixed_steps": len(mixed),
        "mixed_steps_s": sum(s.wall_s for s in mixed), "steps": len(trace.steps),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95), "ttft_max_s": max(ttft, default=0.0),
        "preemptions": trace.preemptions, "peak_concurrent_requests": max((s.active for s in trace.steps), default=0),
        "mean_concurrent_requests_per_step": (sum(s.active for s in trace.steps) / len(trace.steps)
                                              if trace.steps else 0.0),
        "timeline": {"t_s": [round(s.end - s.wall_s - trace.start, 4) for s in trace.steps],  # each step's start
                     "active": [s.active for s in trace.steps]},
        **trace.engine,
    }


# ---------------------------------------------------------------------------------------------------- contenders
def generation_config(new_tokens: int):
    from transformers import GenerationConfig

    # eos -1: no stop token (every request generates new_tokens); the engine treats a negative id as none
    return GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0)


def engine_config(args, **overrides):
    """The continuous batching settings every engine contender shares; ``overrides`` set the budget's part."""
    from transformers import ContinuousBatchingConfig

    # no prefix sharing: the prompts share no prefix, and blocks kept for reuse would blur the budget
    settings = {"page_size": args.page_size, "allow_block_sharing": False, "max_batch_tokens": args.max_batch_tokens,
                "scheduler_type": "fifo", "use_cuda_graph": False}
    return ContinuousBatchingConfig(**{**settings, **overrides})


class EngineProbe:
    """Instruments one ``ContinuousBatchingManager`` from outside, on the instance: each generation-loop iteration
    that ran a forward becomes a :class:`Step` (its rows classified before the forward, timed with its scheduling
    and update), each request's first token is stamped when its step ends, and the batch processor's
    ``offloading_manager.offload_requests`` counts the active requests it evicts."""

    def __init__(self, manager, threads: int):
        self.manager, self.threads, self.trace, self.ids = manager, threads, Trace(), {}
        self.processor, self._pending, self.engine_threads = None, None, None
        create, body, step = manager._create_batch_processor, manager._generation_loop_body, manager._generation_step

        def create_processor():
            processor = create()
            self.processor = processor
            extend = processor.cache.extend_read_and_write_indices

            def recorded_extend(request_id, past_length, query_length, *rest):  # the request's chunks, in order
                self.trace.forwards.setdefault(request_id, []).append((past_length, query_length))
                return extend(request_id, past_length, query_length, *rest)

            processor.cache.extend_read_and_write_indices = recorded_extend
            offload = processor.offloading_manager.offload_requests

            def counted_offload():
                before = len(processor.scheduler.active_requests)
                done = offload()
                self.trace.preemptions += before - len(processor.scheduler.active_requests)
                return done

            processor.offloading_manager.offload_requests = counted_offload
            return processor

        def generation_step():
            if self.engine_threads is None:  # the engine's own thread: its OpenMP pool follows the calling thread
                import torch

                if self.threads:
                    torch.set_num_threads(self.threads)
                self.engine_threads = torch.get_num_threads()
            rows = self.processor.inputs_and_outputs.requests_in_batch
            decode = sum(1 for r in rows if r.query_length == 1 and r.has_new_token and r.state.generated_len())
            prefill = sum(r.query_length for r in rows) - decode
            self._pending = (decode, prefill, len(self.processor.scheduler.active_requests))
            step()

        def loop_body(batch_processor, bootstrapping):
            self._pending = None
            t, c = time.perf_counter(), time.process_time()
            keep = body(batch_processor, bootstrapping)
            if self._pending is not None:
                end = time.perf_counter()
                self.trace.steps.append(Step(end - t, time.process_time() - c, *self._pending, end=end))
                for r in batch_processor.inputs_and_outputs.requests_in_batch:
                    index = self.ids.get(r.state.request_id)
                    if r.has_new_token and index is not None and index not in self.trace.first_token:
                        self.trace.first_token[index] = end
            return keep

        manager._create_batch_processor = create_processor
        manager._generation_loop_body = loop_body
        manager._generation_step = generation_step

    def serve(self, prompts: list[list[int]], new_tokens: int, desc: str | None = None) -> dict:
        """Submits ``prompts`` at once and waits for every result (a progress bar of finished requests with
        ``desc``); returns request index -> GenerationOutput."""
        from tqdm import tqdm

        results, ids = {}, self.manager.add_requests(inputs=prompts, max_new_tokens=new_tokens)
        self.ids = {request_id: i for i, request_id in enumerate(ids)}
        bar = tqdm(total=len(ids), desc=desc, unit="request", disable=desc is None)
        while len(results) < len(ids):
            out = self.manager.get_result(timeout=1)
            if out is None:
                if not self.manager.is_running():
                    raise RuntimeError(f"the engine stopped with {len(ids) - len(results)} requests unfinished")
                continue
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.is_finished():
                results[self.ids[out.request_id]] = out
                bar.update(1)
        bar.close()
        return results

    def reset(self) -> None:
        self.trace = Trace()


def serve_engine(model, prompts, args, cb_config, warmup_prompts) -> Trace:
    """Serves ``prompts`` through transformers' continuous batching manager of ``model``, instrumented by
    :class:`EngineProbe`, after an untimed warm-up through the same manager; records the engine's KV cache."""
    import torch
    from speedlib import cache_bytes

    manager = model.init_continuous_batching(generation_config=generation_config(args.new_tokens),
                                             continuous_batching_config=cb_config)
    probe = EngineProbe(manager, args.threads)
    manager.start()
    try:
        probe.serve(warmup_prompts, 4)
        probe.reset()
        trace = probe.trace
        trace.start, trace.cpu_start = time.perf_counter(), time.process_time()
        results = probe.serve(prompts, args.new_tokens, desc=args.progress)
        trace.end, trace.cpu_end = time.perf_counter(), time.process_time()
        trace.tokens = {i: list(out.generated_tokens) for i, out in results.items()}
        cache = probe.processor.cache
        trace.engine = {"engine_cache_class": type(cache).__name__, "engine_cache_bytes": cache_bytes(cache),
                        "engine_num_blocks": getattr(cache, "num_blocks", None),
                        "engine_max_batch_tokens": getattr(cache, "max_batch_tokens", None),
                        "engine_threads": probe.engine_threads,
                        "attn_implementation": model.config._attn_implementation}
        trace.request_ids = {i: request_id for request_id, i in probe.ids.items()}
        allocators = getattr(cache, "cache_allocators", {})
        if allocators:
            trace.engine["engine_bytes_per_block"] = sum(a.bytes_per_block for a in allocators.values())
        if isinstance(getattr(cache, "cache_tensor", None), torch.Tensor):  # the engine's one arena of pages
            trace.engine["engine_cache_tensor_bytes"] = cache.cache_tensor.nbytes
    finally:
        manager.stop(block=True)
        manager.destroy()
    return trace


def paged_fp(model, prompts, args, warmup_prompts) -> Trace:
    """transformers' continuous batching on its own fp32 paged cache, ``num_blocks`` from the budget."""
    per_token = kv_bytes_per_token(model.config)
    blocks = paged_num_blocks(args.budget, args.page_size, per_token)
    trace = serve_engine(model, prompts, args, engine_config(args, num_blocks=blocks), warmup_prompts)
    engine = trace.engine
    if (engine["engine_num_blocks"], engine["engine_bytes_per_block"]) != (blocks, args.page_size * per_token) \
            or engine["engine_cache_tensor_bytes"] > args.budget:
        raise RuntimeError(f"the engine built {engine['engine_num_blocks']} blocks of {engine['engine_bytes_per_block']} "
                           f"bytes in {engine['engine_cache_tensor_bytes']} bytes for {blocks} blocks of "
                           f"{args.page_size * per_token} bytes within a budget of {args.budget} bytes")
    engine.update({"kv_budget_bytes": args.budget, "kv_bytes": engine["engine_cache_tensor_bytes"],
                   "requested_num_blocks": blocks})
    return trace


class StepStamps:
    """A stopping criterion that never stops: it stamps the end of every generate step (prefill, then decodes)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.stamps.append((time.perf_counter(), time.process_time()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def static(model, prompts, args, warmup_prompts) -> Trace:
    """``model.generate`` with ``DynamicCache`` on left-padded batches, each as large as fits the budget."""
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache, StoppingCriteriaList

    per_token = kv_bytes_per_token(model.config)
    batches = static_batches([len(p) for p in prompts], args.new_tokens, args.budget, per_token)

    def generate(rows: list[list[int]], new_tokens: int, stamps: StepStamps):
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config(new_tokens),
                                 past_key_values=DynamicCache(config=model.config),
                                 stopping_criteria=StoppingCriteriaList([stamps]))
        return out[:, width:].tolist()

    generate(warmup_prompts, 4, StepStamps())
    trace = Trace(start=time.perf_counter(), cpu_start=time.process_time())
    bar = tqdm(total=len(prompts), desc=args.progress, unit="request", disable=args.progress is None)
    for batch in batches:
        stamps = StepStamps()
        t, c = time.perf_counter(), time.process_time()
        rows = [prompts[i] for i in batch]
        tokens = generate(rows, args.new_tokens, stamps)
        width = max(len(r) for r in rows)
        for k, (end, cpu) in enumerate(stamps.stamps):
            decode, prefill = (0, len(batch) * width) if k == 0 else (len(batch), 0)
            trace.steps.append(Step(end - t, cpu - c, decode, prefill, len(batch), end=end))
            t, c = end, cpu
        for i, row in zip(batch, tokens):
            trace.first_token[i] = stamps.stamps[0][0]
            trace.tokens[i] = row
        bar.update(len(batch))
    bar.close()
    trace.end, trace.cpu_end = time.perf_counter(), time.process_time()
    longest = max(len(batch) * (max(len(prompts[i]) for i in batch) + args.new_tokens) for batch in batches)
    trace.engine = {"kv_budget_bytes": args.budget, "kv_bytes": longest * per_token, "batches": len(batches),
                    "batch_sizes": [len(b) for b in batches], "threads": torch.get_num_threads(),
                    "attn_implementation": model.config._attn_implementation}
    return trace


NEAR_TIE = 1e-3  # a top-2 logit gap under this at the first differing token: a near-tie, not a wrong token


def check_tokens(model, make_template, prompts, args, trace: Trace) -> dict:
    """Each request served again alone, untimed, with a cache of its own from the same template, its prompt fed in
    the chunks the engine ran it in (``trace.forwards``): its greedy tokens against the engine's. A difference is a
    near-tie where the alone run's top-2 logit gap at the first differing token is under ``NEAR_TIE``. A request the
    engine preempted (recomputed from its start) is counted apart."""
    import torch
    from tqdm import tqdm

    model.set_attn_implementation("oscar")
    counts = {"requests": len(prompts), "equal": 0, "near_tie": 0, "different": 0, "recomputed": 0,
              "near_tie_limit": NEAR_TIE, "first_differences": []}
    for i in tqdm(range(len(prompts)), desc="tokens vs generate alone", disable=args.progress is None):
        forwards = trace.forwards.get(trace.request_ids[i], [])
        pasts = [p for p, _ in forwards]
        if pasts != sorted(pasts):
            counts["recomputed"] += 1
            continue
        chunks = [n for p, n in forwards if p < len(prompts[i])]
        cache, pos = make_template(model, args), 0
        with torch.inference_mode():
            for n in chunks:
                logits = model(input_ids=torch.tensor([prompts[i][pos:pos + n]]),
                               position_ids=torch.arange(pos, pos + n)[None], cache=cache).logits[0, -1]
                pos += n
            got, gap = trace.tokens[i], None
            for j, token in enumerate(got):
                top = logits.topk(2)
                if int(top.indices[0]) != token:
                    gap = float(top.values[0] - top.values[1])
                    counts["first_differences"].append({"request": i, "token": j, "top2_gap": gap})
                    break
                if j + 1 < len(got):
                    logits = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]),
                                   cache=cache).logits[0, -1]
                    pos += 1
        if gap is None:
            counts["equal"] += 1
        else:
            counts["near_tie" if gap < NEAR_TIE else "different"] += 1
    return counts


def mean_request_tokens(args) -> int:
    """The workload's mean request length (prompt and generated tokens): what the INT2 engine sizes its window
    slots for (``expected_request_tokens``), as a server is configured for the requests it expects."""
    return (args.prompt_tokens[0] + args.prompt_tokens[1]) // 2 + args.new_tokens


def paged_int2(make_template: Callable, **engine_options) -> Callable:
    """A contender serving through the engine on INT2 pages: ``enable_paged_int2(model, make_template(model, args),
    kv_budget_bytes=budget, expected_request_tokens=mean_request_tokens(args), **engine_options)``, then the same
    manager and settings as ``paged_fp`` except the budget, which the engine takes in bytes."""

    def serve(model, prompts, args, warmup_prompts) -> Trace:
        from hf_kvint2.serving import disable_paged_int2, enable_paged_int2

        options = {"expected_request_tokens": mean_request_tokens(args), **engine_options}
        layout = enable_paged_int2(model, make_template(model, args), kv_budget_bytes=args.budget, **options)
        try:
            trace = serve_engine(model, prompts, args, engine_config(args), warmup_prompts)
        finally:
            disable_paged_int2(model)
        if args.check_tokens:
            trace.check = lambda: check_tokens(model, make_template, prompts, args, trace)
        trace.engine.update({"kv_budget_bytes": args.budget, "engine_options": options,
                             **{f"layout_{name}": getattr(layout, name) for name in LAYOUT_FIELDS
                                if hasattr(layout, name)}})
        return trace

    def prepare(model, args) -> None:
        """Load the compiled kernels the INT2 caches run (a short generate with one such cache), before the RSS
        baseline: a once-per-process cost, like the model's first forward, not the engine's."""
        import torch

        model.set_attn_implementation("oscar")
        with torch.inference_mode():
            model.generate(torch.arange(3, 3 + WARMUP_TOKENS)[None], attention_mask=torch.ones(1, WARMUP_TOKENS),
                           generation_config=generation_config(4), cache=make_template(model, args))
        model.set_attn_implementation("sdpa")

    serve.prepare = prepare
    return serve


# how the INT2 engine split the budget (hf_kvint2.serving.PagedLayout), recorded with its results
LAYOUT_FIELDS = ("window_slots", "window_bytes", "num_blocks", "bytes_per_block", "page_tokens")


def oscar_template(model, args):
    from hf_kvint2.demo import make_oscar_cache

    return make_oscar_cache(model)


def scaled_template(model, args):
    from hf_kvint2 import OscarScaledCache

    return OscarScaledCache(config=model.config)


def unquantized_template(model, args):
    """The same engine with quantization off: a recent window longer than any request, so no token is ever
    demoted to INT2 and every request's K/V stays at full precision in its window slot (the slots, sized by the
    budget, then hold few requests)."""
    from hf_kvint2 import OscarScaledCache

    return OscarScaledCache(config=model.config, recent_tokens=args.prompt_tokens[1] + args.new_tokens)


@dataclass(frozen=True)
class Contender:
    label: str
    full_precision: bool  # a baseline: the ratios are against the best of these
    serve: Callable  # (model, prompts, args, warmup_prompts) -> Trace
    needs: str | None = None  # a module the contender imports; skipped with a message where it is missing


CONTENDERS = {
    "paged_fp": Contender("transformers CB, fp32 pages", True, paged_fp),
    "static": Contender("static generate, DynamicCache", True, static),
    "paged_int2_oscar": Contender("CB, INT2 pages (OscarCache)", False, paged_int2(oscar_template),
                                  needs="hf_kvint2.serving"),
    "paged_int2_scaled": Contender("CB, INT2 pages (OscarScaledCache)", False, paged_int2(scaled_template),
                                   needs="hf_kvint2.serving"),
    "engine_unquantized": Contender("CB, the INT2 engine with quantization off", True,
                                    paged_int2(unquantized_template), needs="hf_kvint2.serving"),
}


# ---------------------------------------------------------------------------------------------------- worker / main
def missing_module(name: str | None) -> str | None:
    import importlib.util

    if name is None:
        return None
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    return None if found else f"{name} is not importable here"


def worker(name: str, args) -> dict:
    import warnings

    import torch
    from speedlib import set_threads

    from hf_kvint2.models import load_smollm2

    warnings.simplefilter("ignore")
    set_threads(args.threads)
    contender = CONTENDERS[name]
    skipped = missing_module(contender.needs)
    if skipped:
        return {"contender": name, "label": contender.label, "skipped": skipped}
    args.progress = contender.label  # the label of the worker's progress bar
    args.check_tokens = name in args.check_tokens
    model, tokenizer = load_smollm2(torch.float32, attn_implementation="sdpa")
    prompts = workload(tokenizer, args.requests, tuple(args.prompt_tokens), args.seed)
    warm = min(WARMUP_TOKENS, args.prompt_tokens[0])  # the shortest prompt fits every contender's budget
    warmup_prompts = workload(tokenizer, 2, (warm, warm), args.seed + 1)
    with torch.no_grad():  # the first forward materializes ~500 MiB of the model's own: not the contender's
        model(input_ids=torch.tensor(warmup_prompts[0][:8])[None], use_cache=False)
    prepare = getattr(contender.serve, "prepare", None)
    if prepare is not None:  # once-per-process costs the contender's code has (compiled kernels loaded)
        prepare(model, args)
    sampler = RssSampler()
    trace = contender.serve(model, prompts, args, warmup_prompts)
    growth = sampler.stop()
    if trace.check is not None:
        trace.engine["token_check"] = trace.check()
    row = {"contender": name, "label": contender.label, "full_precision": contender.full_precision,
           **summarize(trace, prompts), "rss_before_mib": sampler.start_bytes / 2**20,
           "peak_rss_growth_mib": growth / 2**20, "peak_rss_growth_vs_budget": growth / args.budget,
           "peak_anon_rss_growth_mib": sampler.anon_growth_bytes / 2**20,
           "tokens": [trace.tokens[i] for i in sorted(trace.tokens)]}
    if row["completed"] != len(prompts):
        raise RuntimeError(f"{name}: {row['completed']} of {len(prompts)} requests completed")
    return row


def compare(rows: list[dict]) -> None:
    """Per round: ratios to the best full-precision contender (by each metric), and how many requests got the same
    tokens as static ``generate`` with ``DynamicCache`` (the full-precision reference; informative only: padding and
    paged reads reorder float sums, so a near-tie can flip)."""
    for r in {row["round"] for row in rows}:
        done = [row for row in rows if row["round"] == r and "skipped" not in row]
        fp = [row for row in done if row["full_precision"]]
        reference = next((row for row in done if row["contender"] == "static"), None)
        for row in done:
            for metric in ("tokens_per_s", "decode_tokens_per_s", "tokens_per_cpu_s", "decode_tokens_per_cpu_s"):
                if fp:
                    best = max(fp, key=lambda b: b[metric])
                    row[f"{metric}_vs_best_fp"] = row[metric] / best[metric]
                    row[f"{metric}_best_fp"] = best["contender"]
            if reference is not None:
                same = [a == b for a, b in zip(row["tokens"], reference["tokens"])]
                row["requests_with_static_tokens"] = sum(same)
        paged = next((row for row in done if row["contender"] == "paged_fp"), None)
        for row in done:
            if paged is not None and paged["peak_concurrent_requests"]:
                row["peak_concurrent_vs_paged_fp"] = row["peak_concurrent_requests"] / paged["peak_concurrent_requests"]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in results["rows"] if "skipped" not in row and row["round"] == 0]
    labels = [row["label"] for row in rows]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    panels = [(axes[0, 0], "tokens_per_s", "end-to-end generated tokens / s"),
              (axes[0, 1], "decode_tokens_per_s", "decode tokens / s (prefill-free steps)")]
    for ax, metric, title in panels:
        ax.bar(range(len(rows)), [row[metric] for row in rows], color=[f"C{i}" for i in range(len(rows))])
        ax.set_title(title)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
    ax = axes[1, 0]
    width = 0.4
    ax.bar([i - width / 2 for i in range(len(rows))], [row["ttft_p50_s"] for row in rows], width, label="p50")
    ax.bar([i + width / 2 for i in range(len(rows))], [row["ttft_p95_s"] for row in rows], width, label="p95")
    ax.set_title("time to first token (s), all requests submitted at once")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=15, fontsize=8)
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    for i, row in enumerate(rows):
        ax.step(row["timeline"]["t_s"], row["timeline"]["active"], where="post", color=f"C{i}",
                label=f"{row['label']} (peak {row['peak_concurrent_requests']}, "
                      f"{row['preemptions']} preemptions)")
    ax.set_title("concurrent requests holding KV")
    ax.set_xlabel("seconds since the requests arrived")
    ax.legend(fontsize=7)
    meta = results["workload"]
    fig.suptitle(f"Serving {meta['requests']} requests ({meta['prompt_tokens'][0]}-{meta['prompt_tokens'][1]} prompt "
                 f"tokens, {meta['new_tokens']} new) at a {meta['budget_mib']:g} MiB KV budget, SmolLM2-135M fp32, "
                 "CPU (hf_kvint2 benchmarks/serving.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS),
                    help="contenders served, in this order each round (default: all)")
    ap.add_argument("--requests", type=int, default=32, help="requests served (default 32)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[2048, 4096], metavar=("LOW", "HIGH"),
                    help="prompt lengths, uniform between LOW and HIGH inclusive (default 2048 4096)")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per request (default 128)")
    ap.add_argument("--budget-mib", type=float, default=512.0, help="KV budget of every contender in MiB "
                                                                    "(default 512)")
    ap.add_argument("--page-size", type=int, default=256, help="tokens per page of the engine contenders "
                                                               "(default 256, transformers' default)")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="query tokens per engine step (default: the engine's, 8192)")
    ap.add_argument("--check-tokens", nargs="+", default=[], metavar="CONTENDER",
                    choices=[name for name in CONTENDERS if name.startswith("paged_int2")],
                    help="INT2 contenders whose requests are each run again alone after serving, with a cache of "
                         "their own (untimed), counting the requests whose greedy tokens equal the engine's")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every contender, in turn (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    add_shared_options(ap, out_name="serving_cpu.json", threads_default=1, worker_metavar=("CONTENDER",))
    args = ap.parse_args()
    args.budget = int(args.budget_mib * 2**20)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args)))
        return

    from tqdm import tqdm

    load = os.getloadavg()[0]
    env = worker_env(args.threads, omp=True)
    options = {"--requests": args.requests, "--prompt-tokens": args.prompt_tokens, "--new-tokens": args.new_tokens,
               "--budget-mib": args.budget_mib, "--page-size": args.page_size, "--seed": args.seed,
               "--threads": args.threads}
    if args.max_batch_tokens is not None:
        options["--max-batch-tokens"] = args.max_batch_tokens
    if args.check_tokens:
        options["--check-tokens"] = args.check_tokens
    if any(getattr(CONTENDERS[name].serve, "prepare", None) for name in args.contenders):
        # Compiled once here, each worker loads the INT2 kernels from Numba's cache: a worker that compiled them
        # would keep the compiler's freed memory among its own, blurring the RSS growth it measures (~40 MiB).
        tqdm.write("compiling the INT2 kernels ahead (python -m hf_kvint2.precompile)")
        subprocess.run([sys.executable, "-m", "hf_kvint2.precompile"], env=env, check=True, stdout=subprocess.DEVNULL)
    rows = []
    jobs = [(r, name) for r in range(args.rounds) for name in args.contenders]
    for r, name in tqdm(jobs, desc="serving benchmark"):
        row = {**run_worker(__file__, [name], options, env, name, show_stderr=True), "round": r}
        rows.append(row)
        if "skipped" in row:
            tqdm.write(f"{row['label']}: skipped ({row['skipped']})")
        else:
            tqdm.write(f"{row['label']}: {row['tokens_per_s']:.2f} tokens/s, decode {row['decode_tokens_per_s']:.2f}, "
                       f"TTFT p50 {row['ttft_p50_s']:.1f} s, peak {row['peak_concurrent_requests']} concurrent, "
                       f"{row['preemptions']} preemptions, RSS +{row['peak_rss_growth_mib']:.0f} MiB")
    compare(rows)
    for row in rows:
        row.pop("tokens", None)
    workload_meta = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "budget_mib": args.budget_mib, "budget_bytes": args.budget, "page_size": args.page_size,
                     "max_batch_tokens": args.max_batch_tokens, "seed": args.seed, "texts": list(TEXTS)}
    meta = {"model": "SmolLM2-135M-Instruct, fp32", "threads": args.threads, "rounds": args.rounds, **run_meta(load),
            "arrival": "all requests submitted at once", "greedy": True, "eos": "ignored",
            "decode": "decode rows / wall time of engine steps without prefill tokens (scheduling included)",
            "rss": "peak RSS growth over the RSS before the engine or cache was built (after the model's first "
                   "forward and the INT2 kernels' loading from Numba's cache, compiled ahead by python -m "
                   "hf_kvint2.precompile), sampled every 10 ms; peak_anon_rss_growth_mib: the same for its anonymous "
                   "part (resident minus file-backed pages)"}
    write_results(args.out, meta, {"workload": workload_meta, "rows": rows}, plot)
    for row in rows:
        if "skipped" in row:
            print(f"{row['label']:36s} skipped: {row['skipped']}")
            continue
        print(f"{row['label']:36s} round {row['round']}: {row['tokens_per_s']:7.2f} tokens/s "
              f"({row.get('tokens_per_s_vs_best_fp', float('nan')):.2f}x best fp), decode "
              f"{row['decode_tokens_per_s']:7.2f} ({row.get('decode_tokens_per_s_vs_best_fp', float('nan')):.2f}x), "
              f"TTFT p50/p95 {row['ttft_p50_s']:.2f}/{row['ttft_p95_s']:.2f} s, {row['preemptions']} preemptions, "
              f"peak {row['peak_concurrent_requests']} concurrent, RSS +{row['peak_rss_growth_mib']:.0f} MiB "
              f"(budget {args.budget_mib:g})")


if __name__ == "__main__":
    main()
