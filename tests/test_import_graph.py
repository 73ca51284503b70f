"""memcalc's modules import one another without circles.

Every import counts as an arrow, whether it stands at the top of a module or inside a function (a
function-level import hides a circle from Python, not from the reader); only imports under
``if TYPE_CHECKING:`` are left out, since they never run. A circle shows up as a strongly connected
component of more than one module; the test prints each one it finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import memcalc

PACKAGE = Path(memcalc.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, modules: frozenset[str] = frozenset()) -> set[str]:
    """The memcalc modules ``module`` names in its import statements, TYPE_CHECKING blocks left out.

    `from package import name` points at the submodule where `name` is one of `modules`, else at the package.
    """
    found: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name == "memcalc" or name.startswith("memcalc.")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the memcalc modules it imports."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        names = _imports(tree, module, path.name == "__init__.py", frozenset(paths))
        graph[module] = {name for name in names if name in paths and name != module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
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
            connect(node)
    return sorted(found)


def test_the_graph_sees_function_level_imports_and_skips_type_checking_ones():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from memcalc import c\n"
        "def f():\n    from memcalc.d import x\n"
    )
    names = _imports(ast.parse(source), "memcalc.pkg.a", is_package=False, modules=frozenset({"memcalc.pkg.b"}))
    assert names == {"memcalc.pkg.b", "memcalc.d"}


def test_memcalc_modules_import_one_another_without_circles():
    circles = strongly_connected(import_graph())
    for circle in circles:
        print("circle:", " <-> ".join(circle))
    assert circles == []


def _parts(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between memcalc's parts: its subpackages and top-level modules (memcalc.config, memcalc.schemas)."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        parts.setdefault(part(module), set()).update(part(t) for t in targets if part(t) != part(module))
    return parts


def test_memcalc_parts_import_one_another_without_circles():
    """The parts stand on floors: the config reads files into the model's vocabulary (model.knobs, model.rules,
    model.families) and never the other way round."""
    circles = strongly_connected(_parts(import_graph()))
    for circle in circles:
        print("circle between parts:", " <-> ".join(circle))
    assert circles == []
