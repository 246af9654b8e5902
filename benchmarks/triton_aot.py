"""Compile every Triton kernel in every dispatcher configuration for sm_80 and sm_90 on a CPU, report resources.

    python benchmarks/triton_aot.py                          # full matrix, both targets -> results/triton_aot.json
    python benchmarks/triton_aot.py --reuse benchmarks/results/triton_aot.json   # after a kernel edit: recompile
                                                             # only the specialisations of the edited kernels
    python benchmarks/triton_aot.py --triton 3.6.0 --no-roofline --reuse benchmarks/results/triton_aot_triton3.6.0.json
                                                             # another Triton (pip --target, cached)
                                                             # -> results/triton_aot_triton3.6.0.json
    python benchmarks/triton_aot.py --check benchmarks/results/triton_aot*.json --sample 2   # what CI runs
    python benchmarks/triton_aot.py --filter bfloat16_d128 --arch 90 --out /tmp/aot   # a subset

Configurations: ``hf_kvint2.kernels.aot.dispatch_configurations()`` (cache layouts x K/V dtype x head_dim x GQA); the
launches of each come from the wrappers themselves (``hf_kvint2.kernels.aot``); identical specialisations are
compiled once. Per specialisation and target: registers per thread, spill bytes, shared memory, occupancy. The
JSON also holds the roofline predictions (``benchmarks/roofline.py``) and ``triton_aot.png`` plots them.

``--reuse REPORT`` takes results from an earlier report for specialisations whose kernel source hash, Triton
version and target are unchanged (compiling is a pure function of those) and compiles everything else;
``--verify N`` recompiles N of the reused ones per kernel and target and fails unless registers, shared memory and
spills are identical. Exit status 1 when any configuration fails to compile.

``--check REPORT...`` (CI) compiles almost nothing: it fails unless each report holds a successful compile of every
specialisation of every dispatcher configuration on every target for the kernels' *current* source
(``aot.kernel_source_hash``: the code, not its position in the file), then recompiles ``--sample N`` of them per
kernel and target with the installed Triton in a fresh cache: the quickest, and others chosen by the source hash
(so each kernel edit samples other configurations). Where the installed Triton made the report, the recompiled
registers, shared memory and spills must equal the committed ones; with another Triton they must compile and fit.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled; Triton is not imported yet
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless set; 1 is every version's default

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def use_triton(version: str) -> None:
    """Re-run this script with Triton ``version`` first on sys.path (installed once with pip --target)."""
    import importlib.metadata

    if importlib.metadata.version("triton") == version:
        return
    target = Path.home() / ".cache" / "hf_kvint2" / f"triton-{version}"
    if not (target / "triton").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"triton=={version}"], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]),
               HF_KVINT2_AOT_TRITON=version)  # the re-run writes the per-version report
    args = [a for i, a in enumerate(sys.argv) if a != "--triton" and (i == 0 or sys.argv[i - 1] != "--triton")]
    sys.exit(subprocess.run([sys.executable, *args], check=False, env=env).returncode)


def layout_dict(layout) -> dict:
    return {"axis": layout.axis, "group_size": layout.group_size, "clip": layout.clip,
            "token_scaling": layout.token_scaling, "range_clip": layout.range_clip}


def load_known(paths: list[Path], triton_version: str, source_hashes: dict) -> dict:
    known = {}
    for path in paths or []:
        if path.exists():
            known.update(_load_known(path, triton_version, source_hashes))
    return known


def _load_known(path: Path, triton_version: str, source_hashes: dict) -> dict:
    if path.suffix == ".jsonl":  # the checkpoint of an unfinished run: one compile per line
        known = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["triton"] == triton_version and source_hashes.get(row["kernel"]) == row["source_hash"] \
                    and row["result"].get("ok"):
                known[(row["key"], row["arch"])] = row["result"]
        print(f"reusing {len(known)} results of {path}")
        return known
    report = json.loads(path.read_text())
    if report.get("triton") != triton_version:
        print(f"not reusing {path}: made with Triton {report.get('triton')}, this is {triton_version}")
        return {}
    known = {}
    for spec in report["specialisations"]:
        if source_hashes.get(spec["kernel"]) != spec["source_hash"]:
            continue
        for arch, res in spec["targets"].items():
            if res.get("ok"):
                known[(spec["key"], int(arch.removeprefix("sm_")))] = {k: v for k, v in res.items() if k != "reused"}
    return known


def verify(unique: dict, results: dict, per_kernel: int, workers: int) -> list[str]:
    """Recompile up to ``per_kernel`` reused specialisations per (kernel, target), the quickest; the mismatches."""
    from hf_kvint2.kernels import aot

    sample = {}  # the quickest to compile first: CI runs this
    for (key, arch), res in sorted(results.items(), key=lambda kv: (kv[1].get("compile_s", 0), kv[0])):
        spec, fn = unique[arch][key]
        picked = sample.setdefault(arch, {})
        if res.get("reused") and sum(1 for s, _ in picked.values() if s.kernel == spec.kernel) < per_kernel:
            picked[key] = (spec, fn)
    fresh = aot.compile_all(sample, workers)
    bad = []
    for (key, arch), res in fresh.items():
        old = results[(key, arch)]
        same = all(res.get(k) == old.get(k) for k in ("ok", "registers", "shared_bytes", "spill_store_bytes"))
        if not same:
            bad.append(f"{key} sm_{arch}: recompiled {res} != reused {old}")
    print(f"verified {len(fresh)} reused specialisations by recompiling them: {len(bad)} mismatches")
    return bad


def _committed(paths: list[Path]) -> list[dict]:
    reports = []
    for path in paths:
        if not path.exists():
            raise SystemExit(f"--check: {path} does not exist; make it with benchmarks/triton_aot.py (see --help).")
        report = json.loads(path.read_text())
        report["path"] = str(path)
        report["by_key"] = {(s["key"], s["source_hash"]): s for s in report["specialisations"]}
        reports.append(report)
    return reports


def coverage(unique: dict, hashes: dict, by_config: dict, report: dict) -> list[str]:
    """What ``report`` lacks: (configuration, target) pairs with a specialisation that has no successful compile
    for the current kernel source, or whose compile failed."""
    problems = []
    for name, per_arch in by_config.items():
        for arch_name, keys in per_arch.items():
            arch = int(arch_name.removeprefix("sm_"))
            for key in keys:
                spec = unique[arch][key][0]
                entry = report["by_key"].get((key, hashes[spec.kernel]))
                res = (entry or {}).get("targets", {}).get(arch_name)
                if res is None:
                    problems.append(f"{name} {arch_name}: {spec.kernel} {key} not compiled for source "
                                    f"{hashes[spec.kernel]}")
                elif not res.get("ok"):
                    problems.append(f"{name} {arch_name}: {spec.kernel} {key} failed: {res.get('error')}")
    return problems


def pick_sample(unique: dict, hashes: dict, report: dict, per_kernel: int) -> dict:
    """Up to ``per_kernel`` specialisations per (kernel, target): the quickest to compile (as recorded), then others
    drawn with the kernel's source hash as seed from those recorded under 10 s."""
    import random

    sample = {}
    for arch, specs in unique.items():
        by_kernel = {}
        for key, (spec, fn) in sorted(specs.items()):
            res = report["by_key"].get((key, hashes[spec.kernel]), {}).get("targets", {}).get(f"sm_{arch}", {})
            by_kernel.setdefault(spec.kernel, []).append((res.get("compile_s", 60.0), key))
        for kernel, timed in by_kernel.items():
            timed.sort()
            chosen = [timed[0][1]]
            rest = [k for t, k in timed[1:] if t < 10.0]
            random.Random(f"{hashes[kernel]}:{arch}").shuffle(rest)
            chosen += rest[:per_kernel - 1]
            for key in chosen[:per_kernel]:
                sample.setdefault(arch, {})[key] = specs[key]
    return sample


def check(args) -> int:
    """CI: every configuration covered by every report, for the current source; a sample recompiled now."""
    import triton
    from hf_kvint2.kernels import aot
    from hf_kvint2.kernels.aot import dispatch_configurations

    start = time.perf_counter()
    archs = [int(a) for a in args.arch.split(",")]
    configs = dispatch_configurations()
    unique, by_config = aot.collect(configs, archs)
    fns = {spec.kernel: fn for specs in unique.values() for spec, fn in specs.values()}
    hashes = {name: aot.kernel_source_hash(fn) for name, fn in fns.items()}
    n_unique = sum(len(v) for v in unique.values())
    reports = _committed(args.check)
    problems = []
    summary = {"configurations_count": len(configs), "specialisations_count": n_unique,
               "kernel_source_hashes": hashes, "triton": triton.__version__, "reports": {}}
    for report in reports:
        missing = coverage(unique, hashes, by_config, report)
        covered = n_unique - len({m.split(": ", 1)[1] for m in missing})
        print(f"{report['path']} (Triton {report['triton']}): {len(configs)} configurations, "
              f"{n_unique} specialisations on {len(archs)} targets; {len(missing)} gaps (a configuration, target and specialisation without a result)")
        summary["reports"][report["path"]] = {"triton": report["triton"], "gaps": len(missing),
                                              "covered_specialisations": covered}
        problems += [f"{report['path']}: {m}" for m in missing]
    if problems:
        print(f"FAILED: {len(problems)} (configuration, target, specialisation) entries have no successful compile for the current "
              f"kernel source; regenerate: python benchmarks/triton_aot.py --reuse {reports[0]['path']} "
              f"(and the same with --triton VERSION for each per-version report)")
    same_version = [r for r in reports if r["triton"] == triton.__version__]
    reference = same_version[0] if same_version else reports[0]
    sample = pick_sample(unique, hashes, reference, args.sample)
    fresh = aot.compile_all(sample, args.workers)
    rows = []
    for (key, arch), res in sorted(fresh.items()):
        spec = unique[arch][key][0]
        old = reference["by_key"].get((key, hashes[spec.kernel]), {}).get("targets", {}).get(f"sm_{arch}", {})
        fields = ("ok", "registers", "shared_bytes", "spill_store_bytes", "spill_load_bytes")
        row = {"kernel": spec.kernel, "key": key, "target": f"sm_{arch}", "compile_s": res["compile_s"],
               **{f: res.get(f) for f in fields}, "committed": {f: old.get(f) for f in fields}}
        rows.append(row)
        if not res["ok"]:
            problems.append(f"{spec.kernel} {key} sm_{arch}: does not compile with Triton {triton.__version__}: "
                            f"{res['error']}")
        elif same_version and any(res.get(f) != old.get(f) for f in fields):
            problems.append(f"{spec.kernel} {key} sm_{arch}: recompiled {row} != committed")
        print(f"  recompiled {spec.kernel} {key} sm_{arch} in {res['compile_s']:.1f} s: {res.get('registers')} "
              f"registers, {res.get('spill_store_bytes')} B spilled, {res.get('shared_bytes')} B shared "
              f"(committed with Triton {reference['triton']}: {old.get('registers')}, "
              f"{old.get('spill_store_bytes')}, {old.get('shared_bytes')})")
    how = "compared with the committed results" if same_version else \
        f"Triton {triton.__version__} made none of the reports: checked that they compile and fit"
    print(f"recompiled {len(rows)} specialisations ({how}); {time.perf_counter() - start:.0f} s")
    summary.update(sample=rows, compared=bool(same_version), problems=problems, wall_s=time.perf_counter() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton_aot_check.json").write_text(json.dumps(summary, indent=1, default=str))
    for line in problems[:50]:
        print("FAILED:", line)
    return 1 if problems else 0


def markdown_table(report: dict) -> str:
    """Worst case per kernel, head_dim, variant (decode: dot dtype; quantize: group axis) and target: registers,
    spills, shared memory, occupancy; failures counted."""
    rows = {}
    for spec in report["specialisations"]:
        c = spec["constexprs"]
        variant = {"body_attention": f"{str(c.get('DOT_DTYPE', '')).split('.')[-1]} dots",
                   "quantize_pack": "per-channel" if c.get("AXIS_CHANNEL") else "per-token"}.get(spec["kernel"], "-")
        for arch, res in spec["targets"].items():
            k = (spec["kernel"], c.get("D"), variant, arch)
            r = rows.setdefault(k, {"n": 0, "failed": 0, "regs": 0, "spill": 0, "spilling": 0, "smem": 0, "occ": 1.0})
            r["n"] += 1
            if not res.get("ok"):
                r["failed"] += 1
                continue
            r["regs"] = max(r["regs"], res["registers"])
            r["spill"] = max(r["spill"], res["spill_store_bytes"])
            r["spilling"] += bool(res["spill_store_bytes"])
            r["smem"] = max(r["smem"], res["shared_bytes"])
            r["occ"] = min(r["occ"], res["occupancy"])
    header = ("| kernel | head_dim | variant | target | specialisations (failed) | max registers "
              "| spilling / max spill stores (B) | max shared (KiB) | min occupancy |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for (kernel, d, variant, arch), r in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2],
                                                                             kv[0][3])):
        lines.append(f"| {kernel} | {d} | {variant} | {arch} | {r['n']} ({r['failed']}) | {r['regs']} | "
                     f"{r['spilling']} / {r['spill']} | {r['smem'] / 1024:.1f} | {r['occ']:.0%} |")
    return "\n".join(lines)


def roofline_table(rows: list[dict]) -> str:
    """Predicted µs per layer step and the predicted ratio to bf16 SDPA, per GPU, batch and context."""
    lines = ["| GPU | batch | context | bf16 SDPA (µs) | OscarCache (µs, x SDPA) | OscarScaledCache (µs, x SDPA) |",
             "|---|---|---|---|---|---|"]
    cells = {(r["gpu"], r["batch"], r["context"], r["method"]): r for r in rows}
    for gpu, batch, context in sorted({k[:3] for k in cells}, key=lambda k: (k[0] != "H200", k[1], k[2])):
        sdpa = cells[(gpu, batch, context, "bf16 SDPA")]["predicted_us"]
        parts = [f"{cells[(gpu, batch, context, m)]['predicted_us']:.1f} "
                 f"({cells[(gpu, batch, context, m)]['predicted_speedup_vs_sdpa']:.1f}x)"
                 for m in ("OscarCache", "OscarScaledCache")]
        lines.append(f"| {gpu} | {batch} | {context // 1024}k | {sdpa:.1f} | {parts[0]} | {parts[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="80,90", help="compute capabilities (default 80,90)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                    help="compiles run in parallel (default: up to 2)")
    ap.add_argument("--filter", default=None, help="only configurations whose name contains this")
    ap.add_argument("--kernels", default=None, help="only these kernels (comma-separated: body_attention, "
                    "merge_splits, quantize_pack)")
    ap.add_argument("--reuse", type=Path, nargs="+", default=None, help="earlier reports to take unchanged results "
                    "from")
    ap.add_argument("--verify", type=int, default=0, help="recompile this many reused results per kernel/target")
    ap.add_argument("--triton", default=None, help="run with this Triton version (pip install --target, cached)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    ap.add_argument("--no-roofline", action="store_true", help="skip the roofline predictions and the plot")
    ap.add_argument("--check", type=Path, nargs="+", default=None, help="CI: fail unless these reports cover every "
                    "configuration for the current kernel source; recompile a --sample")
    ap.add_argument("--sample", type=int, default=4, help="with --check: recompile this many per kernel and target")
    args = ap.parse_args(argv)
    if args.triton:
        use_triton(args.triton)
    if args.check:
        return check(args)
    import torch
    import triton
    from hf_kvint2.kernels import aot
    from hf_kvint2.kernels.aot import dispatch_configurations

    start = time.perf_counter()
    archs = [int(a) for a in args.arch.split(",")]
    configs = [c for c in dispatch_configurations() if not args.filter or args.filter in c.name]
    unique, by_config = aot.collect(configs, archs)
    if args.kernels:
        wanted = set(args.kernels.split(","))
        unique = {a: {k: v for k, v in specs.items() if v[0].kernel in wanted} for a, specs in unique.items()}
        by_config = {name: {arch: [k for k in keys if k in unique[int(arch[3:])]] for arch, keys in per.items()}
                     for name, per in by_config.items()}
    fns = {spec.kernel: fn for specs in unique.values() for spec, fn in specs.values()}
    hashes = {name: aot.kernel_source_hash(fn) for name, fn in fns.items()}
    known = load_known(args.reuse, triton.__version__, hashes)
    n_unique = sum(len(v) for v in unique.values())
    print(f"Triton {triton.__version__}: {len(configs)} configurations -> {n_unique} specialisations on "
          f"{len(archs)} targets ({sum(1 for a in unique for k in unique[a] if (k, a) in known)} reused)")
    per_version = args.triton or os.environ.get("HF_KVINT2_AOT_TRITON")
    out_json = args.out / (f"triton_aot_triton{triton.__version__}.json" if per_version else "triton_aot.json")
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = out_json.with_suffix(".partial.jsonl")  # survives an interrupted run: pass it to --reuse
    kernel_of = {(key, arch): spec.kernel for arch, items in unique.items() for key, (spec, _) in items.items()}

    def save(key, arch, res):
        with checkpoint.open("a") as f:
            f.write(json.dumps({"key": key, "arch": arch, "kernel": kernel_of[(key, arch)], "triton": triton.__version__,
                                "source_hash": hashes[kernel_of[(key, arch)]], "result": res}, default=str) + "\n")

    results = aot.compile_all(unique, args.workers, known, on_result=save)
    mismatches = verify(unique, results, args.verify, args.workers) if args.verify and known else []

    specs = {}
    for arch, items in unique.items():
        for key, (spec, fn) in items.items():
            entry = specs.setdefault(key, {"key": key, "kernel": spec.kernel, "source_hash": hashes[spec.kernel],
                                           "constexprs": spec.describe(), "signature": dict(spec.types),
                                           "targets": {}})
            entry["targets"][f"sm_{arch}"] = results[(key, arch)]
    failed = sorted({f"{k} sm_{a}: {r['error']}" for (k, a), r in results.items() if not r["ok"]})
    compile_s = [r["compile_s"] for r in results.values() if not r.get("reused")]
    report = {
        "what": "Ahead-of-time compilation of the hf_kvint2 Triton kernels for GPU targets on a CPU machine: "
                "registers, spills, shared memory and occupancy from the cubins (ptxas/cuobjdump bundled with "
                "Triton). 'roofline' holds PREDICTIONS (bytes / bandwidth), not measurements.",
        "command": " ".join(["python", *sys.argv]), "triton": triton.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "targets": {f"sm_{a}": aot.TARGETS[a] for a in archs},
        "kernel_source_hashes": hashes, "configurations_count": len(configs),
        "specialisations_count": len(specs), "compiled_now": len(compile_s),
        "compile_cpu_s": sum(compile_s), "workers": args.workers, "failed": failed,
        "verify_mismatches": mismatches,
        "configurations": [{"name": c.name, "cache": c.cache, "key_layout": layout_dict(c.key_layout),
                            "value_layout": layout_dict(c.value_layout), "centred": c.centred,
                            "dtype": str(c.dtype), "head_dim": c.head_dim, "gqa": c.gqa, "kv_heads": c.kv_heads,
                            "scale_dtype": str(c.scale_dtype), "mask": c.mask, "batch_context": c.shapes,
                            "specialisations": by_config[c.name]} for c in configs],
        "specialisations": sorted(specs.values(), key=lambda s: (s["kernel"], s["key"])),
    }
    if not args.no_roofline:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import roofline

        report["roofline"] = {"note": roofline.__doc__.strip(), "shapes": roofline.SHAPES,
                              "rows": roofline.predictions()}
    report["wall_s"] = time.perf_counter() - start
    out_json.write_text(json.dumps(report, indent=1, default=str))
    checkpoint.unlink(missing_ok=True)
    if not args.no_roofline:
        roofline.plot(report["roofline"]["rows"], args.out / "triton_aot.png")
    print(markdown_table(report))
    if "roofline" in report:
        print(roofline_table(report["roofline"]["rows"]))
    print(f"{len(specs)} specialisations, {len(compile_s)} compiled now ({sum(compile_s):.0f} s of compile time, "
          f"{args.workers} workers), {report['wall_s']:.0f} s wall; wrote {out_json}")
    for line in failed + mismatches:
        print("FAILED:", line)
    return 1 if failed or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
