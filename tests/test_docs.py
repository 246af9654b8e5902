"""Every Python block of README.md and docs/*.md runs as written, each in a fresh interpreter, and prints no
deprecation warning (of hf_kvint2, transformers or anyone else; one torch-internal message is listed
below).

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
# Deprecations inside third-party internals that no example can avoid (matched exactly, so anything else counts):
# torch's ONNX exporter deep-copies pytree specs, which trips torch's own LeafSpec deprecation.
FOREIGN_DEPRECATIONS = ("`isinstance(treespec, LeafSpec)` is deprecated",)


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
                    and not any(known in line for known in FOREIGN_DEPRECATIONS)]
    assert not deprecations, "the block printed deprecation warnings:\n" + "\n".join(deprecations)
