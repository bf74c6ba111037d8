"""HunyuanVideo's VAE: its upsampler and block-causal mid-block styles, and its plan rules
on T, H, and T and H.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from haloshard import _comm
from haloshard._annotation import Annotation
from haloshard._attention import gather_many
from haloshard._compat import enabled_local_tensor_mode, maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._forward import (
    ShardedForward,
    install,
    names_errors,
)
from haloshard._halo_forward import HaloForward, halo_windows
from haloshard._layer_styles import GroupNormParallel
from haloshard._layout import lack, shard_size_and_offset, shard_sizes
from haloshard._masked_attention import frame_attention
from haloshard._norms import group_norm
from haloshard._site import Site, dtensor_site, has_spare, pick, rewrap, site_of
from haloshard._specs import WindowPlan, plan_windows
from haloshard.integrations.diffusers._base import (
    DimStyle,
    Rule,
    agreements_of,
    also_rows,
    causal_conv,
    check_class,
    check_time_dim,
    passing,
    pointwise,
    rows_causal_conv,
    rows_pointwise,
    time_rows_causal_conv,
)
from haloshard.integrations.diffusers.stencils import RepeatConvStencil, UpCausalStencil


class HunyuanUpsampleParallel(DimStyle):
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

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "HunyuanVideoUpsampleCausal3D", "HunyuanUpsampleParallel")
        if self.dim == 3:
            install(module, HaloForward.of(module, Annotation(None, 3, _hunyuan_rows(module)),
                                           device_mesh))
            if _direct_upsample(module) and module.conv.time_causal_padding[5] == 0:
                _direct_forward(module, _RowsUpsampleForward)
            return module
        check_time_dim(self.dim, "HunyuanUpsampleParallel")
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
        also_rows(module, _hunyuan_rows)
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


class _IndexedUpsample(HaloForward):
    """What both upsampler forwards below share: the input's site, its window plan and the
    exchanged window (each sharded dim's halo in turn), handed to `indexed` (with whether
    the ranks are simulated: then every rank runs the longest chunk's window); the module's
    own window path runs instead when `indexes` refuses the input's sharded dims, arguments
    come besides the input, an enclosing block left spare slices, or a rank has no
    outputs."""

    def sharded(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        site = site_of(x, self.annotation.dim, self.mesh, several=True)
        steps = [(site.axis, site.dim, self.annotation.stencil),
                 *((a, d, self.stencils.get(d)) for a, d in site.others)]
        if (args or kwargs or has_spare(site.spare) or not self.indexes(site)
                or any(st is None or min(shard_sizes(st.out_length(site.shape[d]),
                                                     site.mesh.size(a))) == 0
                       for a, d, st in steps)):
            return super().sharded(x, *args, **kwargs)
        uniform, reuse = enabled_local_tensor_mode() is not None, self.reuse(site)
        plans = [(a, d, plan_windows(st, site.shape[d], site.mesh.size(a), uniform=uniform))
                 for a, d, st in steps]
        # handed over in a list `indexed` empties: the window is freed once gathered from,
        # not held by this frame through the conv
        taken = [halo_windows(site, plans, [st for _, _, st in steps], reuse)]
        return self.indexed(site, plans, taken, uniform)

    def indexes(self, site: Site) -> bool:
        """Whether `indexed` computes this input's outputs: one sharded dim."""
        return not site.others

    def indexed(self, site: Site, plans: list[tuple[int, int, WindowPlan]],
                window: list[torch.Tensor], uniform: bool) -> Any:
        raise NotImplementedError


def _own(y: torch.Tensor, site: Site, plans: list[tuple[int, int, WindowPlan]],
         uniform: bool) -> Any:
    """An indexed upsampler's output, exactly this rank's: simulated ranks computed the
    longest chunk's along each dim and keep their own; a DTensor with the global output
    lengths of every sharded dim."""
    shape = list(site.shape)
    for axis, d, plan in plans:
        if uniform:
            y = y.narrow(d, 0, pick(site.mesh.get_local_rank(axis), plan.out_len)[0])
        shape[d] = plan.out_length
    return rewrap(y, replace(site, shape=tuple(shape)), site.dim, shape[site.dim])


class _UpsampleForward(_IndexedUpsample):
    """`HunyuanVideoUpsampleCausal3D` on `Shard(T)` without running its forward on a
    window: the up-frames this rank's outputs read (its `span - 1` frames of history
    included, replicate-padded on H and W) are gathered from the exchanged input window in
    one index, then its conv runs on them with no padding. The module's own forward on a
    window builds the repeated frames, their concatenation and a padded copy, each for up
    to `span + factor - 1` more frames than this rank outputs, then drops those outputs.
    With H sharded as well (T and H), the up-rows come from the rows' window as on H alone
    (`_RowsUpsampleForward`); a rank without outputs takes the window path."""

    def indexes(self, site: Site) -> bool:
        return not site.others or (len(site.others) == 1 and site.others[0][1] == 3
                                   and isinstance(self.stencils.get(3), RepeatConvStencil))

    def indexed(self, site: Site, plans: list[tuple[int, int, WindowPlan]],
                window: list[torch.Tensor], uniform: bool) -> Any:
        stencil, world = self.annotation.stencil, site.mesh.size(site.axis)
        assert isinstance(stencil, UpCausalStencil)
        rank, m, wrapper = site.mesh.get_local_rank(site.axis), self.module, self.module.conv
        pads, win = wrapper.time_causal_padding, window.pop()
        (_, _, h, w), device = win.shape[1:], win.device
        frames = _up_frames(rank, site.length, world, stencil, uniform, device)
        if len(plans) == 1:  # H whole
            rows = _up_rows(h, int(m.upsample_factor[1]), pads[2], device)
        else:  # H sharded on the other axis: the up-rows this rank's output rows read
            axis, d, _ = plans[1]
            rows_stencil = self.stencils[d]
            assert isinstance(rows_stencil, RepeatConvStencil)
            rows = _window_rows(site.mesh.get_local_rank(axis), site.shape[d],
                                site.mesh.size(axis), rows_stencil, uniform, device)
        cols = _up_rows(w, int(m.upsample_factor[2]), pads[0], device)
        up = _gathered(win, frames, rows, cols)
        del win
        return _own(wrapper.conv(up), site, plans, uniform)


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


class _RowsUpsampleForward(_IndexedUpsample):
    """`HunyuanVideoUpsampleCausal3D` with H sharded (T whole), without running its forward
    on a window of rows: the up-rows this rank's outputs read (the conv's reach on each
    side, replicate beyond the global ends) are gathered from the exchanged window in one
    index, with every up-frame (its causal history included) and up-column, replicate-padded
    as its `F.pad` pads them; then its conv runs on them with no padding. The module's own
    forward on a window builds the interpolated frames, their concatenation and a padded
    copy, each `factor * reach` rows taller than what this rank reads, then drops those
    outputs. With T sharded as well, or a rank without outputs, the window path runs."""

    def indexed(self, site: Site, plans: list[tuple[int, int, WindowPlan]],
                window: list[torch.Tensor], uniform: bool) -> Any:
        stencil, world = self.annotation.stencil, site.mesh.size(site.axis)
        assert isinstance(stencil, RepeatConvStencil)
        rank, m, win = site.mesh.get_local_rank(site.axis), self.module, window.pop()
        pads, device = m.conv.time_causal_padding, win.device
        # every frame is on this rank: its up-frames as one rank of one computes them
        time = UpCausalStencil(int(m.upsample_factor[0]), pads[4] + 1)
        frames = _up_frames(0, win.shape[2], 1, time, False, device)
        rows = _window_rows(rank, site.length, world, stencil, uniform, device)
        cols = _up_rows(win.shape[4], int(m.upsample_factor[2]), pads[0], device)
        up = _gathered(win, frames, rows, cols)
        del win
        return _own(m.conv.conv(up), site, plans, uniform)


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
                        frames=n if padded else None, _reuse=agreements_of(attn, site))
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
                       global_length=site.length, reuse=agreements_of(attn, site))
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
    reuse = agreements_of(attn, site)
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


class HunyuanMidBlockParallel(DimStyle):
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

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "HunyuanVideoMidBlock3D", "HunyuanMidBlockParallel")
        if self.dim != 3:  # H: K and V gathered along H, the frame mask unchanged
            check_time_dim(self.dim, "HunyuanMidBlockParallel")
        for i, attn in enumerate(module.attentions):
            if attn is not None:
                _check_attention(attn, f"attentions.{i}")
        install(module, _MidBlockForward(module, self.dim))
        return module


HUNYUAN_RULES: dict[str, Rule] = {
    **passing("AutoencoderKLHunyuanVideo", "HunyuanVideoEncoder3D", "HunyuanVideoDecoder3D",
               "HunyuanVideoDownBlock3D", "HunyuanVideoUpBlock3D",
               "HunyuanVideoResnetBlockCausal3D",
               "HunyuanVideoDownsampleCausal3D"),  # calls its strided causal conv only
    "HunyuanVideoCausalConv3d": (causal_conv, True),
    "HunyuanVideoUpsampleCausal3D": (lambda m: HunyuanUpsampleParallel(), True),
    "HunyuanVideoMidBlock3D": (lambda m: HunyuanMidBlockParallel(), False),
    "Attention": (lambda m: None, True),  # run by the mid-block's style
    "GroupNorm": (lambda m: GroupNormParallel(), True),
    "Conv3d": (lambda m: pointwise(m), True),  # quant_conv, post_quant_conv
}


HUNYUAN_ROWS: dict[str, Rule] = {
    "HunyuanVideoCausalConv3d": (rows_causal_conv, True),
    "HunyuanVideoUpsampleCausal3D": (lambda m: HunyuanUpsampleParallel(dim=3), True),
    "HunyuanVideoMidBlock3D": (lambda m: HunyuanMidBlockParallel(dim=3), False),
    "Attention": (lambda m: None, True),  # run by the mid-block's style
    "GroupNorm": (lambda m: GroupNormParallel(dim=3), True),
    "Conv3d": (rows_pointwise, True),
}
HUNYUAN_TIME_ROWS: dict[str, Rule] = {
    "HunyuanVideoMidBlock3D": (lambda m: HunyuanMidBlockParallel(), False),
    "Attention": (lambda m: None, True),  # run by the mid-block's style
    "HunyuanVideoUpsampleCausal3D": (lambda m: HunyuanUpsampleParallel(), True),
    "HunyuanVideoCausalConv3d": (time_rows_causal_conv, True),
    "GroupNorm": (lambda m: GroupNormParallel(), True),  # statistics over both axes
    "Conv3d": (lambda m: pointwise(m), True),  # per slice along H too (kernel 1)
}


HUNYUAN_NAMES = ("AutoencoderKLHunyuanVideo", "HunyuanVideoEncoder3D",
                  "HunyuanVideoDecoder3D")
