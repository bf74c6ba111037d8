"""Bad input: a clear HaloError on every rank, never a hang (gloo) or silent result."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from haloshard import HaloError, halo_exchange
from haloshard.testing import rank_map, shard, simulated_mesh, worker_mesh


def _outcome(fn) -> str:
    try:
        fn()
    except HaloError as exc:
        return f"HaloError: {exc}"
    return "ok"


def bad_call(case: str) -> str:
    """One mistake, usually on one rank only; every rank reports what it raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    full = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    x = shard(full, 2, world, rank)
    args: dict[str, object] = {"left": 1, "right": 1, "dim": 2, "pad": "zeros",
                               "transport": None}
    if case == "negative_left" and rank == 1:
        args["left"] = -1
    elif case == "dim_out_of_range" and rank == 1:
        args["dim"] = 3
    elif case == "unknown_pad" and rank == 1:
        args["pad"] = "mirror"
    elif case == "unknown_transport":
        args["transport"] = "nccl"
    elif case == "reflect_too_wide":
        args.update(left=5, pad="reflect")
    elif case == "circular_too_wide":
        args.update(right=6, pad="circular")
    elif case == "shape_mismatch" and rank == 1:
        x = torch.zeros(2, 4, x.shape[2])
    elif case == "dtype_mismatch" and rank == 1:
        x = x.double()
    elif case == "requires_grad_mismatch" and rank == 1:
        x = x.clone().requires_grad_()
    elif case == "not_a_shard_split":
        x = full.narrow(2, 0, 4) if rank == 0 else full.narrow(2, 4, 1)
    elif case == "global_length_wrong":
        return _outcome(lambda: halo_exchange(x, left=1, right=1, dim=2, group=mesh,
                                              global_length=9))
    return _outcome(lambda: halo_exchange(x, left=args["left"], right=args["right"],
                                          dim=args["dim"], group=mesh,
                                          pad=args["pad"], transport=args["transport"]))


CASES = {
    "negative_left": "left halo must be a non-negative int, got -1",
    "dim_out_of_range": "dim 3 is out of range for a 3-D tensor",
    "unknown_pad": "pad must be one of .* got 'mirror'",
    "unknown_transport": "transport must be one of .* got 'nccl'",
    "reflect_too_wide": "pad='reflect' needs halos shorter than the global length 5",
    "circular_too_wide": "pad='circular' needs halos of at most the global length 5",
    "shape_mismatch": r"ranks disagree on size of dim 1: \[3, 4\]",
    "dtype_mismatch": "ranks disagree on dtype",
    "requires_grad_mismatch": "ranks disagree on requires_grad",
    "not_a_shard_split": r"chunk lengths along dim 2 are \[4, 1\].*as \[3, 2\]",
    "global_length_wrong": "global_length=9 but the chunks along dim 2 add up to 5",
}
# Errors first seen on one rank: the others name that rank instead of repeating its message.
ONE_RANK = {"negative_left", "dim_out_of_range", "unknown_pad"}


@pytest.mark.gloo
def test_every_rank_raises(gloo) -> None:
    world = gloo(2)
    for case, message in CASES.items():
        outcomes = world.run(bad_call, case, timeout=60)
        for rank, got in enumerate(outcomes):
            assert got.startswith("HaloError: "), (case, rank, got)
            if case in ONE_RANK and rank == 0:
                assert "rank(s) [1] of the group rejected" in got, (case, got)
            else:
                assert pytest.importorskip("re").search(message, got), (case, rank, got)
        # the group is still usable afterwards: nobody is left inside a collective
        assert world.run(bad_call, "none", timeout=60) == ["ok", "ok"]


def not_in_group() -> str:
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    x = torch.ones(1, 1, 2)
    if rank == 2:  # dist.new_group left this rank out
        return _outcome(lambda: halo_exchange(x, left=1, right=0, dim=2, group=pair))
    return _outcome(lambda: halo_exchange(x, left=1, right=0, dim=2, group=pair))


@pytest.mark.gloo
def test_rank_outside_group(gloo) -> None:
    outcomes = gloo(3).run(not_in_group, timeout=60)
    assert outcomes[:2] == ["ok", "ok"]
    assert "this rank (2) is not in the group: dist.new_group returned" in outcomes[2]


@pytest.mark.simulated
def test_bad_group_type_and_p2p_in_simulation() -> None:
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.ones(1, 1, 2))
        with pytest.raises(HaloError, match=r"group must be a ProcessGroup.* got int"):
            halo_exchange(x, left=1, right=0, dim=2, group=3)  # type: ignore[arg-type]
        with pytest.raises(HaloError, match="transport='p2p' needs real processes"):
            halo_exchange(x, left=1, right=0, dim=2, group=mesh, transport="p2p")


@pytest.mark.simulated
def test_two_d_mesh_needs_an_axis() -> None:
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "cp")) as mesh:
        x = rank_map(mesh, lambda r: torch.ones(1, 1, 2), mesh_axis="cp")
        with pytest.raises(HaloError, match=r"needs an axis: pass \(mesh, mesh_axis\)"):
            halo_exchange(x, left=1, right=0, dim=2, group=mesh)
        with pytest.raises(HaloError, match="mesh axis 'tp' is not one of"):
            halo_exchange(x, left=1, right=0, dim=2, group=(mesh, "tp"))


def one_rank_raises() -> str:
    """Rank 1 fails before its halo layer; rank 0 must not wait past the group's timeout."""
    import time

    if dist.get_rank() == 1:
        return "raised ValueError in its own code"
    start = time.perf_counter()
    outcome = _outcome(lambda: halo_exchange(torch.ones(1, 1, 3), left=1, right=1, dim=2,
                                             group=worker_mesh(dist.get_world_size())))
    return f"{outcome} after {time.perf_counter() - start:.0f}s"


@pytest.mark.gloo
def test_failure_on_one_rank_is_bounded() -> None:
    """The process group timeout (here 3 s) bounds the wait, then HaloError, not a hang."""
    from haloshard.testing import GlooWorld

    world = GlooWorld(2, pg_timeout=3, timeout=60)
    try:
        waiting, failed = world.run(one_rank_raises)
    finally:
        world.close(force=True)  # the group timed out: it cannot be reused
    assert failed == "raised ValueError in its own code"
    assert waiting.startswith("HaloError: the halo metadata exchange did not complete")
    assert int(waiting.rsplit(" after ", 1)[1].rstrip("s")) <= 30


def test_halo_exchange_refuses_the_internal_pad_modes() -> None:
    """`reflect-or-zeros` / `circular-or-zeros` are the hooks' own modes, not the API's."""
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.zeros(1, 1, 3))
        with pytest.raises(HaloError, match=r"pad must be one of .* got 'reflect-or-zeros'"):
            halo_exchange(x, left=1, right=1, dim=2, group=mesh, pad="reflect-or-zeros")


def test_halo_exchange_takes_keywords_only() -> None:
    """The 0.1 positional form is gone (never released): `left`, `right`, `dim`, `group`
    are required keywords, and the signature says so."""
    params = inspect.signature(halo_exchange).parameters
    for name in ("left", "right", "dim", "group"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is inspect.Parameter.empty, name
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.arange(3.0).reshape(1, 1, 3) + 3 * r)
        with pytest.raises(TypeError, match="positional argument"):
            halo_exchange(x, 1, 1, 2, mesh)  # type: ignore[misc]
        with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'group'"):
            halo_exchange(x, left=1, right=1, dim=2)  # type: ignore[call-arg]
