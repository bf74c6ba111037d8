"""Every collective and point-to-point call haloshard makes lives in this module.

Groups arrive as a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair and are
resolved once into a `Group`: group-local rank and size (symbolic per-rank ints under
`LocalTensorMode`), the ProcessGroup, and the form functional collectives accept. Peers are
group-local ranks; P2P converts them to global ranks with `dist.get_global_rank`, so a `cp`
sub-mesh of a `(dp, cp)` mesh works.

The exchange's own moves (`start_all_to_all`, `start_p2p`) return a `Pending`: plain eager
tensors go through c10d's async calls (no functional-collective wrapper on the hot path);
traced, fake and simulated tensors through functional collectives, which torch.compile and
LocalTensorMode understand.
"""

from __future__ import annotations

import contextlib
import math
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import accumulate
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from haloshard._compat import (
    LocalIntNode,
    all_gather_single,
    all_gather_single_autograd,
    all_reduce,
    all_to_all_single,
    assert_async,
    dist_all_gather_single,
    dist_reduce_scatter_single,
    enabled_local_tensor_mode,
    functional_broadcast,
    in_backward,
    maybe_run_for_local_tensor,
    object_collective_device,
    reduce_scatter_single,
    resolve_process_group,
    wait_tensor,
)
from haloshard._errors import HaloError, raise_rejected
from haloshard._tracing import planner_cache, runs_while_tracing

GroupLike = dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str]
_T = TypeVar("_T")
# Rows to send along dim 0: one tensor, or blocks of them in order (see `start_all_to_all`).
Rows = torch.Tensor | list[torch.Tensor]
# What the collective in flight is for (e.g. a module's fqn), named in timeout errors. A
# plain module-level value: set by whoever runs a layer (the hooks), read only on errors.
current_label: str | None = None
# The status `reduce_grads` sends in the halo move that opened the group's last forward
# (`opening`), so that a peer running a forward instead meets it there and both raise.
REDUCING = 3
# Per group (weakly: a destroyed group's id may be reused): the halo site whose agreed move
# was the group's first collective outside a backward since a backward, `reduce_grads`,
# `set_timeout` or a layer's error last ran on it (None: another kind of collective came
# first); the groups whose first such collective since then has run; and the groups whose
# last collective ended a step (ran in a backward, or was `reduce_grads`'), so that no
# peer can be in a backward still.
_OPENINGS: weakref.WeakKeyDictionary[dist.ProcessGroup, Any] = weakref.WeakKeyDictionary()
_OPENED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
_AFTER_BACKWARD: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


@contextlib.contextmanager
def labelled(label: str | None) -> Iterator[None]:
    """Name the collectives issued inside (e.g. by a module's fqn) in their errors."""
    global current_label
    previous, current_label = current_label, label
    try:
        yield
    finally:
        current_label = previous


def waited(collective: str, fn: Callable[[], _T]) -> _T:
    """Run `fn` (which waits on a collective), turning a backend failure into `HaloError`.

    A timeout or a broken group surfaces as a `RuntimeError` (`DistBackendError`) on the
    ranks that were waiting; they raise `HaloError` naming the collective and the label.
    """
    try:
        return fn()
    except RuntimeError as exc:
        where = f" for {current_label}" if current_label else ""
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise HaloError(
            f"the {collective}{where} did not complete: another rank of the group did not "
            "reach it within the process group's timeout (did it raise or skip a layer, or "
            "run a call this rank did not, such as an extra forward?), "
            f"or the group is broken. Backend said: {first}"
        ) from exc


def opens(group: Group, site: Any = None) -> None:
    """Note a collective about to start on `group`: the agreed halo move of `site` (its
    store, key and label), or any other collective (None). The first outside a backward
    since a backward, `reduce_grads`, `set_timeout` or a layer's error last ran on the
    group is the one a forward starts with (see `opening`). Eager, real groups only: a
    compiled or simulated run has no rank running alone."""
    if torch.compiler.is_compiling() or enabled_local_tensor_mode() is not None:
        return
    if in_backward():
        if current_label is None:  # not a layer timing its formulations inside a forward
            _AFTER_BACKWARD.add(group.pg)
            _OPENED.discard(group.pg)  # the next forward opens afresh
        return
    _AFTER_BACKWARD.discard(group.pg)
    if group.pg not in _OPENED:
        _OPENED.add(group.pg)
        _OPENINGS[group.pg] = site


def opening(group: Group) -> Any:
    """The halo site whose agreed move opened the group's last forward, or None; None also
    when this rank's last collective on the group was a forward's (it skipped a backward,
    say): a peer may then be in a backward's move, which meeting the forward's move with
    other sizes would abort (gloo), where a collective of another kind only waits."""
    return _OPENINGS.get(group.pg) if group.pg in _AFTER_BACKWARD else None


def forget_openings() -> None:
    """After a layer raised (on every rank, each from the same agreement): the ranks may
    have opened that forward with different collectives; the next forward opens afresh."""
    if not torch.compiler.is_compiling():
        _OPENED.clear()


def reopen(group: Group, site: Any) -> None:
    """After `reduce_grads` or `set_timeout`: the next collective on `group` opens the next
    forward; until it runs, the opening stays `site` (what was there before, not their own
    collectives)."""
    _OPENED.discard(group.pg)
    _OPENINGS[group.pg] = site
    _AFTER_BACKWARD.add(group.pg)


def set_timeout(group: GroupLike, timeout: float | timedelta) -> None:
    """Bound every later collective on `group` (a mesh: each of its axes' groups).

    `init_device_mesh` gives the groups of a multi-axis mesh the 30-minute default timeout,
    whatever `init_process_group(timeout=...)` said; call this once after building the mesh
    so a rank that fails before a halo layer makes the others raise `HaloError` in time.

    Every rank of the group (of the mesh) must call it with the same timeout: the ranks
    agree on it first, in one small all-gather per mesh axis under the old timeout.

    Raises:
        HaloError: on every rank, when a rank's timeout is not a positive, finite number
            of seconds or a timedelta, or when the ranks pass different timeouts (each
            rank's value named); nothing is changed then.

    Example::
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        haloshard.set_timeout(mesh, 60)  # seconds
    """
    problem, delta = None, None
    try:
        delta = _timeout_delta(timeout)
    except HaloError as error:
        problem = str(error)
    if isinstance(group, DeviceMesh):
        # last axis first: the gathered rows then come in the mesh's row-major order
        groups = [_from_mesh(group, axis) for axis in reversed(range(group.ndim))]
        ranks: list[int] | None = group.mesh.flatten().tolist()
    else:
        groups, ranks = [resolve_group(group)], None
    if enabled_local_tensor_mode() is not None:  # simulated ranks share this one call
        if problem is not None:
            raise HaloError(problem)
    else:
        with _outside_forwards(groups):
            _check_timeouts(_gather_timeouts(delta, problem, groups), problem, ranks)
    assert delta is not None  # a problem raised above
    for grp in groups:
        grp.pg.set_timeout(delta)


@contextlib.contextmanager
def _outside_forwards(groups: list[Group]) -> Iterator[None]:
    """Collectives that open no forward (`set_timeout`'s): each group's opening and
    whether its last collective ended a step are as before them."""
    saved = [(g, _OPENINGS.get(g.pg), g.pg in _OPENED, g.pg in _AFTER_BACKWARD)
             for g in groups]
    try:
        yield
    finally:
        for g, site, opened, after in saved:
            _OPENINGS[g.pg] = site
            (_OPENED.add if opened else _OPENED.discard)(g.pg)
            (_AFTER_BACKWARD.add if after else _AFTER_BACKWARD.discard)(g.pg)


def _gather_timeouts(delta: timedelta | None, problem: str | None, groups: list[Group]
                     ) -> list[int]:
    """Every rank's (flag, microseconds) pair, flat: one all-gather per group, each carrying
    what the ones before gathered, so every rank of a mesh ends with every rank's pair."""
    micros = -1 if delta is None else delta // timedelta(microseconds=1)
    values = [int(problem is not None), micros]
    for grp in groups:
        rows = gather_ints(torch.tensor(values, dtype=torch.int64), grp,
                           "set_timeout agreement")
        values = [v for row in rows for v in row]
    return values


def _check_timeouts(pairs: list[int], problem: str | None, ranks: list[int] | None) -> None:
    """The same `HaloError` on every rank when a rank's timeout is bad or they differ."""
    raise_rejected(problem, pairs[0::2], "set_timeout")
    micros = pairs[1::2]
    if len(set(micros)) > 1:
        seconds = [m / 1e6 for m in micros]
        shown = (f"{dict(zip(ranks, seconds, strict=True))} (global rank: seconds)" if ranks
                 else f"{seconds} seconds (rank by rank)")
        raise HaloError(f"ranks disagree on the set_timeout timeout: {shown}; every rank "
                        "must pass the same timeout")


# Longer than any run, and well inside what the backends hold: gloo rejects timedelta.max,
# and counts a collective's deadline in int64 nanoseconds of its clock, which 10**6 days
# overflowed (every later collective then timed out at once); 100 years fit 3 times over.
_MAX_TIMEOUT = timedelta(days=36500)


def _timeout_delta(timeout: object) -> timedelta:
    """`timeout` (seconds or a timedelta) as a timedelta in `(0, _MAX_TIMEOUT]`."""
    delta = None
    if isinstance(timeout, timedelta):
        delta = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        with contextlib.suppress(OverflowError, ValueError):  # inf, nan, beyond timedelta
            delta = timedelta(seconds=timeout)
    if delta is None or not timedelta(0) < delta <= _MAX_TIMEOUT:
        raise HaloError(f"timeout must be a positive, finite number of seconds (at most "
                        f"{_MAX_TIMEOUT.total_seconds():.0f}) or a timedelta, got {timeout!r}")
    return delta


@dataclass(frozen=True)
class Group:
    """A resolved group: what the exchange needs to know about it."""

    pg: dist.ProcessGroup
    funcol_group: Any
    size: int
    rank: int | torch.SymInt


def _mesh_axis(mesh: DeviceMesh, mesh_axis: int | str) -> int:
    names = mesh.mesh_dim_names or ()
    if isinstance(mesh_axis, str):
        if mesh_axis not in names:
            raise HaloError(f"mesh axis {mesh_axis!r} is not one of the mesh's names {names}")
        return names.index(mesh_axis)
    if not 0 <= mesh_axis < mesh.ndim:
        raise HaloError(f"mesh axis {mesh_axis} is out of range for a {mesh.ndim}-D mesh")
    return mesh_axis


def _from_mesh(mesh: DeviceMesh, mesh_axis: int | str) -> Group:
    axis = _mesh_axis(mesh, mesh_axis)
    if mesh.get_coordinate() is None:
        raise HaloError(f"this rank is not in the device mesh {mesh}")
    return Group(mesh.get_group(axis), (mesh, axis), mesh.size(axis), mesh.get_local_rank(axis))


def _from_pg(pg: dist.ProcessGroup) -> Group:
    lm = enabled_local_tensor_mode()
    if lm is None:
        rank = dist.get_rank(pg)
        if rank < 0:
            raise HaloError(
                f"this rank ({dist.get_rank()}) is not in the group with ranks "
                f"{dist.get_process_group_ranks(pg)}"
            )
        return Group(pg, pg, pg.size(), rank)
    members = dist.get_process_group_ranks(pg)
    if set(lm.ranks) - set(members):
        raise HaloError(
            f"under LocalTensorMode a ProcessGroup must hold every simulated rank "
            f"{sorted(lm.ranks)}, got {members}; pass a DeviceMesh axis instead"
        )
    local = {r: dist.get_group_rank(pg, r) for r in lm.ranks}
    return Group(pg, pg, pg.size(), torch.SymInt(LocalIntNode(local)))


def resolve_group(group: GroupLike) -> Group:
    """Resolve a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair.

    Raises:
        HaloError: for any other value, a mesh of more than one dim without an axis, or a
            group the calling rank is not in.
    """
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return _from_mesh(group[0], group[1])
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise HaloError(
                f"a {group.ndim}-D DeviceMesh needs an axis: pass (mesh, mesh_axis), "
                f"e.g. (mesh, {(group.mesh_dim_names or (group.ndim - 1,))[-1]!r})"
            )
        return _from_mesh(group, 0)
    if isinstance(group, dist.ProcessGroup):
        return _from_pg(group)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group returns on ranks it does not include.
        raise HaloError(f"this rank ({dist.get_rank()}) is not in the group: dist.new_group "
                        "returned GroupMember.NON_GROUP_MEMBER here")
    raise HaloError(
        "group must be a ProcessGroup, a 1-D DeviceMesh or a (DeviceMesh, mesh_axis) pair, "
        f"got {type(group).__name__}"
    )


def is_eager(buf: torch.Tensor) -> bool:
    """Plain tensors in eager mode take c10d's own async calls (a `Work` to wait on); traced,
    fake and simulated (`LocalTensorMode`) tensors take functional collectives."""
    return (type(buf) is torch.Tensor and not torch.compiler.is_compiling()
            and enabled_local_tensor_mode() is None)


@dataclass(frozen=True)
class Pending:
    """A collective in flight: `wait()` returns its result once it has arrived.

    A flagged all-to-all (`flags` set) receives each peer's rows followed by one status
    element; `wait()` strips the flags and raises `HaloError` when a peer raised its flag.
    """

    tensor: torch.Tensor
    works: tuple[Any, ...] = ()
    what: str = "halo exchange"
    flags: _Flags | None = None

    def wait(self) -> torch.Tensor:
        for work in self.works:
            waited(self.what, work.wait)
        return self.tensor if self.flags is None else self.flags.unpack(self.tensor)


@dataclass(frozen=True, eq=False)
class _Flags:
    """Where a flagged all-to-all's rows and status elements sit in the buffers it sends and
    receives: each peer's rows, then one status element. Built once per split plan and row
    shape (`_flags`), with the status positions as index tensors per device."""

    row: tuple[int, ...]  # the shape of one row (a slice along the moved dim)
    send_splits: list[int]  # elements to each peer, its status included
    recv_splits: list[int]
    send_rows: tuple[tuple[int, int], ...]  # (offset, rows) of each peer's rows
    recv_rows: tuple[tuple[int, int], ...]
    send_at: tuple[int, ...]  # offset of each peer's status element
    recv_at: tuple[int, ...]
    _index: dict[tuple[str, torch.device], torch.Tensor]

    def index(self, which: str, device: torch.device) -> torch.Tensor:
        """The status positions of the sent (`"send"`) or received buffer, on `device`."""
        key = (which, device)
        if key not in self._index:
            at = self.send_at if which == "send" else self.recv_at
            self._index[key] = torch.tensor(at, dtype=torch.int64, device=device)
        return self._index[key]

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        per_row = math.prod(self.row)
        flags = flat.index_select(0, self.index("recv", flat.device))
        pieces = [flat.narrow(0, at, n * per_row) for at, n in self.recv_rows if n]
        # From one peer (2 ranks, or halos from one side): its rows, in place.
        data = (pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces
                else flat[:0]).view(sum(n for _, n in self.recv_rows), *self.row)
        check_flags(flags, "this halo layer a tensor that differs from the one")
        return data

    def statuses(self, flat: torch.Tensor) -> list[int]:
        """Every peer's status element, as ints (a host sync)."""
        return [int(f) for f in flat.index_select(0, self.index("recv", flat.device)).tolist()]


@planner_cache(256)
def _flags(row: tuple[int, ...], send: tuple[int, ...], recv: tuple[int, ...]) -> _Flags:
    """The layout of a flagged all-to-all sending `send[p]` rows of shape `row` to each
    peer `p` and receiving `recv[p]`."""
    per_row = math.prod(row)

    def spans(rows: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        ends = list(accumulate(n * per_row + 1 for n in rows))
        return (tuple((end - n * per_row - 1, n) for n, end in zip(rows, ends, strict=True)),
                tuple(end - 1 for end in ends))

    (send_rows, send_at), (recv_rows, recv_at) = spans(send), spans(recv)
    return _Flags(row, [n * per_row + 1 for n in send], [n * per_row + 1 for n in recv],
                  send_rows, recv_rows, send_at, recv_at, {})


def statuses(moved: Pending) -> list[int]:
    """Wait for a flagged all-to-all and return every rank's status, raising nothing: for a
    rank that sent placeholder rows and decides from its peers' statuses what to raise."""
    for work in moved.works:
        waited(moved.what, work.wait)
    assert moved.flags is not None
    return moved.flags.statuses(moved.tensor)


def check_flags(flags: torch.Tensor, what: str) -> None:
    """`HaloError` when a peer raised its status flag (one element per rank): it found a
    mistake or a change in `what` every rank agreed on at the call site's last agreement.
    On an accelerator
    the check is deferred to the device (a failure is a device assert, no host sync)."""
    if flags.device.type != "cpu":
        assert_async(flags.eq(0).all(), "a peer raised HaloError for this layer")
        return
    statuses = flags.tolist()
    if not any(statuses):  # the steady state: nothing to raise
        return
    check_reducing(statuses)
    raised = [rank for rank, f in enumerate(statuses) if f]
    if raised:
        raise HaloError(f"rank(s) {raised} of the group passed {what} every rank agreed on "
                        "at its last agreement (see the error on those ranks)")


def check_reducing(statuses: list[int]) -> None:
    """`HaloError` when a peer sent `REDUCING` in this rank's halo move: it called
    `reduce_grads` while this rank runs a forward."""
    reducing = [rank for rank, f in enumerate(statuses) if f == REDUCING]
    if reducing:
        raise HaloError(
            f"rank(s) {reducing} of the group called reduce_grads while this rank runs this "
            "halo layer's forward: every rank must run the same forwards and backwards "
            "before reduce_grads (an extra forward on this rank, e.g. under "
            "torch.no_grad(), or one those ranks skipped)")


def start_flagged_all_to_all(
    buf: Rows, recv_splits: list[int], send_splits: list[int], group: Group, flag: int
) -> Pending:
    """`start_all_to_all` whose message to every peer (itself included) ends in one status
    element: 0, or 1 when this rank found a mistake and sends placeholder rows. The status
    rides in the move that happens anyway, so an agreed layer needs no metadata collective
    for a mistake on one rank to raise on every rank. `buf`: as for `start_all_to_all`."""
    opens(group)
    parts = [buf] if isinstance(buf, torch.Tensor) else buf
    layout = _flags(tuple(parts[0].shape[1:]), tuple(send_splits), tuple(recv_splits))
    per_row = math.prod(layout.row)
    send = parts[0].new_empty(sum(layout.send_splits))
    _pack(parts, [send.narrow(0, at, n * per_row).view(n, *layout.row)
                  for at, n in layout.send_rows if n])
    send.index_fill_(0, layout.index("send", send.device), flag)
    out = send.new_empty(sum(layout.recv_splits))
    work = dist.all_to_all_single(out, send, layout.recv_splits, layout.send_splits,
                                  group=group.pg, async_op=True)
    return Pending(out, (work,), flags=layout)


def _pack(parts: list[torch.Tensor], segments: list[torch.Tensor]) -> None:
    """Copy the rows of `parts` into `segments` (each list concatenated along dim 0, the same
    number of rows in all): one strided copy per overlap, each row written once."""
    parts = [p for p in parts if p.shape[0]]
    segments = [s for s in segments if s.shape[0]]
    if len(parts) == len(segments) and all(
            p.shape[0] == s.shape[0] for p, s in zip(parts, segments, strict=True)):
        for part, segment in zip(parts, segments, strict=True):  # one copy each
            segment.copy_(part)
        return
    i = j = at_part = at_seg = 0
    while i < len(parts):
        n = min(parts[i].shape[0] - at_part, segments[j].shape[0] - at_seg)
        segments[j].narrow(0, at_seg, n).copy_(parts[i].narrow(0, at_part, n))
        at_part, at_seg = at_part + n, at_seg + n
        if at_part == parts[i].shape[0]:
            i, at_part = i + 1, 0
        if at_seg == segments[j].shape[0]:
            j, at_seg = j + 1, 0


def _contiguous(buf: Rows) -> torch.Tensor:
    """`buf`'s rows as one contiguous tensor: itself when it is one, else a new buffer each
    row is copied into once."""
    if isinstance(buf, torch.Tensor):
        return buf.contiguous()
    full = [p for p in buf if p.shape[0]]
    if len(full) == 1:
        return full[0].contiguous()
    out = buf[0].new_empty((sum(p.shape[0] for p in buf), *buf[0].shape[1:]))
    _pack(buf, [out])
    return out


# Every metadata row travels at least this wide, after a tag naming its exchange: two ranks
# in different exchanges (a layer's agreement on one, `reduce_grads` or a packed conv's on
# the other) then send rows of one size and raise `HaloError`, instead of a gloo abort on
# mismatched sizes. Longer rows (one int per parameter) keep their size.
_ROW_WIDTH = 32
_TAGS: dict[int, str] = {}  # tag -> exchange name, for the message


_METADATA_DEVICES: weakref.WeakKeyDictionary[dist.ProcessGroup, torch.device] = (
    weakref.WeakKeyDictionary())


def metadata_device(pg: dist.ProcessGroup) -> torch.device:
    """Where `pg` takes a metadata row: the CPU if it has a CPU backend (gloo, or
    "cpu:gloo,cuda:nccl"), else this rank's current accelerator (`init_process_group("nccl")`
    alone takes CUDA tensors only)."""
    if pg not in _METADATA_DEVICES:
        kind = object_collective_device(pg)
        _METADATA_DEVICES[pg] = (torch.device("cpu") if kind == "cpu" else
                                 torch.device(kind, torch.accelerator.current_device_index()))
    return _METADATA_DEVICES[pg]


def gather_ints(values: torch.Tensor, group: Group, what: str = "halo metadata exchange"
                ) -> list[list[int]]:
    """All-gather one small int64 vector per rank; every rank gets every rank's row.

    Raises:
        HaloError: on every rank, when the ranks are in different exchanges (`what`).
    """
    tag = zlib.crc32(what.encode())
    _TAGS[tag] = what
    n = values.numel()
    width = max(_ROW_WIDTH, n + 2)
    row = values.new_full((width,), -1)
    row[0], row[1] = tag, n
    row[2 : 2 + n] = values.reshape(-1)

    def run() -> list[int]:
        opens(group)
        if is_eager(row):
            moved = row.to(metadata_device(group.pg))
            out = moved.new_empty(group.size * width)
            dist_all_gather_single(out, moved, group=group.pg)
            return out.tolist()
        return all_gather_single(row, 0, group.funcol_group).tolist()

    flat = waited(what, run)
    rows = [flat[i * width : (i + 1) * width] for i in range(group.size)]
    _check_tags([r[0] for r in rows])
    return [r[2 : 2 + n] for r in rows]


def gather_ints_while_tracing(values: tuple[int, ...], group: Group,
                              what: str = "halo metadata exchange") -> list[list[int]]:
    """`gather_ints` under torch.compile: run for real while dynamo traces, once per trace
    (every rank traces the same calls in the same order); the graph keeps the rows as a
    constant, so a compiled call sends no metadata. `values`: plain ints (a dynamic size
    cannot travel: pass -1 for it).

    Raises:
        HaloError: on every rank, when the ranks are in different exchanges (`what`), or
            (after the group's timeout) when a rank does not trace this call.
    """
    return [list(row) for row in _gather_now(group.pg.group_name, values, what)]


@runs_while_tracing
def _gather_now(group_name: str, values: tuple[int, ...], what: str
                ) -> tuple[tuple[int, ...], ...]:
    group = _from_pg(resolve_process_group(group_name))
    rows = gather_ints(torch.tensor(values, dtype=torch.int64), group, what)
    return tuple(tuple(row) for row in rows)


@maybe_run_for_local_tensor
def _check_tags(tags: list[int]) -> None:
    if len(set(tags)) > 1:
        names = [_TAGS.get(t, f"an exchange this rank has not run (tag {t})") for t in tags]
        raise HaloError(f"ranks are in different collectives: {names} (rank by rank); every "
                        "rank must run the same layers in the same order (did one rank skip "
                        "or add a call, or run a layer in another mode?)")


def start_all_to_all(
    buf: Rows, recv_splits: list[Any], send_splits: list[Any], group: Group
) -> Pending:
    """Start an all-to-all along dim 0 with per-peer split sizes (zero: no bytes to that
    peer). The receive buffer is allocated uninitialised: the collective fills all of it.

    `buf`: the rows to send, `(rows, ...)`, or (eager tensors) a list of blocks of them in
    order, views of any strides (e.g. a chunk's edge slices), each packed with one copy.
    """
    opens(group)
    if isinstance(buf, torch.Tensor) and not is_eager(buf):
        return Pending(all_to_all_single(buf, recv_splits, send_splits, group.funcol_group))
    buf = _contiguous(buf)
    out = buf.new_empty((sum(recv_splits), *buf.shape[1:]))
    work = dist.all_to_all_single(out, buf, list(recv_splits), list(send_splits),
                                  group=group.pg, async_op=True)
    return Pending(out, (work,))


def all_to_all(
    buf: Rows, recv_splits: list[Any], send_splits: list[Any], group: Group
) -> torch.Tensor:
    """All-to-all along dim 0 with per-peer split sizes, waited for."""
    return start_all_to_all(buf, recv_splits, send_splits, group).wait()


def all_gather(buf: torch.Tensor, group: Group, what: str = "all-gather") -> torch.Tensor:
    """All-gather along dim 0: every rank gets every rank's `buf`, in rank order."""
    opens(group)
    if not is_eager(buf):
        return all_gather_single(buf, 0, group.funcol_group)
    buf = buf.contiguous()
    out = buf.new_empty((group.size * buf.shape[0], *buf.shape[1:]))
    work = dist_all_gather_single(out, buf, group=group.pg, async_op=True)
    waited(what, work.wait)
    return out


def broadcast(buf: torch.Tensor, src: int, group: Group, what: str = "broadcast"
              ) -> torch.Tensor:
    """Rank `src`'s `buf` (a group-local rank) on every rank; the others pass a buffer of its
    shape and dtype, which an eager broadcast fills in place (not differentiable)."""
    opens(group)
    root = dist.get_global_rank(group.pg, src)
    if not is_eager(buf):
        return wait_tensor(functional_broadcast(buf, root, group.funcol_group))
    buf = buf.contiguous()
    work = dist.broadcast(buf, root, group=group.pg, async_op=True)
    waited(what, work.wait)
    return buf


def reduce_scatter(buf: torch.Tensor, group: Group, what: str = "reduce-scatter"
                   ) -> torch.Tensor:
    """Sum over ranks, then rank r keeps block r of dim 0 (the adjoint of `all_gather`)."""
    opens(group)
    if not is_eager(buf):
        return reduce_scatter_single(buf, "sum", 0, group.funcol_group)
    buf = buf.contiguous()
    out = buf.new_empty((buf.shape[0] // group.size, *buf.shape[1:]))
    work = dist_reduce_scatter_single(out, buf, group=group.pg, async_op=True)
    waited(what, work.wait)
    return out


def start_p2p(
    buf: Rows, recv_splits: list[int], send_splits: list[int], group: Group
) -> Pending:
    """The all-to-all move done with `batch_isend_irecv`; eager, real groups only. `buf`:
    as for `start_all_to_all`.

    Send buffers are contiguous chunks of one buffer: gloo rejects strided sends, and a
    failure mid-batch would leave posted ops dangling.
    """
    if torch.compiler.is_compiling():
        raise HaloError(
            "transport='p2p' cannot run under torch.compile (batch_isend_irecv is not "
            "traceable safely); use transport='all_to_all'"
        )
    if enabled_local_tensor_mode() is not None:
        raise HaloError(
            "transport='p2p' needs real processes; under LocalTensorMode use 'all_to_all' "
            "or 'allgather'"
        )
    opens(group)
    buf = _contiguous(buf)
    out = buf.new_empty((sum(recv_splits), *buf.shape[1:]))
    if buf.shape[1:].numel() == 0:
        return Pending(out)
    ops = [
        dist.P2POp(dist.isend, chunk, group=group.pg, group_peer=peer)
        for peer, chunk in enumerate(buf.split(send_splits))
        if chunk.shape[0]
    ] + [
        dist.P2POp(dist.irecv, chunk, group=group.pg, group_peer=peer)
        for peer, chunk in enumerate(out.split(recv_splits))
        if chunk.shape[0]
    ]
    return Pending(out, tuple(dist.batch_isend_irecv(ops)) if ops else ())


def all_reduce_sum(buf: torch.Tensor, group: Group, what: str = "all-reduce") -> torch.Tensor:
    """Sum `buf` over the group (not differentiable: for gradients after backward)."""
    opens(group)
    if not is_eager(buf):
        return wait_tensor(all_reduce(buf, "sum", group.funcol_group))
    out = buf.clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(out, group=group.pg, async_op=True)
    waited(what, work.wait)
    return out


# torch's DistributedDataParallel packs gradients into buckets of this size by default
# (`bucket_cap_mb=25`).
BUCKET_MB = 25.0


def all_reduce_sum_(tensors: list[torch.Tensor], group: Group, what: str, cap: int) -> None:
    """Sum each of `tensors` (one dtype) over the group, in place (not differentiable: for
    gradients after backward). They travel in flat buckets of at most `cap` bytes, as DDP's
    do (a larger tensor alone, reduced in place when dense): beside the tensors this holds
    at most two buckets, one in flight while the next is packed, where one flat copy of
    them all would hold as much again as the tensors themselves. Every rank must pass the
    same sizes and `cap` (its buckets are then the same)."""
    pending: tuple[Any, torch.Tensor, list[torch.Tensor]] | None = None
    for bucket in _buckets(tensors, cap):
        dense = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if dense else _packed(bucket)
        if not is_eager(flat):
            _unpack(bucket, all_reduce_sum(flat, group, what).reshape(-1))
            continue
        opens(group)
        work = dist.all_reduce(flat, group=group.pg, async_op=True)
        if pending is not None:
            _finish(pending, what)
        pending = (work, flat, bucket)
    if pending is not None:
        _finish(pending, what)


def _buckets(tensors: list[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    """`tensors` in order, in runs of at most `cap` bytes (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > cap:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += n
    if bucket:
        yield bucket


def _packed(bucket: list[torch.Tensor]) -> torch.Tensor:
    """`bucket`'s values in one flat buffer, each in its logical (row-major) order whatever
    its memory format: ranks whose tensors differ in layout pack the same sequence."""
    numels = [t.numel() for t in bucket]
    flat = bucket[0].new_empty(sum(numels))
    for t, part in zip(bucket, flat.split(numels), strict=True):
        part.view(t.shape).copy_(t)  # no temporary, unlike `t.reshape(-1)` of a strided t
    return flat


def _finish(pending: tuple[Any, torch.Tensor, list[torch.Tensor]], what: str) -> None:
    work, flat, bucket = pending
    waited(what, work.wait)
    if flat is not bucket[0]:  # a packed bucket: its sums back into the tensors
        _unpack(bucket, flat)


def _unpack(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
        t.copy_(part.view_as(t))


class _AllGather(torch.autograd.Function):
    """Forward: `(n, ...) -> (P * n, ...)`, every rank's block in rank order.
    Backward: `(P * n, ...) -> (n, ...)`, the sum over ranks of this rank's block."""

    @staticmethod
    def forward(ctx: Any, buf: torch.Tensor, group: Group, what: str  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.group, ctx.what = group, what
        return all_gather(buf, group, what)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: the reduce-scatter is differentiated too
            return _ReduceScatter.apply(grad, ctx.group, ctx.what), None, None
        return reduce_scatter(grad, ctx.group, f"backward of the {ctx.what}"), None, None


class _ReduceScatter(torch.autograd.Function):
    """`_AllGather`'s backward as a Function of its own, for gradients of gradients.
    Forward: `(P * n, ...) -> (n, ...)`, the sum over ranks of this rank's block.
    Backward: `(n, ...) -> (P * n, ...)`, the all-gather again (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, group: Group, what: str  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.group, ctx.what = group, what
        return reduce_scatter(grad, group, f"backward of the {what}")

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _AllGather.apply(gg, ctx.group, ctx.what), None, None


def all_gather_autograd(buf: torch.Tensor, group: Group, what: str = "all-gather"
                        ) -> torch.Tensor:
    """Differentiable all-gather along dim 0; backward is a reduce-scatter of the gradient."""
    opens(group)
    if is_eager(buf):
        return _AllGather.apply(buf, group, what)
    return all_gather_single_autograd(buf, 0, group.funcol_group)
