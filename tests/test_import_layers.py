"""The import layers of ARCHITECTURE.md, enforced over the source (no import is executed).

Every ``import`` of a first-party module counts, at module level and inside functions alike. Each module of
``hf_kvint2`` and ``kernels`` (installed as ``hf_kvint2.kernels``) has a layer in ARCHITECTURE.md's module table
(read from the document itself, so the table and this check cannot drift apart) and imports only from its layer
or the layers below. The graph must have no cycle, and a first-party module may be imported inside a function only
when it needs an optional third-party dependency (``LAZY_ALLOWED``), or by a module whose job is to load the rest
late (``LAZY_IMPORTERS``: the start-up path that must not load torch or transformers before it is needed). Those
imports still count for the layer and cycle checks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
TABLE_HEADER = "| layer | module | owns |"
PACKAGES = {"hf_kvint2": ROOT / "hf_kvint2", "hf_kvint2.kernels": ROOT / "kernels"}
# First-party modules imported inside functions on purpose: the Triton kernels import Triton (optional) at their
# top; kernels.reference imports hf_kvint2, and the kernels package must import nothing at its top (transformers
# imports a top-level ``kernels`` when it probes for the Hub package of that name; see kernels/__init__.py).
LAZY_ALLOWED = {"hf_kvint2.kernels.decode_attention", "hf_kvint2.kernels.quantize_pack",
                "hf_kvint2.kernels.reference"}
# Modules that import first-party modules inside functions on purpose: ``import hf_kvint2`` loads neither torch nor
# transformers, so the "oscar" registration imports hf_kvint2.attention only once transformers' model code loads;
# the demo, the precompile command and the server parse their arguments (and print --help) before they load torch,
# transformers and the caches.
LAZY_IMPORTERS = {"hf_kvint2.registration", "hf_kvint2.demo", "hf_kvint2.precompile", "hf_kvint2.serve"}


def module_files() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The first-party module ``name`` refers to (a package attribute that is a module counts as the module)."""
    name = name.replace("kernels", "hf_kvint2.kernels", 1) if name.split(".")[0] == "kernels" else name
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """(imported first-party module, whether at module level, line) for every import statement of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    top_level = {id(node) for node in tree.body}
    top_level |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" for alias in node.names] if prefix in modules or \
                _resolve(prefix, modules) else []
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                out.append((resolved, id(node) in top_level, node.lineno))
    return out


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = module_files()
    graph, lazy = {m: set() for m in modules}, []
    for module, path in modules.items():
        for target, at_top, line in imports_of(module, path, modules):
            graph[module].add(target)
            if not at_top and target not in LAZY_ALLOWED and module not in LAZY_IMPORTERS:
                lazy.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    return graph, lazy


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def layer_table(text: str) -> dict[str, tuple[int, str]]:
    """ARCHITECTURE.md's module table: module -> (rank, layer name), lowest layer first. A row with an empty layer
    cell belongs to the layer above it; modules are the backticked file (``x.py``) and folder (``x/``: the package
    and every module in it, keyed ``hf_kvint2.x.*``) names of the module cell, relative to ``hf_kvint2/``
    (``kernels/...``: the ``kernels`` folder, installed as ``hf_kvint2.kernels``)."""
    lines = text.splitlines()
    if TABLE_HEADER not in lines:
        raise AssertionError(f"ARCHITECTURE.md has no module table (a line {TABLE_HEADER!r}).")
    table, layers, layer = {}, [], None
    for line in lines[lines.index(TABLE_HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0]:
            layer = cells[0]
            assert layer not in layers, f"layer {layer!r} has two groups of rows in the table"
            layers.append(layer)
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if not name.endswith((".py", "/")):
                continue
            parts = [p for p in name.removesuffix("/").removesuffix(".py").split("/") if p != "__init__"]
            module = ".".join(["hf_kvint2", *parts]) + (".*" if name.endswith("/") else "")
            assert module not in table, f"{name} is listed twice in the table"
            table[module] = (len(layers) - 1, layer)
    return table


def layer_of(module: str, table: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The table entry of ``module``: its own row, or that of the closest folder holding it."""
    if module in table:
        return table[module]
    name = module
    while name:
        if name + ".*" in table:
            return table[name + ".*"]
        name = name.rpartition(".")[0]
    return None


def upward_imports(graph: dict[str, set[str]], table: dict[str, tuple[int, str]]) -> list[str]:
    """Every import of a module from a higher layer than the importer's."""
    found = []
    for module in sorted(graph):
        rank, layer = layer_of(module, table)
        for target in sorted(graph[module]):
            target_rank, target_layer = layer_of(target, table)
            if target_rank > rank:
                found.append(f"{module} ({layer}) imports {target} ({target_layer})")
    return found


def test_the_layer_table_lists_every_module_and_only_modules():
    table = layer_table(ARCHITECTURE.read_text(encoding="utf-8"))
    modules = module_files()
    missing = [m for m in modules if layer_of(m, table) is None]
    assert not missing, f"modules without a layer in ARCHITECTURE.md's table: {missing}"
    stale = [m for m in table if not any(n == m.removesuffix(".*") or n.startswith(m.removesuffix("*"))
                                         for n in modules)]
    assert not stale, f"ARCHITECTURE.md's table lists modules that do not exist: {stale}"


def test_imports_go_only_downward():
    """ARCHITECTURE.md: "A module imports only from its layer or the layers below it"."""
    graph, _ = import_graph()
    upward = upward_imports(graph, layer_table(ARCHITECTURE.read_text(encoding="utf-8")))
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_checker_sees_upward_imports_and_reads_the_table():
    """The checker itself: rows without a layer name join the layer above, folders cover their modules (a file's
    row covers only itself), a module's own row wins over its folder's, and an import from a higher layer is
    reported."""
    rows = ["intro", TABLE_HEADER, "| --- | --- | --- |", "| low | `a.py`, `pkg/` (`hf_kvint2.pkg`) | x |",
            "| | `b.py` | y |", "| high | `c.py`, `pkg/tool.py` | z |", "", "| other | `d.py` | table |"]
    text = "\n".join(rows)
    table = layer_table(text)
    assert table == {"hf_kvint2.a": (0, "low"), "hf_kvint2.pkg.*": (0, "low"), "hf_kvint2.b": (0, "low"),
                     "hf_kvint2.c": (1, "high"), "hf_kvint2.pkg.tool": (1, "high")}
    assert layer_of("hf_kvint2.pkg", table) == layer_of("hf_kvint2.pkg.inner", table) == (0, "low")
    assert layer_of("hf_kvint2.a.b", table) is None  # a module's row does not cover names below it
    graph = {"hf_kvint2.a": {"hf_kvint2.b"}, "hf_kvint2.c": {"hf_kvint2.a"},
             "hf_kvint2.pkg.inner": {"hf_kvint2.pkg.tool"}, "hf_kvint2.pkg.tool": {"hf_kvint2.pkg.inner"}}
    assert upward_imports(graph, table) == ["hf_kvint2.pkg.inner (low) imports hf_kvint2.pkg.tool (high)"]


def test_no_import_cycle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_first_party_imports_at_module_level():
    _, lazy = import_graph()
    assert not lazy, "first-party imports inside functions (only optional dependencies may be lazy):\n" + \
        "\n".join(lazy)


def test_checker_sees_function_level_cycles(tmp_path):
    """The checker itself: a cycle closed by an import inside a function is found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from hf_kvint2 import cache\n")
    found = imports_of("hf_kvint2.zzz", mod, module_files())
    assert found == [("hf_kvint2.cache", False, 2)]



def test_the_kernels_folder_hands_over_to_an_installed_kernels_library(tmp_path):
    """Python run from the repository root has the ``kernels`` folder on sys.path ahead of site-packages: imported
    as a top-level ``kernels`` it must give way to an installed library of that name (Hugging Face's, which
    transformers >= 5.25 imports: ``from kernels import CUDAProperties``). A stand-in library on PYTHONPATH (after
    the root, before site-packages) plays it."""
    import subprocess
    import sys

    library = tmp_path / "site" / "kernels"
    library.mkdir(parents=True)
    (library / "__init__.py").write_text("CUDAProperties = 'the installed library'\n")
    probe = ("import kernels, hf_kvint2.kernels as ours; "
             "print(kernels.CUDAProperties, hasattr(kernels, 'kernels_enabled_for'), hasattr(ours, 'kernels_enabled_for'))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"}
    out = subprocess.run([sys.executable, "-c", probe], check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "the installed library False True"
