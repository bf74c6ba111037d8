"""Issue #26, third pass: what the second pass left open.

- a mistake one rank finds in its own arguments before an agreement (`frame_attention`'s q, k,
  v shapes, `group_norm`'s eps, dim or segments, `varlen_conv`'s documents under its pad
  mode) joins the agreement and raises on every rank at once, not on that rank alone;
Every case records what each rank raised and how long it took, on real gloo processes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from haloshard import HaloError, frame_attention, group_norm, varlen_conv
from haloshard.testing import GlooWorld, shard, worker_mesh

# A mistake every rank sees raises at once: well under a second of work, 5 s with margin for
# a loaded 2-core machine. The process group's timeout here is 60 s, so a wait would show.
AT_ONCE_S = 5.0


def _outcome(fn: Callable[[], object]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        fn()
    except HaloError as exc:
        return f"HaloError: {exc}", time.perf_counter() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


# ---------------------------------------------------------------- checks inside agreements
def _frames(rank: int) -> torch.Tensor:
    """This rank's chunk of 5 frames of 3 tokens (2 ranks: 3 and 2 frames)."""
    full = torch.randn(1, 2, 5, 3, 4, generator=torch.Generator().manual_seed(0))
    return shard(full, 2, 2, rank)


def _frame_attention_case(mesh: DeviceMesh, rank: int, case: str) -> None:
    q = k = v = _frames(rank)
    length: object = 5
    if case == "frame_attention_q_shape" and rank == 1:
        q = q[..., :2]  # E = 2, k and v keep 4
    elif case == "frame_attention_not_3d" and rank == 1:
        q = k = v = q.flatten(0, -2)[0]
    elif case == "frame_attention_no_length" and rank == 1:
        length = None
    frame_attention(q, k, v, mesh, global_length=length)  # type: ignore[arg-type]


def _frame_attention_agreed(mesh: DeviceMesh, rank: int, case: str) -> None:
    """A call site agreed before (a style's store): the second call's mistake on rank 1
    rides in the K/V all-gather's status rows (training) or broadcasts (inference)."""
    store: dict[object, object] = {}
    q = k = v = _frames(rank).requires_grad_(case == "frame_attention_agreed_training")
    frame_attention(q, k, v, mesh, global_length=5, _reuse=(store, "site"))
    assert store, "the first call cached its agreement"
    if rank == 1:
        q = q[..., :2]
    frame_attention(q, k, v, mesh, global_length=5, _reuse=(store, "site"))


def _group_norm_case(mesh: DeviceMesh, rank: int, case: str) -> None:
    x = torch.ones(2, 4, 3 - rank, 2)  # T = 5 split (3, 2)
    eps: object = 1e-5
    dim, segments = 2, None
    if case == "group_norm_eps" and rank == 1:
        eps = "1e-5"
    elif case == "group_norm_dim" and rank == 1:
        dim = 7
    elif case == "group_norm_segments" and rank == 1:
        segments = ["three", 2]
    group_norm(x, 2, None, None, eps, mesh, dim=dim, segments=segments,  # type: ignore[arg-type]
               global_length=5)


def _varlen_case(mesh: DeviceMesh, rank: int, case: str) -> None:
    x = torch.ones(1, 2, 4)  # T = 8 split (4, 4); documents of 1 and 7
    pad = "reflect" if rank == 1 else "zeros"  # reflect cannot pad a 1-slice document
    varlen_conv(x, torch.ones(2, 2, 3), dim=2, cu_seqlens=[0, 1, 8], group=mesh, padding=1,
                pad=pad)


AGREED: dict[str, tuple[Callable[[DeviceMesh, int, str], None], str]] = {
    "frame_attention_q_shape": (
        _frame_attention_case, r"q, k, v of one shape .*\(1, 2, 2, 3, 2\)|rank\(s\) \[1\] "),
    "frame_attention_not_3d": (_frame_attention_case, r"q, k, v of one shape|rank\(s\) \[1\] "),
    "frame_attention_no_length": (
        _frame_attention_case, r"needs global_length=|rank\(s\) \[1\] "),
    "frame_attention_agreed_training": (
        _frame_attention_agreed, r"q, k, v of one shape|rank\(s\) \[1\] "),
    "frame_attention_agreed_inference": (
        _frame_attention_agreed, r"q, k, v of one shape|rank\(s\) \[1\] "),
    "group_norm_eps": (_group_norm_case, r"eps must be a real number|rank\(s\) \[1\] "),
    "group_norm_dim": (_group_norm_case, r"needs 2 <= dim < 4, got 7|rank\(s\) \[1\] "),
    "group_norm_segments": (_group_norm_case, r"segments must be non-negative|rank\(s\) \[1\] "),
    "varlen_conv_document_pad": (
        _varlen_case, r"document 0 \(slices 0:1\): pad='reflect'|rank\(s\) \[1\] "),
}


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    """Two gloo ranks for this module; a 10 s process-group timeout, so that a rank left
    waiting (the failure these tests guard against) shows as a slow case, not a stall."""
    with GlooWorld(2, pg_timeout=10, timeout=180) as w:
        yield w


def agreed_case(name: str) -> tuple[tuple[str, float], str]:
    """The case on this rank (what it raised, seconds), then whether a good call works."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    got = _outcome(lambda: AGREED[name][0](mesh, rank, name))
    q = _frames(rank)
    return got, _outcome(lambda: frame_attention(q, q, q, mesh, global_length=5))[0]


@pytest.mark.gloo
@pytest.mark.parametrize("name", sorted(AGREED))
def test_own_mistakes_raise_inside_the_agreement(world: GlooWorld, name: str) -> None:
    results = world.run(agreed_case, name)
    texts = [text for (text, _), _ in results]
    for rank, ((text, seconds), afterwards) in enumerate(results):
        assert text.startswith("HaloError: "), (rank, texts)
        assert re.search(AGREED[name][1], text), (rank, texts)
        assert seconds < AT_ONCE_S, (rank, seconds, texts)
        assert afterwards == "ok", (rank, afterwards)
