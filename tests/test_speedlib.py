"""benchmarks/speedlib, the harness every speed benchmark runs on: options, worker processes, interleaving, output.

No model is loaded: these check the harness's own behaviour, which the benchmarks' numbers rest on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import speedlib


def test_interleaved_rounds_calls_every_variant_once_per_round_in_order():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("base", "a", "b")}
    before = []
    times = speedlib.interleaved_rounds(calls, rounds=3, warmup=2, before=before.append)
    assert order == ["base", "a", "b"] * 5  # 2 untimed rounds, then 3 timed ones
    assert before == order  # the hook runs before every call, warm-up included
    assert {name: len(t) for name, t in times.items()} == {"base": 3, "a": 3, "b": 3}


def test_interleaved_rounds_times_with_the_given_clock():
    ticks = iter(range(100))
    times = speedlib.interleaved_rounds({"x": lambda: None, "y": lambda: None}, rounds=2, warmup=0,
                                        clock=lambda: next(ticks))
    assert times == {"x": [1, 1], "y": [1, 1]}  # each call: two consecutive readings of the clock


def test_ratio_summary_total_median_and_quartiles():
    baseline, times = [2.0, 2.0, 2.0, 6.0], [1.0, 1.0, 2.0, 2.0]
    summary = speedlib.ratio_summary(baseline, times)
    assert summary["total"] == pytest.approx(12 / 6)  # the rates over all rounds, not the mean of ratios
    assert summary["median"] == pytest.approx(2.0)  # per-round ratios 2, 2, 1, 3
    assert summary["quartiles"][0] <= summary["median"] <= summary["quartiles"][-1]
    # work per call: 4 sequences per step against 1 at the same step time is 4x the throughput
    assert speedlib.ratio_summary([1.0], [1.0], work=4, baseline_work=1)["total"] == pytest.approx(4.0)


def test_run_worker_returns_the_last_json_line_and_names_a_failing_case(tmp_path):
    script = tmp_path / "case.py"
    script.write_text("import json, os, sys\n"
                      "if sys.argv[2] == 'fail':\n    sys.exit('broken case')\n"
                      "print('progress output')\n"
                      "print(json.dumps({'args': sys.argv[1:], 'threads': os.environ.get('NUMBA_NUM_THREADS')}))\n")
    env = speedlib.worker_env(1, omp=False)
    row = speedlib.run_worker(str(script), ["ok", 3], {"--steps": 5, "--configs": ["a", "b"]}, env, "ok case")
    assert row == {"args": ["--worker", "ok", "3", "--steps", "5", "--configs", "a", "b"], "threads": "1"}
    with pytest.raises(RuntimeError, match="fail case failed:(.|\n)*broken case"):
        speedlib.run_worker(str(script), ["fail"], {}, env, "fail case")


def test_run_worker_shows_the_workers_stderr_as_it_comes_and_keeps_it_for_a_failure(tmp_path, capfd):
    script = tmp_path / "case.py"
    script.write_text("import json, sys\n"
                      "sys.stderr.write('step 1/2\\r\u2588 step 2/2\\n')\n"
                      "if sys.argv[2] == 'fail':\n    sys.exit('broken case')\n"
                      "print(json.dumps({'ok': True}))\n")
    env = speedlib.worker_env(1, omp=False)
    assert speedlib.run_worker(str(script), ["ok"], {}, env, "ok case", show_stderr=True) == {"ok": True}
    assert capfd.readouterr().err == "step 1/2\r\u2588 step 2/2\n"
    with pytest.raises(RuntimeError, match="fail case failed:\nstep 1/2\r\u2588 step 2/2\nbroken case"):
        speedlib.run_worker(str(script), ["fail"], {}, env, "fail case", show_stderr=True)


def test_worker_env_sets_thread_counts_before_the_worker_starts():
    env = speedlib.worker_env(2, omp=True, NUMBA_CACHE_DIR="/tmp/x")
    assert (env["NUMBA_NUM_THREADS"], env["OMP_NUM_THREADS"], env["NUMBA_CACHE_DIR"]) == ("2", "2", "/tmp/x")
    env = speedlib.worker_env(2, omp=False)  # OpenMP's count left as the parent has it
    assert env["NUMBA_NUM_THREADS"] == "2" and env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")
    assert speedlib.worker_env(0, omp=True) == dict(os.environ)  # 0: the libraries' defaults


def test_shared_options_are_spelled_the_same_in_every_script(tmp_path):
    ap = argparse.ArgumentParser()
    speedlib.add_shared_options(ap, out_name="x.json", model_default="synthetic", worker_metavar=("A", "B"))
    args = ap.parse_args(["--worker", "1", "2", "--threads", "3"])
    assert (args.model, args.threads, args.worker, args.out.name) == ("synthetic", 3, ["1", "2"], "x.json")
    assert "--worker" not in ap.format_help()  # the parent's hand-off to a worker is not a user option
    bare = argparse.ArgumentParser()
    speedlib.add_shared_options(bare, out_name="y.json", threads_default=None)
    assert vars(bare.parse_args([])) == {"out": speedlib.RESULTS / "y.json"}


def test_write_results_writes_json_and_the_plot_next_to_it(tmp_path):
    plotted = []
    speedlib.write_results(tmp_path / "sub" / "r.json", {"machine": "m"}, [{"x": 1}],
                           lambda results, png: plotted.append((results, png)))
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"meta": {"machine": "m"}, "results": [{"x": 1}]}
    assert plotted == [([{"x": 1}], tmp_path / "sub" / "r.png")]


def test_run_meta_names_the_machine_the_date_and_the_command():
    meta = speedlib.run_meta(0.5)
    assert f"{meta['cpus']} cores" in meta["machine"]
    assert meta["date_utc"][:2] == "20" and meta["load_average_at_start"] == 0.5 and meta["command"]
