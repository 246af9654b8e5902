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
