"""The package's import graph has no cycle.

A cycle makes the import order decide which names exist when a module body runs, and hides a
dependency that points the wrong way (a pure module reaching up into the DTensor guards). The
graph is read from the source with `ast`: every `import` and `from ... import` statement of a
module, at module level and inside functions and classes alike (a deferred import is still a
dependency: it only moves the cycle from import time to call time), plus `__import__` and
`importlib.import_module` calls with a constant name.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "haloshard"
ROOT = "haloshard"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _constant_import(node: ast.Call) -> str | None:
    """The module named by `__import__("x")` or `importlib.import_module("x")`, else None."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(
        func, ast.Attribute) else None
    if name not in ("__import__", "import_module") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) \
        else None


def _targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The package modules one import statement (or call) loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.Call):
        return [name] if (name := _constant_import(node)) else []
    assert isinstance(node, ast.ImportFrom)
    source = _absolute(node, module, is_package)
    # `from pkg import sub` loads the submodule `pkg.sub`; `from pkg import name` runs pkg.
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
            for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        module, is_package = _module_name(path), path.name == "__init__.py"
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom | ast.Call):
                targets = _targets(node, module, is_package, modules)
                edges.update(t for t in targets if t in modules and t != module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a closed path [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once left
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "haloshard._layout" in graph["haloshard"]  # the package re-exports it
    assert "haloshard._errors" in graph["haloshard._layout"]
    assert graph["haloshard._errors"] == set()


def test_find_cycle_reports_the_path() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_layout_is_pure() -> None:
    """`_layout` is arithmetic and the placement: it imports nothing above the error type and
    the compat names, and builds no tensor (the DTensor guards reach it through a hook)."""
    assert import_graph()["haloshard._layout"] == {"haloshard._compat", "haloshard._errors"}
    tree = ast.parse((PACKAGE / "_layout.py").read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "torch"}
    assert used == set(), used


def test_fx_repr_names_only_the_class() -> None:
    from haloshard import HaloShard

    p = HaloShard(2, left=1, right=3, pad="replicate")
    text, names = p.__fx_repr__()
    assert names == {"HaloShard": HaloShard}
    assert eval(text, names) == p  # as the FX codegen evaluates it
