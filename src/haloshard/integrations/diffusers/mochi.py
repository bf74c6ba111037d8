"""Mochi's VAE decode (diffusers' `AutoencoderKLMochi`) with T sharded, output kept sharded.

`vae._decode(z)` runs the decoder once over the clip (`plan_for(vae)` covers it), then drops
the first `temporal_compression_ratio - 1` frames (`drop_last_temporal_frames`) with a slice
along T. On a `Shard(2)` DTensor, DTensor runs that slice by gathering the whole video on
every rank. `mochi_decode` runs it as a stencil instead: each rank keeps its `Shard(2)` chunk
of the shorter clip, taking the frames that move across a rank boundary from the ranks after
it (the dropped frames are at the global start, so every chunk shifts by the same count).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard._annotation import Annotation
from haloshard._attention import agree_chunks
from haloshard._comm import resolve_group
from haloshard._compat import enabled_local_tensor_mode
from haloshard._errors import HaloError
from haloshard._exchange import memory_format
from haloshard._forward import (
    ShardedForward,
    install,
    names_errors,
)
from haloshard._halo_forward import HaloForward
from haloshard._layer_styles import (
    GroupNormParallel,
    LocalParallel,
)
from haloshard._layout import PadMode, lack, shard_sizes
from haloshard._masked_attention import frame_attention
from haloshard._norms import group_norm
from haloshard._site import Site, dtensor_site
from haloshard._swap import rows_to_time, time_to_rows
from haloshard.integrations.diffusers._base import (
    DimStyle,
    Rule,
    agreements_of,
    also_rows,
    check_class,
    check_time_dim,
    cog_causal_conv,
    passing,
    pointwise,
    rows_causal_conv,
    rows_pointwise,
    time_rows_causal_conv,
)
from haloshard.integrations.diffusers.stencils import RepeatStencil


@dataclass(frozen=True)
class DropFirstStencil:
    """`x[:, :, count:]` along T: output frame `j` is input frame `j + count`.

    Example::
        >>> DropFirstStencil(2).out_length(18), DropFirstStencil(2).window(4, 8)
        (16, (4, 10, 0))
    """

    count: int
    pad: PadMode = "zeros"  # never used: windows stay inside [0, T)
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return max(length - self.count, 0)

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        # the module drops `count` frames from the front of its window itself
        return start, stop + self.count, 0


class _DropFirst(nn.Module):
    """The end of `AutoencoderKLMochi._decode`: the first `count` frames dropped."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, self.count:]


# One hooked drop per VAE, so its per-signature agreements are made once, not per call.
_DROPS: weakref.WeakKeyDictionary[nn.Module, _DropFirst] = weakref.WeakKeyDictionary()


def _check_vae(vae: nn.Module) -> None:
    if type(vae).__name__ != "AutoencoderKLMochi":
        raise HaloError(f"expected diffusers' AutoencoderKLMochi, got {type(vae).__name__}")
    for name in ("use_tiling", "use_slicing", "use_framewise_decoding"):
        if getattr(vae, name, False):
            raise HaloError(f"AutoencoderKLMochi.{name} is on; turn it off (decode would no "
                            "longer run the decoder once over the sharded clip)")


def _drop(vae: nn.Module, count: int) -> _DropFirst:
    drop = _DROPS.get(vae)
    if drop is None or drop.count != count:
        drop = _DropFirst(count)
        forward = HaloForward.of(drop, Annotation(None, 2, DropFirstStencil(count)), None)
        # dropping frames along T reads each row and column alone: a video also sharded
        # on H or W (a `(t, h)` mesh) keeps its chunk there, with no halo
        forward.per_slice = (3, 4)
        install(drop, forward)
        _DROPS[vae] = drop
    return drop


def mochi_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode(z).sample` of a Mochi VAE parallelized with `plan_for(vae)`, on a
    `Shard(2)` latent, with the video a `Shard(2)` DTensor (DTensor's own slice in
    `vae.decode` would gather the whole video on every rank). A latent also sharded on H
    (`plan_for(vae, dims=(2, 3))`, `[Shard(2), Shard(3)]` on a `(t, h)` mesh) keeps its
    rows; one sharded on H alone is sliced along T locally, as `vae.decode` does.

    Raises:
        HaloError: for another model, or tiling, slicing or framewise decoding on.

    Example::
        parallelize_module(vae, mesh, plan_for(vae))
        mochi_decode(vae, distribute_tensor(z, mesh, [Shard(2)])).shape[2]  # z: T = 3 -> 13
    """
    _check_vae(vae)
    dec = vae.decoder(z)[0]
    count = vae.temporal_compression_ratio - 1
    if not vae.drop_last_temporal_frames or dec.size(2) < count + 1 or count == 0:
        return dec
    if not isinstance(dec, DTensor) or Shard(2) not in dec.placements:
        return dec[:, :, count:]  # T whole on every rank: DTensor slices it locally
    return _drop(vae, count)(dec)


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
                along = _swapped_rows(h) if self.dim == 2 else None
                if along is not None:
                    h = _swapped_attention(attn, norm, h, along)
                else:
                    attend = _pixel_attention if self.dim == 2 else _pixel_attention_rows
                    h = h + attend(attn, norm(h), self.dim)
        return h, cache


def _swapped_rows(h: DTensor) -> int | None:
    """The dim whose rows Mochi's attention along T takes T's place on (3: H, 4: W, the
    longer of this rank's), or None: gather K/V along T instead. Eager real ranks with at
    least a row per rank along it (the same choice on every rank of the T group: their
    chunks' rows and columns are the same)."""
    if (enabled_local_tensor_mode() is not None or torch.compiler.is_compiling()
            or not isinstance(h, DTensor)):
        return None
    site = dtensor_site(h, 2, several=True)
    if type(site.local) is not torch.Tensor or site.local.ndim != 5:
        return None
    along = 3 if site.local.shape[3] >= site.local.shape[4] else 4
    return along if site.local.shape[along] >= site.mesh.size(site.axis) else None


def _swapped_attention(attn: nn.Module, norm: nn.Module, h: DTensor, along: int) -> DTensor:
    """`h + attention(norm(h))` of a Mochi block on a `Shard(T)` chunk, the attention
    along T of each pixel's own sequence: the normalised chunk moved to this rank's rows
    of every frame (`time_to_rows`, an all-to-all), the processor's steps run on whole
    sequences there (`_attend_rows`: one device's kernel on `1/P` of the pixels, every rank
    alike), the output moved back (`rows_to_time`) and added to `h`. Exact (the same
    kernels on the same sequences); differentiable (each move is the other's backward).
    The ranks agree on the chunk's shape and frames first (one small gather per call)."""
    site = dtensor_site(h, 2, several=True)
    grp = resolve_group((site.mesh, site.axis))
    lengths = shard_sizes(site.length, grp.size)
    x = dtensor_site(norm(h), 2, several=True).local
    agree_chunks((x,), 2, grp, global_length=site.length)
    rows = time_to_rows(x, grp, lengths, along)  # (T, B, H_r, W, C)
    del x
    tokens = rows.permute(1, 2, 3, 0, 4).contiguous()  # (B, H_r, W, T, C)
    del rows
    o = _attend_rows(attn, tokens).permute(3, 0, 1, 2, 4)  # (T, B, H_r, W, C), a view
    del tokens
    residual = site.local
    if torch.is_grad_enabled():
        out = residual + rows_to_time(o, grp, lengths, along, residual)
    else:  # each piece added to the residual as it lands (one pass)
        out = rows_to_time(o, grp, lengths, along, residual, residual=residual)
    return DTensor.from_local(out, site.mesh, site.placements, run_check=False,
                              shape=h.shape, stride=h.stride())


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
    reuse, length, group = agreements_of(attn, site), site.length, (site.mesh, site.axis)
    tokens = _pixel_tokens(site, dim, h.shape, padded)  # (B, H, W, T_r, C)
    del h, site  # the caller's norm output: freed here unless autograd keeps it
    # grad mode is part of the agreed signature: every rank runs as many parts
    parts = 1 if torch.is_grad_enabled() else min(_PIXEL_PARTS, tokens.shape[2])
    # slices of rows where they are contiguous (batch 1), so q, k, v's linears copy no part
    along = 1 if tokens.shape[0] == 1 and tokens.shape[1] >= parts else 2
    if parts > 1:
        # each part's output divided straight into its slice (no cat, no second pass);
        # each part agrees at its own key, so a steady call agrees nothing (one key for all
        # would see its signature change at every part: a placeholder round and a fresh
        # agreement each time)
        o = tokens.new_empty(tokens.shape)
        for j, (part, out) in enumerate(zip(tokens.tensor_split(parts, dim=along),
                                            o.tensor_split(parts, dim=along), strict=True)):
            store = reuse[0].setdefault(("pixel part", parts, j), {})
            torch.div(_attend_pixels(attn, part, group, length, n if padded else None,
                                     (store, reuse[1])), attn.rescale_output_factor, out=out)
    else:
        o = _attend_pixels(attn, tokens, group, length, n if padded else None, reuse) / \
            attn.rescale_output_factor
    del tokens
    o = o.permute(0, 4, 3, 1, 2)
    if padded:
        o = o.narrow(dim, 0, n)
        for d, rows in kept.items():
            o = o.narrow(d, 0, rows)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    # a view, as one device's block adds it to the residual: a copy here would transpose
    # the whole chunk once more (C from innermost to second)
    return DTensor.from_local(o, mesh, placements, run_check=False, shape=shape, stride=stride)


def _attend_pixels(attn: nn.Module, tokens: torch.Tensor, group: Any, length: int,
                   frames: Any, reuse: Any) -> torch.Tensor:
    """The processor's steps on `(B, H, W_j, T_r, C)` tokens: q, k, v (q, k normalised),
    causal attention along T, the output projection (and residual); q, k, v dropped once
    attended."""
    def heads(lin: nn.Module, norm: nn.Module | None) -> torch.Tensor:
        t = lin(tokens)
        # a view, heads split off the linear's output: frame_attention's fused kernel
        # (inference) reads it as it is; its other paths copy what they need
        t = t.unflatten(-1, (attn.heads, t.shape[-1] // attn.heads)).transpose(-3, -2)
        if norm is not None:  # an LpNorm over each token's E (`_check_mochi_attention`): its
            # dim (-1 or 3) names E in the processor's 4-D layout, not in these 6-D rows
            t = F.normalize(t, p=norm.p, dim=-1, eps=norm.eps)
        return t.unsqueeze(-2)  # (B, H, W, h, T_r, 1, E)

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
        rows = [(site.mesh, a) for a, _ in site.others]

        def norm(frames: torch.Tensor) -> torch.Tensor:
            return gn(frames) if not rows else group_norm(
                frames, gn.num_groups, gn.weight, gn.bias, gn.eps, rows[0], dim=2,
                other_groups=rows[1:])

        if enabled_local_tensor_mode() is None:
            # (B * T_r, C, H_r, W) as one device's norm takes them: a view of a
            # channels-last chunk (a copy otherwise), normalised in that layout, and viewed
            # back: the rank holds the input and one output, as one device does
            y = norm(local.transpose(1, 2).flatten(0, 1)).unflatten(0, (-1, n)).transpose(1, 2)
            return DTensor.from_local(y.contiguous(memory_format=memory_format(local)),
                                      site.mesh, site.placements, run_check=False,
                                      shape=x.shape, stride=x.stride())
        # simulated ranks: frames padded to the longest chunk (flattened into the batch
        # below: a per-rank length there breaks LocalTensorMode); each padding frame is a
        # sample of its own, dropped below. (T_r * B, C, H_r, W) by frames: concatenated,
        # not flattened, since under LocalTensorMode a view over per-rank row counts cannot
        # be decided
        local = _pad_end(local, 2, shard_sizes(site.length, site.mesh.size(site.axis))[0])
        y = norm(torch.cat(local.unbind(2), 0))
        y = torch.stack(y.split(local.shape[0], 0), 2).narrow(2, 0, n)
        return DTensor.from_local(y.contiguous(), site.mesh, site.placements,
                                  run_check=False, shape=x.shape, stride=x.stride())


class _FrameNormParallel(ParallelStyle):
    """`MochiChunkedGroupNorm3D` on T and H (`_FrameNormForward`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "MochiChunkedGroupNorm3D", "_FrameNormParallel")
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
    o = _attend_rows(attn, tokens).permute(0, 4, 3, 1, 2).narrow(dim, 0, n)
    stride = tuple(math.prod(h.shape[i + 1 :]) for i in range(h.ndim))
    # a view, as one device's block adds it to the residual (see `_pixel_attention`)
    return DTensor.from_local(o, site.mesh, site.placements, run_check=False, shape=h.shape,
                              stride=stride)


def _attend_rows(attn: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """`MochiVaeAttnProcessor2_0` on whole sequences: `(B, H_r, W, T, C)` tokens (each
    pixel's every frame, contiguous) -> the processor's output, same layout."""
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
    if torch.is_grad_enabled():
        if attn.residual_connection:
            o = o + tokens
        return o / attn.rescale_output_factor
    if attn.residual_connection:  # in place: the same sums, one buffer fewer
        o.add_(tokens)
    return o.div_(attn.rescale_output_factor)


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


class MochiBlockParallel(DimStyle):
    """`MochiDownBlock3D` / `MochiMidBlock3D` on `Shard(T)`, attention included, exact.

    The block's conv_in, resnets and norms run through their own plan entries; each
    attention (causal along T, one sequence per pixel) runs as its processor does. On real
    ranks its input moves to this rank's rows of every frame and back (`_swapped_attention`:
    an all-to-all each way, `(P - 1) / P` of the chunk each, balanced, memory `1/P` of one
    device's). Under simulated ranks, or with fewer rows and columns than ranks, it runs
    `frame_attention(causal=True)` over keys and values gathered along T instead
    (training: every rank holds the block's full K and V, `2 * B * T * H * W * C`; under
    `torch.no_grad()`: two ranks' blocks of them, one source rank at a time).

    With H sharded (`dim=3`) every pixel's T is on its rank: the attention runs on this
    rank's rows and nothing moves.

    Raises:
        HaloError: in `_apply` for another class, a dim other than 2 (T) or 3 (H), or an
            attention it does not know; at run time for a plain tensor input or a
            conv_cache.
    """

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).__name__ not in ("MochiDownBlock3D", "MochiMidBlock3D"):
            raise HaloError(f"MochiBlockParallel applies to diffusers' MochiDownBlock3D and "
                            f"MochiMidBlock3D, got {type(module).__name__}")
        if self.dim != 3:  # H: every pixel's T is local, attention runs on the rows
            check_time_dim(self.dim, "MochiBlockParallel")
        for i, attn in enumerate(module.attentions):
            if attn is not None:
                _check_mochi_attention(attn, f"attentions.{i}")
        install(module, _MochiBlockForward(module, self.dim))
        return module


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


class MochiUpBlockParallel(DimStyle):
    """`MochiUpBlock3D` on `Shard(T)`, exact: its resnets through their plan entries, then
    its per-token `proj` and depth-to-space (each frame becomes `temporal_expansion`
    frames) on the window of input frames this rank's output frames come from.

    With H sharded (`dim=3`), each row becomes `spatial_expansion` rows instead.

    Raises:
        HaloError: in `_apply` for another class or a dim other than 2 (T) or 3 (H).
    """

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_class(module, "MochiUpBlock3D", "MochiUpBlockParallel")
        if self.dim != 3:  # H: each row becomes spatial_expansion rows
            check_time_dim(self.dim, "MochiUpBlockParallel")
        factor = module.temporal_expansion if self.dim == 2 else module.spatial_expansion
        expand = _MochiExpand(module)
        install(expand, HaloForward.of(expand, Annotation(None, self.dim, RepeatStencil(factor)),
                                       device_mesh))
        if self.dim == 2:  # with H sharded too, each row becomes spatial_expansion rows
            also_rows(expand, lambda m: RepeatStencil(module.spatial_expansion))
        install(module, _MochiUpForward(module, expand, self.dim))
        return module

MOCHI_RULES: dict[str, Rule] = {
    **passing("AutoencoderKLMochi", "MochiEncoder3D", "MochiDecoder3D",
               "MochiResnetBlock3D"),
    "CogVideoXCausalConv3d": (cog_causal_conv, True),
    "MochiChunkedGroupNorm3D": (lambda m: LocalParallel(), True),
    "MochiDownBlock3D": (lambda m: MochiBlockParallel(), False),
    "MochiMidBlock3D": (lambda m: MochiBlockParallel(), False),
    "MochiUpBlock3D": (lambda m: MochiUpBlockParallel(), ("proj",)),
    "Attention": (lambda m: None, True),  # run by the block's style
    "FourierFeatures": (lambda m: LocalParallel(), True),
    "Linear": (lambda m: LocalParallel(dim=1), True),  # proj_in / proj_out, channels-last
    "Conv3d": (lambda m: pointwise(m), True),  # the decoder's 1x1 conv_in
}
MOCHI_ROWS: dict[str, Rule] = {
    "CogVideoXCausalConv3d": (rows_causal_conv, True),  # F.pad of H, replicate
    # per frame: (B*T, C, H, W) in its own forward, the GroupNorm's statistics over H
    "MochiChunkedGroupNorm3D": (lambda m: {"norm_layer": GroupNormParallel()}, True),
    "MochiDownBlock3D": (lambda m: MochiBlockParallel(dim=3), False),
    "MochiMidBlock3D": (lambda m: MochiBlockParallel(dim=3), False),
    "MochiUpBlock3D": (lambda m: MochiUpBlockParallel(dim=3), ("proj",)),
    "Attention": (lambda m: None, True),  # run by the block's style
    "FourierFeatures": (lambda m: LocalParallel(dim=3), True),
    "Linear": (lambda m: LocalParallel(dim=2), True),  # channels-last: H at dim 2
    "Conv3d": (rows_pointwise, True),
}
MOCHI_TIME_ROWS: dict[str, Rule] = {
    "MochiChunkedGroupNorm3D": (lambda m: _FrameNormParallel(), True),
    "MochiDownBlock3D": (lambda m: MochiBlockParallel(), False),  # attention along T
    "MochiMidBlock3D": (lambda m: MochiBlockParallel(), False),
    "MochiUpBlock3D": (lambda m: MochiUpBlockParallel(), ("proj",)),
    "Attention": (lambda m: None, True),  # run by the block's style
    "FourierFeatures": (lambda m: LocalParallel(local_dims=(3,)), True),
    "Linear": (lambda m: LocalParallel(dim=1, local_dims=(2,)), True),  # channels-last
    "CogVideoXCausalConv3d": (time_rows_causal_conv, True),
    "Conv3d": (lambda m: pointwise(m), True),  # per slice along H too (kernel 1)
}
MOCHI_NAMES = ("AutoencoderKLMochi", "MochiEncoder3D", "MochiDecoder3D")
