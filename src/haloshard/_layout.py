"""The `HaloShard` placement and its layout arithmetic.

A `HaloShard(dim, left, right, pad)` local tensor is the `Shard(dim)` chunk of the global
tensor extended by the `left` slices that precede it and the `right` slices that follow it in
the global tensor padded by `pad`. Everything here is pure arithmetic on Python ints: which
global slice every local slice of every rank holds. The exchange plan is built on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor.placement_types import Placement, Shard

from haloshard._compat import maybe_run_for_local_tensor
from haloshard._errors import HaloError

PadMode = Literal["zeros", "replicate", "reflect", "circular"]
# The package's one pad-mode table: each mode's name in `F.pad` (`nn.Conv`'s `padding_mode`
# spells them as we do).
F_PAD_MODES: dict[str, str] = {"zeros": "constant", "replicate": "replicate",
                               "reflect": "reflect", "circular": "circular"}
PAD_MODES: tuple[str, ...] = tuple(F_PAD_MODES)
# Internal: like reflect / circular, with zeros beyond one reflection / wrap. The hooks use
# them when a layer's shared halo is wider than those modes allow but no window reads past
# the single-device padding.
LENIENT_PADS: tuple[str, ...] = ("reflect-or-zeros", "circular-or-zeros")


# Run whenever a HaloShard is built. The package's `__init__` puts the DTensor guards here
# (`_dtensor_ops.install`, idempotent): DTensor mishandles a custom placement silently, so
# they must be in place before the first one exists, but not at import, so that a program
# that never builds a HaloShard runs torch unchanged. A hook keeps this module below them.
_ON_BUILD: list[Callable[[], None]] = []


def call_when_built(hook: Callable[[], None]) -> None:
    """Run `hook()` whenever a `HaloShard` is built from now on (once per hook)."""
    if hook not in _ON_BUILD:
        _ON_BUILD.append(hook)


def shard_size_and_offset(length: int, num_chunks: int, rank: int) -> tuple[int, int]:
    """`Shard(dim)`'s split of `length` slices into `num_chunks` (torch.chunk semantics).

    Example::
        >>> shard_size_and_offset(5, 4, 2)
        (1, 4)
    """
    size, offset = Shard.local_shard_size_and_offset(length, num_chunks, rank)
    return int(size), int(offset)


def shard_sizes(length: int, num_chunks: int) -> tuple[int, ...]:
    """The length of every rank's `Shard(dim)` chunk, uneven and empty chunks included.

    Example::
        >>> shard_sizes(5, 4)
        (2, 2, 1, 0)
    """
    return tuple(shard_size_and_offset(length, num_chunks, r)[0] for r in range(num_chunks))


def check_pad_fits(length: int, left: int, right: int, pad: str) -> None:
    """Raise `HaloError` when the pad mode cannot fill a halo of this width.

    The rules are `F.pad`'s: `reflect` needs every halo shorter than the global length,
    `circular` at most the global length, `replicate` a non-empty tensor.
    """
    widest = max(left, right)
    if widest == 0 or pad == "zeros" or pad in LENIENT_PADS:
        return
    if pad == "reflect" and widest >= length:
        raise HaloError(
            f"pad='reflect' needs halos shorter than the global length {length}, got "
            f"left={left}, right={right}"
        )
    if pad == "circular" and widest > length:
        raise HaloError(
            f"pad='circular' needs halos of at most the global length {length}, got "
            f"left={left}, right={right}"
        )
    if pad == "replicate" and length == 0:
        raise HaloError(f"pad='replicate' needs a non-empty tensor, got global length {length}")


def padded_source(index: int, length: int, pad: str) -> int | None:
    """The global slice that padded position `index` (may be < 0 or >= length) copies.

    None means a zero slice. Matches `F.pad` for every mode.

    Example::
        >>> [padded_source(i, 4, "reflect") for i in (-2, -1, 4, 5)]
        [2, 1, 2, 1]
    """
    if 0 <= index < length:
        return index
    if pad == "zeros":
        return None
    if pad == "replicate":
        return min(max(index, 0), length - 1)
    if pad.startswith("reflect"):
        source = -index if index < 0 else 2 * (length - 1) - index
    else:
        source = index % length if -length <= index < 2 * length else -1
    if 0 <= source < length:
        return source
    # Beyond one reflection / wrap: only the internal "...-or-zeros" modes get here (their
    # callers read none of these slices); the public modes are checked by check_pad_fits.
    assert pad in LENIENT_PADS, (index, length, pad)
    return None


@dataclass(frozen=True)
class HaloShard(Placement):
    """`Shard(dim)` whose local pieces also carry `left` / `right` halo slices.

    The global tensor is split along `dim` exactly as `Shard(dim)` splits it. Rank r's local
    tensor is its chunk extended by `left` slices before and `right` slices after, taken from
    the global tensor padded by `pad` (`zeros`, `replicate`, `reflect` or `circular`). A halo
    may be longer than a neighbour's chunk: it is then assembled from several ranks.

    Args:
        dim: the sharded tensor dimension (non-negative).
        left: halo slices before the chunk.
        right: halo slices after the chunk.
        pad: how slices beyond the global ends are filled.

    Raises:
        HaloError: for a negative dim or halo, or an unknown pad mode.

    Example::
        >>> p = HaloShard(2, left=2)
        >>> p
        HaloShard(dim=2, left=2, right=0, pad='zeros')
        >>> [p.local_length(5, 4, r) for r in range(4)]
        [4, 4, 3, 2]
    """

    dim: int
    left: int = 0
    right: int = 0
    pad: PadMode = "zeros"

    def __post_init__(self) -> None:
        Placement.__init__(self)  # the dataclass __init__ skips the C++ base: is_shard() segfaulted
        for name in ("dim", "left", "right"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise HaloError(f"HaloShard {name} must be a non-negative int, got {value!r}")
        if self.pad not in PAD_MODES:
            raise HaloError(f"HaloShard pad must be one of {PAD_MODES}, got {self.pad!r}")
        for hook in _ON_BUILD:  # the DTensor guards: see _ON_BUILD
            hook()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dim, self.left, self.right, self.pad))

    def __reduce__(self) -> tuple[type[HaloShard], tuple[int, int, int, str]]:
        return type(self), (self.dim, self.left, self.right, self.pad)  # C++ base: no pickle

    def __str__(self) -> str:
        pad = "" if self.pad == "zeros" else f",{self.pad}"
        return f"H({self.dim},{self.left},{self.right}{pad})"

    def __fx_repr__(self) -> tuple[str, dict[str, object]]:
        return repr(self), {type(self).__name__: type(self)}  # the names the repr uses

    def shard_size_and_offset(self, length: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Rank's chunk (size, global offset) without halos, as `Shard(dim)` splits."""
        return shard_size_and_offset(length, num_chunks, rank)

    def local_length(self, length: int, num_chunks: int, rank: int) -> int:
        """Rank's local length along `dim`: its chunk plus both halos."""
        return shard_size_and_offset(length, num_chunks, rank)[0] + self.left + self.right

    def local_sources(self, length: int, num_chunks: int, rank: int) -> list[int | None]:
        """For each local slice of `rank`, the global slice it holds (None: zero padding).

        Example::
            >>> HaloShard(0, left=1, right=1, pad="replicate").local_sources(4, 2, 0)
            [0, 0, 1, 2]
        """
        check_pad_fits(length, self.left, self.right, self.pad)
        size, offset = shard_size_and_offset(length, num_chunks, rank)
        first = offset - self.left
        return [
            padded_source(first + i, length, self.pad)
            for i in range(size + self.left + self.right)
        ]


@maybe_run_for_local_tensor
def lack(n: int, longest: int) -> int:
    """Slices a chunk of `n` lacks to `longest` (per simulated rank): what pads every
    rank's chunk to one length where a kernel cannot take per-rank lengths."""
    return longest - n
