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


def test_library_modules_do_not_import_the_test_helpers() -> None:
    """`verify_plan` is a library API: what it shares with `haloshard.testing` lives in an
    internal module below both (only the demo, which runs simulated ranks, uses testing)."""
    users = {m for m, edges in import_graph().items() if "haloshard.testing" in edges}
    assert users == {"haloshard.demo"}, users
    import haloshard._per_rank as per_rank_module
    import haloshard.testing as testing

    for name in ("per_rank", "rank_map", "seeded_randn", "shard", "single_device"):
        assert getattr(testing, name) is getattr(per_rank_module, name)


def test_only_comm_sets_the_collective_label() -> None:
    """The label that names a module in a collective's timeout is set through
    `_comm.labelled`, not by assigning `_comm.current_label` elsewhere."""
    setters = [path.name for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_comm.py"
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr == "current_label"
               and isinstance(node.ctx, ast.Store)]
    assert setters == [], setters


def _unwrapping_functions() -> set[str]:
    """`module.Class` of every autograd Function whose forward unwraps a DTensor."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or not any(
                    getattr(base, "attr", getattr(base, "id", None)) == "Function"
                    for base in cls.bases):
                continue
            forwards = [f for f in cls.body if isinstance(f, ast.FunctionDef)
                        and f.name == "forward"]
            if any(isinstance(node, ast.Attribute) and node.attr == "to_local"
                   for f in forwards for node in ast.walk(f)):
                found.add(f"{path.stem}.{cls.name}")
    return found


def test_one_differentiable_unwrap() -> None:
    """`_redistribute.unwrap` is the package's one `to_local` with a layout-keeping backward;
    `verify_plan`'s `_Tap` differs on purpose (a DTensor stays a DTensor, its gradient is
    recorded as it arrives)."""
    assert _unwrapping_functions() == {"_redistribute._Unwrap", "_verify._Tap"}


def test_one_pad_mode_table() -> None:
    """Each pad mode's `F.pad` name is written once, in `_layout` (the public `PAD_MODES`
    follows it); no other module spells out a table of them."""
    from haloshard._layout import F_PAD_MODES, PAD_MODES

    assert PAD_MODES == tuple(F_PAD_MODES) == ("zeros", "replicate", "reflect", "circular")
    tables = [path.name for path in sorted(PACKAGE.rglob("*.py"))
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Dict) and {"reflect", "circular"} <= {
                  k.value for k in node.keys if isinstance(k, ast.Constant)}]
    assert tables == ["_layout.py"], tables


def test_halo_parallel_states_the_trial_margin() -> None:
    """`HaloParallel`'s docstring gives the margin the formulation trial applies."""
    from haloshard import HaloParallel
    from haloshard._choice import _EXCHANGE_FIRST_MARGIN

    doc = " ".join((HaloParallel.__doc__ or "").split())
    assert f"must be {round(_EXCHANGE_FIRST_MARGIN * 100)}% faster" in doc


def test_transports_are_objects_in_one_registry() -> None:
    """A transport's behaviour lives on its object in `_exchange`'s registry: no library
    module compares a transport's name (the registry's order is the metadata rows' code
    order). The demo, which reports each transport's bytes, is a user of the API."""
    from haloshard import TRANSPORTS
    from haloshard._exchange import _TRANSPORTS, Transport

    assert TRANSPORTS == ("all_to_all", "p2p", "allgather")
    assert all(isinstance(t, Transport) and t.name == n for n, t in _TRANSPORTS.items())
    compared = [path.name for path in sorted(PACKAGE.rglob("*.py")) if path.name != "demo.py"
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in TRANSPORTS
                    for c in [node.left, *node.comparators])]
    assert compared == [], compared
