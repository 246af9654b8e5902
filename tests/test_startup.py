"""Start-up cost: ``import hf_kvint2`` loads nothing heavy, every script prints --help at once, and the lazy public
names and the "oscar" registration still work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Modules `import hf_kvint2` must not load: model code, JIT compilers, ONNX, the Hub client (and torch itself,
# which every one of them needs).
HEAVY = re.compile(r"^(torch|transformers|numba|llvmlite|triton|onnx\w*|huggingface_hub)(\.|$)")
SCRIPTS = [["-m", "hf_kvint2.demo"], ["-m", "hf_kvint2.precompile"],
           *[[str(p)] for p in sorted((ROOT / "benchmarks").glob("**/*.py")) if p.parent.name != "speedlib"],
           *[[str(p)] for p in sorted((ROOT / "calibration_scripts").glob("*.py"))]]


def imported_modules(code: str) -> list[str]:
    """Modules a fresh interpreter imports to run ``code``, from ``python -X importtime``."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return [line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")][1:]


def test_import_loads_no_model_code_jit_onnx_or_hub_client():
    modules = imported_modules("import hf_kvint2")
    assert "hf_kvint2" in modules
    heavy = [m for m in modules if HEAVY.match(m)]
    assert not heavy, f"import hf_kvint2 loaded {heavy[:10]}"


def test_public_names_resolve_lazily_and_oscar_is_registered():
    code = ("import hf_kvint2, sys\n"
            "names = [getattr(hf_kvint2, n) for n in hf_kvint2.__all__]\n"
            "assert hf_kvint2.OscarCache.__module__ == 'hf_kvint2.cache'\n"
            "assert callable(hf_kvint2.distributed.tp_group)\n"  # submodules, as before the lazy import
            "from transformers import AttentionInterface\n"
            "from transformers.masking_utils import AttentionMaskInterface\n"
            "assert 'oscar' in AttentionInterface._global_mapping and 'oscar' in AttentionMaskInterface._global_mapping\n"
            "from hf_kvint2 import demo\n"
            "assert demo.ATTN_IMPLEMENTATION == hf_kvint2.ATTN_IMPLEMENTATION\n"
            "print(len(names))")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], check=False, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(__import__("hf_kvint2").__all__))


@pytest.mark.parametrize("order", ["transformers first", "cache first"])
def test_oscar_registered_whatever_the_import_order(order):
    first = "import transformers.modeling_utils; import hf_kvint2" if order == "transformers first" \
        else "from hf_kvint2 import OscarCache"
    code = (f"{first}\nfrom transformers import AttentionInterface\n"
            "assert 'oscar' in AttentionInterface._global_mapping")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], check=False, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_unknown_attribute_is_an_attribute_error():
    import hf_kvint2

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_kvint2.nope  # noqa: B018


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: Path(s[-1]).name)
def test_help_prints_at_once(script):
    # At once: --help loads none of the heavy modules (torch alone takes seconds to import on a busy machine).
    out = subprocess.run([sys.executable, "-X", "importtime", *script, "--help"], check=False, capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
    modules = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    heavy = [m for m in modules if HEAVY.match(m)]
    assert not heavy, f"{script[-1]} --help imported {heavy[:10]}"
    assert not re.search(r"SPEC \d|issue \d", out.stdout), "help text names an internal document"


def option_helps(script: list[str]) -> dict[str, str]:
    text = subprocess.run([sys.executable, *script, "--help"], check=False, capture_output=True, text=True, cwd=ROOT,
                          env={"COLUMNS": "10000", "PATH": ""}).stdout
    options = text.split("options:", 1)[1]
    found = {}
    for entry in re.split(r"\n(?=  -)", options.strip("\n")):  # one entry per option: signature, then its help
        first, _, rest = entry.partition("\n")
        signature, _, same_line = first.strip().partition("  ")
        found[signature.split()[0].rstrip(",")] = " ".join((same_line + " " + rest).split())
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: Path(s[-1]).name)
def test_every_option_has_help(script):
    helps = option_helps(script)
    assert helps
    missing = [name for name, text in helps.items() if not text]
    assert not missing, f"{script[-1]}: options without help: {missing}"


def test_quality_methods_help_lists_the_valid_names():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quality
    finally:
        sys.path.pop(0)
    from transformers import LlamaConfig

    from hf_kvint2.evaluation import standard_methods

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    keys = [m.key for m in standard_methods(config, lambda cfg: None, ("hqq", "quanto"))]
    assert list(quality.METHOD_KEYS) == keys
    assert all(k in option_helps([str(ROOT / "benchmarks" / "quality.py")])["--methods"] for k in keys)
