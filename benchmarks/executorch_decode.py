"""ExecuTorch programs of SmolLM2-135M and Gemma 3 270M: the static INT2 cache against the eager cache, and against
transformers' float StaticCache program (memory, speed). CPU, float32 weights, batch 1.

Parts (``--parts``, comma-separated):

* **build**: write the programs into ``--workdir`` (kept there; an existing file is reused): SmolLM2 with the shipped
  calibration (``OscarCache.from_pretrained``) and with transformers' ``StaticCache`` at ``--max-cache-len``
  (8192), Gemma 3 270M with its shipped calibration (sliding layers as rings) at prompt + new tokens.
* **equality**: a ``--prompt-tokens`` (1024) prompt from Emma fed token by token through the INT2 program, then
  ``--new-tokens`` (64) greedy tokens; the program's eager twin (``executorch_module``: the same module, run by
  PyTorch) fed the same tokens gives the reference tokens and logits. Also reported: the eager static cache as
  ``OscarExportableModule`` runs it by default (blocked body read, the prompt prefilled in one forward).
* **memory**: per program, the cache buffers as the runtime reports them (``MethodMeta`` attributes), the planned
  arenas (cache buffers, activations, inputs, outputs), the ``.pte`` size, and the peak RSS of a runner process
  (loading the program, 16 decode steps) next to that of the same process before loading it.
* **speed**: both SmolLM2 programs step at positions 2048 and ``max_cache_len - 64``, interleaved (one step of each
  per round, process CPU time, one XNNPACK thread; speedlib.interleaved_rounds). A static program computes over
  every slot at each step, so the cache is not prefilled. ``--profile``: one ETDump-profiled step of each program,
  time by operator (what bounds the step).

    python benchmarks/executorch_decode.py [--parts build,equality,memory,speed] [--workdir /tmp/hf_kvint2_pte]

Writes ``benchmarks/results/executorch_decode.json`` (speedlib's ``{meta, results}``; each part merged into it) and
``executorch_decode.png``.
Time on the 2-core development machine, one thread: building SmolLM2's INT2 program at 8192 about 15 minutes
(torch.export, then ExecuTorch's passes over ~20k nodes; 3.9 GB peak), the float one about 3 minutes; equality
minutes per model (a step computes over every slot of its program); memory and speed a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedlib import add_shared_options, run_meta, write_results

# torch, executorch and hf_kvint2's modules are imported where used, so that --help prints at once.
ARTIFACTS = {"smollm2": "hf-kvint2/SmolLM2-135M-Instruct-oscar", "gemma3": "hf-kvint2/gemma-3-270m-oscar"}


def load(name: str):
    import torch

    from hf_kvint2 import models

    loader = models.load_smollm2 if name == "smollm2" else models.load_gemma3
    model, tokenizer = loader(torch.float32, attn_implementation="oscar")
    return model.eval(), tokenizer


def shipped_cache(name: str, model):
    from hf_kvint2 import OscarCache

    return OscarCache.from_pretrained(ARTIFACTS[name], config=model.config)


def prompt_ids(tokenizer, n: int, offset: int = 400):
    import torch

    from hf_kvint2.evaluation import EVAL_TEXT, encode, load_text

    ids = encode(tokenizer, load_text(EVAL_TEXT))
    if len(ids) < offset + n:
        raise ValueError(f"The evaluation text has {len(ids)} tokens, fewer than {offset + n}.")
    return torch.tensor(ids[offset:offset + n])[None]


def programs(args) -> dict[str, dict]:
    """name -> {model, kind, max_cache_len} of every program: SmolLM2's two at ``--max-cache-len`` (memory, speed),
    and an INT2 program of each model at prompt + new tokens (equality: a step computes over every slot, so a
    program sized for the sequence runs it fastest)."""
    seq = args.prompt_tokens + args.new_tokens
    return {"smollm2_int2": {"model": "smollm2", "kind": "int2", "max_cache_len": args.max_cache_len},
            "smollm2_static": {"model": "smollm2", "kind": "static", "max_cache_len": args.max_cache_len},
            "smollm2_int2_seq": {"model": "smollm2", "kind": "int2", "max_cache_len": seq},
            "gemma3_int2_seq": {"model": "gemma3", "kind": "int2", "max_cache_len": seq}}


def _selected(args, names):
    return [n for n in names if not args.programs or n in args.programs.split(",")]


def pte_path(args, name: str, spec: dict) -> Path:
    return Path(args.workdir) / f"{name}_{spec['max_cache_len']}.pte"


# ------------------------------------------------------------------------------------------------ build
def build(args) -> dict:
    import torch

    from hf_kvint2.export_executorch import export_executorch, export_executorch_baseline

    out = {}
    for name in _selected(args, programs(args)):
        spec = programs(args)[name]
        path = pte_path(args, name, spec)
        if path.exists():
            out[name] = {"path": str(path), "reused": True, "pte_bytes": path.stat().st_size}
            print(name, "exists:", path)
            continue
        model, _ = load(spec["model"])
        with torch.no_grad():
            if spec["kind"] == "int2":
                info = export_executorch(model, path, shipped_cache(spec["model"], model),
                                         max_cache_len=spec["max_cache_len"],
                                         attention_block=spec["max_cache_len"])
            else:
                info = export_executorch_baseline(model, path, max_cache_len=spec["max_cache_len"])
        out[name] = info.to_dict()
        print(name, {k: v for k, v in out[name].items() if k != "buffers"})
        del model
    return out


# ------------------------------------------------------------------------------------------------ equality
def equality(args) -> dict:
    import torch

    from hf_kvint2.export import OscarExportableModule
    from hf_kvint2.export_executorch import ExecutorchRunner, executorch_module

    out = {}
    for name in _selected(args, ("smollm2_int2_seq", "gemma3_int2_seq")):
        spec = programs(args)[name]
        model, tokenizer = load(spec["model"])
        ids = prompt_ids(tokenizer, args.prompt_tokens)
        n, new, max_len = args.prompt_tokens, args.new_tokens, spec["max_cache_len"]
        row = {"prompt_tokens": n, "new_tokens": new, "max_cache_len": max_len}
        runner = ExecutorchRunner(pte_path(args, name, spec), config=model.config,
                                  cache=shipped_cache(spec["model"], model), threads=1)
        t0 = time.perf_counter()
        tokens, logits = runner.generate(ids, new, return_logits=True)
        row["program_seconds"] = round(time.perf_counter() - t0, 1)
        # the twin: the same module and body read, run by PyTorch, fed the same tokens
        module = executorch_module(model, shipped_cache(spec["model"], model), max_cache_len=max_len,
                                   attention_block=max_len)
        want, want_logits = [], []
        t0 = time.perf_counter()
        with torch.no_grad():
            for pos in range(n + new - 1):
                tok = ids[0, pos] if pos < n else want[-1]
                r = module(torch.tensor([[int(tok)]]), torch.tensor([pos]))[0, -1]
                if pos >= n - 1:
                    want.append(int(r.argmax()))
                    want_logits.append(r)
        module.unbind()
        row["twin_seconds"] = round(time.perf_counter() - t0, 1)
        want_logits = torch.stack(want_logits)
        diff = (logits - want_logits).abs()
        row.update(tokens_equal=tokens == want, first_difference=next((i for i, (a, b) in enumerate(zip(tokens, want))
                                                                        if a != b), None),
                   max_abs_logit_diff=diff.max().item(), max_abs_logit=want_logits.abs().max().item(),
                   tokens=tokens)
        # the eager static cache as OscarExportableModule runs it by default: prompt in one forward, blocked read
        module = OscarExportableModule(model, shipped_cache(spec["model"], model), max_cache_len=max_len)
        with torch.no_grad():
            step = module.prefill(ids)[0, -1]
            default = []
            for i in range(new):
                default.append(int(step.argmax()))
                if i < new - 1:
                    step = module(torch.tensor([[default[-1]]]), torch.tensor([n + i]))[0, -1]
        module.unbind()
        row["eager_default_tokens_equal"] = default == tokens
        row["eager_default_first_difference"] = next((i for i, (a, b) in enumerate(zip(tokens, default)) if a != b),
                                                     None)
        out[name] = row
        print(name, {k: v for k, v in row.items() if k != "tokens"})
        del model, runner
    return out


# ------------------------------------------------------------------------------------------------ memory
RSS_SCRIPT = """
import json, sys, resource, torch
from hf_kvint2.export_executorch import ExecutorchRunner
def rss():
    fields = dict(line.split(':', 1) for line in open('/proc/self/status'))
    return {k: int(fields[k].split()[0]) * 1024 for k in ('VmRSS', 'VmHWM')}
before = rss()
runner = ExecutorchRunner(sys.argv[1], threads=1)
loaded = rss()
runner.generate(torch.tensor([[1, 2, 3, 4]]), 13)
print(json.dumps({'before_load': before, 'after_load': loaded, 'after_16_steps': rss(), **runner.memory()}))
"""


def memory(args) -> dict:
    out = {}
    for name in _selected(args, ("smollm2_int2", "smollm2_static")):
        spec = programs(args)[name]
        path = pte_path(args, name, spec)
        res = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)], capture_output=True, text=True, check=True)
        measured = json.loads(res.stdout.strip().splitlines()[-1])
        row = {"max_cache_len": spec["max_cache_len"], "pte_bytes": path.stat().st_size,
               "kv_buffer_bytes": measured["cache_bytes"], "planned_bytes": measured["planned_bytes"],
               "peak_rss_bytes": measured["after_16_steps"]["VmHWM"],
               "rss_before_load_bytes": measured["before_load"]["VmRSS"],
               "rss_after_load_bytes": measured["after_load"]["VmRSS"]}
        out[name] = row
        print(name, row)
    return out


def memory_ratios(mem: dict) -> dict:
    """INT2 over the float program, for each measure (once both programs have been measured)."""
    a, b = mem["smollm2_int2"], mem["smollm2_static"]
    return {k: round(a[k] / b[k], 4) for k in ("kv_buffer_bytes", "planned_bytes", "pte_bytes", "peak_rss_bytes")}


# ------------------------------------------------------------------------------------------------ speed
def _profile(path: Path, position: int) -> dict:
    """Three ETDump-profiled decode steps from ``position``: the median milliseconds of each operator kind (XNNPACK's
    delegate calls as one entry), the largest first."""
    from executorch.devtools import Inspector

    from hf_kvint2.export_executorch import ExecutorchRunner

    runner = ExecutorchRunner(path, threads=1, etdump=True)
    runner.next_position = position
    for i in range(3):
        runner.step(1, position + i)
    dump = Path(path).with_suffix(".etdp")
    runner.program.write_etdump_result_to_file(str(dump), str(dump.with_suffix(".bin")))
    frame = Inspector(etdump_path=str(dump)).to_dataframe()
    ops = frame[frame["event_name"].str.startswith(("native_call_", "DELEGATE_CALL"))]
    by_op = {}
    for event, raw in zip(ops["event_name"], ops["raw"]):
        name = event.replace("native_call_", "")
        by_op[name] = by_op.get(name, 0.0) + statistics.median(raw)
    execute = frame[frame["event_name"] == "Method::execute"]["raw"].iloc[0]
    top = dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:10])
    return {"step_ms_median": round(statistics.median(execute), 2),
            "operators_ms": {k: round(v, 3) for k, v in top.items()}, "operators_total_ms": round(sum(by_op.values()), 2)}


def speed(args) -> dict:
    """Decode steps of both SmolLM2 programs at positions 2048 and ``max_cache_len - 64``, interleaved (one call of
    each per round, process CPU time, one XNNPACK thread). The cache is not prefilled: a static program's step
    computes over every slot whatever it holds (masked slots included), so its cost is set by ``max_cache_len`` and
    not by the values stored (as speedlib.fill_cache's random K/V for the eager caches)."""
    from speedlib import interleaved_rounds, ratio_summary

    from hf_kvint2.export_executorch import ExecutorchRunner

    specs = programs(args)
    paths = {name: pte_path(args, name, specs[name]) for name in ("smollm2_static", "smollm2_int2")}
    positions = [2048, args.max_cache_len - 64]
    out = {"positions": positions, "rounds": args.speed_steps, "warmup": 1, "threads": 1, "rows": []}
    for pos in positions:
        runners = {name: ExecutorchRunner(path, threads=1) for name, path in paths.items()}

        def call(runner):
            def step():
                runner.step(1, runner.next_position)
            return step

        for runner in runners.values():
            runner.next_position = pos
        times = interleaved_rounds({name: call(r) for name, r in runners.items()}, args.speed_steps, 1)
        row = {"position": pos}
        for name, ts in times.items():
            row[name] = {"median_ms": round(1000 * statistics.median(ts), 1),
                         "tokens_per_s": round(1 / statistics.median(ts), 3)}
        row["int2_over_static_tokens_per_s"] = ratio_summary(times["smollm2_static"], times["smollm2_int2"])
        out["rows"].append(row)
        print(row)
        del runners
    if args.profile:
        out["profile"] = {"position": positions[-1],
                          **{name: _profile(path, positions[-1]) for name, path in paths.items()}}
        print(out["profile"])
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    mem = result.get("memory", {})
    names = [n for n in ("smollm2_int2", "smollm2_static") if n in mem]
    if names:
        labels = ["INT2 (hf_kvint2)", "fp32 StaticCache"][:len(names)]
        kv = [mem[n]["kv_buffer_bytes"] / 2**20 for n in names]
        other = [(mem[n]["planned_bytes"] - mem[n]["kv_buffer_bytes"]) / 2**20 for n in names]
        axes[0].bar(labels, kv, label="cache buffers")
        axes[0].bar(labels, other, bottom=kv, label="other planned memory")
        axes[0].set_ylabel("MiB")
        axes[0].set_title(f"SmolLM2 program, max_cache_len {mem[names[0]]['max_cache_len']}")
        axes[0].legend()
    rows = result.get("speed", {}).get("rows", [])
    if rows:
        x = range(len(rows))
        for k, (name, label) in enumerate((("smollm2_int2", "INT2"), ("smollm2_static", "fp32 StaticCache"))):
            axes[1].bar([i + 0.4 * k for i in x], [r[name]["tokens_per_s"] for r in rows], width=0.4, label=label)
        axes[1].set_xticks([i + 0.2 for i in x], [f"position {r['position']}" for r in rows])
        axes[1].set_ylabel("decode tokens/s (1 thread)")
        axes[1].set_title("SmolLM2 .pte decode")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="build,equality,memory,speed",
                   help="comma-separated: build the programs, compare greedy tokens with the eager cache, measure "
                        "memory, measure decode speed")
    p.add_argument("--workdir", default="/tmp/hf_kvint2_pte", help="where the .pte files are written and reused")
    p.add_argument("--max-cache-len", type=int, default=8192, help="positions of the memory and speed programs")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length of the token comparison")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared after the prompt")
    p.add_argument("--speed-steps", type=int, default=8, help="timed rounds per position (one step per program)")
    p.add_argument("--profile", action="store_true",
                   help="also one ETDump profile per SmolLM2 program (ExecuTorch's Inspector needs pandas)")
    p.add_argument("--programs", default="", help="comma-separated program names to build / compare (default all)")
    add_shared_options(p, out_name="executorch_decode.json", threads_default=1)
    args = p.parse_args()
    load_start = os.getloadavg()[0]

    import torch

    torch.set_num_threads(args.threads)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    # each part's result is merged into the file, so that the parts can run one at a time
    previous = json.loads(args.out.read_text()) if args.out.exists() else {"meta": {}, "results": {}}
    results = previous["results"]
    from importlib.metadata import version

    meta = run_meta(load_start)
    meta.update(executorch=version("executorch"))
    # the command, date and load of every invocation whose parts the file holds
    meta["invocations"] = [*previous["meta"].get("invocations", []),
                           {k: meta[k] for k in ("command", "date_utc", "load_average_at_start")}]
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        found = {"build": build, "equality": equality, "memory": memory, "speed": speed}[part](args)
        # build, equality and memory report per program (--programs runs some); speed compares the two
        results[part] = found if part == "speed" else {**results.get(part, {}), **found}
        results[part]["seconds"] = round(time.perf_counter() - t0, 1)
        if part == "memory" and {"smollm2_int2", "smollm2_static"} <= results[part].keys():
            results[part]["smollm2_int2_over_static"] = memory_ratios(results[part])
            print(results[part]["smollm2_int2_over_static"])
        write_results(args.out, meta, results, plot)


if __name__ == "__main__":
    main()
