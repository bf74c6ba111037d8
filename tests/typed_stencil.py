"""Checked by mypy (tests/test_typing.py), not run: a user's stencil, written as the docs
say (a frozen dataclass), satisfies `haloshard.Stencil` and is accepted by `HaloParallel`
and `annotate`, as are the library's own stencils.

The one line marked `type: ignore[arg-type]` must stay an error: mypy runs with
`--warn-unused-ignores`, so a protocol that stopped checking anything fails the test too.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from haloshard import (
    ConvStencil,
    FirstFrameStencil,
    HaloParallel,
    PadMode,
    ResampleStencil,
    Stencil,
    TransposeStencil,
    annotate,
)


@dataclass(frozen=True)
class EveryOther:
    """A user's layer kind: keeps every other slice (fields for the protocol's members)."""

    pad: PadMode = "zeros"
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return (length + 1) // 2

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        return 2 * start, 2 * stop - 1, 0


@dataclass(frozen=True)
class Causal:
    """A user's causal layer: `min_input` a property, as the library's `ConvStencil` has."""

    span: int
    pad: PadMode = "replicate"
    fill: float | None = None

    @property
    def min_input(self) -> int:
        return self.span

    def out_length(self, length: int) -> int:
        return length

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        return start - self.span + 1, stop, 0


@dataclass(frozen=True)
class NoWindow:
    """Not a stencil: it lacks `window`."""

    pad: PadMode = "zeros"
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return length


def plans(module: nn.Module) -> list[HaloParallel]:
    own: list[Stencil] = [ConvStencil(span=3), TransposeStencil(kernel=4, stride=2),
                          ResampleStencil(2), FirstFrameStencil(2, "down")]
    annotate(module, Causal(3))
    styles = [HaloParallel(EveryOther()), HaloParallel(Causal(3), dim=2)]
    styles += [HaloParallel(stencil) for stencil in own]
    styles.append(HaloParallel(NoWindow()))  # type: ignore[arg-type]
    return styles
