"""LTX-Video 0.9.5/0.9.7's encoder downsampler (diffusers' `LTXVideoDownsampler3d`) on
`Shard(T)`.

Its forward repeats the clip's first `s - 1` frames in front (`s`: its temporal stride),
then folds every `s` frames into channels twice: once averaged (the residual), once after a
stride-1 conv (LTX's causal or centred conv with its own edge padding). Output frame j
reads padded frames `[j*s, j*s + s)` and, through the conv, the frames before (and after)
them. The module runs unedited on a window of its input: a window that starts at input
frame `a = i*s` (not 0) repeats its own first frames in front, which the module's output
frames `< d` read, so the window starts `d` output frames early and drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

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
