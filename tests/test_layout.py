"""The layout keeps its shape: packages import only what lies below them, and no module imports
itself back through others.

Read from the source (every import statement, including those inside functions and under
TYPE_CHECKING: each is a dependency, whenever it runs), so a new arrow that runs the wrong way fails
here, naming the file and the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own package and the packages of lower layers, nothing else:
# the algorithm, policies and rewards know nothing of serving, weights or the trainer; serving knows
# nothing of the trainer; the core knows no world.
LAYERS: list[tuple[str, ...]] = [
    ("serve_app.errors", "serve_app.schemas", "serve_app.stored", "serve_app.imports", "serve_app.media", "serve_app.retry",
     "serve_app.local_ray", "serve_app.wire", "serve_app.families", "serve_app.api", "serve_app.config.sampling"),
    ("serve_app.flowgrpo",),
    ("serve_app.rewards", "serve_app.models"),
    ("serve_app.config",),
    ("serve_app.policies",),
    ("serve_app.weights",),
    ("serve_app.serving", "serve_app.client", "serve_app.http_client"),
    ("serve_app.trainer",),
    ("serve_app.worlds",),
    ("deployments",),
    ("serve_app.app",),
]
# Modules of the lowest layer may use each other (errors, schemas, media: the shared vocabulary).
SHARED_LAYER = 0


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    paths = [*ROOT.glob("serve_app/**/*.py"), *ROOT.glob("deployments/**/*.py")]
    return {module_name(p): p for p in paths}


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for each import of the project's own modules in `path`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target]
            # `from package import module` imports the module.
            targets += [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in ("serve_app", "deployments"):
                found.append((target, node.lineno))
    return found


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The project module an import names (the longest existing prefix), or None."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the layer entry that holds `module`); the root package's own __init__ is shared."""
    if module == "serve_app":
        return SHARED_LAYER, module
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                return index, entry
    raise AssertionError(f"{module} belongs to no layer of tests/test_layout.py: add it to LAYERS")


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = source_modules()
    graph: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        edges = []
        for target, line in imports_of(name, path):
            resolved = resolve(target, modules)
            if resolved is not None and resolved != name and (resolved, line) not in edges:
                edges.append((resolved, line))
        graph[name] = edges
    return graph


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    wrong = []
    for module, edges in graph.items():
        layer, entry = layer_of(module)
        for target, line in edges:
            target_layer, target_entry = layer_of(target)
            same_package = target_entry == entry
            lower = target_layer < layer or (target_layer == layer == SHARED_LAYER)
            if not (same_package or lower):
                wrong.append(f"{module} (line {line}) imports {target}: {target_entry} is not below {entry}")
    return wrong


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every import cycle between modules, each as the path that closes it (Tarjan's strongly connected
    components: a component of more than one module is a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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


def test_every_module_belongs_to_a_layer():
    for module in source_modules():
        layer_of(module)


def test_no_package_imports_a_package_above_it():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("bad_edge", [
    ("serve_app.flowgrpo.sampler", "serve_app.weights.versions"),
    ("serve_app.serving.engine_contract", "serve_app.trainer.mismatch"),
    ("serve_app.policies.base", "serve_app.serving.engine"),
])
def test_the_check_catches_an_upward_import(bad_edge):
    graph = import_graph()
    source, target = bad_edge
    graph[source] = [*graph[source], (target, 1)]
    assert any(f"{source} (line 1) imports {target}" in w for w in upward_imports(graph))


def test_the_check_catches_a_cycle():
    graph = import_graph()
    graph["serve_app.trainer.loss"] = [*graph["serve_app.trainer.loss"], ("serve_app.trainer.update", 1)]
    graph.setdefault("serve_app.trainer.update", []).append(("serve_app.trainer.loss", 2))
    assert any({"serve_app.trainer.loss", "serve_app.trainer.update"} <= set(c) for c in cycles(graph))
