"""The shape of the code (shared/DESIGN.md §2): no import cycles, imports that flow down, plug-ins as lazy tables.

Imports are read from the source with ``ast`` — every ``import`` statement anywhere in a file, so an import inside a
function ("lazy") counts like one at the top. An import names the module it loads, not its parent packages.
A string that names a project module (``"eval.cli"``, ``"pkg.module:Class"``: a plug-in table, an
``importlib.import_module`` argument) is a deferred import: it must flow downwards like a real one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("verl", "eval", "serve", "loadtest")
# verl's internal order (DESIGN §2): a module may import its own level or a lower one, never a higher one.
VERL_LEVELS = {
    "algos": 0, "protocol": 0, "utils": 0, "errors": 0,
    "models": 1, "data": 1, "rewards": 1, "tracking": 1, "tools": 1,
    "rollout": 2, "evaluators": 2, "workers": 3, "trainer": 4, "cli": 5,
}
# Modules whose place is fixed by someone else's habits: `python3 -m verl.trainer.main_ppo` is verl's launch line,
# a command-line entry point (level 5) that has to live in the trainer package.
MODULE_LEVELS = {"verl.trainer.main_ppo": 5}
# "a.b.c" or "a.b.c:Name": how a plug-in table or import_module names a module.
MODULE_STRING = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?::[\w.]+)?")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for file in (REPO / package).rglob("*.py"):
            parts = list(file.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = file
    return modules


def imports_of(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``file`` imports, lazily or not (``from a.b import c`` is a.b.c when that is a module)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            candidates = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            candidates = candidates or [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:  # `import a.b.c` where c is a name in a.b
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
    return found


def modules_named_in_strings(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that string constants in ``file`` name in full (``"eval.cli"``, ``"eval.x:Class"``)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.fullmatch(node.value):
            module = node.value.partition(":")[0]
            if module in modules and module != name:
                found.add(module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Import statements only: what can form a cycle at import time."""
    modules = project_modules()
    return {name: imports_of(name, file, modules) for name, file in modules.items()}


@pytest.fixture(scope="module")
def references(graph) -> dict[str, set[str]]:
    """Imports and module-naming strings: what the layering rules hold to."""
    modules = project_modules()
    return {name: graph[name] | modules_named_in_strings(name, file, modules) for name, file in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_lazy_imports_string_tables_and_cycles(tmp_path):
    modules = {"a": Path("a.py"), "a.b": Path("a/b.py"), "a.c": Path("a/c.py")}
    probe = tmp_path / "probe.py"
    probe.write_text('def f():\n    from a.b import thing\n\nPLUGINS = {"x": "a.c:Thing", "y": "not.a.module:Y"}\n'
                     'MESSAGE = "see a.c for details"\nSCOPE = "a"\n')
    assert imports_of("a", probe, modules) == {"a.b"}
    assert modules_named_in_strings("a", probe, modules) == {"a.c"}
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


def test_no_import_cycles_anywhere(graph):
    assert len(graph) > 100  # the whole project was read
    assert cycles(graph) == []


def test_verl_core_never_imports_eval_serve_or_loadtest(references):
    bad = {(m, i) for m, deps in references.items() if m.startswith("verl.") and m != "verl.cli"
           for i in deps if i.split(".")[0] in ("eval", "serve", "loadtest")}
    assert bad == set()


def test_verl_layers_only_import_downwards(references):
    def level(module: str) -> int | None:
        if module in MODULE_LEVELS:
            return MODULE_LEVELS[module]
        parts = module.split(".")
        return VERL_LEVELS.get(parts[1]) if parts[0] == "verl" and len(parts) > 1 else None

    upward = sorted((m, i) for m, deps in references.items() for i in deps
                    if level(m) is not None and level(i) is not None and level(i) > level(m))
    assert upward == []


def test_loading_a_model_never_trains_one(graph):
    assert not any(dep.startswith("verl.trainer") for dep in graph["verl.models.loader"])


def test_evaluators_have_one_home_and_pyproject_declares_no_builtins(graph):
    """Built-in evaluators are listed once (``verl.evaluators.registry``); the trainer and eval import them."""
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("entry-points", {})
    assert "verl.evaluators" not in entry_points
    assert "verl.evaluators.registry" in graph["verl.trainer.validation"] | graph["verl.evaluators"]
    assert not any(module.startswith("eval.evaluators") for module in graph)
