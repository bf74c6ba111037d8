"""Halo specs: how far along `dim` each layer reaches, derived from the module or given.

A layer is described along the sharded dim by a *stencil*: its global output length and, for
any range of outputs, the range of (padded) global input slices that produces exactly those
outputs when the layer runs with no padding of its own along `dim`. That is DistDL's model:
first fix which outputs each rank owns (the `Shard(dim)` split of the output length), then
derive the input range each rank needs. Halos follow from those ranges, so stride, dilation,
uneven and empty shards and upsampling are exact without rebalancing anything.

Everything here is pure arithmetic on Python ints; nothing mutates a module or a tensor.
`_annotation.py` validates a module's halo with them; `_halo_forward.py` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, cast

from torch import nn

from haloshard._compat import CONV_PADDING_RECORD
from haloshard._errors import HaloError
from haloshard._layout import (
    PAD_MODES,
    HaloShard,
    PadMode,
    shard_size_and_offset,
    shard_sizes,
)
from haloshard._tracing import planner_cache

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_MAX_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
_AVG_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_POOLS = (*_MAX_POOLS, *_AVG_POOLS)
SPATIAL = {cls: n for n, group in enumerate(
    zip(CONVS, TRANSPOSED, _MAX_POOLS, _AVG_POOLS, strict=True), start=1) for cls in group}
# Modules whose halo haloshard derives; anything else needs an explicit HaloShard spec.
DERIVABLE: tuple[type[nn.Module], ...] = (*CONVS, *TRANSPOSED, *_MAX_POOLS, *_AVG_POOLS,
                                           nn.Upsample)


class Stencil(Protocol):
    """What the hooks need to know about a layer along the sharded dim: the protocol a user
    implements for a new layer kind (a frozen dataclass, so plans can cache on it), passed
    as `HaloParallel(stencil)` or `annotate(module, stencil)`.

    The hooks fix which outputs each rank owns (the `Shard` split of `out_length(T)`), ask
    `window` for the input range that produces them, exchange the halo that range needs,
    run the module's own forward on that window (its padding along the dim removed for the
    layers haloshard derives) and keep `stop - start` outputs from `offset` on.

    Attributes:
        pad: how a window is filled beyond the global ends (`zeros`, `replicate`, ...).
        fill: a value that replaces `pad` beyond the global ends (max pooling: -inf).
        min_input: the window length a rank that owns no output runs the module on (its
            output is dropped; every rank stays in the same collectives): an int >= 1.

    Methods:
        out_length(length): the layer's global output length for a global input length.
        window(start, stop): for outputs `[start, stop)`, the global input range `[i0, i1)`
            (may reach beyond `[0, T)`: filled by `pad`) and where those outputs start in
            the module's output on that window: `(i0, i1, offset)`.
        at_length(length) (optional): the stencil to use for a given global length, for a
            layer whose computation depends on it (`FirstFrameStencil(even=...)`).

    Every rank asks for every rank's window, so an answer no module can compute (not ints,
    `i1 <= i0`, a negative offset or output length) raises `HaloError` on every rank at
    once; a user's stencil is also checked against the module's output on its windows at
    the first call per input signature (one small gather): a window too short for the
    outputs it promises raises on every rank too.

    Example::
        >>> ConvStencil(span=3, pad_left=2).window(4, 6)  # causal kernel 3: 2 frames back
        (2, 6, 0)
    """

    # Read-only properties, not plain attributes: a frozen dataclass (fields or properties)
    # then satisfies the protocol; a settable member would reject it under a type checker.
    @property
    def pad(self) -> PadMode: ...

    @property
    def fill(self) -> float | None: ...

    @property
    def min_input(self) -> int: ...

    def out_length(self, length: int) -> int: ...

    def window(self, start: int, stop: int) -> tuple[int, int, int]: ...


@dataclass(frozen=True)
class ConvStencil:
    """Output o reads padded inputs `[o * stride - pad_left, ... + span)` (conv, pooling).

    `span` is the dilated kernel extent `dilation * (kernel - 1) + 1`. `fill` replaces `pad`
    beyond the global ends when set (max pooling ignores its padding: -inf).

    Example::
        >>> s = ConvStencil(span=3, stride=2, pad_left=1, pad_right=1)
        >>> s.out_length(7), s.window(2, 4)
        (4, (3, 8, 0))
    """

    span: int
    stride: int = 1
    pad_left: int = 0
    pad_right: int = 0
    pad: PadMode = "zeros"
    fill: float | None = None

    def __post_init__(self) -> None:
        if self.span < 1 or self.stride < 1 or min(self.pad_left, self.pad_right) < 0:
            raise HaloError(f"a stencil needs span >= 1, stride >= 1 and padding >= 0, got "
                            f"span={self.span}, stride={self.stride}, "
                            f"padding=({self.pad_left}, {self.pad_right})")

    @property
    def min_input(self) -> int:
        return self.span

    def out_length(self, length: int) -> int:
        """Global output length along dim (the layer's own formula)."""
        padded = length + self.pad_left + self.pad_right
        return (padded - self.span) // self.stride + 1 if padded >= self.span else 0

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        """Padded input range `[i0, i1)` for outputs `[start, stop)`; outputs begin at 0."""
        first = start * self.stride - self.pad_left
        return first, (stop - 1) * self.stride - self.pad_left + self.span, 0


@dataclass(frozen=True)
class TransposeStencil:
    """Transposed conv: input i adds into outputs `i * stride - padding + j * dilation`.

    Run without padding on inputs `[i0, i1)`, the layer yields outputs starting at global
    `i0 * stride - padding`; inputs beyond the global ends are zeros (they add nothing).

    Example::
        >>> TransposeStencil(kernel=4, stride=2, padding=1).window(0, 4)
        (-1, 3, 3)
    """

    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    output_padding: int = 0
    pad: PadMode = "zeros"
    fill: float | None = None
    min_input: int = 1

    def __post_init__(self) -> None:
        if (min(self.kernel, self.stride, self.dilation) < 1
                or min(self.padding, self.output_padding) < 0
                or self.output_padding >= max(self.stride, self.dilation)):
            raise HaloError(
                f"a TransposeStencil needs kernel, stride, dilation >= 1, padding >= 0 and "
                f"0 <= output_padding < max(stride, dilation) (as ConvTranspose), got "
                f"kernel={self.kernel}, stride={self.stride}, dilation={self.dilation}, "
                f"padding={self.padding}, output_padding={self.output_padding}")

    def out_length(self, length: int) -> int:
        reach = self.dilation * (self.kernel - 1)
        return max(0, (length - 1) * self.stride - 2 * self.padding + reach
                   + self.output_padding + 1) if length else 0

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        reach, s, p = self.dilation * (self.kernel - 1), self.stride, self.padding
        # Every contributor of every output, and enough inputs that the local output covers
        # [start, stop) even where a stride wider than the kernel leaves gaps.
        i0 = min(-((reach - start - p) // s), (start + p) // s)
        i1 = max((stop - 1 + p) // s + 1, -((reach - (stop - 1 + p)) // s) + 1)
        return i0, i1, start + p - i0 * s


@dataclass(frozen=True)
class ResampleStencil:
    """`F.interpolate` by an integer factor along dim, `nearest` or `linear`.

    Linear (align_corners=False) clamps source positions at the global ends, which is what a
    replicate-padded halo of one slice gives, so its windows carry one extra slice per side.

    Example::
        >>> ResampleStencil(2, "linear").window(0, 4)
        (-1, 3, 2)
    """

    factor: int
    mode: str = "nearest"
    fill: float | None = None
    min_input: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.factor, int) or self.factor < 1 or self.mode not in (
                "nearest", "linear"):
            raise HaloError(f"a ResampleStencil needs an integer factor >= 1 and mode "
                            f"'nearest' or 'linear', got factor={self.factor!r}, "
                            f"mode={self.mode!r}")

    @property
    def pad(self) -> PadMode:
        return "replicate" if self.mode == "linear" else "zeros"

    def out_length(self, length: int) -> int:
        return length * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        if self.mode != "linear":
            i0 = start // f
            return i0, (stop - 1) // f + 1, start - i0 * f
        # floor((o + 0.5) / f - 0.5) in integers
        i0 = (2 * start + 1 - f) // (2 * f)
        return i0, (2 * (stop - 1) + 1 - f) // (2 * f) + 2, start - i0 * f


STENCILS = (ConvStencil, TransposeStencil, ResampleStencil)


def halo_supplies_padding(stride: int, padding: int, dilation: int, kernel: int, left: int,
                          right: int) -> bool:
    """The rule of a conv run on a halo'd chunk: along the sharded dim it has stride 1 and
    no padding of its own, and the halo is exactly its reach, `dilation * (kernel - 1)`.

    Example::
        >>> halo_supplies_padding(1, 0, 2, 3, 4, 0), halo_supplies_padding(1, 1, 1, 3, 1, 1)
        (True, False)
    """
    return stride == 1 and padding == 0 and left + right == dilation * (kernel - 1)


def is_stencil(spec: object) -> bool:
    """Whether `spec` implements the `Stencil` protocol (a user's own layer kind included):
    `pad`, `fill`, `min_input`, `out_length` and `window`, hashable (plans cache on it).

    Example::
        >>> is_stencil(ConvStencil(span=3, pad_left=1, pad_right=1)), is_stencil(3)
        (True, False)
    """
    try:
        hash(spec)
    except TypeError:
        return False
    return (all(hasattr(spec, name) for name in ("pad", "fill", "min_input"))
            and callable(getattr(spec, "out_length", None))
            and callable(getattr(spec, "window", None)))


def check_stencil(stencil: Stencil) -> None:
    """Validate a stencil's attributes (a user's own layer kind included), at annotation.

    Raises:
        HaloError: naming the stencil, for a `pad` that is not a pad mode, a `fill` that is
            not None or a number, or a `min_input` that is not an int >= 1 (a rank owning no
            output runs the module on that many slices: modules refuse empty inputs).

    Example::
        >>> check_stencil(ConvStencil(span=3))  # returns: valid
    """
    if stencil.pad not in PAD_MODES:
        raise HaloError(f"stencil {stencil!r} has pad={stencil.pad!r}; expected one of "
                        f"{PAD_MODES}")
    fill = stencil.fill
    if fill is not None and (_not_int(fill) and not isinstance(fill, float)):
        raise HaloError(f"stencil {stencil!r} has fill={fill!r}; expected None or a number")
    if _not_int(stencil.min_input) or stencil.min_input < 1:
        raise HaloError(f"stencil {stencil!r} has min_input={stencil.min_input!r}; expected "
                        "an int >= 1: a rank that owns no output runs the module on that many "
                        "slices, and modules refuse an empty input")


def _not_int(value: object) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def _asked(stencil: Stencil, method: str, *args: int) -> object:
    """`stencil.method(*args)`; an exception from the user's code becomes a HaloError
    naming the call (it raises on every rank alike: every rank asks the same)."""
    try:
        return getattr(stencil, method)(*args)
    except HaloError:
        raise
    except Exception as error:
        raise HaloError(f"{_call(stencil, method, args)} raised {type(error).__name__}: "
                        f"{error}") from error


def _call(stencil: Stencil, method: str, args: tuple[int, ...]) -> str:
    # built only for a message: torch.compile traces the checks, not the reprs
    return f"{stencil!r}.{method}({', '.join(str(a) for a in args)})"


def _wrong(stencil: Stencil, method: str, args: tuple[int, ...], got: object,
           expected: str) -> HaloError:
    return HaloError(f"{_call(stencil, method, args)} returned {got!r}; expected {expected}")


def stencil_at(stencil: Stencil, length: int) -> Stencil:
    """The stencil for a global length: `at_length(length)` where the stencil has one.

    Raises:
        HaloError: when `at_length` does not answer a valid stencil.
    """
    if getattr(stencil, "at_length", None) is None:
        return stencil
    found = _asked(stencil, "at_length", length)
    if not is_stencil(found):
        raise _wrong(stencil, "at_length", (length,), found,
                     "a stencil (pad, fill, min_input, out_length, window)")
    check_stencil(found)  # type: ignore[arg-type]
    return found  # type: ignore[return-value]


def answered_length(stencil: Stencil, length: int) -> int:
    """`stencil.out_length(length)`, checked: an int >= 0.

    Example::
        >>> answered_length(ConvStencil(span=3), 7)
        5
    """
    got = _asked(stencil, "out_length", length)
    if _not_int(got) or got < 0:  # type: ignore[operator]
        raise _wrong(stencil, "out_length", (length,), got, "an int >= 0")
    return got  # type: ignore[return-value]


def answered_window(stencil: Stencil, start: int, stop: int) -> tuple[int, int, int]:
    """`stencil.window(start, stop)`, checked: three ints `(i0, i1, offset)` with
    `i0 < i1` (a non-empty, non-reversed input range) and `offset >= 0`. Where the outputs
    end within the module's output on that window is checked when the module has run.

    Example::
        >>> answered_window(ConvStencil(span=3, pad_left=2), 4, 6)
        (2, 6, 0)
    """
    got = _asked(stencil, "window", start, stop)
    if not isinstance(got, tuple | list) or len(got) != 3 or any(map(_not_int, got)):
        raise _wrong(stencil, "window", (start, stop), got, "three ints (i0, i1, offset)")
    i0, i1, offset = got
    if i0 >= i1:
        raise _wrong(stencil, "window", (start, stop), got,
                     f"an input range i0 < i1 (outputs [{start}, {stop}) must come from at "
                     "least one input slice)")
    if offset < 0:
        raise _wrong(stencil, "window", (start, stop), got,
                     f"offset >= 0 (where output {start} lies in the module's output on the "
                     "window)")
    return i0, i1, offset


def stencil_of_spec(spec: HaloShard) -> ConvStencil:
    """The stencil of a length-preserving layer that reads `left` / `right` extra slices.

    Example::
        >>> stencil_of_spec(HaloShard(2, left=2, pad="replicate"))
        ConvStencil(span=3, stride=1, pad_left=2, pad_right=0, pad='replicate', fill=None)
    """
    return ConvStencil(span=spec.left + spec.right + 1, pad_left=spec.left,
                       pad_right=spec.right, pad=spec.pad)


def spatial_index(module: nn.Module, dim: int) -> int:
    """Which of the module's kernel dims `dim` is, for batched `(B, C, *spatial)` inputs.

    Raises:
        HaloError: when `dim` is not one of the module's spatial dims.

    Example::
        >>> spatial_index(nn.Conv3d(1, 1, 3), 2)
        0
    """
    n = _spatial_dims(module)
    if not 2 <= dim < 2 + n:
        raise HaloError(f"dim {dim} is not a spatial dim of {type(module).__name__}, whose "
                        f"batched input is (B, C, {n} spatial dims): expected 2 <= dim < {2 + n}")
    return dim - 2


def _spatial_dims(module: nn.Module) -> int:
    for cls, n in SPATIAL.items():
        if isinstance(module, cls):
            return n
    return 3  # nn.Upsample: up to 3 spatial dims; the input's rank decides at run time


def _along(value: int | tuple[int, ...] | list[int], index: int) -> int:
    if isinstance(value, int):
        return value
    return int(value[index]) if len(value) > 1 else int(value[0])


def conv_padding(module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> list[tuple[int, int]]:
    """`(left, right)` padding per spatial dim, from the public `padding` attribute.

    torch's own record (`_reversed_padding_repeated_twice`) is set in `__init__` and goes
    stale when a subclass resets `self.padding` afterwards (diffusers' Wan conv does); torch
    reads it only for a non-zeros `padding_mode`, where it must agree with `padding`.

    Raises:
        HaloError: when the two records disagree for a non-zeros padding mode.

    Example::
        >>> conv_padding(nn.Conv2d(1, 1, (3, 4), padding="same"))
        [(1, 1), (1, 2)]
    """
    n, padding = len(module.kernel_size), module.padding
    if isinstance(padding, str):
        total = [d * (k - 1) if padding == "same" else 0
                 for k, d in zip(module.kernel_size, module.dilation, strict=True)]
        pairs = [(t // 2, t - t // 2) for t in total]
    else:
        pairs = [(int(p), int(p)) for p in (padding * n if len(padding) == 1 else padding)]
    if module.padding_mode != "zeros":
        rev = getattr(module, CONV_PADDING_RECORD)
        stale = [(rev[2 * (n - 1 - i)], rev[2 * (n - 1 - i) + 1]) for i in range(n)]
        if stale != pairs:
            raise HaloError(
                f"{type(module).__name__} pads {pairs} by its padding attribute but torch "
                f"will pad {stale} (padding_mode={module.padding_mode!r}, set at __init__); "
                "expected padding not to change after __init__")
    return pairs


def _conv(module: nn.Conv1d | nn.Conv2d | nn.Conv3d, si: int) -> ConvStencil:
    k, d = module.kernel_size[si], module.dilation[si]
    left, right = conv_padding(module)[si]
    return ConvStencil(span=d * (k - 1) + 1, stride=module.stride[si], pad_left=left,
                       pad_right=right, pad=module.padding_mode)


def _transposed(module: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d,
                si: int) -> TransposeStencil:
    if module.padding_mode != "zeros":
        raise HaloError(f"{type(module).__name__} supports only padding_mode='zeros', got "
                        f"{module.padding_mode!r}")
    return TransposeStencil(kernel=module.kernel_size[si], stride=module.stride[si],
                            dilation=module.dilation[si], padding=_along(_ints(module), si),
                            output_padding=_along(module.output_padding, si))


def _ints(module: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d
          ) -> tuple[int, ...]:
    # torch types `padding` as `str | tuple` for every conv, but a transposed conv's
    # constructor always stores a tuple (it accepts no padding string).
    return cast("tuple[int, ...]", module.padding)


def _pool(module: nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d | nn.AvgPool1d | nn.AvgPool2d
          | nn.AvgPool3d, si: int) -> ConvStencil:
    name = type(module).__name__
    if module.ceil_mode:
        raise HaloError(f"{name} with ceil_mode=True is not supported (its last window is "
                        "partial at the global end only); expected ceil_mode=False")
    k, p = _along(module.kernel_size, si), _along(module.padding, si)
    s = _along(module.stride, si) if module.stride not in (None, (), []) else k
    if isinstance(module, _MAX_POOLS):
        if module.return_indices:
            raise HaloError(f"{name} with return_indices=True is not supported: the indices "
                            "would be shard-local; expected return_indices=False")
        d = _along(module.dilation, si)
        return ConvStencil(span=d * (k - 1) + 1, stride=s, pad_left=p, pad_right=p,
                           fill=-math.inf)
    if not module.count_include_pad and p:
        raise HaloError(f"{name} with count_include_pad=False and padding {p} along the "
                        "sharded dim is not supported: its edge divisor is global; expected "
                        "count_include_pad=True or padding 0")
    return ConvStencil(span=k, stride=s, pad_left=p, pad_right=p)


def _upsample(module: nn.Upsample, si: int) -> ResampleStencil:
    factor = module.scale_factor
    f = factor[si] if isinstance(factor, tuple) else factor
    if module.size is not None or f is None or float(f) != int(f) or int(f) < 1:
        raise HaloError(f"Upsample along the sharded dim needs an integer scale_factor >= 1 "
                        f"(not size=), got scale_factor={factor!r}, size={module.size!r}")
    if module.mode not in ("nearest", "nearest-exact", "linear", "bilinear", "trilinear"):
        raise HaloError(f"Upsample mode {module.mode!r} is not supported along the sharded "
                        "dim; expected nearest, nearest-exact, linear, bilinear or trilinear")
    linear = module.mode in ("linear", "bilinear", "trilinear")
    if linear and module.align_corners:
        raise HaloError("Upsample with align_corners=True is not supported: its source "
                        "positions depend on the global length; expected align_corners=False")
    return ResampleStencil(int(f), "linear" if linear else "nearest")


# The methods torch's own forwards of these kinds call besides `forward`: a subclass that
# overrides one (weight standardisation in `_conv_forward`, as timm's StdConv does) computes
# something its attributes do not show.
_FORWARD_METHODS = ("forward", "_conv_forward", "_output_padding")


def known_forward(module: nn.Module) -> bool:
    """Whether the module runs torch's own forward for its kind (conv, pooling, ...): its
    `forward` and the methods that forward calls are its torch class's, on the class and the
    instance.

    Only then may a stencil derived from its attributes be trusted to describe what it
    computes, and a fast path replace its forward: a subclass with its own `forward` (or
    `_conv_forward`) may pad, rescale or standardise in ways no attribute shows.

    Example::
        >>> known_forward(nn.Conv3d(1, 1, 3)), known_forward(nn.GELU())
        (True, False)
    """
    base = next((cls for cls in DERIVABLE if isinstance(module, cls)), None)
    return base is not None and torch_forward(module, base)


def torch_forward(module: nn.Module, base: type[nn.Module], *, attached: bool = False) -> bool:
    """Whether `module` runs `base`'s own forward: an instance of `base` whose `forward` and
    the methods torch's forwards call (`_conv_forward`, `_output_padding`) are `base`'s, on
    its class and on the instance (but the instance's `forward` where a haloshard forward is
    `attached` to it).

    Example::
        >>> class Std(nn.Conv1d):
        ...     def _conv_forward(self, x, w, b):
        ...         return super()._conv_forward(x, w - w.mean(), b)
        >>> torch_forward(nn.GroupNorm(1, 2), nn.GroupNorm), torch_forward(Std(1, 1, 3), nn.Conv1d)
        (True, False)
    """
    return isinstance(module, base) and all(
        (name not in module.__dict__ or (attached and name == "forward"))
        and getattr(type(module), name, None) is getattr(base, name, None)
        for name in _FORWARD_METHODS)


def derive_stencil(module: nn.Module, dim: int) -> Stencil:
    """The stencil of a conv, transposed conv, pooling or upsampling module along `dim`.

    Raises:
        HaloError: for any other module, or a configuration that cannot be exact.

    Example::
        >>> derive_stencil(nn.Conv3d(4, 4, (3, 3, 3), padding=(1, 1, 1)), 2)
        ConvStencil(span=3, stride=1, pad_left=1, pad_right=1, pad='zeros', fill=None)
    """
    if not isinstance(module, DERIVABLE):
        names = ", ".join(cls.__name__ for cls in DERIVABLE)
        raise HaloError(f"cannot derive a halo for {type(module).__name__}; expected one of "
                        f"{names}, or pass an explicit HaloShard spec")
    si = spatial_index(module, dim)
    if isinstance(module, CONVS):
        return _conv(module, si)
    if isinstance(module, TRANSPOSED):
        return _transposed(module, si)
    if isinstance(module, nn.Upsample):
        return _upsample(module, si)
    assert isinstance(module, _POOLS)  # DERIVABLE holds nothing else
    return _pool(module, si)


def local_attrs(module: nn.Module, dim: int) -> dict[str, object]:
    """The attribute values that make `module` add no padding of its own along `dim`.

    The halo supplies that padding instead. Other dims keep theirs.

    Example::
        >>> local_attrs(nn.Conv2d(1, 1, 3, padding=1), 2)
        {'padding': (0, 1), '_reversed_padding_repeated_twice': [1, 1, 0, 0]}
    """
    if isinstance(module, nn.Upsample) or not isinstance(module, DERIVABLE):
        return {}
    si, n = spatial_index(module, dim), _spatial_dims(module)
    if isinstance(module, CONVS):
        return _conv_attrs(module, si, n)
    if isinstance(module, TRANSPOSED):
        return {"padding": _with(_ints(module), si, n, 0),
                "output_padding": _with(module.output_padding, si, n, 0)}
    assert isinstance(module, _POOLS)  # DERIVABLE holds nothing else
    return {"padding": _with(module.padding, si, n, 0)}


def _with(value: int | tuple[int, ...], index: int, n: int, new: int) -> tuple[int, ...]:
    full = [value] * n if isinstance(value, int) else list(value) * (n if len(value) == 1 else 1)
    full[index] = new
    return tuple(full)


def _conv_attrs(module: nn.Conv1d | nn.Conv2d | nn.Conv3d, si: int, n: int) -> dict[str, object]:
    pairs = conv_padding(module)
    pairs[si] = (0, 0)
    uneven = [i + 2 for i, (lo, hi) in enumerate(pairs) if lo != hi]
    if uneven and module.padding_mode == "zeros":
        raise HaloError(f"padding='same' with an even dilated kernel on dim(s) {uneven} (not "
                        f"the sharded dim {si + 2}) cannot be expressed without F.pad; expected "
                        "an odd kernel there or padding_mode other than 'zeros'")
    # torch pads non-zeros modes from its private record: keep it in step with `padding`.
    rev = [p for lo, hi in reversed(pairs) for p in (lo, hi)]
    return {"padding": tuple(lo for lo, _ in pairs), CONV_PADDING_RECORD: rev}


def check_spec(module: nn.Module, spec: HaloShard, dim: int) -> None:
    """Validate an explicit spec against the module it annotates (once, at annotation).

    A derivable module's spec must equal its derived halo; for any other module the spec
    must reach at least as far as the widest unpadded kernel inside it.

    Raises:
        HaloError: naming the spec and what the module needs.
    """
    if spec.dim != dim:
        raise HaloError(f"spec {spec!r} shards dim {spec.dim} but dim={dim} was given; "
                        "expected the same dim")
    if isinstance(module, DERIVABLE) and known_forward(module):
        derived = derive_stencil(module, dim)
        if derived != stencil_of_spec(spec):
            raise HaloError(f"spec {spec!r} does not match {type(module).__name__}, which "
                            f"needs {derived}; pass spec=None to derive it")
        return
    if isinstance(module, CONVS) and 0 <= dim - 2 < _spatial_dims(module):
        # Its own forward runs on the window with its padding attribute along dim removed:
        # that padding is the halo's, so a spec must equal it where there is one.
        own = conv_padding(module)[dim - 2]
        if any(own) and own != (spec.left, spec.right):
            raise HaloError(f"spec {spec!r} does not match {type(module).__name__}'s padding "
                            f"{own} along dim {dim}; expected left, right = {own}")
    for name, inner in module.named_modules():
        if isinstance(inner, CONVS) and _spatial_dims(inner) > dim - 2 >= 0:
            need = _conv(inner, dim - 2)
            missing = need.span - 1 - need.pad_left - need.pad_right
            if spec.left + spec.right < missing:
                raise HaloError(
                    f"spec {spec!r} is too small for {name or 'the module'}: its kernel spans "
                    f"{need.span} slices along dim {dim} with padding ({need.pad_left}, "
                    f"{need.pad_right}), so left + right must be >= {missing}, got "
                    f"{spec.left + spec.right}")


@dataclass(frozen=True)
class WindowPlan:
    """One layer on one world: halos to exchange and every rank's input and output window.

    `win_start[r]` / `win_len[r]` index rank r's exchanged tensor (its chunk plus `left`
    and `right` halo slices), followed by `win_zeros[r]` zero slices; `out_start[r]` /
    `out_len[r]` index the layer's local output. A rank that owns no outputs runs the layer
    on a `min_input` window and keeps none of it, so every rank stays in the same
    collectives and autograd graph.
    """

    length: int
    out_length: int
    left: int
    right: int
    win_start: tuple[int, ...]
    win_len: tuple[int, ...]
    win_zeros: tuple[int, ...]
    out_start: tuple[int, ...]
    out_len: tuple[int, ...]


@planner_cache(4096)
def plan_windows(stencil: Stencil, length: int, world: int, *, uniform: bool = False
                 ) -> WindowPlan:
    """Plan one layer: `Shard` split of the outputs, then the inputs each rank needs.

    With `uniform=True` every rank's window has the same length (extended to the right by
    zeros; the extra outputs are dropped): under `LocalTensorMode` some ops (max pooling) cannot
    take per-rank symbolic lengths.

    Raises:
        HaloError: when the layer has no output for this global length, or the stencil
            answers what no module can compute (`check_stencil`, `answered_window`).

    Example::
        >>> p = plan_windows(ConvStencil(span=3, stride=2, pad_left=1, pad_right=1), 7, 2)
        >>> p.out_length, p.left, p.right, p.win_start, p.win_len
        (4, 1, 1, (0, 0), (5, 5))
    """
    check_stencil(stencil)
    stencil = stencil_at(stencil, length)
    out_length = answered_length(stencil, length)
    if out_length <= 0:
        raise HaloError(f"{stencil} has no output for global length {length} along the "
                        "sharded dim; the single-device module would fail too")
    chunks = [shard_size_and_offset(length, world, r) for r in range(world)]
    outs = [shard_size_and_offset(out_length, world, r) for r in range(world)]
    # Every rank asks for every rank's window: a bad answer raises on all of them at once.
    wins = {r: answered_window(stencil, o, o + n) for r, (n, o) in enumerate(outs) if n}
    left = max([0, *(chunks[r][1] - i0 for r, (i0, _, _) in wins.items())])
    right = max([0, *(i1 - sum(chunks[r]) for r, (_, i1, _) in wins.items())])
    starts = tuple(wins[r][0] - chunks[r][1] + left if r in wins else 0 for r in range(world))
    lens = [wins[r][1] - wins[r][0] if r in wins else stencil.min_input for r in range(world)]
    if uniform:
        lens = [max(lens)] * world
    # Slices a window lacks (an idle rank's, or a uniform window's tail) are zeros appended
    # locally: their outputs are dropped, and widening the halo could break reflect/circular.
    held = [min(n, chunks[r][0] + left + right - starts[r]) for r, n in enumerate(lens)]
    return WindowPlan(length, out_length, left, right, starts, tuple(held),
                      tuple(n - h for n, h in zip(lens, held, strict=True)),
                      tuple(wins[r][2] if r in wins else 0 for r in range(world)),
                      shard_sizes(out_length, world))
