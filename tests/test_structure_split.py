"""The halo layer's pieces each live in one module (issue 28, items 3 and 4).

Read from the source with `ast`, as `test_structure.py` reads the import graph: the conv
formulation is chosen in `_choice` alone; what the modules split out of the old `_hooks`
give each other are public names; one installer (`_forward.install`) replaces a forward.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "haloshard"
# the modules the halo layer was split into, and the one that chooses its conv formulation
SPLIT = ("_site", "_annotation", "_no_pad", "_packed", "_halo_forward", "_choice")
# the names of the formulation choice: defined in `_choice` and nowhere else
CHOICE = {"formulation", "by_taps", "overlappable", "ConvChoice", "slow_window",
          "taps_layout", "_taps_everywhere", "_overlap_kept", "_EXCHANGE_FIRST_MARGIN",
          "_TRIAL_ROUNDS", "_TRIAL_MAX_ROUNDS", "_TRIAL_SECONDS", "CORRECTED", "SPLIT",
          "WHOLE"}


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names |= {e.id for e in elts if isinstance(e, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_formulation_is_chosen_in_one_module() -> None:
    where = {path: sorted(_defined(tree) & CHOICE) for path, tree in _trees().items()}
    assert {p: n for p, n in where.items() if n} == {"_choice.py": sorted(CHOICE)}


def test_split_modules_share_public_names() -> None:
    """No module imports a `_private` name from one of the split modules."""
    private = [f"{path}: {node.module}.{alias.name}"
               for path, tree in _trees().items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module in {
                   f"haloshard.{m}" for m in SPLIT}
               for alias in node.names if alias.name.startswith("_")]
    assert private == [], private


def test_no_private_name_crosses_modules() -> None:
    """No module of the package imports another's `_private` name (issue 28): what one
    module gives another is public within the package. A private submodule itself
    (`from haloshard import _comm`) is a module, not a name."""
    modules = {p.stem for p in PACKAGE.rglob("*.py")}
    private = [f"{path}: {node.module}.{alias.name}"
               for path, tree in _trees().items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                   "haloshard")
               for alias in node.names
               if alias.name.startswith("_") and alias.name not in modules]
    assert private == [], private


def test_hooks_is_gone_and_one_installer_remains() -> None:
    """`_hooks` held five concerns; nothing defines `attach`, a second installer, now."""
    assert importlib.util.find_spec("haloshard._hooks") is None
    attach = [path for path, tree in _trees().items() if "attach" in _defined(tree)]
    assert attach == [], attach
    from haloshard import annotate
    from haloshard._annotation import annotate as defined

    assert annotate is defined  # the public path still works
