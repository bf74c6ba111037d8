"""Context-parallel plans for the video VAEs of diffusers 0.42.1, T sharded over a mesh.

`plan_for(module)` returns the `parallelize_module` plan of a VAE, its encoder or its
decoder, dispatching on the class. Supported (exact against one device, forward and
backward, odd and even T, uneven and empty shards; checked with `haloshard.verify_plan` in
tests/test_diffusers.py):

- `AutoencoderKLHunyuanVideo`: encoder and decoder, block-causal mid-block attention;
- `AutoencoderKLCogVideoX`: encoder and decoder; its `encode`/`decode` loop over frame
  batches (GroupNorm statistics per batch), which `cogvideox_encode(vae, x)` and
  `cogvideox_decode(vae, z)` compute exactly with T sharded;
- `AutoencoderKLMochi`: encoder and decoder, causal attention along T per pixel;
  `mochi_decode(vae, z)` is `vae.decode(z).sample` with the video left sharded;
- `AutoencoderKLLTXVideo`: the 0.9.0 configuration, residual upsamplers with any
  `upsample_factor`, timestep conditioning (0.9.1+: per-sample tables on the decoder
  and its resnets, `ReplicatedArgsParallel`), and 0.9.5/0.9.7's encoder downsamplers
  (`LTXDownsamplerParallel`, `haloshard.integrations._ltx`); noise injection raises
  `HaloError`.
- `AutoencoderKLWan` (Wan 2.1): on T, `wan_encoder_plan(vae)` with `wan_encode(vae, x)`,
  and `wan_decoder_plan(vae)` with `wan_decode(vae, z)` (`haloshard.integrations._wan`,
  re-exported here) give exactly `vae._encode`'s chunk loop (T = 1 + 4k) and `vae._decode`'s
  frame loop; on H, `plan_for(vae, dims=(3,))` runs those loops themselves (the public
  `encode` / `decode`, unchanged) on each rank's rows.

Each plan checks every layer by class, with or without parameters: a class it does not know
raises `HaloError` naming the layer by fqn, rather than being left to DTensor's default
dispatch; so does a VAE switch that changes how `encode` / `decode` walk T (tiling,
slicing, framewise encoding or decoding). The styles that only these models need live here:

- `HunyuanMidBlockParallel`: the mid-block builds a block-causal `(THW)^2` frame mask in its
  own forward and hands it to a diffusers `Attention`. The style runs the block's resnets
  (each with its own plan entries) and replaces the attention by `frame_attention` on this
  rank's queries (K/V gathered along T, the mask built per rank from frame positions, never
  densely); the attention's parameters and GroupNorm are used as its `AttnProcessor2_0`
  would. Empty shards run no diffusers attention code.
- `HunyuanUpsampleParallel`: "keep the first frame, repeat the others `f` times, then a
  causal conv": the module runs on a window that starts early enough for the causal conv
  to see real frames (FirstFrameParallel's window gives it one input frame only).
- `CogSpatialNormParallel`: CogVideoX's decoder norm conditioned on the latent, which it
  resizes by the global T.
- `MochiBlockParallel`, `MochiUpBlockParallel`: Mochi's blocks with causal attention along
  T per pixel, and depth-to-space along T.
- `LTXUpsamplerParallel`: a conv before depth-to-space along T, on windows with its reach.

`plan_for(module, dims=(3,))` shards H instead (every model above), and `dims=(2, 3)` T
and H at once on a `(t, h)` mesh (HunyuanVideo, Mochi, LTX-Video); the styles above then
take `dim=3`, or a stencil along H beside their T one (`RepeatConvStencil`,
`ConvRepeatStencil`). With H sharded, T is whole on every rank, so the models' own frame
loops (CogVideoX's frame batches, Wan's chunks with their feature caches) run unchanged;
Wan's causal convs take their H halo for their cached frames too
(`WanCausalConvParallel`), and its per-frame attention gathers K and V along H
(`WanAttentionParallel`). A layer that cannot be sharded on the dims asked for raises
`HaloError` naming it when the plan is built.

diffusers is imported only when a function here is called.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard import _comm, _dtensor_ops, _segments
from haloshard._annotation import Annotation
from haloshard._attention import gather_many
from haloshard._compat import enabled_local_tensor_mode, maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._forward import (
    ShardedForward,
    install,
    names_errors,
)
from haloshard._halo_forward import HaloForward, halo_window
from haloshard._layer_styles import (
    CausalConvParallel,
    FirstFrameParallel,
    GroupNormParallel,
    LocalParallel,
    ReplicatedArgsParallel,
)
from haloshard._layout import HaloShard, PadMode, lack, shard_size_and_offset, shard_sizes
from haloshard._masked_attention import frame_attention
from haloshard._norms import group_norm
from haloshard._site import Site, dtensor_site, has_spare, pick, rewrap, site_of
from haloshard._specs import ConvStencil, plan_windows
from haloshard._styles import HaloParallel
from haloshard.integrations._cogvideox import cogvideox_decode, cogvideox_encode
from haloshard.integrations._ltx import (
    LTXDownsamplerParallel,
    SlicedConvRun,
    SpaceToDepthStencil,
)
from haloshard.integrations._mochi import mochi_decode
from haloshard.integrations._wan import (
    CachedUpStencil,
    WanAttentionParallel,
    WanCausalConvParallel,
    cached_resample,
    wan_decode,
    wan_decoder_plan,
    wan_encode,
    wan_encoder_plan,
)

__all__ = [
    "plan_for",
    "cogvideox_encode",
    "cogvideox_decode",
    "mochi_decode",
    "wan_encoder_plan",
    "wan_encode",
    "wan_decoder_plan",
    "wan_decode",
    "cached_resample",
    "CachedUpStencil",
    "WanCausalConvParallel",
    "WanAttentionParallel",
    "HunyuanMidBlockParallel",
    "HunyuanUpsampleParallel",
    "CogSpatialNormParallel",
    "MochiBlockParallel",
    "MochiUpBlockParallel",
    "LTXUpsamplerParallel",
    "LTXDownsamplerParallel",
    "UpCausalStencil",
    "RepeatStencil",
    "ConvDepthToSpaceStencil",
    "RepeatConvStencil",
    "ConvRepeatStencil",
    "SpaceToDepthStencil",
]

DIFFUSERS_VERSION = "0.42.1"
_PAD = {"replicate": "replicate", "constant": "zeros", "zeros": "zeros"}


def _check_class(module: nn.Module, name: str, style: str) -> None:
    if type(module).__name__ != name:
        raise HaloError(f"{style} applies to diffusers' {name}, got {type(module).__name__}")


def _check_time_dim(dim: int, style: str) -> None:
    """The styles here implement their module's rule along T (dim 2 of `(B, C, T, H, W)`:
    first frames, causal masks, depth-to-space along T) and along H (dim 3, each its own
    way); along W that rule would be applied to the wrong axis (wrong numbers, no error),
    so another dim is refused."""
    if dim not in (2, 3):
        raise HaloError(f"{style} implements its module's rule along T (dim 2 of (B, C, T, "
                        f"H, W)) and H (dim 3) only, got dim={dim}; expected dim=2 or 3 "
                        "(shard W with the generic styles, e.g. HaloParallel for a conv)")


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


class HunyuanUpsampleParallel(ParallelStyle):
    """`HunyuanVideoUpsampleCausal3D` on `Shard(T)`: exact for any temporal factor.

    Its forward (interpolate the first frame spatially, the others by `upsample_factor`,
    then its `HunyuanVideoCausalConv3d`) runs unedited on a window of its input.

    With H sharded (`dim=3`), the stencil along H is `RepeatConvStencil` (nearest by the
    factor along H, then the conv's replicate `F.pad` of H): with nearest power-of-two
    factors and a conv of torch's own, the up-rows a rank's outputs read are gathered from
    its window of rows in one index and convolved; otherwise the module runs on the window.

    Raises:
        HaloError: in `_apply` for another class, a dim other than 2 (T) or 3 (H), a
            non-integer factor along dim, or a conv that is not causal with replicate
            padding and stride 1 along T (centred along H).
    """

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"HunyuanUpsampleParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_class(module, "HunyuanVideoUpsampleCausal3D", "HunyuanUpsampleParallel")
        if self.dim == 3:
            install(module, HaloForward.of(module, Annotation(None, 3, _hunyuan_rows(module)),
                                           device_mesh))
            if _direct_upsample(module) and module.conv.time_causal_padding[5] == 0:
                _direct_forward(module, _RowsUpsampleForward)
            return module
        _check_time_dim(self.dim, "HunyuanUpsampleParallel")
        factor, wrapper = module.upsample_factor[0], module.conv
        conv = wrapper.conv
        k, stride, dilation = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        span = dilation * (k - 1) + 1
        if (factor != int(factor) or factor < 1 or stride != 1 or conv.padding[0] != 0
                or wrapper.time_causal_padding[4:] != (k - 1, 0) or dilation != 1
                or wrapper.pad_mode != "replicate"):
            raise HaloError(f"HunyuanUpsampleParallel expects an integer temporal factor and "
                            f"a causal replicate conv of stride 1, got factor {factor}, "
                            f"kernel {k}, stride {stride}, dilation {dilation}, padding "
                            f"{wrapper.time_causal_padding}, pad_mode {wrapper.pad_mode!r}")
        stencil = UpCausalStencil(int(factor), span)
        install(module, HaloForward.of(module, Annotation(None, self.dim, stencil), device_mesh))
        if _direct_upsample(module):
            _direct_forward(module, _UpsampleForward)
        _also_rows(module, _hunyuan_rows)
        return module


def _direct_forward(module: nn.Module, kind: type[HaloForward]) -> None:
    """The installed halo forward of `module` replaced by `kind`, a direct upsampler."""
    base = module.forward
    assert isinstance(base, HaloForward)
    module.forward = kind(module, base.annotation, base.mesh, base.saved, base.previous,
                          overlap=False, name=base.name)


def _direct_upsample(module: nn.Module) -> bool:
    """Whether `_UpsampleForward` may compute the upsampler from its attributes: nearest
    factors that are powers of two (their `1 / f` is exact, so interpolate's source index
    is `i // f`), a replicate `F.pad` of H and W, and torch's own Conv3d with no padding."""
    conv, pads = module.conv.conv, module.conv.time_causal_padding
    factors = tuple(module.upsample_factor)
    return (len(factors) == 3 and all(f == int(f) and f >= 1 and int(f) & (int(f) - 1) == 0
                                      for f in factors)
            and type(conv) is nn.Conv3d and tuple(conv.padding) == (0, 0, 0)
            and conv.padding_mode == "zeros" and conv.stride[0] == 1
            and conv.dilation[0] == 1 and pads[0] == pads[1] and pads[2] == pads[3])


class _UpsampleForward(HaloForward):
    """`HunyuanVideoUpsampleCausal3D` on `Shard(T)` without running its forward on a
    window: the up-frames this rank's outputs read (its `span - 1` frames of history
    included, replicate-padded on H and W) are gathered from the exchanged input window in
    one index, then its conv runs on them with no padding. The module's own forward on a
    window builds the repeated frames, their concatenation and a padded copy, each for up
    to `span + factor - 1` more frames than this rank outputs, then drops those outputs.
    With H sharded as well, or a rank without outputs, the window path runs."""

    def sharded(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        site = site_of(x, self.annotation.dim, self.mesh, several=True)
        world = site.mesh.size(site.axis)
        stencil = self.annotation.stencil
        assert isinstance(stencil, UpCausalStencil)
        out_length = stencil.out_length(site.length)
        if (site.others or args or kwargs or has_spare(site.spare)
                or min(shard_sizes(out_length, world)) == 0):
            return super().sharded(x, *args, **kwargs)
        uniform = enabled_local_tensor_mode() is not None
        plan = plan_windows(stencil, site.length, world, uniform=uniform)
        window = halo_window(site, plan, self.annotation, self.reuse(site))
        rank, m = site.mesh.get_local_rank(site.axis), self.module
        (_, _, h, w), wrapper = window.shape[1:], m.conv
        pads = wrapper.time_causal_padding
        frames = _up_frames(rank, site.length, world, stencil, uniform, window.device)
        rows = _up_rows(h, int(m.upsample_factor[1]), pads[2], window.device)
        cols = _up_rows(w, int(m.upsample_factor[2]), pads[0], window.device)
        up = _gathered(window, frames, rows, cols)
        del window
        y = wrapper.conv(up)
        if uniform:  # every simulated rank ran the longest chunk's frames: keep its own
            y = y.narrow(self.annotation.dim, 0, pick(rank, plan.out_len)[0])
        return rewrap(y, site, self.annotation.dim, out_length)


@maybe_run_for_local_tensor
def _up_frames(rank: int, length: int, world: int, stencil: UpCausalStencil, uniform: bool,
               device: torch.device) -> torch.Tensor:
    """Window indices of the input frames behind the up-frames `[s - span + 1, s + n)`
    (this rank's n outputs from global up-frame s and their history): up-frame 0 and the
    replicate padding before it repeat frame 0, up-frame u > 0 is frame `(u - 1) // f + 1`.
    `uniform`: as many as the longest chunk's, the last one repeated (simulated ranks)."""
    out_length = stencil.out_length(length)
    n, s = shard_size_and_offset(out_length, world, rank)
    i0 = stencil.window(s, s + n)[0]
    longest = shard_sizes(out_length, world)[0] if uniform else n
    u = torch.arange(s - stencil.span + 1, s + longest, device=device).clamp(max=s + n - 1)
    return torch.where(u > 0, torch.div(u - 1, stencil.factor, rounding_mode="floor") + 1,
                       0) - i0


class _RowsUpsampleForward(HaloForward):
    """`HunyuanVideoUpsampleCausal3D` with H sharded (T whole), without running its forward
    on a window of rows: the up-rows this rank's outputs read (the conv's reach on each
    side, replicate beyond the global ends) are gathered from the exchanged window in one
    index, with every up-frame (its causal history included) and up-column, replicate-padded
    as its `F.pad` pads them; then its conv runs on them with no padding. The module's own
    forward on a window builds the interpolated frames, their concatenation and a padded
    copy, each `factor * reach` rows taller than what this rank reads, then drops those
    outputs. With T sharded as well, or a rank without outputs, the window path runs."""

    def sharded(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        site = site_of(x, self.annotation.dim, self.mesh, several=True)
        world, stencil = site.mesh.size(site.axis), self.annotation.stencil
        assert isinstance(stencil, RepeatConvStencil)
        out_length = stencil.out_length(site.length)
        if (site.others or args or kwargs or has_spare(site.spare)
                or min(shard_sizes(out_length, world)) == 0):
            return super().sharded(x, *args, **kwargs)
        uniform = enabled_local_tensor_mode() is not None
        plan = plan_windows(stencil, site.length, world, uniform=uniform)
        window = halo_window(site, plan, self.annotation, self.reuse(site))
        rank, m = site.mesh.get_local_rank(site.axis), self.module
        pads, device = m.conv.time_causal_padding, window.device
        # every frame is on this rank: its up-frames as one rank of one computes them
        time = UpCausalStencil(int(m.upsample_factor[0]), pads[4] + 1)
        frames = _up_frames(0, window.shape[2], 1, time, False, device)
        rows = _window_rows(rank, site.length, world, stencil, uniform, device)
        cols = _up_rows(window.shape[4], int(m.upsample_factor[2]), pads[0], device)
        up = _gathered(window, frames, rows, cols)
        del window
        y = m.conv.conv(up)
        if uniform:  # every simulated rank ran the longest chunk's rows: keep its own
            y = y.narrow(3, 0, pick(rank, plan.out_len)[0])
        return rewrap(y, site, 3, out_length)


@maybe_run_for_local_tensor
def _window_rows(rank: int, length: int, world: int, stencil: RepeatConvStencil,
                 uniform: bool, device: torch.device) -> torch.Tensor:
    """Window indices of the input rows behind the up-rows `[s - reach, s + n + reach)`
    (this rank's n output rows from global up-row s and the rows its conv reads around
    them): an up-row beyond the global ends repeats the edge one (replicate), up-row u
    is row `u // factor`. `uniform`: as many as the longest chunk's, the last repeated."""
    out_length, reach = stencil.out_length(length), stencil.reach
    n, s = shard_size_and_offset(out_length, world, rank)
    i0 = stencil.window(s, s + n)[0]
    longest = shard_sizes(out_length, world)[0] if uniform else n
    u = torch.arange(s - reach, s + longest + reach, device=device).clamp(
        max=s + n - 1 + reach)
    return torch.div(u.clamp(0, out_length - 1), stencil.factor, rounding_mode="floor") - i0


def _gathered(window: torch.Tensor, frames: torch.Tensor, rows: torch.Tensor,
              cols: torch.Tensor) -> torch.Tensor:
    """`window[:, :, frames][:, :, :, rows][..., cols]`: eager, in one index (one buffer);
    simulated ranks (per-rank frame counts) one dim at a time."""
    if _comm.is_eager(window):
        return window[:, :, frames[:, None, None], rows[None, :, None], cols[None, None, :]]
    return window.index_select(2, frames).index_select(3, rows).index_select(4, cols)


def _up_rows(size: int, factor: int, pad: int, device: torch.device) -> torch.Tensor:
    """Source rows of `size` rows upsampled by `factor` (nearest), then replicate-padded
    by `pad` on each side."""
    up = torch.arange(-pad, size * factor + pad, device=device).clamp(0, size * factor - 1)
    return torch.div(up, factor, rounding_mode="floor")


def _also_rows(module: nn.Module, rows: Callable[[nn.Module], Any]) -> None:
    """With H sharded too (T and H on a `(t, h)` mesh), the module runs on a window of
    rows as well (`rows(module)`'s stencil); a module whose rows have no stencil here
    raises `HaloError` when its input is sharded on H too."""
    with contextlib.suppress(HaloError):
        module.forward.stencils = {3: rows(module)}


def _hunyuan_rows(module: nn.Module) -> RepeatConvStencil:
    """The upsampler's stencil along H: nearest by its factor, then its conv's centred
    replicate `F.pad` of H (stride and dilation 1)."""
    factor, wrapper = module.upsample_factor[1], module.conv
    conv = wrapper.conv
    k, pads = conv.kernel_size[1], tuple(wrapper.time_causal_padding[2:4])
    if (factor != int(factor) or factor < 1 or conv.stride[1] != 1 or conv.dilation[1] != 1
            or conv.padding[1] != 0 or pads != ((k - 1) // 2, (k - 1) // 2)
            or wrapper.pad_mode != "replicate"):
        raise HaloError(f"HunyuanUpsampleParallel(dim=3) expects an integer factor along H "
                        f"and a conv of stride 1 replicate-padded by (k - 1) // 2 on each "
                        f"side of H, got factor {factor}, kernel {k}, stride {conv.stride[1]}, "
                        f"H padding {pads}, pad_mode {wrapper.pad_mode!r}")
    return RepeatConvStencil(int(factor), (k - 1) // 2)


# ---------------------------------------------------------------- HunyuanVideo mid-block
class _MidBlockForward(ShardedForward):
    """The mid-block's forward on a `Shard(T)` DTensor."""

    def attend(self, h: DTensor) -> Callable[[nn.Module, DTensor, int], DTensor]:
        if self.dim == 3:
            return _causal_attention_rows
        both = any(p == Shard(3) for p in h.placements)
        return _causal_attention_both if both else _causal_attention

    def sharded(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            raise HaloError(f"HunyuanMidBlockParallel needs a Shard({self.dim}) DTensor input, "
                            f"got {type(x).__name__}")
        m = self.module
        checkpoint = torch.is_grad_enabled() and m.gradient_checkpointing

        def run(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
            return m._gradient_checkpointing_func(block, h) if checkpoint else block(h)

        h = run(m.resnets[0], x)
        for attn, resnet in zip(m.attentions, m.resnets[1:], strict=True):
            if attn is not None:
                h = self.attend(h)(attn, h, self.dim)
            h = run(resnet, h)
        return h


# Gathers (K/V, CogVideoX's latent) agreed per module and global signature: a later forward
# issues no metadata collective (see `gather_many`).
_AGREED: weakref.WeakKeyDictionary[nn.Module, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _reuse(module: nn.Module, site: Site) -> tuple[dict[Any, Any], Any]:
    """`module`'s agreements and the global signature of a gather of `site`'s chunk."""
    x = site.local
    return _AGREED.setdefault(module, {}), (site.shape, site.placements, id(site.mesh),
                                            site.axis, x.dtype, x.requires_grad,
                                            torch.is_grad_enabled())


def _causal_attention(attn: nn.Module, h: DTensor, dim: int) -> DTensor:
    """`Attention` (AttnProcessor2_0) over the T*H*W tokens of `h` with the mid-block's
    block-causal frame mask: the processor's steps on this rank's `(B, C, T_r, H, W)`."""
    site = dtensor_site(h, dim)
    x, group, n = site.local, (site.mesh, site.axis), site.local.shape[dim]
    gn = attn.group_norm
    y = x if gn is None else group_norm(x, gn.num_groups, gn.weight, gn.bias, gn.eps, group)
    padded = enabled_local_tensor_mode() is not None
    if padded:
        # Simulated ranks: pad every chunk to the longest; some kernels' backward branches
        # on sizes that would otherwise differ between ranks. The padding is dropped below.
        longest = shard_sizes(site.length, site.mesh.size(site.axis))[0]
        y = F.pad(y, (0, 0, 0, 0, 0, lack(n, longest)))
    tokens = y.movedim(1, -1).contiguous()  # (B, T_r, H, W, C)
    height, width = tokens.shape[2], tokens.shape[3]
    q, k, v = (_heads(lin(tokens), attn.heads) for lin in (attn.to_q, attn.to_k, attn.to_v))
    o = frame_attention(q, k, v, group, global_length=site.length, causal=True,
                        frames=n if padded else None, _reuse=_reuse(attn, site))
    o = o.permute(0, 2, 3, 1, 4).flatten(-2)  # (B, T_r, H*W, C)
    o = attn.to_out[1](attn.to_out[0](o)).unflatten(2, (height, width)).movedim(-1, 1)
    if padded:
        o = o.narrow(dim, 0, n)
    if attn.residual_connection:
        o = o + x
    o = o / attn.rescale_output_factor
    stride = tuple(math.prod(h.shape[i + 1 :]) for i in range(h.ndim))
    return DTensor.from_local(o, site.mesh, site.placements, run_check=False, shape=h.shape,
                              stride=stride)


def _causal_attention_rows(attn: nn.Module, h: DTensor, dim: int) -> DTensor:
    """`_causal_attention` with H sharded: K and V gathered along H, every frame's queries
    (this rank's rows) attend to the tokens of frames up to their own, one frame at a time
    (no `(THW)^2` mask; scores for one frame's queries at once)."""
    site = dtensor_site(h, dim)
    x, group = site.local, (site.mesh, site.axis)
    gn = attn.group_norm
    y = x if gn is None else group_norm(x, gn.num_groups, gn.weight, gn.bias, gn.eps, group,
                                        dim=dim)
    n = rows = x.shape[dim]
    if enabled_local_tensor_mode() is not None:
        # simulated ranks: every chunk padded to the longest, as in `_causal_attention`
        rows = shard_sizes(site.length, site.mesh.size(site.axis))[0]
        y = F.pad(y, (0, 0, 0, lack(n, rows)))
    tokens = y.movedim(1, -1).contiguous()  # (B, T, rows, W, C)
    # (B, heads, T, rows, W, E), contiguous: the gather's backward takes its gradient as is
    q, k, v = (lin(tokens).unflatten(-1, (attn.heads, -1)).permute(0, 4, 1, 2, 3, 5)
               .contiguous() for lin in (attn.to_q, attn.to_k, attn.to_v))
    k, v = gather_many((k.narrow(dim, 0, n), v.narrow(dim, 0, n)), dim, group,
                       global_length=site.length, reuse=_reuse(attn, site))
    frames = [F.scaled_dot_product_attention(q[:, :, t].flatten(2, 3),
                                             k[:, :, : t + 1].flatten(2, 4),
                                             v[:, :, : t + 1].flatten(2, 4))
              for t in range(q.shape[2])]
    o = torch.stack(frames, 2).permute(0, 2, 3, 1, 4).flatten(-2)  # (B, T, rows * W, C)
    o = attn.to_out[1](attn.to_out[0](o)).unflatten(2, (rows, tokens.shape[3]))
    o = o.narrow(2, 0, n).movedim(-1, 1)
    if attn.residual_connection:
        o = o + x
    o = o / attn.rescale_output_factor
    stride = tuple(math.prod(h.shape[i + 1 :]) for i in range(h.ndim))
    return DTensor.from_local(o, site.mesh, site.placements, run_check=False, shape=h.shape,
                              stride=stride)


def _causal_attention_both(attn: nn.Module, h: DTensor, dim: int) -> DTensor:
    """`_causal_attention` with T and H sharded (on two mesh axes): K and V gathered along
    H, then along T; this rank's queries attend one local frame at a time to every token,
    the keys of later frames masked (scores for one frame's queries at once)."""
    site = dtensor_site(h, dim, several=True)
    if [d for _, d in site.others] != [3]:
        raise HaloError(f"HunyuanMidBlockParallel takes T, or T and H, sharded; got "
                        f"placements {site.placements}")
    t_group, h_group = (site.mesh, site.axis), (site.mesh, site.others[0][0])
    x, height = site.local, h.shape[3]
    gn = attn.group_norm
    y = x if gn is None else group_norm(x, gn.num_groups, gn.weight, gn.bias, gn.eps,
                                        t_group, dim=dim, other_groups=[h_group])
    n_t, n_h = x.shape[2], x.shape[3]
    rows_t, rows_h, padded = n_t, n_h, enabled_local_tensor_mode() is not None
    if padded:  # simulated ranks: every chunk padded to the longest, as in _causal_attention
        rows_t = shard_sizes(site.length, site.mesh.size(site.axis))[0]
        rows_h = shard_sizes(height, site.mesh.size(site.others[0][0]))[0]
        y = F.pad(y, (0, 0, 0, lack(n_h, rows_h), 0, lack(n_t, rows_t)))
    tokens = y.movedim(1, -1).contiguous()  # (B, T_r, H_r, W, C)
    q, k, v = (lin(tokens).unflatten(-1, (attn.heads, -1)).permute(0, 4, 1, 2, 3, 5)
               .contiguous() for lin in (attn.to_q, attn.to_k, attn.to_v))
    k, v = (t.narrow(2, 0, n_t).narrow(3, 0, n_h) for t in (k, v))
    reuse = _reuse(attn, site)
    k, v = gather_many((k, v), 3, h_group, global_length=height, reuse=reuse)
    k, v = gather_many((k, v), 2, t_group, global_length=site.length, reuse=reuse)
    k, v = k.flatten(2, 4), v.flatten(2, 4)  # (B, heads, T*H*W, E)
    later = _later_tokens(site.mesh.get_local_rank(site.axis), site.length,
                          site.mesh.size(site.axis), rows_t if padded else None,
                          height * h.shape[4], x.device)  # (T_r, T*H*W)
    frames = [F.scaled_dot_product_attention(q[:, :, i].flatten(2, 3), k, v,
                                             attn_mask=~later[i : i + 1])
              for i in range(rows_t)]
    o = torch.stack(frames, 2).permute(0, 2, 3, 1, 4).flatten(-2)  # (B, T_r, H_r*W, C)
    o = attn.to_out[1](attn.to_out[0](o)).unflatten(2, (rows_h, tokens.shape[3]))
    o = o.narrow(1, 0, n_t).narrow(2, 0, n_h).movedim(-1, 1)
    if attn.residual_connection:
        o = o + x
    o = o / attn.rescale_output_factor
    stride = tuple(math.prod(h.shape[i + 1 :]) for i in range(h.ndim))
    return DTensor.from_local(o, site.mesh, site.placements, run_check=False, shape=h.shape,
                              stride=stride)


@maybe_run_for_local_tensor
def _later_tokens(rank: int, length: int, world: int, rows: int | None, per_frame: int,
                  device: torch.device) -> torch.Tensor:
    """For each of this rank's frames (padded to `rows`), which of the `length *
    per_frame` key tokens belong to later frames. A padding row's frame lies beyond the
    clip: it sees every key (no row all masked, no NaN in its dropped output)."""
    size, offset = shard_size_and_offset(length, world, rank)
    frame = torch.arange(rows if rows is not None else size) + offset
    keys = torch.arange(length).repeat_interleave(per_frame)
    return (keys[None, :] > frame[:, None]).to(device)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """`(B, T_r, H, W, heads * E) -> (B, heads, T_r, H * W, E)`."""
    t = t.unflatten(-1, (heads, t.shape[-1] // heads)).flatten(2, 3)
    return t.permute(0, 3, 1, 2, 4)


def _check_attention(attn: nn.Module, fqn: str) -> None:
    processor = type(getattr(attn, "processor", None)).__name__
    extras = [name for name in ("spatial_norm", "norm_q", "norm_k", "norm_cross")
              if getattr(attn, name, None)]
    if (processor != "AttnProcessor2_0" or extras or attn.is_cross_attention
            or not isinstance(attn.group_norm, (nn.GroupNorm, type(None)))):
        raise HaloError(f"HunyuanMidBlockParallel knows diffusers' Attention with "
                        f"AttnProcessor2_0 and a GroupNorm only; {fqn} has processor "
                        f"{processor}, extra norms {extras}, cross attention "
                        f"{attn.is_cross_attention}")


class HunyuanMidBlockParallel(ParallelStyle):
    """`HunyuanVideoMidBlock3D` on `Shard(T)` with its block-causal attention, exact.

    Its resnets run through their own plan entries; each attention runs as its processor
    does, with `frame_attention(causal=True)` in place of SDPA over a dense mask. Memory per
    rank, training: the full K and V, and scores for this rank's queries only (`N / P * N`
    per head); under `torch.no_grad()`: two ranks' blocks of K and V and one block's scores
    (`N / P * N / P` per head), K/V coming one source rank at a time.

    With H sharded (`dim=3`), K and V are gathered along H and each frame's queries
    attend to the tokens of the frames up to their own, one frame at a time; with T and H
    sharded on two mesh axes (`dim=2`, input `[Shard(2), Shard(3)]`), K and V are gathered
    along H, then T, and the later frames' keys are masked, one local frame at a time.

    Raises:
        HaloError: in `_apply` for another class, a dim other than 2 (T) or 3 (H), or an
            attention this style does not know (another processor, cross attention, extra
            norms); at run time for a plain tensor input.
    """

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"HunyuanMidBlockParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_class(module, "HunyuanVideoMidBlock3D", "HunyuanMidBlockParallel")
        if self.dim != 3:  # H: K and V gathered along H, the frame mask unchanged
            _check_time_dim(self.dim, "HunyuanMidBlockParallel")
        for i, attn in enumerate(module.attentions):
            if attn is not None:
                _check_attention(attn, f"attentions.{i}")
        install(module, _MidBlockForward(module, self.dim))
        return module



# ---------------------------------------------------------------- CogVideoX spatial norm
class _SpatialNormForward(ShardedForward):
    """`CogVideoXSpatialNorm3D.forward(f, zq)` on `Shard(T)` DTensors f and zq."""

    def sharded(self, f: torch.Tensor, zq: torch.Tensor,
            conv_cache: dict[str, Any] | None = None) -> tuple[DTensor, dict[str, Any]]:
        # along H a conv_cache (the VAE's loop over frame batches) is harmless: the 1x1x1
        # convs concatenate no cached frame
        if not isinstance(f, DTensor) or not isinstance(zq, DTensor) or (
                conv_cache and self.dim != 3):
            raise HaloError(f"CogSpatialNormParallel needs Shard({self.dim}) DTensors f and zq "
                            f"and no conv_cache, got {type(f).__name__}, {type(zq).__name__}, "
                            f"conv_cache={bool(conv_cache)}")
        if self.dim == 3:
            return self._rows(f, zq)
        m, site, z_site = self.module, dtensor_site(f, self.dim), dtensor_site(zq, self.dim)
        group, n = (site.mesh, site.axis), site.local.shape[self.dim]
        world = site.mesh.size(site.axis)
        # zq is the latent: small. Gather it, resize H and W, pick each local frame's source.
        (z_all,) = gather_many((z_site.local,), self.dim, group, global_length=z_site.length,
                               reuse=_reuse(m, z_site))
        z_all = F.interpolate(z_all, size=(z_site.length, *f.shape[-2:]))
        rows = shard_sizes(site.length, world)[0] if enabled_local_tensor_mode() is not None \
            else None
        index = _zq_frames(site.mesh.get_local_rank(site.axis), site.length, z_site.length,
                           world, rows, f.device)
        z_local = z_all.index_select(self.dim, index)  # >= 1 frame: convs refuse empty input
        conv_y, conv_b = (conv(z_local)[0].narrow(self.dim, 0, n) for conv in (m.conv_y, m.conv_b))
        gn = m.norm_layer
        norm_f = group_norm(site.local, gn.num_groups, gn.weight, gn.bias, gn.eps, group,
                            segments=_segments.at(site.length), dim=self.dim)
        out = norm_f * conv_y + conv_b
        stride = tuple(math.prod(f.shape[i + 1 :]) for i in range(f.ndim))
        y = DTensor.from_local(out, site.mesh, site.placements, run_check=False, shape=f.shape,
                               stride=stride)
        return y, {"conv_y": None, "conv_b": None}


    def _rows(self, f: DTensor, zq: DTensor) -> tuple[DTensor, dict[str, Any]]:
        """H sharded: zq gathered along H and resized as the module does (T is whole
        here), then this rank's rows picked; `norm_layer` with statistics over H."""
        m, site, z_site = self.module, dtensor_site(f, 3), dtensor_site(zq, 3)
        group, n = (site.mesh, site.axis), site.local.shape[3]
        (z_all,) = gather_many((z_site.local,), 3, group, global_length=z_site.length,
                               reuse=_reuse(m, z_site))
        frames, width = f.shape[2], f.shape[4]
        if frames > 1 and frames % 2 == 1:  # the module's rule: the first frame apart
            z_all = torch.cat([F.interpolate(z_all[:, :, :1], size=(1, site.length, width)),
                               F.interpolate(z_all[:, :, 1:],
                                             size=(frames - 1, site.length, width))], dim=2)
        else:
            z_all = F.interpolate(z_all, size=(frames, site.length, width))
        world = site.mesh.size(site.axis)
        longest = shard_sizes(site.length, world)[0] if enabled_local_tensor_mode() \
            is not None else None
        index = _chunk_rows(site.mesh.get_local_rank(site.axis), site.length, world,
                            longest, f.device)
        z_local = z_all.index_select(3, index)
        conv_y, conv_b = (conv(z_local)[0].narrow(3, 0, n) for conv in (m.conv_y, m.conv_b))
        gn = m.norm_layer
        norm_f = group_norm(site.local, gn.num_groups, gn.weight, gn.bias, gn.eps, group,
                            dim=3)
        stride = tuple(math.prod(f.shape[i + 1 :]) for i in range(f.ndim))
        y = DTensor.from_local(norm_f * conv_y + conv_b, site.mesh, site.placements,
                               run_check=False, shape=f.shape, stride=stride)
        return y, {"conv_y": None, "conv_b": None}


@maybe_run_for_local_tensor
def _chunk_rows(rank: int, length: int, world: int, rows: int | None,
                device: torch.device) -> torch.Tensor:
    """This rank's `Shard` rows of `length`, padded with row 0 to `rows` (or to one row
    for an empty chunk: the 1x1x1 convs refuse an empty input)."""
    size, offset = shard_size_and_offset(length, world, rank)
    picked = torch.arange(offset, offset + size)
    want = rows if rows is not None else max(size, 1)
    return torch.cat([picked, picked.new_zeros(want - size)]).to(device)


@maybe_run_for_local_tensor
def _zq_frames(rank: int, length: int, z_length: int, world: int, rows: int | None,
               device: torch.device) -> torch.Tensor:
    """The zq frame each of this rank's f frames reads, as `CogVideoXSpatialNorm3D` resizes
    zq (nearest; the first frame apart for an odd length > 1), padded with frame 0 to
    `rows` (or to one frame for an empty chunk)."""
    def nearest(src: int, dst: int) -> torch.Tensor:
        ramp = torch.arange(src, dtype=torch.float64).view(1, 1, -1)
        return F.interpolate(ramp, size=dst).view(-1).long()

    if length > 1 and length % 2 == 1:
        full = torch.cat([torch.zeros(1, dtype=torch.long), 1 + nearest(z_length - 1,
                                                                         length - 1)])
    else:
        full = nearest(z_length, length)
    size, offset = shard_size_and_offset(length, world, rank)
    picked = full[offset : offset + size]
    want = rows if rows is not None else max(size, 1)
    return torch.cat([picked, picked.new_zeros(want - size)]).to(device)


class CogSpatialNormParallel(ParallelStyle):
    """`CogVideoXSpatialNorm3D` (the CogVideoX decoder's norm conditioned on the latent zq)
    on `Shard(T)`, exact.

    On one device it resizes zq to f's frames (nearest, the first frame apart when f's
    length is odd) by f's *global* length, which a local chunk does not know. Here zq (the
    latent, the model's smallest tensor) is gathered along T, resized in H and W, and each
    local frame picks its source frame by the same nearest rule; the 1x1x1 convs `conv_y`,
    `conv_b` run on those frames and `norm_layer` runs as `group_norm` with global
    statistics. The returned cache is None (as for the other halo modules).

    With H sharded (`dim=3`), zq is gathered along H and resized the same way, each
    rank keeping its rows; T is whole, so the VAE's own frame-batch loop runs unchanged
    (its conv_cache is accepted: the 1x1x1 convs concatenate no cached frame).

    Raises:
        HaloError: in `_apply` for another class, a dim other than 2 (T) or 3 (H), or
            convs that are not 1x1x1; at run time for plain-tensor inputs, or a
            conv_cache along T.
    """

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"CogSpatialNormParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_class(module, "CogVideoXSpatialNorm3D", "CogSpatialNormParallel")
        if self.dim != 3:  # H: zq gathered along H, resized, this rank's rows
            _check_time_dim(self.dim, "CogSpatialNormParallel")
        for name in ("conv_y", "conv_b"):
            conv = getattr(module, name).conv
            if (tuple(conv.kernel_size) != (1, 1, 1) or tuple(conv.stride) != (1, 1, 1)
                    or getattr(module, name).time_kernel_size != 1):
                raise HaloError(f"CogSpatialNormParallel expects 1x1x1 convs, {name} has "
                                f"kernel {conv.kernel_size}, stride {conv.stride}")
        install(module, _SpatialNormForward(module, self.dim))
        return module


# ---------------------------------------------------------------- Mochi
class _MochiBlockForward(ShardedForward):
    """`MochiDownBlock3D` / `MochiMidBlock3D` forward on a `Shard(T)` DTensor: conv_in and
    resnets through their plan entries, each attention as `frame_attention` along T per
    pixel (causal)."""

    def sharded(self, x: torch.Tensor, conv_cache: dict[str, Any] | None = None,
            chunk_size: int = 2**15) -> tuple[DTensor, dict[str, Any]]:
        if not isinstance(x, DTensor) or conv_cache:
            raise HaloError(f"MochiBlockParallel needs a Shard({self.dim}) DTensor input and no "
                            f"conv_cache, got {type(x).__name__}, conv_cache={bool(conv_cache)}")
        m, cache = self.module, {}
        h = x
        if hasattr(m, "conv_in"):
            h, cache["conv_in"] = m.conv_in(h)
        for i, (resnet, norm, attn) in enumerate(zip(m.resnets, m.norms, m.attentions,
                                                     strict=True)):
            h, cache[f"resnet_{i}"] = resnet(h)
            if attn is not None:
                attend = _pixel_attention if self.dim == 2 else _pixel_attention_rows
                h = h + attend(attn, norm(h), self.dim)
        return h, cache


# Inference: Mochi's attention along T runs on this many slices of the rows (or of the
# columns, W, never sharded, for a batch > 1 or fewer rows) in turn, each pixel's sequence
# whole; as many on every rank (W's count): its q, k, v, K/V blocks and softmax state
# are then a fraction of the chunk, far below the convs' buffers.
_PIXEL_PARTS = 4


def _pixel_attention(attn: nn.Module, h: DTensor, dim: int) -> DTensor:
    """`MochiVaeAttnProcessor2_0`: causal attention along T of each pixel's tokens
    `(B*H*W, T, C)`, on this rank's frames; K/V gathered along T. H (or W) may be
    sharded too, on another mesh axis: each pixel's sequence is along T alone.

    The normalised input is dropped once its tokens exist. Without grad the pixels are
    attended in `_PIXEL_PARTS` slices of rows (or W) in turn (each pixel's own sequence,
    so the result is the same), so q, k, v and the attention's buffers are a part's."""
    site = dtensor_site(h, dim, several=True)
    shape, mesh, placements = h.shape, site.mesh, site.placements
    n, padded = site.local.shape[dim], enabled_local_tensor_mode() is not None
    kept = {d: site.local.shape[d] for _, d in site.others}
    reuse, length, group = _reuse(attn, site), site.length, (site.mesh, site.axis)
    tokens = _pixel_tokens(site, dim, h.shape, padded)  # (B, H, W, T_r, C)
    del h, site  # the caller's norm output: freed here unless autograd keeps it
    # grad mode is part of the agreed signature: every rank runs as many parts
    parts = 1 if torch.is_grad_enabled() else min(_PIXEL_PARTS, tokens.shape[2])
    # slices of rows where they are contiguous (batch 1), so q, k, v's linears copy no part
    along = 1 if tokens.shape[0] == 1 and tokens.shape[1] >= parts else 2
    o = torch.cat([_attend_pixels(attn, part, group, length, n if padded else None,
                                  (reuse[0], (reuse[1], parts, j)))
                   for j, part in enumerate(tokens.tensor_split(parts, dim=along))], along) \
        if parts > 1 else _attend_pixels(attn, tokens, group, length,
                                         n if padded else None, reuse)
    del tokens
    o = (o / attn.rescale_output_factor).permute(0, 4, 3, 1, 2)
    if padded:
        o = o.narrow(dim, 0, n)
        for d, rows in kept.items():
            o = o.narrow(d, 0, rows)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(o.contiguous(), mesh, placements, run_check=False,
                              shape=shape, stride=stride)


def _attend_pixels(attn: nn.Module, tokens: torch.Tensor, group: Any, length: int,
                   frames: Any, reuse: Any) -> torch.Tensor:
    """The processor's steps on `(B, H, W_j, T_r, C)` tokens: q, k, v (q, k normalised),
    causal attention along T, the output projection (and residual); q, k, v dropped once
    attended."""
    def heads(lin: nn.Module, norm: nn.Module | None) -> torch.Tensor:
        t = lin(tokens)
        # heads before frames in memory: frame_attention's query rows need no copy
        t = t.unflatten(-1, (attn.heads, t.shape[-1] // attn.heads)).transpose(-3, -2)
        t = t.contiguous()
        return (norm(t) if norm is not None else t).unsqueeze(-2)  # (B, H, W, h, T_r, 1, E)

    q, k, v = heads(attn.to_q, attn.norm_q), heads(attn.to_k, attn.norm_k), \
        heads(attn.to_v, None)
    o = frame_attention(q, k, v, group, global_length=length, causal=True, frames=frames,
                        _reuse=reuse)
    del q, k, v
    o = o.squeeze(-2).transpose(-3, -2).flatten(-2).contiguous()  # (B, H, W_j, T_r, C)
    o = attn.to_out[1](attn.to_out[0](o))
    return o + tokens if attn.residual_connection else o


def _pixel_tokens(site: Site, dim: int, shape: torch.Size, padded: bool) -> torch.Tensor:
    """This rank's chunk as `(B, H, W, T_r, C)` tokens; under simulated ranks padded at
    the end of T (and of the other sharded dims) to equal shapes, as `_causal_attention`."""
    x = site.local
    if padded:
        longest = shard_sizes(site.length, site.mesh.size(site.axis))[0]
        x = F.pad(x, (0, 0, 0, 0, 0, lack(x.shape[dim], longest)))
        for a, d in site.others:
            x = _pad_end(x, d, shard_sizes(shape[d], site.mesh.size(a))[0])
    return x.permute(0, 3, 4, 2, 1).contiguous()


def _pad_end(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """`x` padded with zeros at the end of `dim` to `rows` slices."""
    return F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, lack(x.shape[dim], rows)])


class _FrameNormForward(ShardedForward):
    """`MochiChunkedGroupNorm3D` (a GroupNorm per frame) with T and H sharded: the frames
    are this rank's, each frame's statistics span the ranks sharing its rows."""

    def sharded(self, x: torch.Tensor) -> DTensor:
        if not isinstance(x, DTensor):
            raise HaloError(f"MochiChunkedGroupNorm3D on T and H needs a DTensor input, got "
                            f"{type(x).__name__}")
        site = dtensor_site(x, self.dim, several=True)
        local, gn, n = site.local, self.module.norm_layer, site.local.shape[2]
        if enabled_local_tensor_mode() is not None:
            # simulated ranks: frames padded to the longest chunk (flattened into the
            # batch below: a per-rank length there breaks LocalTensorMode); each padding
            # frame is a sample of its own, dropped below
            local = _pad_end(local, 2, shard_sizes(site.length, site.mesh.size(site.axis))[0])
        # (T_r * B, C, H_r, W) by frames: concatenated, not flattened, since under
        # LocalTensorMode a view over per-rank row counts cannot be decided
        frames = torch.cat(local.unbind(2), 0)
        rows = [(site.mesh, a) for a, _ in site.others]
        y = gn(frames) if not rows else group_norm(
            frames, gn.num_groups, gn.weight, gn.bias, gn.eps, rows[0], dim=2,
            other_groups=rows[1:])
        y = torch.stack(y.split(local.shape[0], 0), 2).narrow(2, 0, n)
        return DTensor.from_local(y.contiguous(), site.mesh, site.placements,
                                  run_check=False, shape=x.shape, stride=x.stride())


class _FrameNormParallel(ParallelStyle):
    """`MochiChunkedGroupNorm3D` on T and H (`_FrameNormForward`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_class(module, "MochiChunkedGroupNorm3D", "_FrameNormParallel")
        install(module, _FrameNormForward(module, 2))
        return module


def _pixel_attention_rows(attn: nn.Module, h: DTensor, dim: int) -> DTensor:
    """`MochiVaeAttnProcessor2_0` with H sharded: each pixel attends along its own T,
    which this rank holds whole: causal attention on this rank's rows, nothing moved."""
    site = dtensor_site(h, dim)
    x, n = site.local, site.local.shape[dim]
    if enabled_local_tensor_mode() is not None:  # as in _causal_attention: equal shapes
        longest = shard_sizes(site.length, site.mesh.size(site.axis))[0]
        x = F.pad(x, (0, 0, 0, lack(n, longest)))
    tokens = x.permute(0, 3, 4, 2, 1).contiguous()  # (B, H_r, W, T, C)

    def heads(lin: nn.Module, norm: nn.Module | None) -> torch.Tensor:
        t = lin(tokens).flatten(0, 2)  # one sequence per pixel, as the processor's batch
        t = t.unflatten(-1, (attn.heads, t.shape[-1] // attn.heads)).transpose(1, 2)
        return norm(t) if norm is not None else t  # (B*H_r*W, heads, T, E)

    # 4-D, as the processor calls it: on CPU, torch's attention runs its flash kernel only
    # for 4-D inputs; with more dims it falls back to the math path, which holds every
    # pixel's (T, T) scores and their softmax at once (one device holds neither).
    q, k, v = heads(attn.to_q, attn.norm_q), heads(attn.to_k, attn.norm_k), \
        heads(attn.to_v, None)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    del q, k, v
    o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).flatten(-2)))  # (B*H_r*W, T, C)
    o = o.unflatten(0, tokens.shape[:3])  # (B, H_r, W, T, C)
    if attn.residual_connection:
        o = o + tokens
    o = (o / attn.rescale_output_factor).permute(0, 4, 3, 1, 2).narrow(dim, 0, n)
    stride = tuple(math.prod(h.shape[i + 1 :]) for i in range(h.ndim))
    return DTensor.from_local(o.contiguous(), site.mesh, site.placements, run_check=False,
                              shape=h.shape, stride=stride)


def _check_mochi_attention(attn: nn.Module, fqn: str) -> None:
    processor = type(getattr(attn, "processor", None)).__name__
    norms = {type(getattr(attn, n, None)).__name__ for n in ("norm_q", "norm_k")}
    if (processor != "MochiVaeAttnProcessor2_0" or not attn.is_causal or attn.group_norm
            or attn.spatial_norm or attn.is_cross_attention or not norms <= {"LpNorm",
                                                                              "NoneType"}
            or any(getattr(attn, n).dim not in (-1, 3) for n in ("norm_q", "norm_k")
                   if getattr(attn, n, None) is not None)):
        raise HaloError(f"MochiBlockParallel knows diffusers' causal Attention with "
                        f"MochiVaeAttnProcessor2_0 and per-token LpNorm q/k norms; {fqn} has "
                        f"processor {processor}, norms {sorted(norms)}, is_causal "
                        f"{attn.is_causal}")


class MochiBlockParallel(ParallelStyle):
    """`MochiDownBlock3D` / `MochiMidBlock3D` on `Shard(T)`, attention included, exact.

    The block's conv_in, resnets and norms run through their own plan entries; each
    attention (causal along T, one sequence per pixel) runs as its processor does, with
    `frame_attention(causal=True)` over keys and values gathered along T. Memory, training:
    every rank holds the block's full K and V (`2 * B * T * H * W * C`): all pixels attend
    along T; under `torch.no_grad()`: two ranks' blocks of them, one source rank at a time.

    With H sharded (`dim=3`) every pixel's T is on its rank: the attention runs on this
    rank's rows and nothing moves.

    Raises:
        HaloError: in `_apply` for another class, a dim other than 2 (T) or 3 (H), or an
            attention it does not know; at run time for a plain tensor input or a
            conv_cache.
    """

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"MochiBlockParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).__name__ not in ("MochiDownBlock3D", "MochiMidBlock3D"):
            raise HaloError(f"MochiBlockParallel applies to diffusers' MochiDownBlock3D and "
                            f"MochiMidBlock3D, got {type(module).__name__}")
        if self.dim != 3:  # H: every pixel's T is local, attention runs on the rows
            _check_time_dim(self.dim, "MochiBlockParallel")
        for i, attn in enumerate(module.attentions):
            if attn is not None:
                _check_mochi_attention(attn, f"attentions.{i}")
        install(module, _MochiBlockForward(module, self.dim))
        return module


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


class _MochiExpand(nn.Module):
    """The end of `MochiUpBlock3D.forward`: `proj` per token, then depth-to-space."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.proj = block.proj
        self.st, self.s = block.temporal_expansion, block.spatial_expansion

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.proj(h.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)
        b, _, t, height, width = h.shape
        h = h.reshape(b, -1, self.st, self.s, self.s, t, height, width)
        h = h.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
        return h.reshape(b, -1, t * self.st, height * self.s, width * self.s)


class _MochiUpForward(ShardedForward):
    """`MochiUpBlock3D.forward`: resnets through their entries, then `_MochiExpand`."""

    copied = ("module", "previous", "expand")

    def __init__(self, module: nn.Module, expand: nn.Module, dim: int = 2) -> None:
        super().__init__(module, dim)
        self.expand = expand

    def sharded(self, x: torch.Tensor, conv_cache: dict[str, Any] | None = None
            ) -> tuple[torch.Tensor, dict[str, Any]]:
        if conv_cache:
            raise HaloError("MochiUpBlockParallel runs without a conv_cache, got one")
        h, cache = x, {}
        for i, resnet in enumerate(self.module.resnets):
            h, cache[f"resnet_{i}"] = resnet(h)
        return self.expand(h), cache


class MochiUpBlockParallel(ParallelStyle):
    """`MochiUpBlock3D` on `Shard(T)`, exact: its resnets through their plan entries, then
    its per-token `proj` and depth-to-space (each frame becomes `temporal_expansion`
    frames) on the window of input frames this rank's output frames come from.

    With H sharded (`dim=3`), each row becomes `spatial_expansion` rows instead.

    Raises:
        HaloError: in `_apply` for another class or a dim other than 2 (T) or 3 (H).
    """

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"MochiUpBlockParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_class(module, "MochiUpBlock3D", "MochiUpBlockParallel")
        if self.dim != 3:  # H: each row becomes spatial_expansion rows
            _check_time_dim(self.dim, "MochiUpBlockParallel")
        factor = module.temporal_expansion if self.dim == 2 else module.spatial_expansion
        expand = _MochiExpand(module)
        install(expand, HaloForward.of(expand, Annotation(None, self.dim, RepeatStencil(factor)),
                                       device_mesh))
        if self.dim == 2:  # with H sharded too, each row becomes spatial_expansion rows
            _also_rows(expand, lambda m: RepeatStencil(module.spatial_expansion))
        install(module, _MochiUpForward(module, expand, self.dim))
        return module


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


class LTXUpsamplerParallel(ParallelStyle):
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

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"LTXUpsamplerParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_class(module, "LTXVideoUpsampler3d", "LTXUpsamplerParallel")
        if self.dim == 3:
            install(module, HaloForward.of(module, Annotation(None, 3, _ltx_rows(module)),
                                           device_mesh, local=SlicedConvRun()))
            return module
        _check_time_dim(self.dim, "LTXUpsamplerParallel")
        conv = module.conv
        k, stride = conv.kernel_size[0], conv.conv.stride[0]
        if stride != 1 or conv.conv.dilation[0] != 1:
            raise HaloError(f"LTXUpsamplerParallel expects its conv to have stride and "
                            f"dilation 1 along T, got {stride}, {conv.conv.dilation[0]}")
        before, after = (k - 1, 0) if conv.is_causal else ((k - 1) // 2, (k - 1) // 2)
        stencil = ConvDepthToSpaceStencil(module.stride[0], before, after)
        install(module, HaloForward.of(module, Annotation(None, self.dim, stencil), device_mesh,
                                       local=SlicedConvRun()))
        _also_rows(module, _ltx_rows)
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


# ---------------------------------------------------------------- plans
# class name -> (style for it, whether the style covers the module's children too: all of
# them, or the named ones)
# (or `{relative fqn: style}` for the module and its children)
_Rule = tuple[Callable[[nn.Module], ParallelStyle | dict[str, ParallelStyle] | None],
              bool | tuple[str, ...]]


def _causal_conv(module: nn.Module) -> ParallelStyle:
    mode = module.pad_mode
    if mode not in _PAD:
        raise HaloError(f"a causal conv with pad_mode {mode!r} is not supported; expected "
                        f"one of {sorted(_PAD)}")
    return CausalConvParallel(pad=_PAD[mode], pads=_own_hw(module))  # type: ignore[arg-type]


def _own_hw(module: nn.Module) -> dict[int, tuple[int, int]]:
    """The H and W widths of the wrapper's own `F.pad` (`time_causal_padding`, W first:
    HunyuanVideo's and CogVideoX's replicate causal conv): named, so that the chunk is
    padded before the T exchange and the wrapper's `F.pad` copies nothing."""
    w_left, w_right, h_left, h_right = module.time_causal_padding[:4]
    pads = {3: (h_left, h_right), 4: (w_left, w_right)}
    return {d: lr for d, lr in pads.items() if any(lr)}  # a 1-wide kernel pads nothing


def _runs_children(module: nn.Module) -> None:
    """A module whose own forward reads no frame but its own: a block that calls its
    children, adds residuals and applies activations; an elementwise activation; a VAE,
    whose encode/decode switches `_check_flags` checks (diffusers 0.42.1, class by class)."""
    return None


# containers and per-element layers every family uses
_PASS: _Rule = (_runs_children, False)
_GENERIC: dict[str, _Rule] = {name: _PASS for name in (
    "ModuleList", "Sequential", "Identity", "Dropout", "SiLU", "GELU", "ReLU", "Mish", "Tanh",
    "LeakyReLU")}


def _passing(*names: str) -> dict[str, _Rule]:
    return {**_GENERIC, **{name: _PASS for name in names}}


_HUNYUAN: dict[str, _Rule] = {
    **_passing("AutoencoderKLHunyuanVideo", "HunyuanVideoEncoder3D", "HunyuanVideoDecoder3D",
               "HunyuanVideoDownBlock3D", "HunyuanVideoUpBlock3D",
               "HunyuanVideoResnetBlockCausal3D",
               "HunyuanVideoDownsampleCausal3D"),  # calls its strided causal conv only
    "HunyuanVideoCausalConv3d": (_causal_conv, True),
    "HunyuanVideoUpsampleCausal3D": (lambda m: HunyuanUpsampleParallel(), True),
    "HunyuanVideoMidBlock3D": (lambda m: HunyuanMidBlockParallel(), False),
    "Attention": (lambda m: None, True),  # run by the mid-block's style
    "GroupNorm": (lambda m: GroupNormParallel(), True),
    "Conv3d": (lambda m: _pointwise(m), True),  # quant_conv, post_quant_conv
}

def _cog_causal_conv(module: nn.Module) -> ParallelStyle:
    """CogVideoX's causal conv: `F.pad` (replicate) or a `torch.cat` of the first frame
    (`k - 1` times, i.e. replicate padding) before a conv of stride 1 along T; it returns
    `(output, conv_cache)`, whose cache comes back as None under a halo."""
    k, stride = module.time_kernel_size, module.conv.stride[0]
    if module.pad_mode == "replicate":  # F.pad then the conv: any stride (Mochi's down)
        return CausalConvParallel(pad="replicate", pads=_own_hw(module))
    if stride != 1 or module.conv.dilation[0] != 1:
        raise HaloError(f"a CogVideoXCausalConv3d with stride {stride} and dilation "
                        f"{module.conv.dilation[0]} along T is not planned; expected 1 and 1")
    return HaloParallel(HaloShard(2, left=k - 1, pad="replicate"))


def _cog_resample(module: nn.Module) -> ParallelStyle:
    # an even T: pairs pooled from frame 0 / every frame repeated; odd: the first frame kept
    if not module.compress_time:
        return LocalParallel()
    down = type(module).__name__ == "CogVideoXDownsample3D"
    return FirstFrameParallel(2, "down" if down else "up", even="all")


_COGVIDEOX: dict[str, _Rule] = {
    **_passing("AutoencoderKLCogVideoX", "CogVideoXEncoder3D", "CogVideoXDecoder3D",
               "CogVideoXDownBlock3D", "CogVideoXUpBlock3D", "CogVideoXMidBlock3D",
               "CogVideoXResnetBlock3D"),
    "CogVideoXCausalConv3d": (_cog_causal_conv, True),
    "CogVideoXDownsample3D": (_cog_resample, True),
    "CogVideoXUpsample3D": (_cog_resample, True),
    "CogVideoXSpatialNorm3D": (lambda m: CogSpatialNormParallel(), True),
    "CogVideoXSafeConv3d": (lambda m: _pointwise(m), True),  # 1x1 shortcut, quant convs
    "GroupNorm": (lambda m: GroupNormParallel(), True),
}

_MOCHI: dict[str, _Rule] = {
    **_passing("AutoencoderKLMochi", "MochiEncoder3D", "MochiDecoder3D",
               "MochiResnetBlock3D"),
    "CogVideoXCausalConv3d": (_cog_causal_conv, True),
    "MochiChunkedGroupNorm3D": (lambda m: LocalParallel(), True),
    "MochiDownBlock3D": (lambda m: MochiBlockParallel(), False),
    "MochiMidBlock3D": (lambda m: MochiBlockParallel(), False),
    "MochiUpBlock3D": (lambda m: MochiUpBlockParallel(), ("proj",)),
    "Attention": (lambda m: None, True),  # run by the block's style
    "FourierFeatures": (lambda m: LocalParallel(), True),
    "Linear": (lambda m: LocalParallel(dim=1), True),  # proj_in / proj_out, channels-last
    "Conv3d": (lambda m: _pointwise(m), True),  # the decoder's 1x1 conv_in
}

def _timestep_conditioned(module: nn.Module, name: str) -> ParallelStyle | None:
    if getattr(module, "per_channel_scale1", None) is not None:
        raise HaloError(f"{type(module).__name__} injects noise drawn per call (its own "
                        "generator): no sharded run reproduces one device's draw")
    return ReplicatedArgsParallel() if getattr(module, name, None) is not None else None


def _ltx_patches(module: nn.Module) -> None:
    """The encoder's patchify and the decoder's unpatchify fold `patch_size_t` frames into
    channels in their own forward: only 1 keeps T apart."""
    if module.patch_size_t != 1:
        raise HaloError(f"{type(module).__name__} with patch_size_t={module.patch_size_t} "
                        "folds frames into channels in its own forward; planned with "
                        "patch_size_t=1 only")


def _ltx_decoder(module: nn.Module) -> ParallelStyle | None:
    _ltx_patches(module)
    return _timestep_conditioned(module, "time_embedder")


_LTX: dict[str, _Rule] = {
    **_passing("AutoencoderKLLTXVideo", "LTXVideoDownBlock3D", "LTXVideo095DownBlock3D",
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
    "LTXVideoResnetBlock3d": (lambda m: _timestep_conditioned(m, "scale_shift_table"), False),
    "PixArtAlphaCombinedTimestepSizeEmbeddings": (lambda m: None, True),
}

_WAN_NAMES = ("AutoencoderKLWan", "WanEncoder3d", "WanDecoder3d")
# the loops' containers: each calls its children with the feature cache and adds residuals
_WAN: dict[str, _Rule] = {
    **_passing("WanEncoder3d", "WanDecoder3d", "WanResidualBlock", "WanMidBlock",
               "WanUpBlock")}

_PLANS: dict[str, dict[str, _Rule]] = {
    "AutoencoderKLLTXVideo": _LTX,
    "LTXVideoEncoder3d": _LTX,
    "LTXVideoDecoder3d": _LTX,
    "AutoencoderKLMochi": _MOCHI,
    "MochiEncoder3D": _MOCHI,
    "MochiDecoder3D": _MOCHI,
    "AutoencoderKLCogVideoX": _COGVIDEOX,
    "CogVideoXEncoder3D": _COGVIDEOX,
    "CogVideoXDecoder3D": _COGVIDEOX,
    "AutoencoderKLHunyuanVideo": _HUNYUAN,
    "HunyuanVideoEncoder3D": _HUNYUAN,
    "HunyuanVideoDecoder3D": _HUNYUAN,
    # Wan: planned on H only (`plan_for` refers T to wan_encoder_plan / wan_decoder_plan)
    "AutoencoderKLWan": _WAN,
    "WanEncoder3d": _WAN,
    "WanDecoder3d": _WAN,
}


def _pointwise(module: nn.Module) -> ParallelStyle:
    if any(k != 1 for k in module.kernel_size) or any(s != 1 for s in module.stride):
        raise HaloError(f"a bare Conv3d outside a causal wrapper is planned only with kernel "
                        f"and stride 1, got kernel {module.kernel_size}, stride "
                        f"{module.stride}")
    return LocalParallel()


# ---------------------------------------------------------------- H, and T and H at once
# Per dims setting, the rules that replace a family's T rules (keyed by the classes
# `_PLANS` knows). A class with a T rule of its own and none here is refused when the plan
# is built (`_refused`); containers, activations and blocks that only call their children
# (`_PASS`) read no row but their own and keep their rule.
_Along = dict[str, dict[str, _Rule]]


def _refused(cls: str, dims: tuple[int, ...]) -> _Rule:
    def refuse(module: nn.Module) -> None:
        raise HaloError(f"{cls} cannot be sharded on dims {dims} by this plan: its rule "
                        "is planned along T only (dims=(2,)); expected dims=(2,), or a plan "
                        "entry of your own for it")
    return refuse, True


def _rows_causal_conv(module: nn.Module) -> ParallelStyle:
    """HunyuanVideo's (and Mochi's replicate) causal conv with H sharded: its `F.pad` of
    H is centred, so `CausalConvParallel(dim=3)` with those widths (any stride). Its causal
    `F.pad` of T and its `F.pad` of W are named too, so that the rows are padded along
    them before the H exchange and the wrapper's `F.pad` copies nothing (one window per
    rank, not the window and its padded copy)."""
    if module.pad_mode not in _PAD:
        raise HaloError(f"a causal conv with pad_mode {module.pad_mode!r} is not supported; "
                        f"expected one of {sorted(_PAD)}")
    w_left, w_right, left, right, t_left, t_right = module.time_causal_padding
    pads = {2: (t_left, t_right), 3: (left, right), 4: (w_left, w_right)}
    return CausalConvParallel(pad=_PAD[module.pad_mode], dim=3,  # type: ignore[arg-type]
                              pads={d: lr for d, lr in pads.items() if d == 3 or any(lr)})


def _time_rows_causal_conv(module: nn.Module) -> ParallelStyle:
    """The same with T and H sharded: the T halo causal, the H halo holds its `F.pad`."""
    if module.pad_mode != "replicate":
        raise HaloError(f"a causal conv with pad_mode {module.pad_mode!r} is planned on T "
                        "and H with pad_mode 'replicate' only (F.pad of T and H)")
    left, right = module.time_causal_padding[2:4]
    return CausalConvParallel(pad="replicate", pads={3: (left, right)})


def _rows_pointwise(module: nn.Module) -> ParallelStyle:
    _pointwise(module)  # refuses a conv that is not 1x1x1
    return LocalParallel(dim=3)


def _rows_ltx_conv(module: nn.Module) -> dict[str, ParallelStyle]:
    """LTX's conv with H sharded: the wrapper pads T only (run on the H chunk), its conv
    pads H itself (`padding`, any stride): the halo derived from the conv."""
    return {"conv": HaloParallel(dim=3)}


def _ltx_patches_rows(module: nn.Module) -> None:
    """The encoder's patchify and the decoder's unpatchify fold `patch_size` rows into
    channels in their own forward: only 1 keeps H apart."""
    _ltx_patches(module)
    if module.patch_size != 1:
        raise HaloError(f"{type(module).__name__} with patch_size={module.patch_size} "
                        "folds rows into channels in its own forward; planned on H with "
                        "patch_size=1 only")


def _ltx_decoder_rows(module: nn.Module) -> ParallelStyle | None:
    _ltx_patches_rows(module)
    return _timestep_rows(module, "time_embedder")


def _timestep_rows(module: nn.Module, name: str) -> ParallelStyle | None:
    _timestep_conditioned(module, name)  # refuses noise injection
    return ReplicatedArgsParallel(dim=3) if getattr(module, name, None) is not None else None


def _ltx_decoder_time_rows(module: nn.Module) -> None:
    _ltx_patches_rows(module)
    if getattr(module, "time_embedder", None) is not None:
        raise HaloError("LTXVideoDecoder3d with timestep conditioning is planned on T or on "
                        "H, not on both at once (ReplicatedArgsParallel takes one sharded "
                        "mesh axis)")


def _no_timestep(module: nn.Module) -> None:
    if getattr(module, "scale_shift_table", None) is not None:
        raise HaloError(f"{type(module).__name__} with timestep conditioning is planned on "
                        "T or on H, not on both at once")


_HUNYUAN_ROWS: dict[str, _Rule] = {
    "HunyuanVideoCausalConv3d": (_rows_causal_conv, True),
    "HunyuanVideoUpsampleCausal3D": (lambda m: HunyuanUpsampleParallel(dim=3), True),
    "HunyuanVideoMidBlock3D": (lambda m: HunyuanMidBlockParallel(dim=3), False),
    "Attention": (lambda m: None, True),  # run by the mid-block's style
    "GroupNorm": (lambda m: GroupNormParallel(dim=3), True),
    "Conv3d": (_rows_pointwise, True),
}
_HUNYUAN_TIME_ROWS: dict[str, _Rule] = {
    "HunyuanVideoMidBlock3D": (lambda m: HunyuanMidBlockParallel(), False),
    "Attention": (lambda m: None, True),  # run by the mid-block's style
    "HunyuanVideoUpsampleCausal3D": (lambda m: HunyuanUpsampleParallel(), True),
    "HunyuanVideoCausalConv3d": (_time_rows_causal_conv, True),
    "GroupNorm": (lambda m: GroupNormParallel(), True),  # statistics over both axes
    "Conv3d": (lambda m: _pointwise(m), True),  # per slice along H too (kernel 1)
}
_MOCHI_ROWS: dict[str, _Rule] = {
    "CogVideoXCausalConv3d": (_rows_causal_conv, True),  # F.pad of H, replicate
    # per frame: (B*T, C, H, W) in its own forward, the GroupNorm's statistics over H
    "MochiChunkedGroupNorm3D": (lambda m: {"norm_layer": GroupNormParallel()}, True),
    "MochiDownBlock3D": (lambda m: MochiBlockParallel(dim=3), False),
    "MochiMidBlock3D": (lambda m: MochiBlockParallel(dim=3), False),
    "MochiUpBlock3D": (lambda m: MochiUpBlockParallel(dim=3), ("proj",)),
    "Attention": (lambda m: None, True),  # run by the block's style
    "FourierFeatures": (lambda m: LocalParallel(dim=3), True),
    "Linear": (lambda m: LocalParallel(dim=2), True),  # channels-last: H at dim 2
    "Conv3d": (_rows_pointwise, True),
}
def _cog_rows_conv(module: nn.Module) -> ParallelStyle | dict[str, ParallelStyle]:
    """CogVideoX's causal conv with H sharded: replicate mode pads H with `F.pad`
    (Mochi's), constant mode leaves H to its conv's own zero padding (its `torch.cat` of
    first frames is along T, whole here)."""
    if module.pad_mode == "replicate":
        return _rows_causal_conv(module)
    return {"conv": HaloParallel(dim=3)}


def _cog_rows_resample(module: nn.Module) -> ParallelStyle:
    """CogVideoX's samplers along H: down pads one zero row at the end, then a 3x3 conv
    of stride 2; up repeats each row twice (nearest), then a 3x3 conv with padding 1.
    Each runs unedited on a window of rows; T (their first-frame rule) is whole here."""
    conv = module.conv
    k, stride, pad = conv.kernel_size[0], conv.stride[0], conv.padding[0]
    if type(module).__name__ == "CogVideoXDownsample3D":
        if (k, stride, pad) != (3, 2, 0):
            raise HaloError(f"CogVideoXDownsample3D along H expects a 3x3 conv of stride 2 "
                            f"and no padding, got kernel {k}, stride {stride}, padding {pad}")
        stencil: Any = ConvStencil(span=3, stride=2, pad_right=1)
    else:
        if (k, stride, pad) != (3, 1, 1):
            raise HaloError(f"CogVideoXUpsample3D along H expects a 3x3 conv of stride 1 "
                            f"and padding 1, got kernel {k}, stride {stride}, padding {pad}")
        stencil = RepeatConvStencil(2, 1, pad="zeros")
    return HaloParallel(stencil, dim=3)


_COGVIDEOX_ROWS: dict[str, _Rule] = {
    "CogVideoXCausalConv3d": (_cog_rows_conv, True),
    "CogVideoXDownsample3D": (_cog_rows_resample, True),
    "CogVideoXUpsample3D": (_cog_rows_resample, True),
    "CogVideoXSpatialNorm3D": (lambda m: CogSpatialNormParallel(dim=3), True),
    "CogVideoXSafeConv3d": (_rows_pointwise, True),
    "GroupNorm": (lambda m: GroupNormParallel(dim=3), True),
}
_LTX_ROWS: dict[str, _Rule] = {
    "LTXVideoEncoder3d": (_ltx_patches_rows, False),
    "LTXVideoDecoder3d": (_ltx_decoder_rows, False),
    "LTXVideoCausalConv3d": (_rows_ltx_conv, True),
    "LTXVideoUpsampler3d": (lambda m: LTXUpsamplerParallel(dim=3), True),
    "RMSNorm": (lambda m: LocalParallel(dim=2), True),  # channels-last: H at dim 2
    "LayerNorm": (lambda m: LocalParallel(dim=2), True),
    "LTXVideoResnetBlock3d": (lambda m: _timestep_rows(m, "scale_shift_table"), False),
    "PixArtAlphaCombinedTimestepSizeEmbeddings": (lambda m: None, True),
}
_LTX_TIME_ROWS: dict[str, _Rule] = {
    "LTXVideoEncoder3d": (_ltx_patches_rows, False),
    "LTXVideoDecoder3d": (_ltx_decoder_time_rows, False),
    "LTXVideoCausalConv3d": (_ltx_causal_conv, True),  # the H halo from its conv
    "LTXVideoUpsampler3d": (lambda m: LTXUpsamplerParallel(), True),  # windows on both
    "RMSNorm": (lambda m: LocalParallel(dim=1, local_dims=(2,)), True),
    "LayerNorm": (lambda m: LocalParallel(dim=1, local_dims=(2,)), True),
    "LTXVideoResnetBlock3d": (_no_timestep, False),
    "PixArtAlphaCombinedTimestepSizeEmbeddings": (lambda m: None, True),
}
_MOCHI_TIME_ROWS: dict[str, _Rule] = {
    "MochiChunkedGroupNorm3D": (lambda m: _FrameNormParallel(), True),
    "MochiDownBlock3D": (lambda m: MochiBlockParallel(), False),  # attention along T
    "MochiMidBlock3D": (lambda m: MochiBlockParallel(), False),
    "MochiUpBlock3D": (lambda m: MochiUpBlockParallel(), ("proj",)),
    "Attention": (lambda m: None, True),  # run by the block's style
    "FourierFeatures": (lambda m: LocalParallel(local_dims=(3,)), True),
    "Linear": (lambda m: LocalParallel(dim=1, local_dims=(2,)), True),  # channels-last
    "CogVideoXCausalConv3d": (_time_rows_causal_conv, True),
    "Conv3d": (lambda m: _pointwise(m), True),  # per slice along H too (kernel 1)
}


def _family(names: tuple[str, ...], rules: dict[str, _Rule]) -> _Along:
    return dict.fromkeys(names, rules)


# ---------------------------------------------------------------- Wan 2.1 on H
def _wan_config(module: nn.Module) -> None:
    """Wan 2.1 only: Wan 2.2's patchify folds rows into channels, and its residual blocks'
    shortcuts (`AvgDown3D`, `DupUp3D`) fold them too."""
    config = module.config
    if config.patch_size is not None or config.is_residual:
        raise HaloError(f"AutoencoderKLWan with patch_size={config.patch_size}, is_residual="
                        f"{config.is_residual} (Wan 2.2) folds rows into channels; planned on "
                        "H with Wan 2.1's patch_size=None, is_residual=False only")


def _wan_rows_conv(module: nn.Module) -> ParallelStyle:
    """Wan's causal conv with H sharded: a 1x1x1 conv (shortcuts, quant convs) per row;
    any other takes its H halo, for its cached frames too."""
    if all(k == 1 for k in module.kernel_size) and not any(module._padding):
        return LocalParallel(dim=3)
    return WanCausalConvParallel()


def _wan_rows_norm(module: nn.Module) -> ParallelStyle:
    if not module.channel_first:
        raise HaloError("WanRMS_norm with channel_first=False normalizes over the last dim "
                        "(W of (B, C, T, H, W)); planned on H with channel_first=True only")
    return LocalParallel(dim=3)  # F.normalize over C: per pixel


def _wan_rows_resample(module: nn.Module) -> dict[str, ParallelStyle]:
    """`WanResample` with H sharded runs its own forward (the loop's cache protocol, its
    reshapes) on the `Shard(3)` DTensor; its `time_conv` (per pixel along T, with the
    cache) takes `WanCausalConvParallel`, and its spatial `resample` (per frame: `(B*T, C,
    H, W)`, H at dim 2) runs unedited on a window of rows. Up: nearest x2 then a 3x3 conv
    with zero padding 1 (`RepeatConvStencil`); down: one zero row at the end, then a 3x3
    conv of stride 2. The window is taken right before the spatial layers: rows beyond
    the global ends are zeros there, as the conv's own padding (the time_conv's bias
    would not keep them zero)."""
    mode, seq = module.mode, module.resample
    if mode in ("upsample2d", "upsample3d"):
        up, conv = seq[0], seq[1]
        ok = (tuple(up.scale_factor) == (2.0, 2.0) and up.mode == "nearest-exact"
              and _conv2d_is(conv, 3, 1, 1))
        stencil: Any = RepeatConvStencil(2, 1, pad="zeros")
    elif mode in ("downsample2d", "downsample3d"):
        pad, conv = seq[0], seq[1]
        ok = (isinstance(pad, nn.ZeroPad2d) and tuple(pad.padding) == (0, 1, 0, 1)
              and _conv2d_is(conv, 3, 2, 0))
        stencil = ConvStencil(span=3, stride=2, pad_right=1)
    else:
        raise HaloError(f"WanResample with mode {mode!r} is not planned on H; expected "
                        "upsample2d, upsample3d, downsample2d or downsample3d")
    if not ok:
        raise HaloError(f"WanResample ({mode}) along H expects diffusers 0.42.1's layers "
                        f"(nearest-exact x2 and a 3x3 conv of padding 1 up; ZeroPad2d((0, 1, "
                        f"0, 1)) and a 3x3 conv of stride 2 down), got {list(seq)}")
    styles: dict[str, ParallelStyle] = {"resample": HaloParallel(stencil, dim=2)}
    if mode.endswith("3d"):
        styles["time_conv"] = WanCausalConvParallel()
    return styles


def _conv2d_is(conv: nn.Module, kernel: int, stride: int, padding: int) -> bool:
    return (isinstance(conv, nn.Conv2d) and conv.padding_mode == "zeros"
            and tuple(conv.kernel_size) == (kernel, kernel) and conv.stride[0] == stride
            and conv.padding[0] == padding and conv.dilation[0] == 1)


def _wan22(module: nn.Module) -> None:
    raise HaloError(f"{type(module).__name__} (Wan 2.2's residual blocks) folds rows into "
                    "channels in its shortcut; planned on H with Wan 2.1 only")


_WAN_ROWS: dict[str, _Rule] = {
    "AutoencoderKLWan": (_wan_config, False),
    "WanCausalConv3d": (_wan_rows_conv, True),
    "WanRMS_norm": (_wan_rows_norm, True),
    "WanAttentionBlock": (lambda m: WanAttentionParallel(), True),
    "WanResample": (_wan_rows_resample, True),
    **{name: (_wan22, True) for name in ("WanResidualDownBlock", "WanResidualUpBlock",
                                         "AvgDown3D", "DupUp3D")},
}


_HUNYUAN_NAMES = ("AutoencoderKLHunyuanVideo", "HunyuanVideoEncoder3D",
                  "HunyuanVideoDecoder3D")
_MOCHI_NAMES = ("AutoencoderKLMochi", "MochiEncoder3D", "MochiDecoder3D")
_LTX_NAMES = ("AutoencoderKLLTXVideo", "LTXVideoEncoder3d", "LTXVideoDecoder3d")
_ALONG: dict[tuple[int, ...], _Along] = {
    (3,): {**_family(_HUNYUAN_NAMES, _HUNYUAN_ROWS), **_family(_LTX_NAMES, _LTX_ROWS),
           **_family(_MOCHI_NAMES, _MOCHI_ROWS),
           **_family(("AutoencoderKLCogVideoX", "CogVideoXEncoder3D", "CogVideoXDecoder3D"),
                     _COGVIDEOX_ROWS),
           **_family(_WAN_NAMES, _WAN_ROWS)},
    (2, 3): {**_family(_HUNYUAN_NAMES, _HUNYUAN_TIME_ROWS),
             **_family(_LTX_NAMES, _LTX_TIME_ROWS),
             **_family(_MOCHI_NAMES, _MOCHI_TIME_ROWS)},
}


def _check_dims(dims: Any) -> tuple[int, ...]:
    got = tuple(dims) if isinstance(dims, (tuple, list)) else None
    if got not in ((2,), (3,), (2, 3)):
        raise HaloError(f"plan_for takes dims=(2,) (T), (3,) (H) or (2, 3) (T and H on a "
                        f"(t, h) mesh), got dims={dims!r}")
    return got  # type: ignore[return-value]


def _check_wan_dims(name: str, dims: tuple[int, ...]) -> None:
    """Wan's encode and decode are chunk loops along T with a feature cache: on H they run
    unchanged; on T they are `wan_encode` / `wan_decode` with their own plans."""
    if name not in _WAN_NAMES or dims == (3,):
        return
    if dims == (2,):
        raise HaloError(f"{name}: Wan's encode and decode are chunk loops along T with a "
                        "feature cache; use wan_encoder_plan(vae) with wan_encode(vae, x), "
                        "and wan_decoder_plan(vae) with wan_decode(vae, z), to shard T, or "
                        "plan_for(vae, dims=(3,)) to shard H (the public calls unchanged)")
    raise HaloError(f"{name} cannot be planned on dims {dims}: Wan's encode and decode "
                    "loops walk T one chunk at a time, so T cannot be sharded under them; "
                    "expected dims=(3,) (H)")


def _rules_along(name: str, dims: tuple[int, ...]) -> dict[str, _Rule]:
    """The rules of `name`'s family for `dims`: the T rules, or those replacing them."""
    rules = _PLANS[name]
    if dims == (2,):
        return rules
    along = _ALONG[dims].get(name, {})
    return {**{cls: rule if rule is _PASS else along.get(cls, _refused(cls, dims))
               for cls, rule in rules.items()}, **along}


# The VAE's own switches that change how `encode` / `decode` walk T, and how to turn each off.
_FLAGS = {
    "use_tiling": "disable_tiling(): spatial tiles would each be sharded on their own",
    "use_slicing": "disable_slicing(): batch slices would each be sharded on their own",
    "use_framewise_encoding": "vae.use_framewise_encoding = False: encode() of a clip longer "
                              "than tile_sample_min_num_frames would run overlapping "
                              "temporal tiles blended at their seams, not the sharded clip",
    "use_framewise_decoding": "vae.use_framewise_decoding = False: decode() (and LTX's "
                              "encode()) of a long clip would run overlapping temporal tiles "
                              "blended at their seams, not the sharded clip",
}


def _check_flags(module: nn.Module) -> None:
    for name, off in _FLAGS.items():
        if getattr(module, name, False):
            raise HaloError(f"{type(module).__name__}.{name} is on; turn it off before "
                            f"planning ({off})")


def _refuse_unknown(fqn: str, sub: nn.Module, model: str) -> None:
    own = [n for n, _ in sub.named_parameters(recurse=False)]
    has = f"has parameters {own}" if own else "has no parameters but its own forward"
    raise HaloError(f"{fqn or '<root>'} ({type(sub).__name__}) {has}, and the {model} plan "
                    "does not know its class: a layer that reads across T would run "
                    "DTensor's default dispatch (the whole clip gathered, or an error)")


def _styles(rule: _Rule, sub: nn.Module, fqn: str) -> dict[str, ParallelStyle]:
    """The styles a rule gives `sub` (and its children, by relative fqn); its refusal
    names the layer."""
    try:
        style = rule[0](sub)
    except HaloError as e:
        if fqn and str(e).startswith(f"{fqn} "):
            raise
        raise HaloError(f"{fqn or '<root>'} ({type(sub).__name__}): {e}") from None
    if isinstance(style, dict):
        return style
    return {} if style is None else {"": style}


def plan_for(module: nn.Module, *, dims: tuple[int, ...] = (2,)
             ) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of a diffusers video VAE, encoder or decoder.

    Every module is checked by class, with or without parameters: a class the plan knows
    gets its style, runs inside one, or is known to act per frame (containers,
    activations); any other is refused, since its own forward may read across T. The
    VAE's switches that change how `encode` / `decode` walk T (tiling, slicing, framewise
    encoding or decoding: HunyuanVideo's default) must be off. An `.encoder` or `.decoder`
    planned alone is for calling directly: only `plan_for(vae)` sees those switches.

    `dims` picks the sharded dims of `(B, C, T, H, W)`: `(2,)` T (every model but Wan,
    whose T plans are `wan_encoder_plan` / `wan_decoder_plan`); `(3,)` H (HunyuanVideo,
    CogVideoX and Wan 2.1 through their public `encode` / `decode`, whose frame loops and
    caches run unchanged on each rank's rows; Mochi; LTX-Video with `patch_size=1`),
    applied on a 1-D mesh with the input `Shard(3)`; `(2, 3)` T and H at once
    (HunyuanVideo, Mochi, LTX-Video with `patch_size=1` and no timestep conditioning),
    applied on the `t` axis of a `(t, h)` mesh (`parallelize_module(vae, mesh["t"],
    plan)`) with the input `[Shard(2), Shard(3)]`. A layer that cannot be sharded on `dims`
    raises `HaloError` naming it and the dims when the plan is built (on T and H:
    CogVideoX's layers; Wan, whose loops walk T; Wan 2.2's residual blocks on H).

    Args:
        module: `AutoencoderKLHunyuanVideo`, `AutoencoderKLCogVideoX`, `AutoencoderKLMochi`,
            `AutoencoderKLLTXVideo` or `AutoencoderKLWan`, or its `.encoder` / `.decoder`.
        dims: `(2,)`, `(3,)` or `(2, 3)`.

    Returns:
        `{fqn: style}` for every layer that needs one, relative to `module`.

    Raises:
        HaloError: for an unsupported class, a switch that is on (named, with how to turn
            it off), a layer the plan does not know (named by fqn), other `dims`, or a
            layer that cannot be sharded on `dims` (named by fqn).

    Example::
        plan = plan_for(vae.decoder)
        parallelize_module(vae.decoder, mesh, plan)
        vae.decoder(distribute_tensor(z, mesh, [Shard(2)])).shape  # z: (1, 16, 5, 8, 8)
        # torch.Size([1, 3, 17, 64, 64])

        parallelize_module(wan, mesh, plan_for(wan, dims=(3,)))  # Wan 2.1, on H
        wan.decode(distribute_tensor(z, mesh, [Shard(3)])).sample.placements  # (Shard(3),)
    """
    dims = _check_dims(dims)
    rules = _PLANS.get(type(module).__name__)
    _check_wan_dims(type(module).__name__, dims)
    if rules is None:
        raise HaloError(f"no haloshard plan for {type(module).__name__}; supported: "
                        f"{sorted(_PLANS)} (diffusers=={DIFFUSERS_VERSION})")
    _check_flags(module)
    rules = _rules_along(type(module).__name__, dims)
    plan: dict[str, ParallelStyle] = {}
    covered: list[str] = []
    for fqn, sub in module.named_modules():
        if any(fqn == c or fqn.startswith(f"{c}.") for c in covered):
            continue
        rule = rules.get(type(sub).__name__)
        if rule is None:
            _refuse_unknown(fqn, sub, type(module).__name__)
            continue
        for name, style in _styles(rule, sub, fqn).items():
            plan[".".join(n for n in (fqn, name) if n)] = style
        if rule[1] is True:
            covered.append(fqn)
        elif rule[1]:  # names of children the style runs itself
            covered.extend(f"{fqn}.{child}" for child in rule[1])
    # The public `encode` chunks its moments (`DiagonalGaussianDistribution`): the backward
    # of that chunk needs haloshard's zero fill of unused view outputs, which a plan that
    # builds no HaloShard (CogVideoX on H) would otherwise run without.
    _dtensor_ops.install()
    return plan
