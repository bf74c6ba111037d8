"""`halo_exchange`: the differentiable neighbour exchange on a local shard.

Three steps, each its own function: agree (every rank checks its arguments, then all ranks
exchange a row of ints so a mistake on one rank raises `HaloError` on all of them and every
rank learns every chunk length), move (the transport carries exactly the distinct remote halo
slices, while the interior is copied into a preallocated output), fill (each received slice is
written once into its halo position). The backward is the explicit adjoint: each halo slice's
gradient is summed per source slice, sent back and added, in place, into the slice it was copied
from, on its owner.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch
from einops import rearrange

from haloshard import _comm
from haloshard._agree import (
    CHANGED,
    Agreed,
    Agreements,
    Fields,
    Reuse,
    agree_while_tracing,
    check_rows,
    dtype_code,
    gather,
    reuse_agreement,
    shown,
)
from haloshard._comm import Group, GroupLike
from haloshard._compat import enabled_local_tensor_mode, maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._layout import LENIENT_PADS, PAD_MODES, check_pad_fits, shard_sizes
from haloshard._plan import HaloFill, Held, Runs, as_runs, exchange_plan, gather_plan, halo_fill
from haloshard._simulated import per_rank
from haloshard._tracing import planner_cache, surfaces_errors

_MAX_DIMS = 8
# One row of ints per rank; "length" is the only field allowed to differ between ranks.
# "global_length" (-1: not given) rides along so that a rank whose stated length differs
# from the others' raises with them, not alone while they wait in the exchange.
_FIELDS = ("error", "ndim", "dim", "left", "right", "pad", "transport", "dtype",
           "requires_grad", "grad_enabled", "length", "global_length",
           *(f"size of dim {i}" for i in range(_MAX_DIMS)))
_LEN = _FIELDS.index("length")


def _shown_field(name: str, values: list[Any]) -> tuple[str, list[Any]]:
    """A row field's values as a message shows them: pad modes, transports and dtypes by
    name, not by their codes in the row."""
    choices = {"pad": PAD_MODES + LENIENT_PADS, "transport": TRANSPORTS}.get(name)
    if choices is None:
        return name, shown(name, values)
    return name, [choices[v] if isinstance(v, int) and 0 <= v < len(choices) else v
                  for v in values]


_ROW = Fields(_FIELDS, "halo_exchange", "every rank must pass the same halo_exchange "
              "arguments and tensors that differ only in the length of the sharded dim",
              may_differ=frozenset({"length"}), show=_shown_field)
# Halo widths and lengths must fit the int64 metadata row (and any index tensor).
_MAX_INT = 2**62


def tensor_problem(x: object) -> str | None:
    """What makes `x` unusable for an exchange on this rank, or None."""
    if not isinstance(x, torch.Tensor):
        return f"expected a tensor, got {type(x).__name__}"
    if x.layout != torch.strided:
        return f"expected a dense (strided) tensor, got layout {x.layout}"
    if x.device.type == "meta" and not torch.compiler.is_compiling():
        return "a meta tensor holds no data to exchange; pass a tensor with storage"
    return None


def _local_problem(
    x: torch.Tensor, left: object, right: object, dim: object, pad: object, transport: object
) -> str | None:
    """What is wrong with this rank's own arguments, or None."""
    for name, value in (("left", left), ("right", right)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"{name} halo must be a non-negative int, got {value!r}"
        if value >= _MAX_INT:
            return f"{name} halo {value} is too large (at most {_MAX_INT - 1})"
    if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        return f"dim {dim!r} is out of range for a {x.ndim}-D tensor"
    if x.ndim > _MAX_DIMS:
        return f"tensors of at most {_MAX_DIMS} dims are supported, got {x.ndim}"
    if pad not in PAD_MODES + LENIENT_PADS:
        return f"pad must be one of {PAD_MODES}, got {pad!r}"
    if transport not in TRANSPORTS:
        return f"transport must be one of {TRANSPORTS} or None, got {transport!r}"
    return None


def _carries_flags(transport: str) -> bool:
    """Whether the named transport's forward move can carry the agreed steady state's flag."""
    return transport in _TRANSPORTS and _TRANSPORTS[transport].carries_flags


def _code(value: object, choices: tuple[object, ...]) -> int:
    return choices.index(value) if value in choices else -1


def as_int(value: object) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and -_MAX_INT < value < _MAX_INT
    return value if ok else -1  # type: ignore[return-value]


def _row_values(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str, error: bool,
    global_length: int | None,
) -> list[int]:
    """This rank's metadata row, one int per `_FIELDS` entry."""
    d = as_int(dim) % max(x.ndim, 1) if not error else as_int(dim)
    sizes = [-1 if i == d else s for i, s in enumerate(x.shape[:_MAX_DIMS])]
    pads = PAD_MODES + LENIENT_PADS
    return [int(error), x.ndim, d, as_int(left), as_int(right), _code(pad, pads),
            _code(transport, TRANSPORTS), dtype_code(x.dtype), int(x.requires_grad),
            int(torch.is_grad_enabled()), x.shape[d] if not error else -1,
            as_int(global_length), *sizes,
            *[-1] * (_MAX_DIMS - len(sizes))]


@maybe_run_for_local_tensor
def _meta_row(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str, error: bool,
    global_length: int | None,
) -> torch.Tensor:
    """`_row_values` as an int64 tensor on `x`'s device, to travel in the agreement."""
    row = _row_values(x, left, right, dim, pad, transport, error, global_length)
    # A meta tensor's row must still travel (it is flagged as an error).
    device = torch.device("cpu") if x.device.type == "meta" else x.device
    return torch.tensor(row, dtype=torch.int64, device=device)


def _agree(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str,
    group: Group, global_length: int | None, problem: str | None = None,
    reuse: Reuse | None = None,
) -> tuple[int, tuple[int, ...], bool]:
    """Validate on every rank at once; return the normalised dim, every chunk length, and
    whether the move must carry status flags (an agreement was reused).

    `problem`: a mistake the caller found in its own arguments on this rank; it is
    reported on every rank like one of the exchange's own. `reuse`: the call site's store,
    key and the call's signature (see `haloshard._agree`): a site agreed before checks this
    rank's row and signature locally, with no collective; a mistake or a change on this
    rank rides as a status in the halo move instead.
    """
    problem = (problem or tensor_problem(x)
               or _local_problem(x, left, right, dim, pad, transport)
               or length_problem(global_length))
    if torch.compiler.is_compiling():
        return _agree_traced(x, left, right, dim, pad, transport, group, global_length,
                             problem)
    key = signature = None
    if (reuse is not None and _carries_flags(transport) and global_length is not None
            and enabled_local_tensor_mode() is None):
        key, signature = (reuse[1], id(group.pg)), (reuse[2], left, right, pad, dim,
                                                     global_length)
        if left or right:  # this site's move may open a forward (see `join_agreed_move`)
            _comm.opens(group, (reuse[0], key, _comm.current_label))
        if key in reuse[0]:
            agreed = _reuse_agreed(x, left, right, dim, pad, transport, group,
                                   global_length, reuse[0], key, signature, problem)
            if agreed is not None:
                return (*agreed, True)
    if isinstance(x, torch.Tensor):
        row = _meta_row(x, left, right, dim, pad, transport, problem is not None,
                        global_length)
    else:  # nothing to describe: a row that says only "error"
        row = torch.tensor(_ROW.error_row(), dtype=torch.int64)
    rows = gather(row, group, "halo metadata exchange")
    check_rows(rows, _ROW, problem)
    lengths = tuple(row[_LEN] for row in rows)
    _check_lengths(lengths, global_length, dim)
    check_pad_fits(sum(lengths), left, right, pad)
    if key is not None:  # every rank agreed: every rank stores it
        d = dim % x.ndim
        reuse[0][key] = Agreed(rows[group.rank], signature, lengths,  # type: ignore[index]
                               tuple(n for i, n in enumerate(x.shape) if i != d), x.dtype,
                               x.device)
    return dim % x.ndim, lengths, False


def _agree_traced(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str,
    group: Group, global_length: int | None, problem: str | None,
) -> tuple[int, tuple[int, ...], bool]:
    """`_agree` under torch.compile: the caller states the length, each rank checks its
    own chunk against it, and the ranks agree on their rows once per trace
    (`haloshard._agree.agree_while_tracing`), so a mistake on one rank raises on every rank
    and the graph sends no metadata."""
    if problem is None and global_length is None:
        problem = "under torch.compile pass global_length="
    lengths: tuple[int, ...] = ()
    if problem is None:
        assert global_length is not None
        lengths = shard_sizes(global_length, group.size)
    if isinstance(group.rank, int) and problem is None:
        problem = own_length_problem(x.shape[dim], lengths, group.rank, dim)
    values = None if not isinstance(x, torch.Tensor) else _row_values(
        x, left, right, dim, pad, transport, problem is not None, global_length)
    # Sizes stay out (this rank's own length is in its error flag; other sizes that differ
    # fail in the move, not silently); a dynamic global_length is specialised.
    agree_while_tracing(values, _ROW, group, "halo metadata exchange", problem,
                        {_LEN, *range(_FIELDS.index("size of dim 0"), len(_FIELDS))})
    if not isinstance(group.rank, int):  # simulated ranks: each checks its own chunk
        check_own_length(x.shape[dim], lengths, group.rank, dim)
    check_pad_fits(sum(lengths), left, right, pad)
    return dim % x.ndim, lengths, False


def _reuse_agreed(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str,
    group: Group, global_length: int, store: Agreements, key: Hashable,
    signature: Hashable, problem: str | None,
) -> tuple[int, tuple[int, ...]] | None:
    """A site agreed before: `haloshard._agree.reuse`, joining the halo move with
    placeholder rows on a mistake or a change. None: every rank changed (agree afresh)."""
    own = None if problem is not None else _row_values(  # a list: no device sync
        x, left, right, dim, pad, transport, False, global_length)
    agreed = store[key]
    if not (left or right) and (problem is not None or own != agreed.row
                                or signature != agreed.signature):
        # no move to ride in, nor any collective to desynchronise
        if problem is not None:
            raise HaloError(problem)
        lengths = shard_sizes(global_length, group.size)
        check_own_length(x.shape[dim], lengths, group.rank, dim)
        return dim % x.ndim, lengths

    def changed(agreed: Agreed) -> str:
        assert own is not None
        wrong = [f for f, a, b in zip(_FIELDS, own, agreed.row, strict=True) if a != b]
        return (f"this rank's tensor or arguments differ from those every rank agreed on "
                f"at this call site's last agreement in {wrong or ['signature']}: got "
                f"{shown_row(own)}, agreed {shown_row(agreed.row)}")

    def join(agreed: Agreed, status: int) -> list[int]:
        try:
            statuses = _join(agreed, group, status)
        except HaloError as error:  # the peers never joined: see docs/failures.md
            raise HaloError(
                f"{error}. This rank's call differs from the one agreed at this layer "
                f"({problem or changed(agreed)}); if the other ranks do not run this call "
                "at all (an extra forward on this rank, e.g. under torch.no_grad(), while "
                "they call reduce_grads or another layer), they wait in a collective this "
                "move cannot meet") from error
        _comm.check_reducing(statuses)
        return statuses

    def differs(agreed: Agreed, kept: list[int]) -> str:
        return (f"{changed(agreed)}; rank(s) {kept} of the group kept the agreed ones: every "
                "rank must pass the same arguments and a tensor that differs only in the "
                "length of the sharded dim")

    agreed_now = reuse_agreement(store, key, own, signature, problem, join, differs)
    return None if agreed_now is None else (dim % x.ndim, agreed_now.lengths)


def leave_agreement(store: Agreements, group: Group, what: str) -> None:
    """Before a call site runs without its halo move this call (`what`, e.g. per document
    under `packed`): join the move of its last agreement on `group` with placeholder rows
    and status `CHANGED`, so peers that run the move raise `HaloError` with this rank
    instead of waiting in a collective it never starts. When every rank leaves alike, the
    agreements are dropped (the next call with a halo agrees afresh)."""
    keys = [k for k in store if k[1] == id(group.pg)]  # type: ignore[index]
    if not keys:
        return
    statuses = _join(store[keys[-1]], group, CHANGED)
    _comm.check_reducing(statuses)
    if set(statuses) - {CHANGED}:
        kept = [r for r, f in enumerate(statuses) if f != CHANGED]
        raise HaloError(f"this rank runs this halo layer {what}, but rank(s) {kept} of "
                        "the group run its halo move: every rank must enter it alike")
    for key in keys:
        del store[key]


def join_agreed_move(store: Agreements, key: Hashable, group: Group, flag: int
                     ) -> list[int]:
    """Join the halo move agreed at `store[key]` on `group` with placeholder rows and
    status `flag`, as a rank does whose call there changed (`_reuse_agreed`), and return
    every rank's status; [] when there is no such agreement or it moves nothing. For a
    rank that runs no forward there now: `leave_agreement`, and `reduce_grads`, which
    joins the move that opened the last forward (`_comm.opening`) with `_comm.REDUCING`,
    so a peer running an extra forward meets it there and both raise at once."""
    return _join(store[key], group, flag) if key in store else []


def _join(agreed: Agreed, group: Group, flag: int) -> list[int]:
    """Every rank's status from the agreed move, joined with placeholder rows; [] when it
    moves nothing."""
    left, right = agreed.row[_FIELDS.index("left")], agreed.row[_FIELDS.index("right")]
    pad = (PAD_MODES + LENIENT_PADS)[agreed.row[_FIELDS.index("pad")]]
    if not (left or right):
        return []
    recv, send = _split_plan(group.rank, agreed.lengths, left, right, pad, group.size)
    placeholder = torch.zeros((sum(send), *agreed.shape), dtype=agreed.dtype,
                              device=agreed.device)
    return _comm.statuses(_comm.start_flagged_all_to_all(placeholder, recv, send, group,
                                                         flag=flag))


def shown_row(row: list[int]) -> dict[str, Any]:
    """A metadata row as a message shows it."""
    return {f: _shown_field(f, [v])[1][0] for f, v in zip(_FIELDS, row, strict=True)
            if v != -1}


def length_problem(global_length: object) -> str | None:
    if global_length is None:
        return None
    if not isinstance(global_length, int) or isinstance(global_length, bool) or not (
            0 <= global_length < _MAX_INT):
        return f"global_length must be a non-negative int, got {global_length!r}"
    return None


@maybe_run_for_local_tensor
def check_own_length(length: int, lengths: tuple[int, ...], rank: int | torch.SymInt,
                      dim: int) -> None:
    """This rank's chunk against its `Shard` split of the stated global length."""
    problem = own_length_problem(length, lengths, rank, dim)
    if problem is not None:
        raise HaloError(problem)


def own_length_problem(length: int, lengths: tuple[int, ...], rank: int | torch.SymInt,
                        dim: int) -> str | None:
    if length != lengths[rank]:
        return (f"global_length={sum(lengths)} splits as {list(lengths)} over {len(lengths)} "
                f"ranks, so rank {rank} must hold {lengths[rank]} slices along dim {dim}, but "
                f"its chunk has {length}")
    return None


def _check_lengths(lengths: tuple[int, ...], global_length: int | None, dim: int) -> None:
    total = sum(lengths)
    if global_length is not None and global_length != total:
        raise HaloError(f"global_length={global_length} but the chunks along dim {dim} add "
                        f"up to {total} (lengths {list(lengths)})")
    expected = shard_sizes(total, len(lengths))
    if lengths != expected:
        raise HaloError(f"chunk lengths along dim {dim} are {list(lengths)} (rank by rank); "
                        f"Shard({dim}) splits the global length {total} as {list(expected)}")


def _index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@planner_cache(1024)
def _plan_tensors(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, device: torch.device,
    held: Held = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = exchange_plan(rank, lengths, left, right, pad, held)
    return _index(plan.send_idx, device), _index(plan.self_idx, device)


@planner_cache(1024)
def _gather_tensors(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, device: torch.device,
    held: Held = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = gather_plan(rank, lengths, left, right, pad, held)
    return _index(plan.idx, device), _index(plan.pick, device)


@maybe_run_for_local_tensor
def _gather_pad(rank: Any, lengths: tuple[int, ...], left: int, right: int, pad: str,
                held: Held = (0, 0)) -> int:
    return gather_plan(rank, lengths, left, right, pad, held).pad


@planner_cache(1024)
def _fill_tensors(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, device: torch.device,
    gap: int | None, held: Held = (0, 0),
) -> HaloFill[torch.Tensor]:
    plan = exchange_plan(rank, lengths, left, right, pad, held)
    fill = halo_fill(plan, lengths[rank] + sum(held) if gap is None else gap)
    return HaloFill(*(_index(getattr(fill, f.name), device) for f in fields(fill)))


@dataclass(frozen=True)
class _Runs:
    """A plan's copies as runs `(position, source, n)` of slices along the dim, for plain
    eager tensors: each run is one strided `narrow` copy, several times cheaper than an index
    op on a strided dim. `send`: positions in the chunk of the rows sent, in order; `recv`,
    `own`, `zero`, `dup_recv`, `dup_own`: positions in the halo buffer (see `HaloFill`) and
    the received row or chunk position each copies."""

    send: Runs
    recv: Runs
    own: Runs
    zero: Runs
    dup_recv: Runs
    dup_own: Runs
    kept: Runs | None  # chunk positions no halo gradient comes back to (None: one is sent twice)


_MAX_RUNS = 16  # beyond: one index op per step costs less than a copy per run


@planner_cache(1024)
def _plan_runs(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, gap: int | None,
    held: Held = (0, 0),
) -> _Runs | None:
    """The plan's copies as `_Runs` (None: more than `_MAX_RUNS`, index ops instead)."""
    plan = exchange_plan(rank, lengths, left, right, pad, held)
    f = halo_fill(plan, lengths[rank] + sum(held) if gap is None else gap)
    kept = tuple(sorted(set(range(lengths[rank] + sum(held))) - set(plan.send_idx)))
    runs = _Runs(send=as_runs(plan.send_idx, tuple(range(len(plan.send_idx)))),
                 recv=as_runs(f.recv_pos, tuple(range(len(f.recv_pos)))),
                 own=as_runs(f.own_pos, plan.self_idx), zero=as_runs(f.zero_pos, f.zero_pos),
                 dup_recv=as_runs(f.dup_recv_pos, f.dup_recv_slot),
                 dup_own=as_runs(f.dup_own_pos, f.dup_own_src),
                 kept=as_runs(kept, kept) if len(set(plan.send_idx)) == len(plan.send_idx)
                 else None)
    count = sum(len(r) for r in vars(runs).values() if r is not None)
    return runs if count <= _MAX_RUNS else None


def _blocks(t: torch.Tensor, dim: int, runs: Runs) -> list[torch.Tensor]:
    """Views of `t`'s slices `position .. position + n` per run, `dim` moved to the front:
    `(n, ...)` each, in order (one empty block when there is no run)."""
    views = [t.narrow(dim, pos, n) for pos, _, n in runs] or [t.narrow(dim, 0, 0)]
    return [v.movedim(dim, 0) for v in views]


def _copy_runs(out: torch.Tensor, src: torch.Tensor, dim: int, runs: Runs) -> None:
    """`out[position .. + n] = src[source .. + n]` along `dim`, per run, in place."""
    for pos, at, n in runs:
        out.narrow(dim, pos, n).copy_(src.narrow(dim, at, n))


# Decorated once here: building the wrapper inside a compiled region breaks dynamo's guards.
# Simulated ranks pass their rank as a SymInt, which torch's typing of the decorator
# (the wrapped signature, `rank: int`) does not admit.
_rank_plan_tensors: Callable[..., tuple[torch.Tensor, torch.Tensor]]
_rank_plan_tensors = maybe_run_for_local_tensor(_plan_tensors)
_rank_gather_tensors: Callable[..., tuple[torch.Tensor, torch.Tensor]]
_rank_gather_tensors = maybe_run_for_local_tensor(_gather_tensors)
_rank_fill_tensors = per_rank(HaloFill)(_fill_tensors)


@maybe_run_for_local_tensor
def _plan_ints(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, held: Held = (0, 0)
) -> list[int]:
    # A flat list: LocalTensorMode combines per-rank ints position by position.
    plan = exchange_plan(rank, lengths, left, right, pad, held)
    return [*plan.recv_splits, *plan.send_splits]


def _split_plan(rank: Any, lengths: tuple[int, ...], left: int, right: int, pad: str,
                world: int, held: Held = (0, 0)) -> tuple[list[Any], list[Any]]:
    """(receive splits, send splits) of this rank's exchange."""
    ints = _plan_ints(rank, lengths, left, right, pad, held)
    return ints[:world], ints[world:]


@dataclass(frozen=True)
class _Route:
    """Everything one rank's exchange needs besides the index tensors (no tensors here)."""

    dim: int
    left: int
    right: int
    pad: str
    transport: Transport
    group: Group
    lengths: tuple[int, ...]
    recv_splits: list[Any]
    send_splits: list[Any]
    flagged: bool = False  # the forward move carries status flags (see `_agree`)
    held: Held = (0, 0)  # halo widths the input already holds (a re-halo; see `widen`)


class Transport:
    """How one exchange's rows travel, registered by name in `TRANSPORTS` (the
    `transport=` of `halo_exchange`). The base moves the chunk's sent slices (`send_idx`)
    to the ranks that need them, one block per peer, and adds their returning gradients into
    those slices; a subclass says how the rows move (`_move`) or replaces the steps.

    Forward: `start` (the rows out) -> `received` (the rows in fill order). Backward:
    `start_backward` (gradient rows back to their owners) -> `fold` (add them into `g_x`).
    """

    name = ""
    # Its rows are the chunk's sent slices, in order: they may be packed from runs of the
    # chunk (views, one copy) and their gradients added back by runs.
    moves_send_rows = True
    # Its backward moves only this exchange's halo gradients, so they may travel beside
    # other backward work (`halo_conv`'s chunk backward) within the memory target.
    backward_overlaps = True
    # Its forward move can carry the agreed steady state's mistake flag (see `_agree`).
    carries_flags = False

    def _move(self, rows: _comm.Rows, recv_splits: list[Any], send_splits: list[Any],
              group: Group) -> _comm.Pending:
        raise NotImplementedError

    def start(self, x: torch.Tensor, move: HaloMove, runs: _Runs | None) -> _comm.Pending:
        """Start carrying the remote halo slices (async where the transport allows)."""
        r = move.route
        return self._move(_send_rows(x, move, runs), r.recv_splits, r.send_splits, r.group)

    def received(self, recv: torch.Tensor, move: HaloMove) -> torch.Tensor:
        """The arrived buffer as the received rows, in fill order (dim 0)."""
        return recv

    def start_backward(self, g_recv: _comm.Rows, move: HaloMove) -> _comm.Pending:
        """Start the adjoint of `start`: the received rows' gradients back to their owners."""
        r = move.route
        return self._move(g_recv, r.send_splits, r.recv_splits, r.group)

    def fold(self, g_x: torch.Tensor, received: torch.Tensor, move: HaloMove) -> None:
        """Add the arrived halo gradients, in place, into the slices of `g_x` they copy."""
        dim = move.route.dim
        g_x.index_add_(dim, move.send_idx, received.movedim(0, dim))


def _send_rows(x: torch.Tensor, move: HaloMove, runs: _Runs | None) -> _comm.Rows:
    """The chunk's sent slices, dim first; with `runs`, views of `x` (packed with one copy
    by the transport)."""
    dim = move.route.dim
    if runs is None:
        return x.index_select(dim, move.send_idx).movedim(dim, 0)
    return _blocks(x, dim, runs.send)


class _AllToAll(Transport):
    """The default: one all-to-all with per-peer split sizes, only halo bytes (compiles)."""

    name, carries_flags = "all_to_all", True

    def _move(self, rows: _comm.Rows, recv_splits: list[Any], send_splits: list[Any],
              group: Group) -> _comm.Pending:
        return _comm.start_all_to_all(rows, recv_splits, send_splits, group)

    def start(self, x: torch.Tensor, move: HaloMove, runs: _Runs | None) -> _comm.Pending:
        r = move.route
        if not r.flagged:
            return super().start(x, move, runs)
        return _comm.start_flagged_all_to_all(_send_rows(x, move, runs), r.recv_splits,
                                              r.send_splits, r.group, flag=0)


class _P2P(Transport):
    """`batch_isend_irecv` to the peers with halo slices (eager, real processes only)."""

    name = "p2p"

    def _move(self, rows: _comm.Rows, recv_splits: list[Any], send_splits: list[Any],
              group: Group) -> _comm.Pending:
        return _comm.start_p2p(rows, recv_splits, send_splits, group)


class _AllGather(Transport):
    """Every rank in the same all-gather of its edge slices (`GatherPlan.idx`, padded with
    zero rows to one length); each picks its halo rows (`GatherPlan.pick`). Backward: the
    picked rows' gradients scattered into every rank's slot, then one reduce-scatter. Its
    layout is its own (`gather_plan`), built only when a move uses it."""

    name, moves_send_rows, backward_overlaps = "allgather", False, False

    @staticmethod
    def _plan(move: HaloMove, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(this rank's slices, where its received rows sit, its zero rows) as tensors."""
        r = move.route
        idx, pick = _rank_gather_tensors(r.group.rank, r.lengths, r.left, r.right, r.pad,
                                         device, r.held)
        return idx, pick, _gather_pad(r.group.rank, r.lengths, r.left, r.right, r.pad, r.held)

    def start(self, x: torch.Tensor, move: HaloMove, runs: _Runs | None) -> _comm.Pending:
        r = move.route
        idx, _, zeros = self._plan(move, x.device)
        mine = x.index_select(r.dim, idx).movedim(r.dim, 0)
        filler = mine.new_zeros((zeros, *mine.shape[1:]))
        return _comm.Pending(_comm.all_gather(torch.cat([mine, filler]), r.group))

    def received(self, recv: torch.Tensor, move: HaloMove) -> torch.Tensor:
        return recv.index_select(0, self._plan(move, recv.device)[1])

    def start_backward(self, g_recv: _comm.Rows, move: HaloMove) -> _comm.Pending:
        assert isinstance(g_recv, torch.Tensor)
        r = move.route
        idx, pick, zeros = self._plan(move, g_recv.device)
        g_every = g_recv.new_zeros((r.group.size * (idx.shape[0] + zeros), *g_recv.shape[1:]))
        g_every.index_add_(0, pick, g_recv)
        return _comm.Pending(_comm.reduce_scatter(g_every, r.group))

    def fold(self, g_x: torch.Tensor, received: torch.Tensor, move: HaloMove) -> None:
        dim = move.route.dim
        idx = self._plan(move, g_x.device)[0]
        g_x.index_add_(dim, idx, received[: idx.shape[0]].movedim(0, dim))


# The registry, in the order of the metadata rows' transport codes (see `_row_values`).
_TRANSPORTS: dict[str, Transport] = {t.name: t for t in (_AllToAll(), _P2P(), _AllGather())}
TRANSPORTS: tuple[str, ...] = tuple(_TRANSPORTS)
DEFAULT_TRANSPORT = _AllToAll.name


_CHANNELS_LAST = {5: (torch.channels_last_3d, "n t h w c -> n c t h w"),
                  4: (torch.channels_last, "n h w c -> n c h w")}


def memory_format(x: torch.Tensor) -> torch.memory_format:
    """`x`'s memory format: channels-last (2-D or 3-D) or contiguous."""
    if x.ndim in _CHANNELS_LAST and not x.is_contiguous():
        fmt = _CHANNELS_LAST[x.ndim][0]
        if x.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def empty_like_layout(x: torch.Tensor, shape: list[Any]) -> torch.Tensor:
    """An output buffer in `x`'s memory format, so channels_last convs stay channels_last.

    Allocated channels-last-ordered and viewed back (a `new_empty`, which LocalTensorMode
    runs per rank, rather than a factory call with a memory_format).
    """
    if memory_format(x) != torch.contiguous_format:
        pattern = _CHANNELS_LAST[x.ndim][1]
        return rearrange(x.new_empty([shape[0], *shape[2:], shape[1]]), pattern)
    return x.new_empty(shape)


@dataclass(frozen=True)
class HaloMove:
    """One rank's prepared exchange: the plan's index tensors and its route.

    Split into steps so a consumer can do its own work while the halo is in flight:
    `start` -> (other work) -> `fill`; backward: `start_backward` -> (other work) -> `fold`.
    Halos live in a buffer `left + gap + right` long along the dim: the exchanged chunk
    (`gap` None: the input's length, chunk and held halos) or windows around the chunk's
    edges.
    """

    send_idx: torch.Tensor
    self_idx: torch.Tensor
    route: _Route
    # `_runs` per gap: every input of `_plan_runs` is the route's, fixed for the move
    _runs_of: dict[int | None, _Runs | None] = field(default_factory=dict, compare=False,
                                                     repr=False)

    def _fill_index(self, device: torch.device, gap: int | None) -> HaloFill[torch.Tensor]:
        r = self.route
        return _rank_fill_tensors(r.group.rank, r.lengths, r.left, r.right, r.pad, device, gap,
                                  r.held)

    def _runs(self, t: torch.Tensor, gap: int | None) -> _Runs | None:
        """The copies as runs, for plain eager tensors (None: index ops)."""
        if not _comm.is_eager(t):
            return None
        if gap not in self._runs_of:
            r = self.route
            rank = cast(int, r.group.rank)  # eager: an int (a SymInt only on simulated ranks)
            self._runs_of[gap] = _plan_runs(rank, r.lengths, r.left, r.right, r.pad, gap,
                                            r.held)
        return self._runs_of[gap]

    def zero_slots(self, t: torch.Tensor, gap: int) -> frozenset[int]:
        """Positions of a `left + gap + right` halo buffer that `fill` leaves zero (zero
        padding beyond the global edges), for plain eager tensors; empty otherwise
        (simulated ranks differ)."""
        if not _comm.is_eager(t):
            return frozenset()
        r = self.route
        rank = cast(int, r.group.rank)  # eager: an int (a SymInt only on simulated ranks)
        plan = exchange_plan(rank, r.lengths, r.left, r.right, r.pad, r.held)
        return frozenset(halo_fill(plan, gap).zero_pos)

    def start(self, x: torch.Tensor) -> _comm.Pending:
        """Start moving `x`'s edge slices to the ranks that need them."""
        return self.route.transport.start(x, self, self._runs(x, None))

    def fill(self, out: torch.Tensor, x: torch.Tensor, moved: _comm.Pending,
             gap: int | None = None) -> None:
        """Wait for the move and write the halos into `out`, in place.

        Each received slice is copied once into its first halo position; own slices (pad
        modes other than zeros, at the global edges) come from `x`; repeats are copied from
        their slot; the rest is zero. Nothing else of `out` is touched.
        """
        route, dim = self.route, self.route.dim
        recv = route.transport.received(moved.wait(), self).movedim(0, dim)
        runs = self._runs(out, gap)
        if runs is not None:
            _copy_runs(out, recv, dim, runs.recv)
            _copy_runs(out, x, dim, runs.own)
            for pos, _, n in runs.zero:
                out.narrow(dim, pos, n).fill_(0)
            _copy_runs(out, recv, dim, runs.dup_recv)
            _copy_runs(out, x, dim, runs.dup_own)
            return
        f = self._fill_index(x.device, gap)
        # Indexed along `dim` of `out` itself, never through a permuted view of it, so that
        # torch.compile turns each into an in-place index_put on the output.
        out.index_copy_(dim, f.recv_pos, recv)
        out.index_copy_(dim, f.own_pos, x.index_select(dim, self.self_idx))
        out.index_fill_(dim, f.zero_pos, 0)
        out.index_copy_(dim, f.dup_recv_pos, recv.index_select(dim, f.dup_recv_slot))
        out.index_copy_(dim, f.dup_own_pos, x.index_select(dim, f.dup_own_src))

    def assemble(self, x: torch.Tensor, moved: _comm.Pending, spare: Any = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """`x` extended by its halos (and `spare` zero slices after them, when given): in
        `out` (any strides) or a new buffer in `x`'s memory format, the chunk copied in
        while the halo travels, then `fill`."""
        route = self.route
        dim, left, length = route.dim, route.left, x.shape[route.dim]
        if out is None:
            shape = list(x.shape)
            shape[dim] = left + length + route.right + (0 if spare is None else spare)
            out = empty_like_layout(x, shape)
        out.narrow(dim, left, length).copy_(x)
        if spare is not None:
            out.narrow(dim, left + length + route.right, spare).zero_()
        self.fill(out, x, moved)
        return out

    def adjoint(self, grad: torch.Tensor, length: Any) -> torch.Tensor:
        """The adjoint of `assemble`: the chunk's part of `grad` (a copy: `grad` is not ours
        to change) with the halo gradients added into their owners' slices.

        Eager, each returned slice written once: the slices no halo gradient comes back to
        are copied while the halo gradients travel, the others are `grad + received`.
        """
        moved, g_own = self.start_backward(grad)
        dim = self.route.dim
        chunk = grad.narrow(dim, self.route.left, length)
        runs = self._runs(grad, None)
        if (runs is None or runs.kept is None or g_own is not None
                or not self.route.transport.moves_send_rows):
            g_x = chunk.clone()  # keeps the layout
            self.fold(g_x, moved, g_own)
            return g_x
        g_x = torch.empty_like(chunk)  # the layout `clone` keeps
        _copy_runs(g_x, chunk, dim, runs.kept)
        received = moved.wait().movedim(0, dim)
        for pos, row, n in runs.send:
            torch.add(chunk.narrow(dim, pos, n), received.narrow(dim, row, n),
                      out=g_x.narrow(dim, pos, n))
        return g_x

    def start_backward(self, grad: torch.Tensor, gap: int | None = None
                       ) -> tuple[_comm.Pending, torch.Tensor | None]:
        """Sum the halos' gradients per source slice and start sending them to the owners.

        `grad` is the gradient of the `fill` buffer. Summed first (replicate repeats
        slices), so each slice's gradient crosses once. Returns (the move in flight, the
        gradient of this rank's own copied slices, None where it copied none).
        """
        dim = self.route.dim
        runs = self._runs(grad, gap)
        g_own = None
        if runs is None or runs.own or runs.dup_own:
            f = self._fill_index(grad.device, gap)
            g_own = grad.index_select(dim, f.own_pos).index_add_(
                dim, f.dup_own_slot, grad.index_select(dim, f.dup_own_pos))
        g_recv: _comm.Rows
        if runs is not None and not runs.dup_recv and self.route.transport.moves_send_rows:
            g_recv = _blocks(grad, dim, runs.recv)  # packed once
        else:
            f = self._fill_index(grad.device, gap)
            g_recv = grad.index_select(dim, f.recv_pos).index_add_(
                dim, f.dup_recv_slot, grad.index_select(dim, f.dup_recv_pos)).movedim(dim, 0)
        return self.route.transport.start_backward(g_recv, self), g_own

    def fold(self, g_x: torch.Tensor, moved: _comm.Pending, g_own: torch.Tensor | None
             ) -> None:
        """Wait for the halo gradients and add them, in place, into their slices of `g_x`."""
        route = self.route
        if g_own is not None:
            g_x.index_add_(route.dim, self.self_idx, g_own)
        route.transport.fold(g_x, moved.wait(), self)


class _HaloExchange(torch.autograd.Function):
    """Forward copies neighbours' edge slices into the halo: `(T_r) -> (left + T_r + right)`.
    Backward adds halo gradients into the owners' edges: `(left + T_r + right) -> (T_r)`.

    Both directions start the transport first and copy the interior (the bulk of the bytes)
    while the halo is in flight; the output is written in place, with no full-size `cat`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, move: HaloMove) -> torch.Tensor:  # type: ignore[override]
        ctx.move, ctx.length = move, x.shape[move.route.dim]
        return move.assemble(x, move.start(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: the adjoint is differentiated in turn
            return _HaloAdjoint.apply(grad, ctx.move, ctx.length), None
        return ctx.move.adjoint(grad, ctx.length), None


class _HaloAdjoint(torch.autograd.Function):
    """`_HaloExchange`'s backward as a Function of its own, for gradients of gradients.
    Forward adds halo gradients into the owners' edges: `(left + T_r + right) -> (T_r)`.
    Backward copies neighbours' edge slices into the halo: `(T_r) -> (left + T_r + right)`
    (the adjoint of a linear map's adjoint is the map: the exchange again, differentiable).
    """

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, move: HaloMove, length: Any  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.move = move
        return move.adjoint(grad, length)

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return apply_move(gg, ctx.move), None, None


def apply_move(x: torch.Tensor, move: HaloMove) -> torch.Tensor:
    """`x` extended by its halos along the prepared `move`, differentiably to any order."""
    return _HaloExchange.apply(x, move)


def prepare_halo(
    x: torch.Tensor, left: int, right: int, dim: int, group: GroupLike, *, pad: str = "zeros",
    transport: str | None = None, global_length: int | None = None,
    problem: str | None = None, reuse: Reuse | None = None,
) -> tuple[HaloMove | None, tuple[int, ...]]:
    """Validate on every rank and plan one exchange; None when there is nothing to move.

    `problem`: the caller's own finding on this rank (raised on every rank). `reuse`: see
    `_agree`. Returns the prepared move and every rank's chunk length along `dim`.
    """
    grp = _comm.resolve_group(group)
    transport = DEFAULT_TRANSPORT if transport is None else transport
    dim, lengths, flagged = _agree(x, left, right, dim, pad, transport, grp, global_length,
                                   problem, reuse)
    if left == right == 0:
        return None, lengths
    route = _route(x, left, right, dim, grp, lengths, pad=pad, transport=transport,
                   flagged=flagged)
    tensors = _rank_plan_tensors(grp.rank, lengths, left, right, pad, x.device)
    return HaloMove(*tensors, route), lengths


def _route(x: torch.Tensor, left: int, right: int, dim: int, group: Group,
           lengths: tuple[int, ...], *, pad: str, transport: str, flagged: bool = False,
           held: Held = (0, 0)) -> _Route:
    """The route of an agreed exchange (`dim` normalised, every chunk length known)."""
    recv, send = _split_plan(group.rank, lengths, left, right, pad, group.size, held)
    return _Route(dim, left, right, pad, _TRANSPORTS[transport], group, lengths, recv, send,
                  flagged, held)


@surfaces_errors
def halo_exchange(
    x: torch.Tensor,
    *,
    left: int,
    right: int,
    dim: int,
    group: GroupLike,
    pad: str = "zeros",
    transport: str | None = None,
    global_length: int | None = None,
    agreements: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Extend a local `Shard(dim)` chunk by its neighbours' halo slices, differentiably.

    Forward copies neighbours' edge slices into the halo:
    `(..., T_r, ...) -> (..., left + T_r + right, ...)`, equal to
    `F.pad(global, (left, right), mode=pad)[start_r : start_r + T_r + left + right]` along
    `dim`. Backward adds halo gradients into the owners' edges:
    `(..., left + T_r + right, ...) -> (..., T_r, ...)`.

    Args:
        x: this rank's chunk; the ranks' chunks are `Shard(dim)`'s split of the global tensor
            (uneven and empty chunks included).
        left: slices to prepend; may exceed a neighbour's chunk (taken from several ranks).
        right: slices to append.
        dim: the sharded dimension.
        group: a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair; ranks are
            group-local, so the `cp` axis of a `(dp, cp)` mesh works.
        pad: `zeros`, `replicate`, `reflect` or `circular`: fills beyond the global ends.
        transport: `all_to_all` (default: moves only halo bytes, compiles), `p2p`
            (`batch_isend_irecv`, eager only) or `allgather` (every rank in the same
            all-gather of its edge slices).
        global_length: the global length of `dim`; required under `torch.compile`, where no
            metadata can be exchanged, and checked against the chunks in eager mode.
        agreements: a dict the caller keeps across calls (one per call site, empty at
            first; needs `global_length`): the first call with given arguments validates
            them on every rank (a metadata all-gather), later calls with the same ones check
            this rank's chunk locally and carry a mistake as a flag inside the halo
            all-to-all, so a steady-state call issues no metadata collective and a mistake
            still raises on every rank. Arguments that change on every rank alike are
            agreed afresh (one placeholder move and one metadata all-gather); changed on
            some ranks only, they raise on every rank. `HaloParallel` layers keep one each.

    Returns:
        The chunk with its halos, in `x`'s dtype and layout order.

    Raises:
        HaloError: on every rank, when any rank passes a bad argument or a tensor that
            differs from the others in anything but the length of `dim`.

    Example::
        >>> full = torch.randn(1, 8, 5, 16, 16)  # on 4 ranks T = 5 splits as (2, 2, 1, 0)
        >>> x = rank_map(mesh, lambda r: shard(full, 2, 4, r))
        >>> y = halo_exchange(x, left=2, right=1, dim=2, group=mesh)
        >>> {rank: t.shape[2] for rank, t in per_rank(y).items()}  # 2 + T_r + 1
        {0: 5, 1: 5, 2: 4, 3: 3}
    """
    if agreements is not None and (global_length is None or not isinstance(agreements, dict)):
        raise HaloError(f"agreements= needs a dict and global_length= (the signature every "
                        f"rank shares), got agreements of type {type(agreements).__name__}, "
                        f"global_length={global_length!r}")
    # The lenient pad modes are the hooks' own (`exchange`), not part of the public API.
    problem = None if pad in PAD_MODES else f"pad must be one of {PAD_MODES}, got {pad!r}"
    reuse = None if agreements is None else (agreements, "halo_exchange", ())
    return exchange(x, left, right, dim, group, pad=pad, transport=transport,
                    global_length=global_length, problem=problem, reuse=reuse)


def exchange(
    x: torch.Tensor, left: int, right: int, dim: int, group: GroupLike, *, pad: str,
    transport: str | None = None, global_length: int | None = None,
    reuse: Reuse | None = None, problem: str | None = None,
) -> torch.Tensor:
    """`halo_exchange` for haloshard's own callers: also takes the lenient pad modes
    (`reflect-or-zeros`, `circular-or-zeros`) and a problem found by the caller."""
    move, _ = prepare_halo(x, left, right, dim, group, pad=pad, transport=transport,
                           global_length=global_length, problem=problem, reuse=reuse)
    return x if move is None else _HaloExchange.apply(x, move)


def widen(
    x: torch.Tensor, left: int, right: int, dim: int, group: GroupLike, *, held: Held,
    lengths: tuple[int, ...], pad: str, transport: str | None = None,
) -> torch.Tensor:
    """Extend a local tensor that already holds `held` halo slices by `left` / `right` more.

    The re-halo of `HaloShard(dim, l, r) -> HaloShard(dim, l + left, r + right)`: the same
    plan, transports and autograd Function as `halo_exchange`, but each rank receives only
    the slices it holds nowhere yet (the rest are copied from its chunk and held halos).
    Forward copies the missing slices into the new halos:
    `(.., l + T_r + r, ..) -> (.., l + left + T_r + r + right, ..)`. Backward adds the new
    halos' gradients into the slices they copy (owners' chunks, or this rank's own slices).
    No agreement step: `lengths` come from DTensor metadata every rank shares.

    Raises:
        HaloError: for an unknown transport.

    Example::
        >>> x = torch.randn(1, 8, 3)  # global T = 8 on 4 ranks, HaloShard(2, 1, 0): 1 + 2
        >>> widen(x, 2, 1, 2, mesh, held=(1, 0), lengths=(2, 2, 2, 2), pad="zeros").shape
        torch.Size([1, 8, 6])
    """
    transport = DEFAULT_TRANSPORT if transport is None else transport
    if transport not in TRANSPORTS:
        raise HaloError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
    if left == right == 0:
        return x
    grp = _comm.resolve_group(group)
    route = _route(x, left, right, dim, grp, lengths, pad=pad, transport=transport, held=held)
    tensors = _rank_plan_tensors(grp.rank, lengths, left, right, pad, x.device, held)
    return _HaloExchange.apply(x, HaloMove(*tensors, route))
