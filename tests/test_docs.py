"""Every Python block of README.md and docs/*.md runs as written, each in a fresh interpreter, and prints no
deprecation warning of hf_kvint2's or transformers' (or of the block's own code).

A block that cannot run here is marked on the line before its fence with
``<!-- doc-test: skip (the reason) -->`` (a GPU, several processes, the network); it is skipped with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\s*\((.+?)\)\s*-->\s*$")
# A Python warning line names the file that raised it; one raised inside another library's own files (torch's
# ONNX exporter trips torch's own deprecations) is not the example's doing. Everything else counts: warnings from
# hf_kvint2, transformers or the block itself, and logged messages (transformers logs its cache-name deprecation).
WARNING_LINE = re.compile(r"^(?P<path>\S+?\.py):\d+: \w*Warning:")
OURS = ("/hf_kvint2/", "/transformers/", "/kernels/", "<string>")


def python_blocks() -> list:
    blocks = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            name = f"{path.relative_to(ROOT)}:{line}"
            marks = [pytest.mark.skip(reason=f"{name}: {skip.group(1)}")] if skip else []
            blocks.append(pytest.param(match.group(1), id=name, marks=marks))
    return blocks


def counts(line: str) -> bool:
    """Whether a deprecation line is hf_kvint2's, transformers' or the example's (see WARNING_LINE)."""
    match = WARNING_LINE.match(line.strip())
    return match is None or any(part in match["path"] for part in OURS)


def test_deprecation_attribution():
    assert counts("`past_key_values`/`cache_params` are deprecated. Use `cache` instead.")  # transformers' logger
    assert counts("/x/site-packages/transformers/generation/utils.py:12: FutureWarning: `a` is deprecated")
    assert counts("<string>:3: DeprecationWarning: old API is deprecated")
    assert not counts("/x/site-packages/torch/jit/_script.py:365: DeprecationWarning: `script_method` is deprecated")


def test_the_docs_have_python_blocks():
    assert len(python_blocks()) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("code", python_blocks())
def test_block_runs_without_deprecation_warnings(code, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    env.pop("PYTEST_CURRENT_TEST", None)
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=900)
    assert run.returncode == 0, f"the block failed:\n{run.stderr[-4000:]}"
    output = run.stdout + run.stderr
    deprecations = [line for line in output.splitlines() if re.search(r"deprecat", line, re.IGNORECASE)
                    and counts(line)]
    assert not deprecations, "the block printed deprecation warnings:\n" + "\n".join(deprecations)


# ---------------------------------------------------------------------------------------------------- history
# Code, tests and docs say what is true now; how it came to be is in git. These patterns catch history creeping
# back in: a work session's or a tracker issue's number, the spec's section numbers (the spec is not shipped), the
# n-th run of a benchmark, run numbers and before/after in the names of files, a past commit, and dates of
# measurements, which belong only to docs/results.md's "Run:" lines (the date and machine of each result).
HISTORY_SCANNED = ("hf_kvint2", "kernels", "tests", "benchmarks", "calibration_scripts", "docs", "model_cards",
                   "README.md", "ARCHITECTURE.md")
# The bundled novels, and the benchmarks' result files: each records its own run (command, date, notes) by design.
HISTORY_SKIPPED = ("hf_kvint2/data", "benchmarks/results", "benchmarks/experiments/results")
ORDINALS = ("second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
            "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+|thirtieth")
HISTORY = {
    "a work session": re.compile(r"\bsessions?[ -]#?\d+|\b(?:this|previous|earlier|later|last|next) sessions?\b",
                                 re.IGNORECASE),
    "an issue number": re.compile(r"\bissues?[ -]?#?\d+", re.IGNORECASE),
    "a SPEC section": re.compile(r"\bSPEC\s*§|\bSPEC\s+\d"),
    "the n-th run": re.compile(rf"\b(?:{ORDINALS})[ -](?:\w+ )?run\b", re.IGNORECASE),
    "a run number": re.compile(r"\brun ?#\d+|\brun\d+\b|_run\d", re.IGNORECASE),
    "a past commit": re.compile(r"\bcommits? [0-9a-f]{7,40}\b"),
    "a measurement date": re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?:-\d\d:\d\d)? UTC\b"),
}
HISTORY_FILE_NAME = re.compile(r"(?:^|[_.-])(?:run\d+|before(?:_fix)?|after(?:_fix)?)(?:[_.-]|$)", re.IGNORECASE)


def history_in(relative: str, text: str) -> list[str]:
    """``path:line: what (match)`` for every history pattern in ``text``; dates are allowed on docs/results.md's
    ``Run:`` lines."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            if what == "a measurement date" and relative == "docs/results.md" and line.startswith("Run:"):
                continue
            match = pattern.search(line)
            if match:
                found.append(f"{relative}:{number}: {what} ({match.group(0)!r}): {line.strip()[:100]}")
    return found


def scanned_files() -> list[Path]:
    files = []
    for name in HISTORY_SCANNED:
        path = ROOT / name
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            relative = file.relative_to(ROOT).as_posix()
            if file.is_file() and "__pycache__" not in file.parts and not relative.startswith(HISTORY_SKIPPED):
                files.append(file)
    return files


def test_history_patterns_find_history_and_spare_plain_english():
    # the examples are assembled so that this file does not hold them verbatim
    history = ["as in " + "session" + " 43", "see " + "issue" + " #15", "the " + "issue" + "-18 protocol",
               "SPEC" + " 3.2", "SPEC" + " §4", "(docs/results.md, " + "seventeenth" + " run)", "the " + "fifteenth" + " speed run", "the " + "run" + "2 file",
               "threads_cpu_ru" + "n2.json", "(" + "run" + " #3)", "the kernel before " + "commit" + " 619fdac", "rerun on " + "2026" + "-12-01",
               "at 19:04" + " UTC", "before this " + "session", "(previous " + "sessions)"]
    for line in history:
        assert history_in("docs/x.md", line), line
    plain = ["The first run converts the GGUF", "the test session warms the kernels", "a first pass stores the norms",
             "see the issue tracker", "SPEC.md describes the algorithm", "run 3 steps", "runs in 2 threads",
             "with a 2048-token window", "version 5.24", "commit your changes"]
    for line in plain:
        assert not history_in("docs/x.md", line), line
    assert not history_in("docs/results.md", "Run: 2026" + "-12-05 19:07" + " UTC, a 2-core AMD EPYC")
    assert history_in("docs/results.md", "measured on 2026" + "-12-05")  # outside a Run: line
    assert HISTORY_FILE_NAME.search("padding" + "_before_fix.json") and HISTORY_FILE_NAME.search("x_ru" + "n2.json")
    assert not HISTORY_FILE_NAME.search("quality_passkey8k.json")


def test_code_tests_and_docs_hold_no_history():
    found = []
    for file in scanned_files():
        relative = file.relative_to(ROOT).as_posix()
        if file.suffix in (".py", ".md", ".txt", ".toml", ".cfg", ".sh"):
            found += history_in(relative, file.read_text(encoding="utf-8"))
    assert not found, "history belongs to git; say what is true now (and why):\n" + "\n".join(found)


def test_no_file_is_named_after_a_run():
    names = [file.relative_to(ROOT).as_posix() for name in ("benchmarks", "tests", "docs")
             for file in sorted((ROOT / name).rglob("*")) if HISTORY_FILE_NAME.search(file.name)]
    assert not names, f"a file named after a run or a fix (keep the current result under the benchmark's name): {names}"


def test_readme_and_results_stay_short():
    assert len((ROOT / "README.md").read_bytes()) < 15_000, "README.md: user documentation; details go to docs/"
    assert len((ROOT / "docs" / "results.md").read_bytes()) < 30_000, "docs/results.md: current results only"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_point_to_files_and_headings_that_exist():
    docs = [*DOCS, ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
            ROOT / "benchmarks" / "experiments" / "README.md"]
    broken = []
    for doc in docs:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
