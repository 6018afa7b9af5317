"""The shape of the code (docs/architecture.md §2): no import cycles, imports that flow down, plug-ins as lazy tables.

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
PACKAGES = ("verl", "eval", "serve", "loadtest", "benchmarks")
# Every module's level (docs/architecture.md §2): a module may import — at its top, lazily, or by naming it in a
# string — its own level or a lower one, never a higher one. verl's core first, in its internal order (its CLI
# last); then the service, the load generator (it drives the service's clients), eval (its ship stage drives both),
# the benchmarks. No exceptions: the packages above the core contribute their commands as entry points.
VERL_LEVELS = {
    "algos": 0, "protocol": 0, "batch": 0, "utils": 0, "errors": 0, "config": 0, "config_aliases": 0, "registry": 0,
    "models": 1, "data": 1, "rewards": 1, "tracking": 1, "tools": 1, "dashboard": 1, "envs": 1, "interactions": 1,
    "sandbox": 1,
    "rollout": 2, "evaluators": 2, "workers": 3, "trainer": 4, "cli": 5,
}
PACKAGE_LEVELS = {"serve": 6, "loadtest": 7, "eval": 8, "benchmarks": 10}
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


def level(module: str) -> int | None:
    """A module's level, or None when nothing gives it one."""
    parts = module.split(".")
    if parts[0] == "verl":
        return VERL_LEVELS.get(parts[1]) if len(parts) > 1 else 0
    return PACKAGE_LEVELS.get(parts[0])


def upward(references: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it reaches above its level), for every such reference."""
    return sorted((m, i) for m, deps in references.items() for i in deps
                  if level(m) is not None and level(i) is not None and level(i) > level(m))


def unleveled(modules: dict[str, object]) -> list[str]:
    return sorted(m for m in modules if level(m) is None)


def test_every_module_has_a_level(graph):
    assert unleveled(graph) == []


def test_verl_core_never_imports_eval_serve_or_loadtest(references):
    bad = {(m, i) for m, deps in references.items() if m.startswith("verl.")
           for i in deps if i.split(".")[0] in ("eval", "serve", "loadtest", "benchmarks")}
    assert bad == set()


def test_layers_only_import_downwards(references):
    assert upward(references) == []


def test_the_layer_checks_fail_on_an_upward_lazy_import_an_importlib_string_and_a_new_package(tmp_path, references):
    """Mutations: each one must be caught."""
    modules = {**{m: Path() for m in references}, "eval.cli": Path()}
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from eval.runner import run_eval\n")
    assert upward({"verl.models.loader": imports_of("verl.models.loader", lazy, modules)}) == [
        ("verl.models.loader", "eval.runner")]
    named = tmp_path / "named.py"
    named.write_text("import importlib\n\ndef f():\n    return importlib.import_module('serve.cli')\n")
    assert upward({"verl.config": modules_named_in_strings("verl.config", named, modules)}) == [
        ("verl.config", "serve.cli")]
    assert upward({"serve.routes": {"eval.ship.run"}}) == [("serve.routes", "eval.ship.run")]
    assert unleveled({**modules, "verl.newthing.core": Path(), "plugins.x": Path()}) == ["plugins.x",
                                                                                         "verl.newthing.core"]


def test_loading_a_model_never_trains_one(graph):
    assert not any(dep.startswith("verl.trainer") for dep in graph["verl.models.loader"])


def test_evaluators_have_one_home_and_pyproject_declares_no_builtins(graph):
    """Built-in evaluators are listed once (``verl.evaluators.registry``); the trainer and eval import them."""
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("entry-points", {})
    assert "verl.evaluators" not in entry_points
    assert "verl.evaluators.registry" in graph["verl.trainer.validation"] | graph["verl.evaluators"]
    assert not any(module.startswith("eval.evaluators") for module in graph)


MAX_FUNCTION_LINES = 80  # a function, its signature and docstring included
MAX_CLASS_LINES = 300


def definition_lengths(modules: dict[str, Path], kinds: tuple[type, ...]) -> list[tuple[int, str]]:
    """(lines from ``def``/``class`` to its end, "module:name") of every definition of ``kinds``, nested included."""
    return [(node.end_lineno - node.lineno + 1, f"{name}:{node.name}") for name, file in modules.items()
            for node in ast.walk(ast.parse(file.read_text(), str(file))) if isinstance(node, kinds)]


def test_no_function_is_longer_than_80_lines_and_no_class_longer_than_300():
    modules = project_modules()
    functions = definition_lengths(modules, (ast.FunctionDef, ast.AsyncFunctionDef))
    assert sorted((n, f) for n, f in functions if n > MAX_FUNCTION_LINES) == []
    assert sorted((n, c) for n, c in definition_lengths(modules, (ast.ClassDef,)) if n > MAX_CLASS_LINES) == []
    probe = _write({}, "class A:\n" + "    x = 1\n" * 300 + "\ndef f():\n" + "    y = 1\n" * 79)
    assert [n for n, _ in definition_lengths({"p": probe}, (ast.ClassDef,))] == [301]
    assert [n for n, _ in definition_lengths({"p": probe}, (ast.FunctionDef,))] == [80]


# The training step's stages (docs/architecture.md §3): every function of these modules (and these classes' methods)
# that takes a batch takes the typed one, annotates every parameter and its return value, and reads the batch by
# field, never by a string key (``batch.batch["old_log_probs"]``, ``non_tensor.get("uid")``). Roles take the wire
# format (``DataProto``) and are not stages.
STAGE_MODULES = ("verl.trainer.stages", "verl.trainer.step_metrics", "verl.trainer.rollout_stage", "verl.trainer.ppo")
STAGE_METHODS = {"verl.workers.actor": ("Actor.update_policy", "Actor._update_mini_batch"),
                 "verl.workers.critic": ("Critic.update",)}
BATCH_PARAMETERS = ("batch", "data", "mini", "micro")
WIRE_ATTRIBUTES = ("batch", "non_tensor")


def stage_functions(modules: dict[str, Path]) -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for module in (*STAGE_MODULES, *STAGE_METHODS):
        tree = ast.parse(modules[module].read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "Roles":
                continue  # the roles' protocol: the wire format
            if isinstance(node, ast.FunctionDef) and module in STAGE_MODULES:
                found.append((f"{module}:{node.name}", node))
            elif isinstance(node, ast.ClassDef):
                found += [(f"{module}:{node.name}.{f.name}", f) for f in node.body if isinstance(f, ast.FunctionDef)
                          and (module in STAGE_MODULES or f"{node.name}.{f.name}" in STAGE_METHODS[module])]
    return found


def stage_violations(name: str, node: ast.FunctionDef) -> list[str]:
    args = [a for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs) if a.arg not in ("self",)]
    takes_batch = [a for a in args if a.arg in BATCH_PARAMETERS]
    if not takes_batch:
        return []
    found = [f"{name}: {a.arg} is not a TrainBatch" for a in takes_batch
             if a.annotation is None or "TrainBatch" not in ast.unparse(a.annotation)]
    found += [f"{name}: {a.arg} has no annotation" for a in args if a.annotation is None]
    found += [f"{name}: no return annotation"] if node.returns is None else []
    for inner in ast.walk(node):
        keyed = (isinstance(inner, ast.Subscript) and isinstance(inner.slice, ast.Constant)
                 and isinstance(inner.slice.value, str))
        got = (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
               and inner.func.attr in ("get", "pop")
               and inner.args and isinstance(inner.args[0], ast.Constant) and isinstance(inner.args[0].value, str))
        target = inner.value if keyed else inner.func.value if got else None
        if target is not None and (isinstance(target, ast.Attribute) and target.attr in WIRE_ATTRIBUTES
                                   or isinstance(target, ast.Name) and target.id in BATCH_PARAMETERS):
            found.append(f"{name}: indexes the batch by a string key ({ast.unparse(inner)})")
    return found


def test_every_stage_takes_the_typed_batch_and_reads_it_by_field():
    stages = stage_functions(project_modules())
    names = {name for name, _ in stages}
    assert {"verl.trainer.stages:correct_rollout", "verl.trainer.ppo:PPOTrainer.train_step",
            "verl.workers.actor:Actor.update_policy", "verl.trainer.step_metrics:rollout_metrics"} <= names
    assert [v for name, node in stages for v in stage_violations(name, node)] == []
    probe = ast.parse('def s(batch: DataProto) -> dict:\n    return batch.batch["old_log_probs"]\n').body[0]
    assert stage_violations("p:s", probe) == ["p:s: batch is not a TrainBatch",
                                              "p:s: indexes the batch by a string key "
                                              "(batch.batch['old_log_probs'])"]


def test_commands_are_module_level_functions():
    """A feature's ``register(app)`` attaches commands defined at module level (importable, testable alone); it
    defines none inside itself."""
    nested = []
    for name, file in project_modules().items():
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "register":
                nested += [f"{name}:{inner.name}" for inner in ast.walk(node) if inner is not node
                           and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert nested == []


# The service's roles (docs/architecture.md §7), one module each, below the composition that wires them (serve.service)
# and the endpoints above it. A role never reaches the composition or an endpoint: each is testable alone.
SERVICE_ROLES = ("serve.lifecycle", "serve.admission", "serve.shadow", "serve.pumps", "serve.changes",
                 "serve.fleet_sync")
SERVICE_ABOVE_ROLES = ("serve.service", "serve.requests", "serve.streaming", "serve.routes", "serve.admin",
                       "serve.api", "serve.cli", "serve.fleet")
MAX_SERVICE_LINES = 80


def role_violations(references: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(role module, the composition or endpoint module it reaches)."""
    return sorted((role, dep) for role in SERVICE_ROLES for dep in references.get(role, ())
                  if dep in SERVICE_ABOVE_ROLES)


def test_the_service_is_a_thin_composition_of_its_roles(references):
    assert role_violations(references) == []
    assert role_violations({"serve.pumps": {"serve.service"}}) == [("serve.pumps", "serve.service")]  # it can fail
    tree = ast.parse((REPO / "serve" / "service.py").read_text())
    [service] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Service"]
    assert service.end_lineno - service.lineno + 1 <= MAX_SERVICE_LINES
    assert {n for n in references["serve.service"] if n.startswith("serve.")} >= set(SERVICE_ROLES)


# Every pluggable table (docs/architecture.md, "Registries"): (module, its Registry).
REGISTRIES = {("verl.algos.advantages", "ADV_ESTIMATORS"), ("verl.algos.advantages", "ESTIMATOR_FACTS"),
              ("verl.algos.kl", "KL_ESTIMATORS"), ("verl.algos.losses", "POLICY_LOSSES"),
              ("verl.rewards.registry", "REWARD_FNS"), ("verl.evaluators.registry", "EVALUATORS"),
              ("verl.rollout.base", "ROLLOUT_ENGINES"), ("verl.rollout.base", "GATEWAY_ENGINES"),
              ("serve.engines", "ENGINES"),
              ("verl.tracking.base", "TRACKERS"), ("verl.tools.registry", "BUILTIN_TOOLS"), ("verl.cli", "COMMANDS"),
              ("verl.data.sources", "SOURCES")}


def registry_assignments(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(module, name) of every module-level ``NAME = Registry(...)`` / ``NAME: ... = Registry(...)``."""
    found = set()
    for name, file in modules.items():
        for node in ast.parse(file.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Registry":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {(name, t.id) for t in targets if isinstance(t, ast.Name)}
    return found


def tables_written_by_registering_functions(modules: dict[str, Path]) -> list[str]:
    """``module:function`` for every ``register*`` function that stores into a module-level table itself
    (``TABLE[name] = ...``) instead of going through a Registry."""
    found = []
    for name, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("register"):
                found += [f"{name}:{node.name}" for inner in ast.walk(node) if isinstance(inner, ast.Assign)
                          for t in inner.targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                          and t.value.id.isupper()]
    return found


def test_every_pluggable_table_is_one_registry_type_that_refuses_a_second_definition():
    import importlib

    from verl.registry import Registry, RegistryError

    modules = project_modules()
    assert registry_assignments(modules) == REGISTRIES
    assert tables_written_by_registering_functions(modules) == []
    for module, attr in sorted(REGISTRIES):
        table = getattr(importlib.import_module(module), attr)
        if len(table) == 0:  # filled by installed packages' entry points only (GATEWAY_ENGINES: serve's)
            assert table.group and table.available(), module
            table = table.copy()
            table.register("probe", "a.b:c")
        assert isinstance(table, Registry) and len(table) > 0, module
        name = next(iter(table))
        with pytest.raises(RegistryError, match=f"{table.kind} '{name}' is defined twice: .* and "):
            table.copy().register(name, object())
        table.copy().register(name, table._entries[name])  # the same definition again (a re-import) is fine
    probe = {"x": Path()}
    assert tables_written_by_registering_functions({"x": _write(probe, "TABLE = {}\n\ndef register_x(n, f):\n"
                                                                      "    TABLE[n] = f\n")}) == ["x:register_x"]


def _write(_: dict, text: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "probe.py"
    path.write_text(text)
    return path


def test_every_console_prints_verbatim():
    """Consoles come from ``verl.utils.cli.new_console`` (markup off), so a message's ``[...]`` survives."""
    made_elsewhere = [name for name, file in project_modules().items() if name != "verl.utils.cli"
                      for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, ast.Call)
                      and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Console"]
    assert made_elsewhere == []


def test_every_design_reference_points_into_docs_architecture():
    """The architecture lives in the repository; a ``docs/architecture.md §N`` in the code names a section of it."""
    sections = set(re.findall(r"^## (\d+)\.", (REPO / "docs" / "architecture.md").read_text(), re.M))
    files = [*project_modules().values(), *(REPO / "tests").rglob("*.py")]
    cited = {(f.name, n) for f in files for n in re.findall(r"docs/architecture\.md §(\d+)", f.read_text())}
    assert len(cited) >= 10 and {n for _, n in cited} <= sections
    assert not [f for f in files if re.search(r"DESIGN(\.md)? §", f.read_text())]


def test_every_environment_switch_is_documented_in_one_table():
    doc = (REPO / "docs" / "architecture.md").read_text()
    table = doc[doc.index("### Environment switches"):doc.index("## 9.")]
    read = {m for f in project_modules().values() for m in re.findall(r"VERL_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    assert len(read) > 20
    assert sorted(v for v in read if v not in table and not v.startswith("VERL_SERVE_")) == []
    assert "VERL_SERVE_<SETTING>" in table
    from serve.settings import ServeSettings  # each VERL_SERVE_ name is a setting (a help text named a wrong one)

    settings = {f"VERL_SERVE_{name.upper()}" for name in ServeSettings.model_fields} | {"VERL_SERVE_CONFIG"}
    assert sorted(v for v in read if v.startswith("VERL_SERVE_") and v not in settings) == []


def option_fields(settings: type) -> list:
    """The ``option`` fields of a settings class and of its nested settings."""
    import dataclasses

    found = []
    for f in dataclasses.fields(settings):
        if "nested" in f.metadata:
            found += option_fields(f.metadata["nested"])
        elif "option" in f.metadata:
            found.append(f)
    return found


@pytest.mark.parametrize("command_name", ["eval", "ship", "loadtest", "loadtest-report"])
def test_a_command_built_from_its_settings_declares_each_option_once(command_name):
    """``verl eval``'s, ``verl ship``'s and ``verl loadtest``'s options are their settings' fields: the same names,
    flags and defaults, so the Python API and the command line cannot disagree (they did: ``slo_p95_ms`` 1000 on the
    command line, None in the canary's settings; ``capacity`` True and False)."""
    import dataclasses

    import typer

    from eval.cli import eval_command
    from eval.settings import EvalSettings
    from eval.ship.cli import ship_command
    from eval.ship.settings import ShipSettings
    from loadtest.cli import loadtest_command, loadtest_report_command
    from loadtest.settings import LoadTestSettings, ReportSettings

    command, settings, leading = {"eval": (eval_command, EvalSettings, {"ckpt", "out", "watch"}),
                                  "ship": (ship_command, ShipSettings, set()),
                                  "loadtest": (loadtest_command, LoadTestSettings, set()),
                                  "loadtest-report": (loadtest_report_command, ReportSettings, set())}[command_name]
    app = typer.Typer(add_completion=False)
    app.command()(command)
    params = {p.name: p for p in typer.main.get_command(app).params}
    fields = option_fields(settings)
    assert len(fields) >= (10 if command_name == "loadtest-report" else 25)
    assert set(params) == {f.name for f in fields} | leading
    for f in fields:
        flags = {flag for spec in f.metadata["flags"] for flag in spec.split("/")}  # --x/--no-x: both
        assert flags <= set(params[f.name].opts + params[f.name].secondary_opts), f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory() if (
            f.default_factory is not dataclasses.MISSING) else None
        if f.metadata["cli_default"] is not dataclasses.MISSING:
            assert f.metadata["parse"](f.metadata["cli_default"]) == default, f.name
        else:
            assert params[f.name].default == default, f.name
    if command_name == "ship":  # the canary runs the guardrails and stages the ship runs
        shipped = ShipSettings(run="r", service="s", shadow_fraction=0.1)
        assert (shipped.canary.slo_p95_ms, shipped.canary.capacity, shipped.canary.shadow) == (1000.0, True, True)
