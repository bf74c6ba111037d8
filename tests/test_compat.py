"""Private torch names live in `haloshard._compat` only, and it refuses an unsupported torch.

The scan parses every module of the package with `ast`. A private torch name is a name whose
dotted path from a torch import has a part starting with `_` (dunders excepted): an import
from a private module (`torch.distributed._local_tensor`), an imported private name, or an
attribute of a torch-bound name (`torch._ops`, `DTensor._op_dispatcher`). An attribute
starting with `_` on any other object (`dt._local_tensor`, `module._reversed_padding...`)
counts too unless haloshard itself defines that name somewhere; aten operator names
(`aten._to_copy`) are operators, not Python internals.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from haloshard import _compat

PACKAGE = pathlib.Path(_compat.__file__).parent
# Private attributes of objects that are not torch's, each with its owner.
NOT_TORCH = {"_gradient_checkpointing_func": "diffusers' ModelMixin"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees() -> dict[pathlib.Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _defined(trees: dict[pathlib.Path, ast.Module]) -> set[str]:
    """Every name haloshard binds anywhere (functions, classes, variables, attributes)."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _torch_imports(tree: ast.Module) -> tuple[dict[str, str], list[str]]:
    """(local name -> torch path) for a module's torch imports, and its private imports."""
    bound: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
                    if any(_private(part) for part in a.name.split(".")):
                        found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                if any(_private(part) for part in f"{node.module}.{a.name}".split(".")):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
    return bound, found


def _private_uses(tree: ast.Module, defined: set[str]) -> list[str]:
    """Private torch imports and attribute accesses in one module."""
    bound, found = _torch_imports(tree)
    aten = {name for name, path in bound.items() if path.endswith(".ops.aten")}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        text = ast.unparse(node)
        on_torch = isinstance(root, ast.Name) and root.id in bound
        if text.startswith(("torch.ops.aten.", "aten.", *(f"{a}." for a in aten))):
            continue
        if on_torch or (node.attr not in defined and node.attr not in NOT_TORCH):
            found.append(f"line {node.lineno}: {text}")
    return found


def test_private_torch_names_only_in_compat() -> None:
    trees = _trees()
    defined = _defined(trees)
    uses = {path.relative_to(PACKAGE).as_posix(): _private_uses(tree, defined)
            for path, tree in trees.items() if path.name != "_compat.py"}
    uses = {path: found for path, found in uses.items() if found}
    assert not uses, f"private torch names outside haloshard/_compat.py: {uses}"
    # The scan itself finds what it is meant to (it reads _compat as a positive control).
    compat = _private_uses(trees[PACKAGE / "_compat.py"], defined)
    assert any("_op_dispatcher" in f for f in compat), compat
    assert any("_local_tensor" in f for f in compat), compat


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu126", "2.13.0a0+git1"])
def test_supported_versions_pass(version: str) -> None:
    _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0+cpu", "2.1.3", "3.13.0", "2.130.0", ""])
def test_unsupported_version_names_both(version: str) -> None:
    with pytest.raises(ImportError) as info:
        _compat.check_torch_version(version)
    message = str(info.value)
    assert f"torch {version} is installed" in message and "torch 2.13.x" in message, message


def test_import_refuses_unsupported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(ImportError, match=r"supports torch 2\.13\.x, but torch 2\.14\.0"):
        importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)  # leave a working module behind for later tests


def test_import_of_package_refuses_unsupported_torch() -> None:
    """In a fresh interpreter, `import haloshard` itself fails with the clear message."""
    script = textwrap.dedent("""
        import torch
        torch.__version__ = "2.12.0"
        try:
            import haloshard
        except ImportError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "refused: haloshard supports torch 2.13.x, but torch 2.12.0" in done.stdout, (
        done.stdout + done.stderr[-2000:])
