"""Stencils of the diffusers models' resamplers along T (or H): what each output slice
reads, for `HaloParallel` and the styles of the family modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from haloshard._layout import PadMode


# ---------------------------------------------------------------- HunyuanVideo upsampler
@dataclass(frozen=True)
class UpCausalStencil:
    """Keep the first frame, repeat each later frame `factor` times, then a causal conv of
    `span` frames (its own replicate padding): output length `1 + (T - 1) * factor`.

    The window starts where the conv's `span - 1` frames of history are real frames of
    the window (not its own padding), or at frame 0.

    Example::
        >>> UpCausalStencil(2, 3).window(5, 9)  # outputs 5..8 need up-frames 3..8
        (1, 5, 3)
    """

    factor: int
    span: int
    pad: PadMode = "zeros"  # never used: windows stay inside [0, T)
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return 0 if length <= 0 else 1 + (length - 1) * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f, first = self.factor, start - (self.span - 1)
        # a window from input i0 >= 1 yields x_i0 once, at global up-frame i0 * f
        i0 = 0 if first <= 0 else first // f
        i1 = 1 if stop == 1 else (stop - 2) // f + 2
        return i0, i1, start - i0 * f


@dataclass(frozen=True)
class RepeatConvStencil:
    """Each row repeated `factor` times (nearest), then a centred conv reading `reach` rows
    on each side with its own `pad` padding: output length `T * factor` (HunyuanVideo's
    upsampler along H).

    Beyond the global ends the window holds `pad` rows, whose repeats are what the conv's
    own padding reads there; the module's padding at the window's edges reaches only
    outputs that are dropped.

    Example::
        >>> RepeatConvStencil(2, 1).window(4, 8)  # up-rows 3..8 come from rows 1..4
        (1, 5, 2)
    """

    factor: int
    reach: int
    pad: PadMode = "replicate"
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return max(length, 0) * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        i0 = (start - self.reach) // f
        return i0, (stop - 1 + self.reach) // f + 1, start - i0 * f


@dataclass(frozen=True)
class ConvRepeatStencil:
    """A centred conv reading `reach` rows on each side (its own zero padding), then each
    row becomes `factor` rows (depth-to-space): output length `T * factor` (LTX-Video's
    upsampler along H).

    Example::
        >>> ConvRepeatStencil(2, 1).window(3, 6)  # conv outputs 1..2 read rows 0..3
        (0, 4, 3)
    """

    factor: int
    reach: int
    pad: PadMode = "zeros"
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return max(length, 0) * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        i0 = start // f - self.reach
        return i0, (stop - 1) // f + 1 + self.reach, start - i0 * f


@dataclass(frozen=True)
class RepeatStencil:
    """Each input frame becomes `factor` output frames (depth-to-space along T).

    Example::
        >>> RepeatStencil(3).window(4, 8)  # outputs 4..7 come from inputs 1..2
        (1, 3, 1)
    """

    factor: int
    pad: PadMode = "zeros"  # never used: windows stay inside [0, T)
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return max(length, 0) * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        return start // f, (stop - 1) // f + 1, start % f


@dataclass(frozen=True)
class ConvDepthToSpaceStencil:
    """A conv along T (`before` frames of history, `after` of future, its own replicate
    padding at the window's edges), then depth-to-space along T by `factor`, then the
    first `factor - 1` frames dropped: output length `T * factor - (factor - 1)`.

    Output frame i is frame `i + factor - 1` of the depth-to-space, which comes from conv
    output `(i + factor - 1) // factor`; the window adds the conv's reach on each side so
    that no kept output reads the window's own padding (LTX's upsampler).

    Example::
        >>> ConvDepthToSpaceStencil(2, 1, 1).window(3, 6)  # conv outputs 2..3 read 1..4
        (1, 5, 1)
    """

    factor: int
    before: int
    after: int
    # beyond the global end the window holds copies of the last frame: the conv's own
    # replicate padding there
    pad: PadMode = "replicate"
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return 0 if length <= 0 else length * self.factor - (self.factor - 1)

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f, drop = self.factor, self.factor - 1
        first, last = (start + drop) // f, (stop - 1 + drop) // f
        # the module drops its window's first `drop` frames too: start no later than start//f
        i0 = max(0, min(first - self.before, start // f))
        return i0, last + 1 + self.after, start - i0 * f
