"""CogVideoX's VAE (diffusers' `AutoencoderKLCogVideoX`) with T sharded, exactly as
`vae._encode` and `vae._decode` compute it on one device.

Neither calls its encoder or decoder once: `_encode` loops over batches of 8 frames (the
first batch takes the remainder), `_decode` over batches of 2 latent frames, each call
carrying a conv cache to the next. For the causal convs that is one call over the clip; the
resamplers keep the parity one call sees; but every GroupNorm (and the decoder's spatial
norm) takes its statistics over one batch. With T sharded, one call over each rank's frames
under `haloshard.frame_batches` does the same: each norm normalises each batch alone, from
statistics all-gathered per batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard import _segments
from haloshard._attention import gather_many
from haloshard._compat import enabled_local_tensor_mode, maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._forward import (
    ShardedForward,
    install,
    names_errors,
)
from haloshard._layer_styles import (
    FirstFrameParallel,
    GroupNormParallel,
    LocalParallel,
)
from haloshard._layout import shard_size_and_offset, shard_sizes
from haloshard._norms import group_norm
from haloshard._segments import frame_batches
from haloshard._site import dtensor_site, rewrap
from haloshard._specs import ConvStencil
from haloshard._styles import HaloParallel
from haloshard.integrations.diffusers._base import (
    DimStyle,
    Rule,
    agreements_of,
    check_class,
    check_time_dim,
    cog_causal_conv,
    passing,
    pointwise,
    rows_causal_conv,
    rows_pointwise,
)
from haloshard.integrations.diffusers._rows import (
    FastConv3d,
    apply_rows_conv,
    rows_site,
    rows_window,
)
from haloshard.integrations.diffusers.stencils import RepeatConvStencil


def _batches(length: int, size: int) -> tuple[int, ...]:
    """The frame batches of diffusers' loop: `length // size` batches (at least one), the
    first with the remainder.

    Example::
        >>> _batches(25, 8), _batches(5, 8)
        ((9, 8, 8), (5,))
    """
    count = max(length // size, 1)
    return (length - size * (count - 1), *([size] * (count - 1)))


def _check_vae(vae: nn.Module) -> None:
    if type(vae).__name__ != "AutoencoderKLCogVideoX":
        raise HaloError(f"expected diffusers' AutoencoderKLCogVideoX, got {type(vae).__name__}")
    if getattr(vae, "use_tiling", False):
        raise HaloError("AutoencoderKLCogVideoX.use_tiling is on; disable it (tiles would be "
                        "sharded twice)")


def cogvideox_encode(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`vae._encode(x)` (the moments before sampling) of a CogVideoX VAE parallelized with
    `plan_for(vae)`, on a `Shard(2)` input: its loop over frame batches in one call.

    Raises:
        HaloError: for another model, or tiling on.

    Example::
        parallelize_module(vae, mesh, plan_for(vae))
        cogvideox_encode(vae, distribute_tensor(video, mesh, [Shard(2)])).shape[2]  # 7
    """
    _check_vae(vae)
    with frame_batches(_batches(x.shape[2], vae.num_sample_frames_batch_size)):
        h = vae.encoder(x)[0]
        return h if vae.quant_conv is None else vae.quant_conv(h)


def cogvideox_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae._decode(z).sample` of a CogVideoX VAE parallelized with `plan_for(vae)`, on a
    `Shard(2)` latent: its loop over latent frame batches in one call.

    Raises:
        HaloError: for another model, or tiling on.
    """
    _check_vae(vae)
    with frame_batches(_batches(z.shape[2], vae.num_latent_frames_batch_size)):
        if vae.post_quant_conv is not None:
            z = vae.post_quant_conv(z)
        return vae.decoder(z)[0]



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
                               reuse=agreements_of(m, z_site))
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
                               reuse=agreements_of(m, z_site))
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


class CogSpatialNormParallel(DimStyle):
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

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "CogVideoXSpatialNorm3D", "CogSpatialNormParallel")
        if self.dim != 3:  # H: zq gathered along H, resized, this rank's rows
            check_time_dim(self.dim, "CogSpatialNormParallel")
        for name in ("conv_y", "conv_b"):
            conv = getattr(module, name).conv
            if (tuple(conv.kernel_size) != (1, 1, 1) or tuple(conv.stride) != (1, 1, 1)
                    or getattr(module, name).time_kernel_size != 1):
                raise HaloError(f"CogSpatialNormParallel expects 1x1x1 convs, {name} has "
                                f"kernel {conv.kernel_size}, stride {conv.stride}")
        install(module, _SpatialNormForward(module, self.dim))
        return module


def _cog_resample(module: nn.Module) -> ParallelStyle:
    # an even T: pairs pooled from frame 0 / every frame repeated; odd: the first frame kept
    if not module.compress_time:
        return LocalParallel()
    down = type(module).__name__ == "CogVideoXDownsample3D"
    return FirstFrameParallel(2, "down" if down else "up", even="all")


COGVIDEOX_RULES: dict[str, Rule] = {
    **passing("AutoencoderKLCogVideoX", "CogVideoXEncoder3D", "CogVideoXDecoder3D",
               "CogVideoXDownBlock3D", "CogVideoXUpBlock3D", "CogVideoXMidBlock3D",
               "CogVideoXResnetBlock3D"),
    "CogVideoXCausalConv3d": (cog_causal_conv, True),
    "CogVideoXDownsample3D": (_cog_resample, True),
    "CogVideoXUpsample3D": (_cog_resample, True),
    "CogVideoXSpatialNorm3D": (lambda m: CogSpatialNormParallel(), True),
    "CogVideoXSafeConv3d": (lambda m: pointwise(m), True),  # 1x1 shortcut, quant convs
    "GroupNorm": (lambda m: GroupNormParallel(), True),
}
def _cog_rows_conv(module: nn.Module) -> ParallelStyle:
    """CogVideoX's causal conv with H sharded: replicate mode pads H with `F.pad`
    (Mochi's), constant mode leaves H to its conv's own zero padding (its `torch.cat` of
    first frames is along T, whole here)."""
    if module.pad_mode == "replicate":
        return rows_causal_conv(module)
    return CogRowsCausalParallel(dim=3)


class CogRowsCausalParallel(DimStyle):
    """`CogVideoXCausalConv3d` in constant mode (CogVideoX's own) with H sharded: its conv
    takes the H halo (`HaloParallel(dim=3)`), its `torch.cat` of cached frames along T
    runs as the module's.

    In inference on real ranks the wrapper's forward runs here instead: its cached frames
    (or its first frame, `k - 1` times) and its input are written straight into the
    conv's window of rows, whose halo rows the exchange then fills, and the conv runs on
    that window (its H padding dropped, the halo holds it). The module's `torch.cat` and
    the conv's window were two buffers of the chunk's size, live at once when the conv
    starts (CogVideoX's encode on H peaked there at 1.18 of one device's share); one is
    left. Its conv cache is the module's: the last `k - 1` frames of its cat, this rank's
    rows. Training and simulated ranks run the module's own forward.

    Raises:
        HaloError: in `_apply` for another class, a dim other than 3, a replicate-mode
            conv, or a conv that pads H otherwise than by `(k_H - 1) // 2` zeros each
            side (padding_mode "zeros") with stride and dilation 1 along H.
    """

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "CogVideoXCausalConv3d", "CogRowsCausalParallel")
        return apply_rows_conv(module, device_mesh, self.dim, "CogRowsCausalParallel",
                               _RowsCausalForward(module, 3, device_mesh),
                               mode=module.pad_mode)


class _RowsCausalForward(ShardedForward):
    """`CogVideoXCausalConv3d.forward(inputs, conv_cache)` (constant mode) on a `Shard(3)`
    DTensor: the cat of cached frames and input built in the conv's window of rows."""

    def fresh(self) -> None:
        self.agreed: dict[Any, Any] = {}

    def sharded(self, inputs: torch.Tensor, conv_cache: torch.Tensor | None = None) -> Any:
        m = self.module
        stencil = m.conv.forward.annotation.stencil  # the conv's HaloForward: its H halo
        site = rows_site(inputs, (conv_cache,), stencil) if m.time_kernel_size > 1 else None
        if site is None:
            return self.original(inputs, conv_cache)
        k1, x = m.time_kernel_size - 1, site.local
        cached = x[:, :, :1].expand(-1, -1, k1, -1, -1) if conv_cache is None \
            else conv_cache.to_local()
        buf, rows, plan = rows_window(site, stencil, [cached, x], self.agreed)
        del x, cached
        cache = rewrap(rows[:, :, -k1:].clone(), site, 3, site.length)
        # the class's own forward (CogVideoXSafeConv3d's chunking) with its H padding
        # dropped while the halo is installed
        with FastConv3d():
            y = type(m.conv).forward(m.conv, buf)
        return rewrap(y, site, 3, plan.out_length), cache


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


COGVIDEOX_ROWS: dict[str, Rule] = {
    "CogVideoXCausalConv3d": (_cog_rows_conv, True),
    "CogVideoXDownsample3D": (_cog_rows_resample, True),
    "CogVideoXUpsample3D": (_cog_rows_resample, True),
    "CogVideoXSpatialNorm3D": (lambda m: CogSpatialNormParallel(dim=3), True),
    "CogVideoXSafeConv3d": (rows_pointwise, True),
    "GroupNorm": (lambda m: GroupNormParallel(dim=3), True),
}
