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

import math
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
from haloshard._forward import (
    ShardedForward,
    install,
    names_errors,
)
from haloshard._halo_forward import HaloForward
from haloshard._layer_styles import (
    CausalConvParallel,
    LocalParallel,
)
from haloshard._layout import HaloShard, PadMode
from haloshard._site import rewrap
from haloshard._styles import HaloParallel
from haloshard.integrations.diffusers._base import (
    DimStyle,
    Rule,
    also_rows,
    check_class,
    check_time_dim,
    no_timestep,
    passing,
    timestep_conditioned,
    timestep_rows,
)
from haloshard.integrations.diffusers._rows import (
    FastConv3d,
    apply_rows_conv,
    centred_rows,
    rows_site,
    rows_window,
)
from haloshard.integrations.diffusers.stencils import ConvDepthToSpaceStencil, ConvRepeatStencil


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


# ---------------------------------------------------------------- LTX-Video
def _ltx_causal_conv(module: nn.Module) -> ParallelStyle:
    """LTX's conv: pads T with repeated edge frames (`torch.concatenate`): `k - 1` first
    frames when causal, `(k - 1) // 2` first and last frames when not; any stride when
    causal (the encoder's stride-2 downsampler)."""
    k, stride = module.kernel_size[0], module.conv.stride[0]
    if module.conv.dilation[0] != 1 or (stride != 1 and not module.is_causal):
        raise HaloError(f"an LTXVideoCausalConv3d with stride {stride} and dilation "
                        f"{module.conv.dilation[0]} along T (causal={module.is_causal}) is "
                        "not planned; expected dilation 1, and stride 1 unless causal")
    if module.is_causal:
        return CausalConvParallel(pad="replicate")
    return HaloParallel(HaloShard(2, left=(k - 1) // 2, right=(k - 1) // 2, pad="replicate"))


class LTXUpsamplerParallel(DimStyle):
    """`LTXVideoUpsampler3d` on `Shard(T)`, exact: its conv (causal or centred), then
    depth-to-space by its temporal stride, then the first `stride - 1` frames dropped,
    run unedited on a window of its input (`ConvDepthToSpaceStencil`).

    With H sharded (`dim=3`), the same module runs on a window of rows
    (`ConvRepeatStencil`: the conv's own zero padding of H, then each row becomes the
    spatial stride's rows).

    Raises:
        HaloError: in `_apply` for another class, a dim other than 2 (T) or 3 (H), or a
            conv that is not stride 1 along dim (and centred with zero padding along H).
    """

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "LTXVideoUpsampler3d", "LTXUpsamplerParallel")
        if self.dim == 3:
            install(module, HaloForward.of(module, Annotation(None, 3, _ltx_rows(module)),
                                           device_mesh, local=SlicedConvRun()))
            return module
        check_time_dim(self.dim, "LTXUpsamplerParallel")
        conv = module.conv
        k, stride = conv.kernel_size[0], conv.conv.stride[0]
        if stride != 1 or conv.conv.dilation[0] != 1:
            raise HaloError(f"LTXUpsamplerParallel expects its conv to have stride and "
                            f"dilation 1 along T, got {stride}, {conv.conv.dilation[0]}")
        before, after = (k - 1, 0) if conv.is_causal else ((k - 1) // 2, (k - 1) // 2)
        stencil = ConvDepthToSpaceStencil(module.stride[0], before, after)
        install(module, HaloForward.of(module, Annotation(None, self.dim, stencil), device_mesh,
                                       local=SlicedConvRun()))
        also_rows(module, _ltx_rows)
        return module


def _ltx_rows(module: nn.Module) -> ConvRepeatStencil:
    """The upsampler's stencil along H: its conv (stride 1, centred zero padding of its
    own), then depth-to-space by its stride along H."""
    conv = module.conv.conv
    k, stride, pad = conv.kernel_size[1], conv.stride[1], conv.padding[1]
    if (stride != 1 or conv.dilation[1] != 1 or conv.padding_mode != "zeros"
            or 2 * pad != k - 1):
        raise HaloError(f"LTXUpsamplerParallel(dim=3) expects a conv of stride 1 with its "
                        f"own zero padding (k - 1) // 2 along H, got kernel {k}, stride "
                        f"{stride}, padding {pad}, padding_mode {conv.padding_mode!r}")
    return ConvRepeatStencil(module.stride[1], pad)


def _ltx_patches(module: nn.Module) -> None:
    """The encoder's patchify and the decoder's unpatchify fold `patch_size_t` frames into
    channels in their own forward: only 1 keeps T apart."""
    if module.patch_size_t != 1:
        raise HaloError(f"{type(module).__name__} with patch_size_t={module.patch_size_t} "
                        "folds frames into channels in its own forward; planned with "
                        "patch_size_t=1 only")


def _ltx_decoder(module: nn.Module) -> ParallelStyle | None:
    _ltx_patches(module)
    return timestep_conditioned(module, "time_embedder")


LTX_RULES: dict[str, Rule] = {
    **passing("AutoencoderKLLTXVideo", "LTXVideoDownBlock3D", "LTXVideo095DownBlock3D",
               "LTXVideoMidBlock3d", "LTXVideoUpBlock3d"),
    "LTXVideoEncoder3d": (_ltx_patches, False),
    "LTXVideoCausalConv3d": (_ltx_causal_conv, True),
    "LTXVideoUpsampler3d": (lambda m: LTXUpsamplerParallel(), True),
    # 0.9.5/0.9.7's encoder: first frames repeated, then space-to-depth along T
    "LTXVideoDownsampler3d": (lambda m: LTXDownsamplerParallel(), True),
    "RMSNorm": (lambda m: LocalParallel(dim=1), True),  # channels-last, per token
    "LayerNorm": (lambda m: LocalParallel(dim=1), True),
    # timestep conditioning (0.9.1+): per-sample scale and shift tables meet the frames in
    # the decoder's and resnets' own forwards; the timestep MLP has no T
    "LTXVideoDecoder3d": (_ltx_decoder, False),
    "LTXVideoResnetBlock3d": (lambda m: timestep_conditioned(m, "scale_shift_table"), False),
    "PixArtAlphaCombinedTimestepSizeEmbeddings": (lambda m: None, True),
}


def _rows_ltx_conv(module: nn.Module) -> ParallelStyle | dict[str, ParallelStyle]:
    """LTX's conv with H sharded: the wrapper pads T only (run on the H chunk), its conv
    pads H itself (`padding`, any stride): the halo derived from the conv; where that conv
    is centred with stride 1 along H, its window built in one buffer in inference
    (`LTXRowsCausalParallel`)."""
    if centred_rows(module.conv):
        return LTXRowsCausalParallel(dim=3)
    return {"conv": HaloParallel(dim=3)}


class LTXRowsCausalParallel(DimStyle):
    """`LTXVideoCausalConv3d` with H sharded: its conv takes the H halo
    (`HaloParallel(dim=3)`), its `torch.concatenate` of repeated edge frames along T runs
    as the module's.

    In inference on real ranks the wrapper's forward runs here instead: its repeated
    first frames (and, centred, last frames) and its input are written straight into the
    conv's window of rows, whose halo rows the exchange then fills (`rows_window`), and
    the conv runs on that window (its H padding dropped, the halo holds it). The module's
    concatenation and the conv's window were two buffers of the chunk's size, live at
    once when the conv starts (LTX-Video's decode on H peaked there at 1.31 of one
    device's share at P = 2); one is left. Training and simulated ranks run the module's
    own forward.

    Raises:
        HaloError: in `_apply` for another class, a dim other than 3, or a conv that pads
            H otherwise than by `(k_H - 1) // 2` zeros each side with stride and dilation
            1 along H.
    """

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "LTXVideoCausalConv3d", "LTXRowsCausalParallel")
        return apply_rows_conv(module, device_mesh, self.dim, "LTXRowsCausalParallel",
                               _LTXRowsForward(module, 3, device_mesh))


class _LTXRowsForward(ShardedForward):
    """`LTXVideoCausalConv3d.forward(hidden_states)` on a `Shard(3)` DTensor: the
    concatenation of edge frames and input built in the conv's window of rows."""

    def fresh(self) -> None:
        self.agreed: dict[Any, Any] = {}

    def sharded(self, hidden_states: torch.Tensor) -> Any:
        m = self.module
        if m.kernel_size[0] == 1:
            # no edge frame to repeat: the module's concatenation is its input (and its
            # `repeat` by 0 of a DTensor has a backward that returns a plain tensor beside
            # DTensor gradients in torch 2.13, which autograd cannot add)
            return m.conv(hidden_states)
        stencil = m.conv.forward.annotation.stencil  # the conv's HaloForward: its H halo
        site = rows_site(hidden_states, (), stencil)
        if site is None:
            return self.original(hidden_states)
        k, x = m.kernel_size[0], site.local
        before, after = (k - 1, 0) if m.is_causal else ((k - 1) // 2, (k - 1) // 2)
        frames = [x[:, :, :1].expand(-1, -1, before, -1, -1), x,
                  x[:, :, -1:].expand(-1, -1, after, -1, -1)]
        buf, _, plan = rows_window(site, stencil, [f for f in frames if f.shape[2]],
                                   self.agreed)
        del x, frames
        # the conv's own forward with its H padding dropped while the halo is installed
        with FastConv3d():
            y = type(m.conv).forward(m.conv, buf)
        return rewrap(y, site, 3, plan.out_length)


class _PatchRowsForward(ShardedForward):
    """The module's own forward, after `LTXPatchRowsParallel`'s check of its input's rows."""

    style = "LTXPatchRowsParallel"

    def __init__(self, module: nn.Module, rows: LTXPatchRowsParallel) -> None:
        super().__init__(module, 3)
        self.rows = rows

    def sharded(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], DTensor):
            self.rows.check(args[0])
        return self.original(*args, **kwargs)


class LTXPatchRowsParallel(ParallelStyle):
    """LTX-Video's patchify (the encoder's first step) and unpatchify (the decoder's last)
    with H sharded: `patch_size` rows folded into channels, or unfolded from them, by
    DTensor's own reshape and flatten in the module's forward, which keep every rank's rows
    local (no communication, exact) when the rows they split into patches (the encoder:
    `H / patch_size`) or merge from them (the decoder: its latent rows times its
    upsamplers' strides along H, `upsampled`) are a multiple of the H mesh axis's size, and
    raise their own `RuntimeError` otherwise. This style checks its module's input first
    (the encoder; the decoder's `mid_block`, whose input has the latent's rows: the
    decoder itself and its `conv_in` carry styles of their own), so the user learns
    what the rows must be before anything runs. The check reads the DTensor's global shape
    and mesh, the same on every rank.

    Raises:
        HaloError: in `_apply` for a module other than `LTXVideoEncoder3d` (or, with
            `upsampled`, `LTXVideoMidBlock3d`); at run time for rows that DTensor's
            reshape or flatten cannot keep local, naming them and the multiple they need.

    Example::
        >>> style = LTXPatchRowsParallel(4)  # an encoder's: H a multiple of 4 x ranks
    """

    def __init__(self, patch_size: int, *, upsampled: int | None = None) -> None:
        super().__init__()
        self.patch_size, self.upsampled = patch_size, upsampled

    def __repr__(self) -> str:
        return f"LTXPatchRowsParallel({self.patch_size}, upsampled={self.upsampled})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # the encoder checks its own input; the decoder's check sits on its mid-block
        check_class(module, "LTXVideoEncoder3d" if self.upsampled is None
                    else "LTXVideoMidBlock3d", "LTXPatchRowsParallel")
        install(module, _PatchRowsForward(module, self))
        return module

    def check(self, x: DTensor) -> None:
        axes = [i for i, p in enumerate(x.placements) if p.is_shard(3)]
        ranks = math.prod(x.device_mesh.size(i) for i in axes)
        rows, p = x.shape[3], self.patch_size
        if self.upsampled is None and rows % (p * ranks):
            raise HaloError(f"LTXVideoEncoder3d folds patch_size={p} rows into channels: "
                            f"with H sharded over {ranks} ranks, DTensor's reshape keeps "
                            f"each rank's rows only for H a multiple of patch_size x ranks = "
                            f"{p * ranks}; got H = {rows}")
        if self.upsampled is not None and rows * self.upsampled % ranks:
            raise HaloError(f"LTXVideoDecoder3d unfolds patch_size={p} rows from channels "
                            f"after its upsamplers ({self.upsampled} rows a latent row): "
                            f"with H sharded over {ranks} ranks, DTensor's flatten keeps "
                            f"each rank's rows only for {self.upsampled} x the latent's rows "
                            f"a multiple of {ranks}; got {rows} latent rows")


def _ltx_encoder_rows(module: nn.Module) -> ParallelStyle | None:
    """The encoder's patchify folds `patch_size_t` frames and `patch_size` rows into
    channels in its own forward: rows by DTensor's reshape (`LTXPatchRowsParallel`)."""
    _ltx_patches(module)
    return LTXPatchRowsParallel(module.patch_size) if module.patch_size != 1 else None


def _upsampled_rows(decoder: nn.Module) -> int:
    """Rows of the decoder's output before its unpatchify, per latent row: its upsamplers'
    strides along H."""
    return math.prod(m.stride[1] for m in decoder.modules()
                     if type(m).__name__ == "LTXVideoUpsampler3d")


def _ltx_unpatch_rows(module: nn.Module) -> dict[str, ParallelStyle]:
    """The decoder's unpatchify (`LTXPatchRowsParallel` on its `mid_block`, the first
    module with the latent's rows and no style of its own), beside the style the decoder
    itself gets."""
    _ltx_patches(module)
    if module.patch_size == 1:
        return {}
    return {"mid_block": LTXPatchRowsParallel(module.patch_size,
                                              upsampled=_upsampled_rows(module))}


def _ltx_decoder_rows(module: nn.Module) -> dict[str, ParallelStyle]:
    style = timestep_rows(module, "time_embedder")
    return {**_ltx_unpatch_rows(module), **({"": style} if style is not None else {})}


def _ltx_decoder_time_rows(module: nn.Module) -> dict[str, ParallelStyle]:
    if getattr(module, "time_embedder", None) is not None:
        raise HaloError("LTXVideoDecoder3d with timestep conditioning is planned on T or on "
                        "H, not on both at once (ReplicatedArgsParallel takes one sharded "
                        "mesh axis)")
    return _ltx_unpatch_rows(module)
LTX_ROWS: dict[str, Rule] = {
    "LTXVideoEncoder3d": (_ltx_encoder_rows, False),
    "LTXVideoDecoder3d": (_ltx_decoder_rows, False),
    "LTXVideoCausalConv3d": (_rows_ltx_conv, True),
    "LTXVideoUpsampler3d": (lambda m: LTXUpsamplerParallel(dim=3), True),
    "RMSNorm": (lambda m: LocalParallel(dim=2), True),  # channels-last: H at dim 2
    "LayerNorm": (lambda m: LocalParallel(dim=2), True),
    "LTXVideoResnetBlock3d": (lambda m: timestep_rows(m, "scale_shift_table"), False),
    "PixArtAlphaCombinedTimestepSizeEmbeddings": (lambda m: None, True),
}
LTX_TIME_ROWS: dict[str, Rule] = {
    "LTXVideoEncoder3d": (_ltx_encoder_rows, False),
    "LTXVideoDecoder3d": (_ltx_decoder_time_rows, False),
    "LTXVideoCausalConv3d": (_ltx_causal_conv, True),  # the H halo from its conv
    "LTXVideoUpsampler3d": (lambda m: LTXUpsamplerParallel(), True),  # windows on both
    "RMSNorm": (lambda m: LocalParallel(dim=1, local_dims=(2,)), True),
    "LayerNorm": (lambda m: LocalParallel(dim=1, local_dims=(2,)), True),
    "LTXVideoResnetBlock3d": (no_timestep, False),
    "PixArtAlphaCombinedTimestepSizeEmbeddings": (lambda m: None, True),
}
LTX_NAMES = ("AutoencoderKLLTXVideo", "LTXVideoEncoder3d", "LTXVideoDecoder3d")
