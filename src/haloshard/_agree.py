"""Agreeing across ranks: the one protocol by which every rank learns that the others passed
what it did, so a mistake on one rank raises the same `HaloError` on every rank at once,
never a backend abort, a hang or wrong numbers.

What is agreed: each caller (the halo exchange, attention gathers, group_norm, varlen convs,
`reduce_grads`, the halo layers' plain inputs, per-sample tables) describes its call on this
rank as one fixed-size row of ints, named by its `Fields`: an error flag (this rank found a
mistake in its own arguments), then every argument, dtype and size the ranks must share,
and the few fields that may differ (a chunk's length along the sharded dim). Floats travel
as their bits (`float_bits`); sequences and tensors as codes or digests.

When, and at what cost:
- an agreement is one all-gather of one row per rank (`gather`: at least 32 int64 each, a
  tag naming the agreement first), at a call site's first call and whenever its signature
  changes; a collective that runs anyway may carry the row instead (group_norm's
  statistics), and callers that learn every chunk length from it gather it on every call
  (`varlen_conv`, plain-tensor halo inputs). `check_rows` then raises the same `HaloError`
  on every rank, naming each rank's value, when a rank flagged an error or a shared field
  differs;
- steady state costs no collective: a call site keeps its last agreement (`Agreements`, one
  `Agreed` per site key, with the call's signature), and a later call compares its own row
  and signature with it locally (`reuse_agreement`). A mistake (`MISTAKE`) or a change
  (`CHANGED`) on one rank rides as a status (one element per peer) in the data collective
  the call runs anyway, that rank sending a placeholder of the agreed shape (the caller's
  `join`): every rank raises, or, when every rank changed alike, all agree afresh. The key
  holds the site alone, never the signature: ranks whose signatures differ must still meet
  in one collective;
- under torch.compile a graph cannot read a gathered row: the ranks agree once per trace,
  for real, while dynamo traces (`agree_while_tracing`; every rank traces the same calls in
  the same order), and the graph keeps the rows as constants, so it sends no metadata. A
  traced size is a symbol: it stays out of the row (`UNSENT`); every other value is
  specialised, so a change retraces and agrees again (a rank that alone retraces waits in
  that agreement until the group's timeout: see docs/failures.md).
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from haloshard import _comm
from haloshard._compat import maybe_run_for_local_tensor
from haloshard._errors import HaloError, raise_rejected

MISTAKE = 1  # the status of a rank that found a mistake in its own call
CHANGED = 2  # the status of a rank whose signature changed since the agreement
UNSENT = -1  # a field this rank does not send (unknown, or a traced size)

_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)


def dtype_code(dtype: torch.dtype) -> int:
    """A code per dtype, distinct for every dtype (listed ones first, others by name)."""
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    return len(_DTYPES) + zlib.crc32(str(dtype).encode())


def shown(field: str, values: list[Any]) -> list[Any]:
    """Row values as a message shows them: dtype codes by name."""
    if not field.endswith("dtype"):
        return values
    names = {dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return [names.get(int(v), v) for v in values]


def float_bits(value: float) -> int:
    """A float as the int64 of its IEEE bits: exact in an int row (`from_bits` inverts)."""
    return int(struct.unpack("<q", struct.pack("<d", float(value)))[0])


def from_bits(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(bits)))[0])


@torch.compiler.assume_constant_result
def digest(values: object) -> int:
    """A code of a value every rank must share (e.g. document boundaries), from its repr.
    Dynamo calls it for real (`zlib` cannot be traced): its argument is a trace constant."""
    return zlib.crc32(repr(values).encode())


@dataclass(frozen=True)
class Fields:
    """The names of a caller's row fields and how a disagreement on them reads.

    `call` names the caller in "rank(s) [r] rejected their {call} arguments"; `hint` ends
    every disagreement message (what every rank must pass); `may_differ` lists the fields
    that may differ between ranks (chunk lengths); `show` turns a field's values into the
    message's label and values (default: the field's name, dtypes by name).
    """

    names: tuple[str, ...]
    call: str
    hint: str
    may_differ: frozenset[str] = frozenset()
    prefix: str = ""
    error: str | None = "error"
    show: Callable[[str, list[Any]], tuple[str, list[Any]]] | None = None

    def at(self, name: str) -> int:
        return self.names.index(name)

    def error_row(self) -> list[int]:
        """The row of a rank that has nothing to describe: only its error flag raised."""
        row = [UNSENT] * len(self.names)
        row[self.at(self.error or self.names[0])] = 1
        return row


@maybe_run_for_local_tensor
def check_rows(rows: list[list[Any]], fields: Fields, own: str | None) -> None:
    """Raise the same `HaloError` on every rank when a rank flagged an error in its row
    (this rank's own `own` problem first) or the ranks' rows differ in a shared field.

    Per simulated rank under LocalTensorMode: groups of a 2-D mesh may hold different rows
    (an uneven batch over dp), which arrive as per-rank ints.
    """
    if fields.error is not None:
        raise_rejected(own, [row[fields.at(fields.error)] for row in rows], fields.call)
    for i, name in enumerate(fields.names):
        values = [row[i] for row in rows]
        if name in fields.may_differ or name == fields.error or len(set(values)) == 1:
            continue
        label, seen = (fields.show or _shown)(name, values)
        raise HaloError(f"{fields.prefix}ranks disagree on {label}: {seen} (rank by rank); "
                        f"{fields.hint}")


def _shown(name: str, values: list[Any]) -> tuple[str, list[Any]]:
    return name, shown(name, values)


def gather(row: torch.Tensor, group: _comm.Group, what: str) -> list[list[int]]:
    """Every rank's row (an int64 vector), in rank order: the agreement's one collective.
    Ranks in different agreements (`what`) raise `HaloError`, not a backend abort."""
    return _comm.gather_ints(row, group, what)


def gather_while_tracing(values: list[Any], group: _comm.Group, what: str,
                         unsent: Collection[int] = ()) -> list[list[int]]:
    """`gather` under torch.compile, once per trace, for real (see the module docstring).
    The fields at `unsent` (traced sizes) travel as `UNSENT`; every other value is
    specialised to an int (a guard: the agreement's values are constants of the trace)."""
    row = tuple(UNSENT if i in unsent else operator.index(v) for i, v in enumerate(values))
    return _comm.gather_ints_while_tracing(row, group, what)


def agree_while_tracing(values: list[Any] | None, fields: Fields, group: _comm.Group,
                        what: str, own: str | None, unsent: Collection[int] = ()) -> None:
    """The trace-time agreement: `check_rows` on every rank's row gathered while dynamo
    traces. `values`: this rank's row (None: only its error flag). Simulated ranks run one
    program with nothing real to agree with: each checks its own problem."""
    if not isinstance(group.rank, int):
        if own is not None:
            raise HaloError(own)
        return
    row = fields.error_row() if values is None or own is not None else values
    check_rows(gather_while_tracing(row, group, what, unsent), fields, own)


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed on at a call site's last agreement: this rank's row, the
    call's signature, every rank's chunk length where the caller needs them, and the shape,
    dtype and device of one placeholder row to join the site's data collective with."""

    row: Any
    signature: Hashable
    lengths: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


# The one steady-state cache: a call site's last agreement per key (the site, the same on
# every rank, and its group), kept by the site's owner (a layer) across calls.
Agreements = dict[Hashable, Agreed]
# A call site's store, its key and this call's signature (global shape, dtype, grad mode...).
Reuse = tuple[Agreements, Hashable, Hashable]


def padded_reuse(reuse: Reuse, requires_grad: bool) -> Reuse:
    """The agreement of a call site's chunk padded before its exchange: its own key and
    signature (the padded chunk's sizes differ from the chunk's, and it needs no gradient
    when padded under no_grad)."""
    return reuse[0], (reuse[1], "padded"), (reuse[2], requires_grad)


def reuse_agreement(store: Agreements, key: Hashable, row: Any, signature: Hashable,
          own: str | None, join: Callable[[Agreed, int], list[int]],
          differs: Callable[[Agreed, list[int]], str]) -> Agreed | None:
    """The agreement this call may reuse, checked locally (no collective), or None when
    there is none or every rank changed alike (the entry is dropped: agree afresh).

    On a mistake (`own`) or a change (row or signature not the agreed ones), this rank
    joins the data collective its peers are starting (`join(agreed, status)`, which sends a
    placeholder and returns every rank's status) and raises `HaloError`: its own problem,
    or `differs(agreed, kept)` naming the ranks that kept the agreed call.
    """
    agreed = store.get(key)
    if agreed is None:
        return None
    if own is None and row == agreed.row and signature == agreed.signature:
        return agreed
    statuses = join(agreed, CHANGED if own is None else MISTAKE)
    if own is None and set(statuses) == {CHANGED}:
        del store[key]
        return None
    raise HaloError(own or differs(agreed, [r for r, s in enumerate(statuses) if s == 0]))
