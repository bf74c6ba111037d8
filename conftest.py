"""Doctests of `src/haloshard`: the names every example may use, and simulated ranks.

An example that uses `mesh` runs inside `simulated_mesh(4)` (four ranks in this process,
`LocalTensorMode`) with `mesh` bound to it; it builds its own inputs with a `>>>` line.
Examples that need real processes, torchrun or a diffusers model are code blocks without
`>>>` and do not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _pytest.doctest import DoctestItem
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import haloshard
from haloshard.testing import CausalConv3d, per_rank, rank_map, shard, simulated_mesh

DOCTEST_WORLD = 4


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace: dict[str, Any]) -> None:
    """torch's usual aliases, the DTensor names the examples meet, haloshard's public API
    and the `haloshard.testing` helpers that build per-rank inputs."""
    doctest_namespace.update({name: getattr(haloshard, name) for name in haloshard.__all__})
    doctest_namespace.update(
        torch=torch, nn=nn, F=F, DTensor=DTensor, Shard=Shard, Replicate=Replicate,
        distribute_tensor=distribute_tensor, parallelize_module=parallelize_module,
        haloshard=haloshard, CausalConv3d=CausalConv3d, per_rank=per_rank, rank_map=rank_map,
        shard=shard, simulated_mesh=simulated_mesh)


def _uses_mesh(item: DoctestItem) -> bool:
    # An example that opens its own simulated_mesh (testing.py's) must not run inside one.
    assert item.dtest is not None
    source = "".join(example.source for example in item.dtest.examples)
    return "mesh" in source and "simulated_mesh(" not in source


@pytest.fixture(autouse=True)
def _doctest_mesh(request: pytest.FixtureRequest,
                  doctest_namespace: dict[str, Any]) -> Iterator[None]:
    """For a doctest that uses `mesh`: run it on DOCTEST_WORLD simulated ranks."""
    item = request.node
    if not isinstance(item, DoctestItem) or not _uses_mesh(item):
        yield
        return
    with simulated_mesh(DOCTEST_WORLD) as mesh:
        doctest_namespace["mesh"] = mesh
        try:
            yield
        finally:
            del doctest_namespace["mesh"]
