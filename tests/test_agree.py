"""Issue 28, item 1: one agreement protocol (`haloshard._agree`), tested on its own.

Pure checks of its parts (the row's float bits, the check that names every rank's value,
the steady-state cache and its placeholder join), simulated ranks (the gather and check
under LocalTensorMode, per-rank rows), and real gloo processes: a field that differs on one
rank raises the same `HaloError` on every rank at once, for the protocol itself and for
`varlen_conv`'s static arguments, which its row now carries in eager mode too.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from haloshard import HaloError, varlen_conv
from haloshard._agree import (
    CHANGED,
    MISTAKE,
    Agreed,
    Fields,
    check_rows,
    float_bits,
    from_bits,
    gather,
    reuse_agreement,
)
from haloshard._comm import resolve_group
from haloshard.testing import rank_map, seeded_randn, shard, simulated_mesh, worker_mesh

# A mistake every rank sees raises at once: well under a second of work, 5 s with margin for
# a loaded 2-core machine (the process group's timeout, 60 s, would show a wait).
AT_ONCE_S = 5.0

_FIELDS = Fields(("error", "eps", "dtype", "length"), "probe", "every rank must pass the same "
                 "probe arguments", may_differ=frozenset({"length"}))


@pytest.mark.parametrize("value", [1e-5, 1e-6, -0.0, 0.0, 1.0 / 3.0, math.inf, 5e-324])
def test_float_bits_round_trip_exactly(value: float) -> None:
    bits = float_bits(value)
    assert isinstance(bits, int) and -(2**63) <= bits < 2**63
    back = from_bits(bits)
    assert back == value and math.copysign(1.0, back) == math.copysign(1.0, value)


def test_float_bits_tell_close_floats_apart() -> None:
    # 1e-5 and its neighbour differ in the last bit: an int row still tells them apart
    assert float_bits(1e-5) != float_bits(math.nextafter(1e-5, 1.0))


def test_check_rows_passes_rows_that_differ_only_where_allowed() -> None:
    check_rows([[0, 7, 1, 3], [0, 7, 1, 0]], _FIELDS, None)  # lengths may differ


def test_check_rows_names_every_ranks_value() -> None:
    rows = [[0, 7, 1, 3], [0, 7, 0, 3], [0, 7, 1, 3]]
    with pytest.raises(HaloError, match=r"^ranks disagree on dtype: \['torch.float32', "
                       r"'torch.float64', 'torch.float32'\] \(rank by rank\); every rank "
                       r"must pass the same probe arguments$"):
        check_rows(rows, _FIELDS, None)


def test_check_rows_reports_own_problem_then_flagged_ranks() -> None:
    rows = [[0, 7, 1, 3], [1, -1, -1, -1]]
    with pytest.raises(HaloError, match=r"^my own mistake$"):
        check_rows(rows, _FIELDS, "my own mistake")
    with pytest.raises(HaloError, match=r"rank\(s\) \[1\] of the group rejected their probe"):
        check_rows(rows, _FIELDS, None)


def test_check_rows_prefix_and_show() -> None:
    fields = Fields(("error", "eps"), "probe", "same eps", prefix="probe: ",
                    show=lambda f, v: (f, [from_bits(b) for b in v]))
    with pytest.raises(HaloError, match=r"^probe: ranks disagree on eps: \[1e-05, 1e-06\]"):
        check_rows([[0, float_bits(1e-5)], [0, float_bits(1e-6)]], fields, None)


def test_error_row_flags_only_the_error() -> None:
    assert _FIELDS.error_row() == [1, -1, -1, -1]


def _agreed(row: list[int], signature: Any = "sig") -> Agreed:
    return Agreed(row, signature, (2, 2), (3,), torch.float32, torch.device("cpu"))


class _Join:
    """A stand-in for a caller's data collective: records the status sent and answers
    with the peers' statuses."""

    def __init__(self, peers: list[int]) -> None:
        self.peers, self.sent = peers, []  # type: list[int]

    def __call__(self, agreed: Agreed, status: int) -> list[int]:
        self.sent.append(status)
        return [status, *self.peers]


def _differs(agreed: Agreed, kept: list[int]) -> str:
    return f"changed; rank(s) {kept} kept {agreed.row}"


def test_reuse_without_agreement_agrees() -> None:
    join = _Join([0])
    assert reuse_agreement({}, "site", [0, 1], "sig", None, join, _differs) is None
    assert join.sent == []


def test_reuse_same_call_is_local() -> None:
    store = {"site": _agreed([0, 1])}
    join = _Join([0])
    assert reuse_agreement(store, "site", [0, 1], "sig", None, join, _differs) is store["site"]
    assert join.sent == []  # steady state: no collective


def test_reuse_change_on_every_rank_agrees_afresh() -> None:
    store = {"site": _agreed([0, 1])}
    join = _Join([CHANGED])
    assert reuse_agreement(store, "site", [0, 1], "new", None, join, _differs) is None
    assert join.sent == [CHANGED] and store == {}


def test_reuse_change_on_one_rank_raises_naming_the_others() -> None:
    store = {"site": _agreed([0, 1])}
    join = _Join([0])
    with pytest.raises(HaloError, match=r"^changed; rank\(s\) \[1\] kept \[0, 1\]$"):
        reuse_agreement(store, "site", [0, 2], "sig", None, join, _differs)
    assert join.sent == [CHANGED]


def test_reuse_mistake_rides_as_its_status() -> None:
    store = {"site": _agreed([0, 1])}
    join = _Join([CHANGED])  # even when the peers changed, a mistake raises
    with pytest.raises(HaloError, match=r"^bad eps$"):
        reuse_agreement(store, "site", None, "sig", "bad eps", join, _differs)
    assert join.sent == [MISTAKE]


@pytest.mark.simulated
def test_simulated_ranks_gather_and_check_per_rank_rows() -> None:
    with simulated_mesh(3) as mesh:
        grp = resolve_group(mesh)
        same = rank_map(mesh, lambda r: torch.tensor([0, 7, 1, r]))
        rows = gather(same, grp, "probe agreement")
        check_rows(rows, _FIELDS, None)  # only the lengths differ
        differ = rank_map(mesh, lambda r: torch.tensor([0, 7 + (r == 2), 1, r]))
        with pytest.raises(HaloError, match=r"ranks disagree on eps: \[7, 7, 8\]"):
            check_rows(gather(differ, grp, "probe agreement"), _FIELDS, None)


def agree_once(case: str) -> tuple[str, float]:
    """One agreement on 2 gloo ranks: rank 1's eps differs in `case` "eps"; in "varlen",
    rank 1 passes `varlen_conv` another pad mode (an eager call)."""
    rank, mesh = dist.get_rank(), worker_mesh(dist.get_world_size())
    start = time.perf_counter()
    try:
        if case == "varlen":
            x = shard(seeded_randn((1, 2, 8), 2), 2, 2, rank)
            varlen_conv(x, seeded_randn((2, 1, 3), 5), dim=2, cu_seqlens=[0, 3, 8], group=mesh,
                        left=1, right=1, pad="zeros" if rank else "replicate", groups=2)
        else:
            eps = 1e-6 if case == "eps" and rank == 1 else 1e-5
            row = torch.tensor([0, float_bits(eps), 1, rank])
            fields = Fields(_FIELDS.names, "probe", "same eps", frozenset({"length"}),
                            show=lambda f, v: (f, [from_bits(b) for b in v] if f == "eps"
                                               else v))
            check_rows(gather(row, resolve_group(mesh), "probe agreement"), fields, None)
        text = "ok"
    except HaloError as error:
        text = f"HaloError: {error}"
    return text, time.perf_counter() - start


@pytest.mark.gloo
@pytest.mark.parametrize("case, message", [
    ("none", "ok"),
    ("eps", "HaloError: ranks disagree on eps: [1e-05, 1e-06] (rank by rank); same eps"),
    ("varlen", "HaloError: ranks disagree on pad: ['replicate', 'zeros'] (rank by rank); "
               "every rank must pass the same global document boundaries and conv arguments"),
])
def test_gloo_agreement_raises_on_every_rank_at_once(gloo, case: str, message: str) -> None:
    for rank, (text, seconds) in enumerate(gloo(2).run(agree_once, case, timeout=120)):
        assert text == message, (rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds)
