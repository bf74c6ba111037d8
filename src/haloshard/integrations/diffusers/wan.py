"""Wan 2.1's video VAE (diffusers' `AutoencoderKLWan`) with T sharded, exactly as
`vae._encode` and `vae._decode` compute it on one device.

`_encode` is not one call: it runs the encoder on frame 0, then on chunks of 4 frames, with a
feature cache per causal conv (the last frames of its input) carried from chunk to chunk. For
the causal convs that is the same as one call over the whole clip (each pads 2 zero frames at
frame 0 only), but the temporal downsampling (`WanResample`, mode `downsample3d`) happens only
on the cached path: a call without a cache skips it. On the cached path it keeps frame 0 and
maps frames `2m-2, 2m-1, 2m` to output m (a stride-2 conv that reads the previous chunk's last
frame from the cache): the "keep the first frame, resample the rest" rule, with one frame of
context before each pair.

So with T sharded each rank runs one call over its frames, every causal conv with its halo
(`HaloShard(2, left=2)`), and every `downsample3d` through `FirstFrameParallel(2, "down")`
whose window already holds that context frame; on its window the module runs its own forward
twice, with its own cache protocol: on the window's first frame alone (which fills the cache),
then on the rest. Outputs equal `vae._encode(x)`'s shard, forward and backward.

`_decode` is a loop over single latent frames with the same caches. Its temporal upsampler
(`WanResample`, mode `upsample3d`) marks its cache "Rep" at frame 0, which it upsamples
spatially only; every later frame goes through a causal conv (`time_conv`, kernel 3) whose
zero history starts at frame 1, so frame 0 is never that conv's context, and each conv
output becomes 2 frames: `1 + 2 (T - 1)` outputs. The window rule `CachedUpStencil` starts
each window at frame 0, or early enough that the window's own first frame (run alone, as
the loop runs frame 0) and the conv's 2 frames of history are real frames of the window, so
no kept output reads the window's zero history.

With H sharded instead (`plan_for(vae, dims=(3,))`), every rank runs the model's own loops
(`vae.encode`, `vae.decode`, unchanged) on its rows: T is whole on every rank, so the chunk
loops, their feature caches (holding `Shard(3)` DTensors: this rank's rows of the cached
frames) and the temporal resampling run as on one device. Three layers read across rows:
`WanCausalConv3d` (its `F.pad` of H, centred zeros) takes its H halo for the cached frames
and its input at once (`WanCausalConvParallel`); `WanAttentionBlock` attends over every
H*W token of each frame, with K and V gathered along H (`WanAttentionParallel`); a
`WanResample`'s spatial layers (per frame) run on a window of rows (the plan's stencils,
in `haloshard.integrations.diffusers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard._annotation import resolve
from haloshard._attention import gather_many, sdpa
from haloshard._compat import enabled_local_tensor_mode
from haloshard._errors import HaloError
from haloshard._exchange import Reuse
from haloshard._forward import ShardedForward, install, names_errors
from haloshard._halo_forward import HaloForward, halo_window
from haloshard._layer_styles import (
    FirstFrameParallel,
    LocalParallel,
)
from haloshard._layout import HaloShard, PadMode, lack, shard_sizes
from haloshard._site import Site, dtensor_site, rewrap, site_of
from haloshard._specs import ConvStencil, WindowPlan
from haloshard._styles import HaloParallel
from haloshard.integrations.diffusers._base import Rule, passing
from haloshard.integrations.diffusers._rows import FastConv3d, rows_site, rows_window
from haloshard.integrations.diffusers.stencils import RepeatConvStencil


def cached_resample(forward: Any, window: torch.Tensor) -> torch.Tensor:
    """Run a `WanResample` on a window as the chunk loops would: its first frame alone with
    an empty cache, then the rest with that cache. Down (`_encode`): the first frame is
    kept as is and cached, the rest go through a stride-2 conv over the cached frame and
    them. Up (`_decode`): the first frame is upsampled spatially only (the cache marked
    "Rep"), the rest through a causal `time_conv` with zero history."""
    cache: list[Any] = [None]
    first = forward(window.narrow(2, 0, 1), feat_cache=cache, feat_idx=[0])
    rest = window.shape[2] - 1
    if rest == 0:
        return first
    return torch.cat([first, forward(window.narrow(2, 1, rest), feat_cache=cache,
                                     feat_idx=[0])], dim=2)


@dataclass(frozen=True)
class CachedUpStencil:
    """Frame 0 gives one output and is no other's context; frames 1.. go through a causal
    conv of `span` frames (zero history before frame 1), each conv output becoming `factor`
    frames: output length `1 + (T - 1) * factor` (Wan's temporal upsampler on `_decode`).

    A window from input i0 >= 1 runs like one from frame 0: its first frame yields one
    (dropped) output and its next `span - 1` frames are history; so the window starts
    `span` frames before its first wanted input, or at frame 0.

    Example::
        >>> CachedUpStencil(2, 3).window(9, 13)  # outputs 9..12 come from inputs 5..6
        (2, 7, 5)
    """

    factor: int
    span: int
    pad: PadMode = "zeros"  # never read: windows stay inside [0, T)
    fill: float | None = None
    min_input: int = 1

    def __post_init__(self) -> None:
        if self.factor < 1 or self.span < 1:
            raise HaloError(f"CachedUpStencil needs factor >= 1 and span >= 1, got "
                            f"factor={self.factor}, span={self.span}")

    def out_length(self, length: int) -> int:
        return 0 if length <= 0 else 1 + (length - 1) * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        first = 0 if start == 0 else (start - 1) // f + 1  # the input of output `start`
        i0 = max(0, first - self.span)
        i1 = 1 if stop == 1 else (stop - 2) // f + 2
        return i0, i1, start - i0 * f


def _check_vae(vae: nn.Module) -> None:
    from diffusers import AutoencoderKLWan

    if not isinstance(vae, AutoencoderKLWan):
        raise HaloError(f"expected diffusers' AutoencoderKLWan, got {type(vae).__name__}")
    config = vae.config
    if config.patch_size is not None or config.is_residual:
        raise HaloError(f"the Wan 2.1 VAE is supported (patch_size=None, is_residual="
                        f"False), got patch_size={config.patch_size}, is_residual="
                        f"{config.is_residual} (Wan 2.2's residual down blocks)")


def wan_encoder_plan(vae: nn.Module) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan that makes `wan_encode(vae, x)` equal `vae._encode(x)`
    with T sharded: causal convs get their 2-frame halo, temporal downsamplers run their
    cached path on first-frame windows, per-frame layers (RMS norms, the mid-block's
    per-frame attention, spatial downsamplers, kernel-1 convs) run on the local frames.

    Raises:
        HaloError: for a model that is not Wan 2.1's `AutoencoderKLWan`.

    Example::
        parallelize_module(vae, mesh, wan_encoder_plan(vae))
        wan_encode(vae, distribute_tensor(video, mesh, [Shard(2)])).placements  # Shard(2)
    """
    _check_vae(vae)
    return {"quant_conv": LocalParallel(), **_plan(vae.encoder, "encoder")}


def wan_decoder_plan(vae: nn.Module) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan that makes `wan_decode(vae, z)` equal
    `vae._decode(z).sample` with T sharded: causal convs get their 2-frame halo, temporal
    upsamplers run their cached path on `CachedUpStencil` windows, per-frame layers run on
    the local frames.

    Raises:
        HaloError: for a model that is not Wan 2.1's `AutoencoderKLWan`.

    Example::
        parallelize_module(vae, mesh, wan_decoder_plan(vae))
        wan_decode(vae, distribute_tensor(z, mesh, [Shard(2)])).shape[2]  # z: T = 5; 17
    """
    _check_vae(vae)
    return {"post_quant_conv": LocalParallel(), **_plan(vae.decoder, "decoder")}


def _plan(part: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
        WanRMS_norm,
    )

    plan: dict[str, ParallelStyle] = {}
    inside: list[str] = []  # per-frame blocks run whole: their own layers take no entry
    for fqn, module in part.named_modules(prefix=prefix):
        if any(fqn.startswith(f"{outer}.") for outer in inside):
            continue
        if isinstance(module, WanCausalConv3d) and module.kernel_size[0] > 1:
            plan[fqn] = HaloParallel(HaloShard(2, left=module.kernel_size[0] - 1))
        elif isinstance(module, WanCausalConv3d | WanRMS_norm):
            plan[fqn] = LocalParallel()
        elif isinstance(module, WanAttentionBlock):
            plan[fqn], inside = LocalParallel(), [*inside, fqn]
        elif isinstance(module, WanResample):
            plan[fqn] = _resample_style(module)
            inside.append(fqn)
    return plan


def _resample_style(module: nn.Module) -> ParallelStyle:
    if module.mode == "downsample3d":
        return FirstFrameParallel(2, "down", even="first", local=cached_resample)
    if module.mode == "upsample3d":
        span = module.time_conv.kernel_size[0]
        return HaloParallel(CachedUpStencil(2, span), local=cached_resample)
    return LocalParallel()


def wan_encode(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`vae._encode(x)` (the moments before sampling) of a parallelized Wan VAE on a
    `Shard(2)` input: one call over each rank's frames, exactly what the chunk loop gives.

    Raises:
        HaloError: when T is not 1 + 4n (what `_encode`'s chunks of 1 + 4 + 4 ... frames
            need), or for a model `wan_encoder_plan` does not cover.
    """
    _check_vae(vae)
    length = x.shape[2]
    if length % 4 != 1:
        raise HaloError(f"Wan encodes 1 + 4n frames (a first frame, then chunks of 4), got "
                        f"T={length}; expected T % 4 == 1")
    return vae.quant_conv(vae.encoder(x))


def wan_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae._decode(z).sample` (the clamped video) of a parallelized Wan VAE on a `Shard(2)`
    latent: one call over each rank's frames, exactly what the frame-by-frame loop gives.

    Raises:
        HaloError: for a model `wan_decoder_plan` does not cover.
    """
    _check_vae(vae)
    y = vae.decoder(vae.post_quant_conv(z))
    if not isinstance(y, DTensor):
        return torch.clamp(y, min=-1.0, max=1.0)
    # elementwise, so on the local chunk: DTensor's own dispatch would hash per-rank strides
    # under simulated ranks
    return DTensor.from_local(torch.clamp(y.to_local(), min=-1.0, max=1.0), y.device_mesh,
                              y.placements, run_check=False, shape=y.shape, stride=y.stride())


# ---------------------------------------------------------------- H sharded: the model's loops
class _CachedRowsForward(HaloForward):
    """`WanCausalConv3d.forward(x, cache_x)` with H sharded: the cached frames (this rank's
    rows) take the same H halo as x, and the module's own forward runs on both windows (its
    `torch.cat` of cache and input along T, its `F.pad` of T and W; the `F.pad` of H
    dropped, the halo holds it)."""

    def sharded(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> Any:
        # the module reads its cache only where it pads T (`_padding[4]`, its own rule)
        if cache_x is None or self.module._padding[4] == 0:
            cache_x = None
        site = rows_site(x, (cache_x,), self.annotation.stencil)
        if site is not None and (cache_x is None
                                 or cache_x.shape[2] <= self.module._padding[4]):
            return self.in_one_window(site, cache_x)
        return super().sharded(x) if cache_x is None else super().sharded(x, cache_x)

    def in_one_window(self, site: Site, cache_x: torch.Tensor | None) -> Any:
        """Inference on real ranks: the module's zero frames before T, its cached frames
        and its input written into one window of rows (W padded in it too), the conv run
        on it; the module's `torch.cat`, its `F.pad` and the exchanged windows were three
        buffers of the chunk's size."""
        m = self.module
        w_left, w_right, _, _, t_left, _ = m._padding
        frames: list[Any] = [site.local]
        if cache_x is not None:
            frames.insert(0, cache_x.to_local())
            t_left -= cache_x.shape[2]
        buf, _, plan = rows_window(site, self.annotation.stencil, [t_left, *frames],
                                   self.agreed, w_pad=(w_left, w_right))
        del frames
        with FastConv3d():  # the module's conv after its `F.pad`: no padding of its own
            y = nn.Conv3d.forward(m, buf)
        return rewrap(y, site, 3, plan.out_length)

    def exchange_first(self, site: Site, plan: WindowPlan, reuse: Reuse, *args: Any,
                       **kwargs: Any) -> Any:
        if not args:
            return super().exchange_first(site, plan, reuse)
        # the cache's rows are x's: the same windows, agreed under a key of their own
        cached = site_of(args[0], self.dim, self.mesh)
        store, _, signature = self.reuse(cached)
        window = halo_window(cached, plan, self.annotation, (store, "cache", signature))
        return super().exchange_first(site, plan, reuse, window)

    def original(self, *args: Any, **kwargs: Any) -> Any:
        with FastConv3d():
            return super().original(*args, **kwargs)


class WanCausalConvParallel(ParallelStyle):
    """Wan's `WanCausalConv3d` with H sharded (dim 3), called as its loops call it: `conv(x)`
    or `conv(x, cache_x)` with the feature cache's last frames (`Shard(3)` DTensors both).

    The module concatenates its cached frames before its input along T, pads W, H
    (centred, zeros) and T (causal, zeros, less the cached frames) with one `F.pad`, then
    convolves with no padding of its own. Here its input and its cached frames each take
    the H halo of `(k_H - 1) // 2` rows per side (zeros beyond the global ends), and the
    module's own forward runs on the two windows with its `F.pad` of H dropped: exact,
    forward and backward, uneven and empty shards included. A conv3d that torch would run
    on its slow path for the window runs tap by tap along T (`_FastConv3d`).

    Raises:
        HaloError: in `_apply` for another class, a dim other than 3, or a conv whose H
            padding is not `(k_H - 1) // 2` zeros on each side with stride and dilation 1
            along H.
    """

    def __init__(self, *, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"WanCausalConvParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_rows_class(module, "WanCausalConv3d", "WanCausalConvParallel", self.dim)
        k, pads = module.kernel_size[1], tuple(module._padding[2:4])
        if (module.stride[1], module.dilation[1]) != (1, 1) or pads != ((k - 1) // 2,) * 2 \
                or k % 2 == 0:
            raise HaloError(f"WanCausalConvParallel expects an odd kernel along H padded by "
                            f"(k - 1) // 2 on each side, stride and dilation 1, got kernel "
                            f"{k}, H padding {pads}, stride {module.stride[1]}, dilation "
                            f"{module.dilation[1]}")
        spec = HaloShard(3, left=pads[0], right=pads[1], pad="zeros")
        install(module, HaloForward.of(module, resolve(module, spec, dim=3), device_mesh))
        base = module.forward
        assert isinstance(base, HaloForward)
        module.forward = _CachedRowsForward(  # the handle restores base.previous
            module, base.annotation, base.mesh, base.saved, base.previous, overlap=False,
            name=base.name)
        return module


def _check_rows_class(module: nn.Module, name: str, style: str, dim: int) -> None:
    if type(module).__name__ != name:
        raise HaloError(f"{style} applies to diffusers' {name}, got {type(module).__name__}")
    if dim != 3:
        raise HaloError(f"{style} shards H (dim 3 of (B, C, T, H, W)), got dim={dim}; "
                        "expected dim=3 (along T, Wan runs wan_encode / wan_decode)")


class _AttentionRowsForward(ShardedForward):
    """`WanAttentionBlock.forward` on a `Shard(3)` DTensor: per frame, this rank's rows'
    queries over the keys and values of every row (gathered along H)."""

    def fresh(self) -> None:
        # K/V gathers agreed by global signature: later calls issue no metadata collective
        self.agreed: dict[Any, Any] = {}

    def sharded(self, x: torch.Tensor) -> DTensor:
        if not isinstance(x, DTensor):
            raise HaloError(f"WanAttentionParallel needs a Shard(3) DTensor input, got "
                            f"{type(x).__name__}")
        m, site = self.module, dtensor_site(x, 3)
        local = site.local
        b, c, t, n, w = local.shape
        rows = n
        if enabled_local_tensor_mode() is not None:
            # simulated ranks: every chunk padded to the longest (the reshapes below take
            # no per-rank length); the padding rows' outputs are dropped
            rows = shard_sizes(site.length, site.mesh.size(site.axis))[0]
        elif n == 0:
            rows = 1  # a rank without rows runs one zero row (its convs refuse none)
        y = F.pad(local, (0, 0, 0, lack(n, rows)))
        y = m.norm(y.permute(0, 2, 1, 3, 4).reshape(b * t, c, rows, w))  # per pixel
        # (B*T, 1, rows, W, 3C): the block's single head, tokens row by row
        q, k, v = m.to_qkv(y).movedim(1, -1).unsqueeze(1).chunk(3, dim=-1)
        key = (site.shape, site.placements, id(site.mesh), x.dtype, x.requires_grad,
               torch.is_grad_enabled())
        k, v = gather_many(tuple(t_.narrow(2, 0, n).contiguous() for t_ in (k, v)), 2,
                           (site.mesh, site.axis), global_length=site.length,
                           reuse=(self.agreed, key))
        o = sdpa(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), None)  # (B*T, 1, N, C)
        o = m.proj(o.squeeze(1).transpose(1, 2).reshape(b * t, c, rows, w))
        o = o.view(b, t, c, rows, w).permute(0, 2, 1, 3, 4).narrow(3, 0, n)
        return rewrap(o + local, site, 3, site.length)


class WanAttentionParallel(ParallelStyle):
    """Wan's `WanAttentionBlock` with H sharded (dim 3): each frame attends over its H*W
    tokens (one head, no mask); this rank's rows' queries run against the keys and values
    of every row, all-gathered along H. The block's norm (per pixel over C), its 1x1
    `to_qkv` and `proj` run on this rank's rows, as the block's own forward uses them.
    Exact, forward and backward (the gather's backward reduce-scatters dK and dV); memory:
    every rank holds one chunk's full K and V (`2 * B * T * H * W * C`).

    Raises:
        HaloError: in `_apply` for another class or a dim other than 3; at run time for a
            plain tensor input.
    """

    def __init__(self, *, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"WanAttentionParallel(dim={self.dim})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_rows_class(module, "WanAttentionBlock", "WanAttentionParallel", self.dim)
        install(module, _AttentionRowsForward(module, 3, device_mesh))
        return module

WAN_NAMES = ("AutoencoderKLWan", "WanEncoder3d", "WanDecoder3d")
# the loops' containers: each calls its children with the feature cache and adds residuals
WAN_RULES: dict[str, Rule] = {
    **passing("WanEncoder3d", "WanDecoder3d", "WanResidualBlock", "WanMidBlock",
               "WanUpBlock")}


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


WAN_ROWS: dict[str, Rule] = {
    "AutoencoderKLWan": (_wan_config, False),
    "WanCausalConv3d": (_wan_rows_conv, True),
    "WanRMS_norm": (_wan_rows_norm, True),
    "WanAttentionBlock": (lambda m: WanAttentionParallel(), True),
    "WanResample": (_wan_rows_resample, True),
    **{name: (_wan22, True) for name in ("WanResidualDownBlock", "WanResidualUpBlock",
                                         "AvgDown3D", "DupUp3D")},
}


def check_wan_dims(name: str, dims: tuple[int, ...]) -> None:
    """Wan's encode and decode are chunk loops along T with a feature cache: on H they run
    unchanged; on T they are `wan_encode` / `wan_decode` with their own plans."""
    if name not in WAN_NAMES or dims == (3,):
        return
    if dims == (2,):
        raise HaloError(f"{name}: Wan's encode and decode are chunk loops along T with a "
                        "feature cache; use wan_encoder_plan(vae) with wan_encode(vae, x), "
                        "and wan_decoder_plan(vae) with wan_decode(vae, z), to shard T, or "
                        "plan_for(vae, dims=(3,)) to shard H (the public calls unchanged)")
    raise HaloError(f"{name} cannot be planned on dims {dims}: Wan's encode and decode "
                    "loops walk T one chunk at a time, so T cannot be sharded under them; "
                    "expected dims=(3,) (H)")
