"""xscale's import graph, read from the source (ast): dependencies point down only.

Layers, lowest first (``docs/architecture.md``): ``config`` (imports nothing else of xscale); ``runtime`` and
``ops``; ``models`` (plain single-device PyTorch); ``data``; ``parallel`` (plans that read components' declared
traits, never a concrete component class) and ``generation``; ``checkpoint``; ``estimate`` and ``launcher``;
``train``; ``interop``; the commands (``commands``, ``cli``, ``bench``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xscale"

COMMANDS = ("xscale.cli", "xscale.commands", "xscale.bench", "xscale.__main__")
# The layers from the ground up: an import may point down this list or stay within its layer, never up.
LAYERS = (
    ("xscale.config",),
    ("xscale.runtime", "xscale.ops"),
    ("xscale.models",),
    ("xscale.data",),
    ("xscale.parallel", "xscale.generation"),
    ("xscale.checkpoint",),
    ("xscale.estimate", "xscale.launcher"),
    ("xscale.train",),
    ("xscale.interop",),
    COMMANDS,
)
ABOVE_MODELS = tuple(prefix for layer in LAYERS[3:] for prefix in layer)
# Modules of xscale.models that parallel/ may import: base classes, traits and protocols, not components.
MODEL_INTERFACES = ("xscale.models", "xscale.models.attention", "xscale.models.attention.core",
                    "xscale.models.attention.multihead", "xscale.models.moe", "xscale.models.traits",
                    "xscale.models.registry", "xscale.models.init", "xscale.models.dropout", "xscale.models.block",
                    "xscale.models.transformer", "xscale.models.position", "xscale.models.norm",
                    "xscale.models.parameters",  # parameters: counts, no component
                    "xscale.models.stacks")  # the stack base class and the lookup of model.stack, no variant
# Imports inside a function that stay: lazy CLI dispatch (``xscale --help`` without importing torch's stack).
LAZY_CLI = {("xscale.cli", "*")}
# Imports inside a function that are not lazy CLI dispatch (importer -> imported): none left.
PENDING_INNER: set[tuple[str, str]] = set()
PENDING_CONCRETE: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The xscale modules an import statement loads (``from a import b`` is ``a.b`` when that is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    resolved = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name.startswith("xscale"):
            resolved.append(name)
    return resolved


def _imports() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """Every module's imported xscale modules, and the (importer, imported) pairs inside function bodies."""
    graph: dict[str, set[str]] = {}
    inner: set[tuple[str, str]] = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[module] = {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for target in _targets(module, node)} - {module}
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        inner.update((module, target) for target in _targets(module, node))
    return graph, inner


GRAPH, INNER = _imports()


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _layer(module: str) -> int | None:
    return next((rank for rank, layer in enumerate(LAYERS) if _in(module, layer)), None)


def test_every_module_but_the_package_root_has_a_layer():
    assert sorted(module for module in MODULES if module != "xscale" and _layer(module) is None) == []


def test_no_import_runs_up_a_layer():
    upward = sorted((module, target) for module, targets in GRAPH.items() if _layer(module) is not None
                    for target in targets if _layer(target) is not None and _layer(target) > _layer(module))
    assert upward == []


def test_the_layer_check_finds_an_upward_import():
    assert _layer("xscale.parallel.checks") < _layer("xscale.train.trainer")
    assert _layer("xscale.config.schema") == 0 and _layer("xscale.commands.train") == len(LAYERS) - 1


def test_the_config_package_imports_nothing_outside_itself():
    outside = sorted((module, target) for module, targets in GRAPH.items() if _in(module, ("xscale.config",))
                     for target in targets if not _in(target, ("xscale.config",)))
    assert outside == []


def test_every_command_lives_in_its_own_commands_module():
    cli = ast.parse((PACKAGE / "cli.py").read_text())
    table = next(node.value for node in ast.walk(cli) if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "COMMANDS" for target in node.targets))
    commands = {ast.literal_eval(key): ast.literal_eval(value)[0] for key, value in zip(table.keys, table.values)}
    assert commands and all(module == f"xscale.commands.{name}" for name, module in commands.items()), commands
    assert not (PACKAGE / "tools").exists()


def test_the_import_graph_has_no_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["xscale.config", "xscale.parallel.dims", "xscale.runtime.step_context",
                                    "xscale.runtime.hooks"])
def test_the_lowest_modules_import_nothing_of_xscale(module):
    assert GRAPH[module] == set()


def test_models_and_ops_never_import_the_layers_above():
    upward = sorted((module, target) for module, targets in GRAPH.items() if _in(module, ("xscale.models", "xscale.ops"))
                    for target in targets if _in(target, ABOVE_MODELS))
    assert upward == []


def test_ops_never_import_models():
    assert sorted((m, t) for m, ts in GRAPH.items() if _in(m, ("xscale.ops",)) for t in ts
                  if _in(t, ("xscale.models",))) == []


def test_parallel_imports_no_concrete_model_component():
    concrete = {(module, target) for module, targets in GRAPH.items() if _in(module, ("xscale.parallel",))
                for target in targets if _in(target, ("xscale.models",)) and target not in MODEL_INTERFACES}
    assert concrete - PENDING_CONCRETE == set(), "parallel/ must read declared traits, not import components"
    assert PENDING_CONCRETE - concrete == set(), "fixed: remove these from PENDING_CONCRETE"


def test_no_xscale_import_inside_a_function():
    inner = {(module, target) for module, target in INNER if (module, "*") not in LAZY_CLI}
    assert inner - PENDING_INNER == set(), "import at module level (a cycle means a layer is wrong)"
    assert PENDING_INNER - inner == set(), "fixed: remove these from PENDING_INNER"


# Process-global mutable state that the layered design removed: per-batch values travel in the StepContext argument,
# plans register hooks or replace parameters instead of rebinding methods. Each pattern names what it forbids.
FORBIDDEN_STATE = {"ScopedValue": "a process-global scoped value", "types.MethodType": "a method rebound on an "
                   "instance", "contextvars": "a context variable (autograd's threads do not see it)",
                   "\n    global ": "a module-level setting rebound by a function (e.g. a kernel backend switch)"}


@pytest.mark.parametrize("package", ["models", "parallel", "runtime", "ops"])
def test_no_process_global_state_in_models_and_plans(package):
    found = [f"{path.relative_to(ROOT)}: {what}" for path in (PACKAGE / package).rglob("*.py")
             for pattern, what in FORBIDDEN_STATE.items() if pattern in path.read_text()]
    assert found == []


# Plans change a built model as torch's own plans do: they replace parameters and register hooks. They never swap a
# module's class, rebind a method or write attributes into a module (state the module does not own).
FORBIDDEN_WRITES = {"__class__ =": "a module's class swapped", "setattr(": "an attribute written into a module",
                    ".token_group =": "an MoE collaborator replaced", ".dispatch =": "an MoE collaborator replaced",
                    ".metrics =": "statistics written into a layer", "config.parallel.microbatches =":
                    "a resolved value written into the caller's config"}


def test_plans_write_no_attribute_into_modules():
    found = [f"{path.relative_to(ROOT)}: {what}" for path in (PACKAGE / "parallel").rglob("*.py")
             for pattern, what in FORBIDDEN_WRITES.items() if pattern in path.read_text()]
    assert found == []
