"""Private and version-new torch names live in `haloshard._compat` only; it refuses a torch
older than the supported range and warns about a newer one.

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
import types
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as _funcol
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import haloshard
from haloshard import HaloShard, _comm, _compat
from haloshard.testing import counted_collectives, per_rank, rank_map, simulated_mesh

PACKAGE = pathlib.Path(_compat.__file__).parent
# Private attributes of objects that are not torch's, each with its owner.
NOT_TORCH = {"_gradient_checkpointing_func": "diffusers' ModelMixin",
             "_padding": "diffusers' WanCausalConv3d"}


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


# Issue 27: torch 2.12 to 2.14 are supported; older is refused, newer warns.
@pytest.mark.parametrize("version", ["2.12.0", "2.12.0a0+git1", "2.12.1", "2.13.0+cpu",
                                     "2.13.1+cu126", "2.14.1"])
def test_supported_versions_pass_silently(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.10.0", "2.1.3", "1.13.1", "2.9.1+cu128", "",
                                     "main"])
def test_older_version_is_refused_naming_both(version: str) -> None:
    with pytest.raises(ImportError) as info:
        _compat.check_torch_version(version)
    message = str(info.value)
    assert f"torch {version} is installed" in message, message
    assert "supports torch 2.12 to 2.14" in message and "torch>=2.12" in message, message


@pytest.mark.parametrize("version", ["2.15.0", "2.15.0a0+gitabc", "2.130.0", "3.0.0"])
def test_newer_version_warns_naming_both(version: str) -> None:
    with pytest.warns(UserWarning) as record:
        _compat.check_torch_version(version)
    message = str(record[0].message)
    assert f"tested with torch 2.12 to 2.14, but torch {version} is installed" in message, (
        message)


def test_import_warns_on_newer_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    try:
        with pytest.warns(UserWarning, match=r"2\.12 to 2\.14, but torch 2\.15\.0"):
            importlib.reload(_compat)
        assert _compat.all_to_all_single is _funcol.all_to_all_single  # the module works
    finally:
        monkeypatch.undo()
        importlib.reload(_compat)  # leave the module as the installed torch makes it


def test_import_of_package_refuses_older_torch() -> None:
    """In a fresh interpreter, `import haloshard` itself fails with the clear message."""
    script = textwrap.dedent("""
        import torch
        torch.__version__ = "2.11.0"
        try:
            import haloshard
        except ImportError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "refused: haloshard supports torch 2.12 to 2.14, but torch 2.11.0" in done.stdout, (
        done.stdout + done.stderr[-2000:])


def test_torch_before_reads_the_installed_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `tests/conftest.py`'s `requires_torch` marker skips on."""
    monkeypatch.setattr(torch, "__version__", "2.12.1+cu130")
    assert _compat.torch_before("2.13") and not _compat.torch_before("2.12")
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    assert not _compat.torch_before("2.13") and _compat.torch_before("2.14")


# The names torch 2.13 introduced (the functional collectives' and c10d's): before 2.13 they
# do not exist, so a module that used them directly would fail there.
VERSION_NEW = {"all_gather_single", "all_gather_single_autograd", "reduce_scatter_single"}


def _version_new_uses(tree: ast.Module) -> list[str]:
    bound, _ = _torch_imports(tree)
    found = [f"import {path}" for path in bound.values() if path.split(".")[-1] in VERSION_NEW]
    for node in ast.walk(tree):
        root = node.value if isinstance(node, ast.Attribute) else None
        while isinstance(root, ast.Attribute):
            root = root.value
        if (isinstance(node, ast.Attribute) and node.attr in VERSION_NEW
                and isinstance(root, ast.Name) and root.id in bound):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_version_new_torch_names_only_in_compat() -> None:
    trees = _trees()
    uses = {path.relative_to(PACKAGE).as_posix(): _version_new_uses(tree)
            for path, tree in trees.items() if path.name != "_compat.py"}
    uses = {path: found for path, found in uses.items() if found}
    assert not uses, f"torch names new in 2.13 outside haloshard/_compat.py: {uses}"
    # The scan itself finds what it is meant to (a positive control).
    sample = ast.parse("import torch.distributed as dist\n"
                       "from torch.distributed._functional_collectives import all_gather_single\n"
                       "dist.reduce_scatter_single(out, buf)\n")
    assert len(_version_new_uses(sample)) == 2, _version_new_uses(sample)


def test_renamed_prefers_the_new_name() -> None:
    new, old = object(), object()
    both, only_old = types.ModuleType("both"), types.ModuleType("only_old")
    both.f_new, both.f_old, only_old.f_old = new, old, old  # type: ignore[attr-defined]
    assert _compat.renamed(both, "f_new", "f_old") is new
    assert _compat.renamed(only_old, "f_new", "f_old") is old


def test_compat_binds_predecessors_before_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without the 2.13 names (2.12): `_compat` binds their predecessors."""
    for name in VERSION_NEW:
        monkeypatch.delattr(_funcol, name, raising=False)  # (absent before 2.13)
    try:
        importlib.reload(_compat)
        assert _compat.all_gather_single is _funcol.all_gather_tensor
        assert _compat.all_gather_single_autograd is _funcol.all_gather_tensor_autograd
        assert _compat.reduce_scatter_single is _funcol.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(_compat)
    assert _compat.all_gather_single is _compat.renamed(_funcol, "all_gather_single",
                                                        "all_gather_tensor")


def test_c10d_predecessors_before_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without c10d's 2.13 names, `_comm`'s eager calls go to `all_gather_into_tensor` and
    `reduce_scatter_tensor`, and `counted_collectives` counts them under the new names."""
    called: list[tuple[str, object, object, dict[str, object]]] = []
    for new, old in _compat.C10D_RENAMED.items():
        monkeypatch.delattr(dist, new, raising=False)
        monkeypatch.setattr(dist, old, lambda out, inp, _old=old, **kw:
                            called.append((_old, out, inp, kw)))
    out, inp, group = torch.zeros(4), torch.ones(2), object()
    with counted_collectives() as calls:
        _compat.dist_all_gather_single(out, inp, group=group, async_op=True)
        _compat.dist_reduce_scatter_single(inp, out, group=group)
    assert called == [
        ("all_gather_into_tensor", out, inp, {"group": group, "async_op": True}),
        ("reduce_scatter_tensor", inp, out, {"group": group, "async_op": False})], called
    assert dict(calls) == {"all_gather_single": 1, "reduce_scatter_single": 1}, dict(calls)


@pytest.mark.filterwarnings("ignore:.*deprecated:FutureWarning")  # 2.13 warns on the old names
def test_funcol_predecessors_move_the_same_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the functional collectives' older names (what 2.12 has), `_comm`'s
    all-gather, its backward and its reduce-scatter move exactly what the new names move,
    under simulated ranks. A data move: exact."""
    for name in VERSION_NEW:
        monkeypatch.setattr(_comm, name, getattr(_funcol, name.replace("single", "tensor")))
    world = 3
    blocks = [torch.arange(4.0) + 10 * r for r in range(world)]
    with simulated_mesh(world) as mesh:
        group = _comm.resolve_group(mesh)
        x = rank_map(mesh, lambda r: blocks[r].clone())
        # (functional collectives return a tensor that waits on first use: `+ 0` is a use)
        gathered = _comm.all_gather(x, group) + 0
        summed = _comm.reduce_scatter(gathered, group) + 0
        ints = _comm.gather_ints(rank_map(mesh, lambda r: torch.tensor([r, 7 * r])), group)
        leaf = rank_map(mesh, lambda r: blocks[r].clone()).requires_grad_()
        (_comm.all_gather_autograd(leaf, group) * torch.arange(12.0)).sum().backward()
    for r in range(world):
        assert torch.equal(per_rank(gathered)[r], torch.cat(blocks))
        assert torch.equal(per_rank(summed)[r], world * blocks[r])
        # each rank's block r of the gathered gradient, summed over the ranks
        assert torch.equal(per_rank(leaf.grad)[r], world * torch.arange(4.0) + 4 * r * world)
    assert ints == [[r, 7 * r] for r in range(world)]


def _no_torch_rule_for_halos(propagate: Any) -> Any:
    """A stand-in for torch's sharding rules that fails when asked about a HaloShard input."""

    def rule(schema: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(q, HaloShard) for arg in schema.args_schema
               if hasattr(arg, "placements") for q in arg.placements):
            raise AssertionError(f"torch's rule was asked about {schema.op}")
        return propagate(schema, *args, **kwargs)

    return rule


def test_detach_and_alias_keep_the_halo_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.14's rule for `detach` redistributes an unknown placement to Replicate (which
    raised for a relu on a HaloShard DTensor that requires grad): the guard answers for
    detach and alias itself, whatever torch's rules say. Data: exact, the same tensors."""
    halo = (HaloShard(2, 2, 0),)  # the first HaloShard installs the guard
    _compat.clear_sharding_cache()  # torch's caches would answer before the guard is asked
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "propagate_op_sharding_non_cached"):
        monkeypatch.setattr(propagator, name, _no_torch_rule_for_halos(getattr(propagator, name)))
    full = torch.arange(24.0, dtype=torch.float64).reshape(1, 3, 8) - 11
    with simulated_mesh(3) as mesh:
        x = haloshard.redistribute(
            distribute_tensor(full, mesh, (Shard(2),)).requires_grad_(), halo)
        outs = [x.detach(), torch.ops.aten.alias(x), x.relu()]
        assert [out.placements for out in outs] == [halo] * 3, [o.placements for o in outs]
        got = [out.to_local() for out in outs]
        expected = [x.to_local(), x.to_local(), x.to_local().relu()]
    for out, want in zip(got, expected, strict=True):
        for r, local in per_rank(out).items():
            assert torch.equal(local, per_rank(want)[r]), r
