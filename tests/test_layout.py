"""Pure layout arithmetic: HaloShard, shard splits, pad sources and the exchange plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from haloshard import PAD_MODES, HaloError, HaloShard, shard_sizes
from haloshard._plan import exchange_plan, gather_plan, halo_fill
from haloshard.testing import reference_pad


def test_repr_str_hash_eq() -> None:
    p = HaloShard(2, left=2, right=0, pad="zeros")
    assert repr(p) == "HaloShard(dim=2, left=2, right=0, pad='zeros')"
    assert str(p) == "H(2,2,0)"
    assert str(HaloShard(1, 1, 1, "replicate")) == "H(1,1,1,replicate)"
    assert p == HaloShard(2, 2) and hash(p) == hash(HaloShard(2, 2))
    assert p != HaloShard(2, 2, 1)
    with pytest.raises(AttributeError):
        p.left = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": -1}, "dim must be a non-negative int, got -1"),
        ({"dim": 2, "left": -1}, "left must be a non-negative int, got -1"),
        ({"dim": 2, "right": 1.5}, "right must be a non-negative int, got 1.5"),
        ({"dim": 2, "pad": "mirror"}, "pad must be one of .* got 'mirror'"),
    ],
)
def test_bad_placement(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(HaloError, match=match):
        HaloShard(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("length", "world"), [(5, 4), (7, 2), (0, 3), (16, 4), (3, 4)])
def test_shard_sizes_match_torch_chunk(length: int, world: int) -> None:
    chunks = torch.arange(length).chunk(world) if length else ()
    expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
    assert list(shard_sizes(length, world)) == expected


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 12), world=st.integers(1, 5), left=st.integers(0, 12),
    right=st.integers(0, 12), pad=st.sampled_from(PAD_MODES),
)
def test_local_sources_match_f_pad(length: int, world: int, left: int, right: int,
                                   pad: str) -> None:
    """Every local slice names the global slice F.pad puts there (exact, integer data)."""
    spec = HaloShard(0, left, right, pad)
    if (pad == "reflect" and max(left, right) >= length) or (
            pad == "circular" and max(left, right) > length):
        with pytest.raises(HaloError, match=f"global length {length}"):
            spec.local_sources(length, world, 0)
        return
    full = torch.arange(1, length + 1, dtype=torch.float64)
    padded = reference_pad(full, left, right, 0, pad)
    offset = 0
    for rank, size in enumerate(shard_sizes(length, world)):
        sources = spec.local_sources(length, world, rank)
        got = [0.0 if g is None else float(g + 1) for g in sources]
        assert got == padded[offset : offset + size + left + right].tolist()
        assert len(sources) == spec.local_length(length, world, rank)
        offset += size


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(0, 12), world=st.integers(1, 5), left=st.integers(0, 6),
    right=st.integers(0, 6), pad=st.sampled_from(("zeros", "replicate", "circular")),
)
def test_plan_sends_match_receives(length: int, world: int, left: int, right: int,
                                   pad: str) -> None:
    """What q sends p is what p expects from q, each distinct slice once, never to itself."""
    if (pad != "zeros" and length == 0) or (pad == "circular" and max(left, right) > length):
        return
    lengths = shard_sizes(length, world)
    plans = [exchange_plan(r, lengths, left, right, pad) for r in range(world)]
    for p in range(world):
        assert plans[p].recv_splits[p] == 0 and plans[p].send_splits[p] == 0
        for q in range(world):
            assert plans[q].send_splits[p] == plans[p].recv_splits[q]
        assert len(plans[p].left_idx) == left and len(plans[p].right_idx) == right
        assert len(gather_plan(p, lengths, left, right, pad).pick) == sum(plans[p].recv_splits)


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(0, 12), world=st.integers(1, 5), left=st.integers(0, 6),
    right=st.integers(0, 6), pad=st.sampled_from(("zeros", "replicate", "circular")),
    gap=st.integers(0, 5), rank=st.integers(0, 4),
)
def test_fill_writes_what_the_halo_indices_pick(length: int, world: int, left: int,
                                                right: int, pad: str, gap: int,
                                                rank: int) -> None:
    """Writing each received slice once, own slices, repeats and zeros into a buffer gives
    the halos `left_idx` / `right_idx` pick out of `recv ++ own ++ zero`, and the backward
    positions add every halo position's gradient into exactly its source slot."""
    if (pad != "zeros" and length == 0) or (pad == "circular" and max(left, right) > length):
        return
    plan = exchange_plan(rank % world, shard_sizes(length, world), left, right, pad)
    fill = halo_fill(plan, gap)
    n_recv, own = sum(plan.recv_splits), list(plan.self_idx)
    source = [f"recv{j}" for j in range(n_recv)] + [f"own{i}" for i in own] + ["0"]
    buf: list[str | None] = [None] * (left + gap + right)
    for pos, j in zip(fill.recv_pos, range(n_recv), strict=True):
        buf[pos] = f"recv{j}"
    for pos, i in zip(fill.own_pos, plan.self_idx, strict=True):
        buf[pos] = f"own{i}"
    for pos in fill.zero_pos:
        buf[pos] = "0"
    for pos, j in zip(fill.dup_recv_pos, fill.dup_recv_slot, strict=True):
        buf[pos] = f"recv{j}"
    for pos, i in zip(fill.dup_own_pos, fill.dup_own_src, strict=True):
        buf[pos] = f"own{i}"
    assert buf[:left] == [source[k] for k in plan.left_idx]
    assert buf[left + gap :] == [source[k] for k in plan.right_idx]
    assert buf[left : left + gap] == [None] * gap  # the chunk's part is not touched
    slots = (list(zip(fill.recv_pos, range(n_recv), strict=True))
             + list(zip(fill.dup_recv_pos, fill.dup_recv_slot, strict=True))
             + [(p, n_recv + k) for p, k in zip(fill.own_pos, range(len(own)), strict=True)]
             + [(p, n_recv + k) for p, k in zip(fill.dup_own_pos, fill.dup_own_slot,
                                                  strict=True)])
    halo = [*range(left), *range(left + gap, left + gap + right)]
    wanted = [(pos, k) for pos, k in zip(halo, plan.left_idx + plan.right_idx, strict=True)
              if k < n_recv + len(own)]
    assert sorted(slots) == sorted(wanted)


def test_plan_multi_hop() -> None:
    # T=5 on 4 ranks (2, 2, 1, 0); rank 2 wants 3 left slices: 1 from rank 0, 2 from rank 1.
    plan = exchange_plan(2, (2, 2, 1, 0), 3, 0, "zeros")
    assert plan.recv_splits == (1, 2, 0, 0)
    assert plan.left_idx == (0, 1, 2)


def test_lenient_pads_match_within_range_and_zero_beyond() -> None:
    """The hooks' internal reflect/circular variants: F.pad's values wherever F.pad is
    defined, zeros (None) beyond one reflection or wrap."""
    from haloshard._layout import padded_source

    for index in range(-2, 5):  # reflect on T=3 is defined for |overshoot| < 3
        assert padded_source(index, 3, "reflect-or-zeros") == padded_source(index, 3, "reflect")
    assert padded_source(-3, 3, "reflect-or-zeros") is None
    assert padded_source(5, 3, "reflect-or-zeros") is None
    for index in range(-3, 6):
        assert padded_source(index, 3, "circular-or-zeros") == index % 3
    assert padded_source(-4, 3, "circular-or-zeros") is None
    assert padded_source(6, 3, "circular-or-zeros") is None
