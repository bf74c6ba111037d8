"""LTX-Video's resamplers on `Shard(T)`: the 0.9.5/0.9.7 encoder downsampler (diffusers'
`LTXVideoDownsampler3d`), and how the decoder's upsampler runs its conv on a window.

Its forward repeats the clip's first `s - 1` frames in front (`s`: its temporal stride),
then folds every `s` frames into channels twice: once averaged (the residual), once after a
stride-1 conv (LTX's causal or centred conv with its own edge padding). Output frame j
reads padded frames `[j*s, j*s + s)` and, through the conv, the frames before (and after)
them. The module runs unedited on a window of its input: a window that starts at input
frame `a = i*s` (not 0) repeats its own first frames in front, which the module's output
frames `< d` read, so the window starts `d` output frames early and drops them.

The decoder's upsampler (`LTXVideoUpsampler3d`, `LTXUpsamplerParallel`) convolves into
`C * prod(stride)` channels (512 -> 4096 at LTX-Video 0.9.0's default) before its
depth-to-space. oneDNN copies a conv's whole weight into its blocked layout at every call,
whatever the input's length, so on a rank's few frames that copy, not the activations, is
the layer's peak. `SlicedConvRun` runs the module's forward with its conv over slices of
the output channels (each output channel's sum is the same computation whichever channels
run beside it), so the copy is one slice's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode

from haloshard._annotation import Annotation
from haloshard._errors import HaloError
from haloshard._forward import install, names_errors
from haloshard._halo_forward import HaloForward
from haloshard._layout import PadMode


@dataclass(frozen=True)
class SpaceToDepthStencil:
    """First `factor - 1` frames repeated in front, then a conv with `before` frames of
    history and `after` of future (its own replicate padding), then every `factor` frames
    folded into one: output length `(T + factor - 1) / factor`, for `T = 1 + k * factor`.

    Example::
        >>> SpaceToDepthStencil(2, 2, 0).window(3, 5)  # outputs 3..4: inputs 2..8, drop 2
        (2, 9, 2)
    """

    factor: int
    before: int
    after: int
    # beyond the global end (a centred conv's window only) the window holds copies of the
    # last frame: the conv's own replicate padding there
    pad: PadMode = "replicate"
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        if length <= 0:
            return 0
        if (length - 1) % self.factor:
            raise HaloError(f"LTXVideoDownsampler3d folds {self.factor} frames into one and "
                            f"needs 1 + k * {self.factor} frames, got {length}")
        return (length - 1) // self.factor + 1

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        # window outputs below `early` read the window's own front copies or conv padding
        early = -(-(f - 1 + self.before) // f)
        first = max(start - early, 0)  # the window's first output, global
        reach = -(-self.after // f) * f  # keeps the window's length 1 + k * f
        return first * f, (stop - 1) * f + 1 + reach, start - first


class LTXDownsamplerParallel(ParallelStyle):
    """`LTXVideoDownsampler3d` (LTX-Video 0.9.5/0.9.7's encoder) on `Shard(T)`, exact: its
    forward runs unedited on a window of its input (`SpaceToDepthStencil`).

    Raises:
        HaloError: in `_apply` for another class or a conv that is not stride and dilation
            1 along T; at run time for a global T that is not `1 + k * stride`.
    """

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"LTXDownsamplerParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).__name__ != "LTXVideoDownsampler3d":
            raise HaloError(f"LTXDownsamplerParallel applies to diffusers' "
                            f"LTXVideoDownsampler3d, got {type(module).__name__}")
        conv = module.conv
        k, stride, dilation = conv.kernel_size[0], conv.conv.stride[0], conv.conv.dilation[0]
        if stride != 1 or dilation != 1:
            raise HaloError(f"LTXDownsamplerParallel expects its conv to have stride and "
                            f"dilation 1 along T, got {stride}, {dilation}")
        before, after = (k - 1, 0) if conv.is_causal else ((k - 1) // 2, (k - 1) // 2)
        stencil = SpaceToDepthStencil(module.stride[0], before, after)
        install(module, HaloForward.of(module, Annotation(None, self.dim, stencil), device_mesh))
        return module


# Output channels per conv call (a multiple of oneDNN's blocks of 16): each call copies
# (reorders) only its slice of the weight; below a few hundred channels the input, copied
# at every call too, and the per-call cost would dominate on small windows.
SLICE_CHANNELS = 256
_CONV3D = (torch.conv3d, torch.nn.functional.conv3d)


class SlicedConvRun:
    """How `LTXUpsamplerParallel` runs the upsampler on its window (`HaloForward.of(local=)`): the
    module's own forward, with every `conv3d` it calls under `torch.no_grad()` computed
    over slices of at most `SLICE_CHANNELS` output channels (`_SlicedConvs`). With
    autograd on it runs unchanged: each slice's weight gradient would come back as a
    zero-filled tensor of the whole weight's size, more than the copy it saves.

    Stateless (a deep copy of the model shares it): it never holds the module.

    Example::
        >>> run = SlicedConvRun()
        >>> conv = nn.Conv3d(2, 600, 3, padding=1)
        >>> with torch.no_grad():
        ...     run(conv, torch.randn(1, 2, 3, 4, 4)).shape  # three calls: 256, 256, 88
        torch.Size([1, 600, 3, 4, 4])
    """

    def __call__(self, forward: Any, window: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return forward(window, *args, **kwargs)
        with _SlicedConvs():
            return forward(window, *args, **kwargs)


class _SlicedConvs(TorchFunctionMode):
    """`conv3d(x, w, b, stride, padding, dilation, groups=1)` as the same conv over slices
    of `w`'s output channels, written into one output (no concatenation held beside it)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _CONV3D or not _sliceable(args, kwargs):
            return func(*args, **kwargs)
        x, weight, *rest = args
        bias = rest.pop(0) if rest else kwargs.pop("bias", None)
        out: torch.Tensor | None = None
        for start in range(0, weight.shape[0], SLICE_CHANNELS):
            stop = min(start + SLICE_CHANNELS, weight.shape[0])
            part = func(x, weight[start:stop], None if bias is None else bias[start:stop],
                        *rest, **kwargs)
            if out is None:
                out = part.new_empty((part.shape[0], weight.shape[0], *part.shape[2:]))
            out[:, start:stop] = part
        return out


def _sliceable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A plain (not DTensor) ungrouped conv3d, input and weight given by position (as
    `nn.Conv3d` calls it), with more output channels than a slice."""
    if len(args) < 2:
        return False
    weight = args[1]
    groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
    return (isinstance(weight, torch.Tensor) and not isinstance(weight, DTensor)
            and weight.ndim == 5 and groups == 1 and weight.shape[0] > SLICE_CHANNELS)
