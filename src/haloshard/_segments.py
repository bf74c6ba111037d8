"""Frame batches: a model run as a loop over batches of frames, computed in one sharded call.

Some VAEs never run on a whole clip at once: CogVideoX's `encode` calls its encoder on
batches of 8 frames (the first batch takes the remainder), carrying a conv cache from batch
to batch. Its causal convs then compute what one call would, and its resamplers too (each
batch keeps the parity that one call would see), but each GroupNorm takes its statistics
over one batch's frames only. Under `with frame_batches(lengths):` a parallelized model
does the same: every layer maps the batches as it would map each batch alone
(`follow`), and the norms normalise each batch with its own statistics (`at`).

The batches of each layer are found by its input's global length: a chain of layers
(encoder, decoder) has one length per resolution.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from haloshard._compat import maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._layout import shard_size_and_offset

# global length -> the batch lengths at that length, while frame_batches is active: a
# plain stack (not a ContextVar), which torch.compile traces (fullgraph) where every layer
# reads it
_STACK: list[dict[int, tuple[int, ...]]] = []


def _active() -> dict[int, tuple[int, ...]] | None:
    return _STACK[-1] if _STACK else None


@contextmanager
def frame_batches(lengths: Sequence[int]) -> Iterator[None]:
    """Run the parallelized model as a loop over batches of frames of these lengths would:
    norms take statistics per batch; resamplers map each batch alone.

    Args:
        lengths: the batch lengths along the sharded dim at the model's input, in order;
            they sum to the input's global length.

    Raises:
        HaloError: for a non-positive length; at run time when a layer would not map the
            batches to its own output (the loop would compute something else), or a norm
            runs at a length no layer mapped the batches to.

    Example::
        with frame_batches((9, 8, 8)):  # CogVideoX's encode of 25 frames
            h = vae.encoder(x)[0]      # x: Shard(2) DTensor, T = 25
    """
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise HaloError(f"frame_batches needs positive batch lengths, got {lengths}")
    _STACK.append({sum(lengths): lengths})
    try:
        yield
    finally:
        _STACK.pop()


def follow(length: int, out_length: int, stencil: Any) -> None:
    """Record the batches of a layer's output: each input batch mapped alone. A layer that
    maps the batches to another total than its output (one call differs from the loop)
    raises."""
    active = _active()
    if active is None or out_length == length or length not in active:
        return
    at_length = getattr(stencil, "at_length", None)
    outs = tuple((at_length(n) if at_length else stencil).out_length(n)
                 for n in active[length])
    if sum(outs) != out_length or min(outs) < 1:
        raise HaloError(f"frame batches {active[length]} of a layer ({stencil}) give "
                        f"{outs} frames one by one, but {out_length} in one call; expected "
                        "a layer that maps each batch as it maps the whole")
    active.setdefault(out_length, outs)


def at(length: int) -> tuple[int, ...] | None:
    """The batch lengths at a global length, None outside `frame_batches`.

    Raises:
        HaloError: inside `frame_batches`, at a length no layer mapped the batches to.
    """
    active = _active()
    if active is None:
        return None
    if length not in active:
        raise HaloError(f"no frame batches known at length {length} (known: "
                        f"{dict(sorted(active.items()))}); a layer that changes the length "
                        "ran outside haloshard's styles")
    return active[length]


@dataclass(frozen=True)
class Segments:
    """Which batch each local slice along `dim` belongs to: `ids` `(T_r,)`, `count` batches."""

    ids: torch.Tensor
    count: int
    dim: int


def local_segments(lengths: Sequence[int], rank: int | torch.SymInt, world: int, dim: int,
                   device: torch.device) -> Segments:
    """The `Segments` of this rank's `Shard` chunk of `sum(lengths)` slices.

    Example::
        >>> local_segments((3, 2), 1, 2, 2, torch.device("cpu")).ids
        tensor([1, 1])
    """
    return Segments(_ids(tuple(lengths), rank, world, device), len(lengths), dim)


@maybe_run_for_local_tensor
def _ids(lengths: tuple[int, ...], rank: int, world: int, device: torch.device
         ) -> torch.Tensor:
    size, offset = shard_size_and_offset(sum(lengths), world, rank)
    bounds = torch.tensor(lengths, device=device).cumsum(0)
    return torch.bucketize(torch.arange(offset, offset + size, device=device), bounds,
                           right=True)
