"""Who sends which slices to whom: the exchange plan for one rank.

DistDL's model: first fix what each rank must hold (its chunk plus halos, from
`HaloShard.local_sources`), then derive, for every remote slice, its owner and the owner's
local offset. Each rank receives every remote slice it needs exactly once, however many halo
positions copy it (replicate and reflect repeat slices), so bytes on the wire equal the
distinct halo bytes. The plan is pure Python and cached: it depends only on the rank, the
chunk lengths and the halo.

A plan can also widen a layout whose ranks already hold `held = (hl, hr)` halo slices (a
re-halo): it then adds `left` / `right` slices beyond those, and only slices a rank does not
hold yet (in its chunk or its held halos) cross the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Generic, TypeVar

from haloshard._layout import padded_source
from haloshard._tracing import planner_cache

# Positions as ints (the plan) or as index tensors (`_exchange` builds them per device).
_Index = TypeVar("_Index")
# Halo widths (left, right) every rank already holds when a plan widens a layout.
Held = tuple[int, int]
# Copies `dst[i] <- src[i]` of slices along the dim, as runs `(dst_start, src_start, n)`.
Runs = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part of a halo exchange; all offsets are rank-local slice indices.

    Local indices (`send_idx`, `self_idx`) count in the held layout: the
    chunk preceded by the `held` left halo (the chunk itself when nothing is held).
    The receive buffer holds, for source ranks in order, the distinct slices wanted from each
    (sorted). The halo source buffer is `recv ++ own slices (self_idx) ++ [one zero slice]`;
    `left_idx` / `right_idx` index it to build the halos.

    `halo_fill` says the same as positions in an output buffer, so halos are written
    straight into it.
    """

    send_idx: tuple[int, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    self_idx: tuple[int, ...]
    left_idx: tuple[int, ...]
    right_idx: tuple[int, ...]


@dataclass(frozen=True)
class GatherPlan:
    """The allgather transport's part of an exchange (`gather_plan`): every rank all-gathers
    a block of `length` rows, its own edge slices (`idx`, local indices in the held layout,
    as `ExchangePlan`'s) padded with zero rows; `pick` says where each slice this rank
    receives (in `ExchangePlan`'s receive order) sits in the gathered buffer."""

    length: int
    idx: tuple[int, ...]
    pick: tuple[int, ...]

    @property
    def pad(self) -> int:
        """Zero rows after this rank's slices, to the common block length."""
        return self.length - len(self.idx)


@dataclass(frozen=True)
class HaloFill(Generic[_Index]):
    """Where the halo slices go in a `left + gap + right` long buffer along the dim.

    The output positions of each received slice's first use (`recv_pos`, one per received
    slice, in order) and of each own slice's (`own_pos`, for the plan's `self_idx`), the zero
    positions, and the repeated uses of a received or own slice (replicate, reflect and
    circular can repeat one) with the slot they repeat (and, for own slices, its source).
    """

    recv_pos: _Index
    own_pos: _Index
    zero_pos: _Index
    dup_recv_pos: _Index
    dup_recv_slot: _Index
    dup_own_pos: _Index
    dup_own_slot: _Index
    dup_own_src: _Index


@planner_cache(4096)
def halo_fill(plan: ExchangePlan, gap: int) -> HaloFill[tuple[int, ...]]:
    """Where `plan`'s halos go in a buffer of `left + gap + right` slices: the exchanged chunk
    when `gap` is the chunk length, or two thin windows around the chunk's edges."""
    left, right = len(plan.left_idx), len(plan.right_idx)
    n_recv, n_own = sum(plan.recv_splits), len(plan.self_idx)
    uses = [*zip(range(left), plan.left_idx, strict=True),
            *zip(range(left + gap, left + gap + right), plan.right_idx, strict=True)]
    first: dict[int, int] = {}
    dups: list[tuple[int, int]] = []
    for pos, slot in uses:
        if slot in first:
            dups.append((pos, slot))
        elif slot < n_recv + n_own:
            first[slot] = pos
    own_slots = [slot - n_recv for _, slot in dups if slot >= n_recv]
    return HaloFill(
        recv_pos=tuple(first[s] for s in range(n_recv)),
        own_pos=tuple(first[n_recv + k] for k in range(n_own)),
        zero_pos=tuple(pos for pos, slot in uses if slot == n_recv + n_own),
        dup_recv_pos=tuple(pos for pos, slot in dups if slot < n_recv),
        dup_recv_slot=tuple(slot for _, slot in dups if slot < n_recv),
        dup_own_pos=tuple(pos for pos, slot in dups if slot >= n_recv),
        dup_own_slot=tuple(own_slots),
        dup_own_src=tuple(plan.self_idx[k] for k in own_slots),
    )


@planner_cache(4096)
def as_runs(dst: tuple[int, ...], src: tuple[int, ...]) -> Runs:
    """`dst[i] <- src[i]` grouped into runs of positions consecutive in both (a run is one
    strided copy of a block of slices, where an index op would take each slice apart).

    Example::
        >>> as_runs((0, 1, 9), (4, 5, 6))
        ((0, 4, 2), (9, 6, 1))
    """
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst, src, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, s, 1))
    return tuple(runs)


def _owner(index: int, ends: tuple[int, ...]) -> int:
    for rank, end in enumerate(ends):
        if index < end:
            return rank
    raise AssertionError(f"slice {index} beyond the global length {ends[-1]}")



def _wanted(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, held: Held = (0, 0)
) -> tuple[list[int | None], list[int | None]]:
    """Global sources of `rank`'s new left and right halo slices (None: zero): the `left`
    slices before its held layout and the `right` slices after it."""
    total = sum(lengths)
    start = sum(lengths[:rank]) - held[0]
    end = sum(lengths[: rank + 1]) + held[1]
    lefts = [padded_source(start - left + i, total, pad) for i in range(left)]
    rights = [padded_source(end + i, total, pad) for i in range(right)]
    return lefts, rights


@planner_cache(4096)
def _held_positions(rank: int, lengths: tuple[int, ...], pad: str, held: Held) -> dict[int, int]:
    """Global slice -> local index in `rank`'s held layout, for every slice it holds.

    A slice held twice (a padded halo repeats one) maps to its chunk position if it has
    one, else to its first position.

    Example::
        >>> _held_positions(0, (2, 2), "replicate", (1, 1))
        {0: 1, 1: 2, 2: 3}
    """
    start, total = sum(lengths[:rank]) - held[0], sum(lengths)
    width = held[0] + lengths[rank] + held[1]
    chunk = range(held[0], held[0] + lengths[rank])
    order = [*chunk, *(j for j in range(width) if j not in chunk)]
    out: dict[int, int] = {}
    for j in order:
        g = padded_source(start + j, total, pad)
        if g is not None:
            out.setdefault(g, j)
    return out


def _remote_needs(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, held: Held = (0, 0)
) -> list[list[int]]:
    """For every source rank, the sorted distinct global slices `rank` needs from it (the
    slices it holds already, its chunk included, are not needed)."""
    ends = tuple(accumulate(lengths))
    needs: list[set[int]] = [set() for _ in lengths]
    lefts, rights = _wanted(rank, lengths, left, right, pad, held)
    mine = _held_positions(rank, lengths, pad, held)
    for g in lefts + rights:
        if g is not None and g not in mine:
            needs[_owner(g, ends)].add(g)
    return [sorted(n) for n in needs]


@planner_cache(4096)
def exchange_plan(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, held: Held = (0, 0)
) -> ExchangePlan:
    """The plan for `rank` given every rank's chunk length along the sharded dim.

    `held`: the halo widths every rank already holds (a re-halo); the plan then adds
    `left` / `right` slices beyond them and receives only slices the rank does not hold.

    Example::
        >>> p = exchange_plan(1, (2, 2, 1, 0), 3, 0, "zeros")
        >>> p.recv_splits, p.left_idx
        ((2, 0, 0, 0), (2, 0, 1))
        >>> exchange_plan(1, (2, 2, 1, 0), 2, 0, "zeros", held=(1, 0)).recv_splits
        (1, 0, 0, 0)
    """
    base = sum(lengths[:rank]) - held[0]  # global index of local position 0
    mine = _remote_needs(rank, lengths, left, right, pad, held)
    theirs = _theirs(rank, lengths, left, right, pad, held)
    recv_order = [g for wanted in mine for g in wanted]
    position = {g: i for i, g in enumerate(recv_order)}
    lefts, rights = _wanted(rank, lengths, left, right, pad, held)
    own = sorted({g for g in lefts + rights if g is not None} - set(position))
    for i, g in enumerate(own):
        position[g] = len(recv_order) + i
    zero = len(recv_order) + len(own)
    local = _held_positions(rank, lengths, pad, held)
    return ExchangePlan(
        send_idx=tuple(g - base for wanted in theirs for g in wanted),
        send_splits=tuple(len(w) for w in theirs),
        recv_splits=tuple(len(w) for w in mine),
        self_idx=tuple(local[g] for g in own),
        left_idx=tuple(zero if g is None else position[g] for g in lefts),
        right_idx=tuple(zero if g is None else position[g] for g in rights),
    )


@planner_cache(1024)
def gather_plan(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, held: Held = (0, 0)
) -> GatherPlan:
    """The allgather transport's layout for `rank` (arguments as `exchange_plan`'s).

    Example::
        >>> g = gather_plan(1, (2, 2, 1, 0), 3, 0, "zeros")
        >>> g.length, g.idx, g.pick
        (2, (0, 1), (0, 1))
    """
    base = sum(lengths[:rank]) - held[0]
    recv_order = [g for wanted in _remote_needs(rank, lengths, left, right, pad, held)
                  for g in wanted]
    union = [sorted({g for w in _theirs(q, lengths, left, right, pad, held) for g in w})
             for q in range(len(lengths))]
    length = max([0, *(len(u) for u in union)])
    slot = {g: q * length + i for q, u in enumerate(union) for i, g in enumerate(u)}
    return GatherPlan(length, tuple(g - base for g in union[rank]),
                      tuple(slot[g] for g in recv_order))


def _theirs(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, held: Held = (0, 0)
) -> list[list[int]]:
    """For every destination rank, the global slices it needs from `rank`."""
    return [_remote_needs(p, lengths, left, right, pad, held)[rank] for p in range(len(lengths))]
