"""A causal conv's window of rows built in one buffer, for the frame-loop VAEs with H sharded.

CogVideoX's and Wan 2.1's causal convs concatenate frames before their input along T (a
conv cache carried from the previous frame batch, or the first frame repeated), Wan's pads
T, H and W with zeros too, then convolve. With H sharded, the conv needs a halo of rows
for every one of those frames. Built the module's way, a rank holds the concatenation, its
padded copy and the window of rows exchanged from it at once (each the chunk's size), where
one device holds the first two. In inference on real ranks, `rows_window` writes every
piece straight into one buffer of the window's shape, and the exchange fills its halo rows
in place. The conv then runs under `FastConv3d`, since fewer rows a rank send more of these
convs to torch's slow conv3d path than on one device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.overrides import TorchFunctionMode

from haloshard._choice import onednn_direct, slow_window
from haloshard._comm import is_eager
from haloshard._compat import onednn_convolution
from haloshard._errors import HaloError
from haloshard._exchange import empty_like_layout, prepare_halo
from haloshard._forward import ShardedForward, install
from haloshard._layout import shard_sizes
from haloshard._site import Site, dtensor_site
from haloshard._specs import Stencil, WindowPlan, plan_windows
from haloshard._styles import HaloParallel

Frames = torch.Tensor | int  # this rank's rows of some frames, or a count of zero frames


def centred_rows(conv: Any) -> bool:
    """Whether a conv pads H by `(k - 1) // 2` zeros each side with stride and dilation 1
    along H: the conv whose window of rows `rows_window` builds."""
    k = conv.kernel_size[1]
    return (k % 2 == 1 and conv.padding_mode == "zeros"
            and (conv.padding[1], conv.stride[1], conv.dilation[1]) == ((k - 1) // 2, 1, 1))


def apply_rows_conv(module: nn.Module, device_mesh: DeviceMesh, dim: int, style: str,
                    forward: ShardedForward, *, mode: str | None = None) -> nn.Module:
    """A causal wrapper's rows style applied: its `.conv` takes the H halo
    (`HaloParallel(dim=3)`), and `forward` (whose inference path builds the conv's window
    of rows in one buffer) replaces the wrapper's. `mode`: the wrapper's own pad mode
    (CogVideoX's), where "replicate" (an `F.pad` of H by the wrapper) is refused.

    Raises:
        HaloError: for a dim other than 3, another pad mode, or a conv that is not
            `centred_rows`, naming the module's class and the conv's geometry along H.
    """
    conv = module.conv
    if dim != 3 or mode == "replicate" or not centred_rows(conv):
        own = "" if mode is None else f"pad_mode {mode!r}, "
        raise HaloError(f"{style} shards H (dim 3) of a {'constant-mode ' if mode else ''}"
                        f"{type(module).__name__} whose conv pads H by (k - 1) // 2 zeros "
                        f"with stride and dilation 1, got dim={dim}, {own}kernel "
                        f"{conv.kernel_size[1]}, padding {conv.padding[1]} "
                        f"({conv.padding_mode}), stride {conv.stride[1]}, dilation "
                        f"{conv.dilation[1]}")
    parallelize_module(conv, device_mesh, HaloParallel(dim=3))
    install(module, forward)
    return module


def rows_site(x: Any, caches: tuple[Any, ...], stencil: Stencil) -> Site | None:
    """The site of `x` when its window of rows is built in one buffer (`rows_window`):
    inference on real ranks, `x` a DTensor sharded on H (dim 3) alone, each cache None or
    a DTensor on `x`'s placements, a halo to move, and every rank holding rows whose window
    is its rows and their halo. The same answer on every rank (global shapes and modes)."""
    if (torch.is_grad_enabled() or type(x) is not DTensor
            or any(c is not None and (type(c) is not DTensor or c.placements != x.placements)
                   for c in caches)
            or not is_eager(x.to_local())):
        return None
    site = dtensor_site(x, 3, several=True)
    if site.others:
        return None
    plan = plan_windows(stencil, site.length, site.mesh.size(site.axis))
    sizes = shard_sizes(site.length, site.mesh.size(site.axis))
    simple = all((plan.win_start[r], plan.win_len[r], plan.win_zeros[r])
                 == (0, plan.left + n + plan.right, 0) for r, n in enumerate(sizes))
    return site if simple and min(sizes) > 0 and plan.left + plan.right > 0 else None


def rows_window(site: Site, stencil: Stencil, frames: list[Frames], agreed: dict[Any, Any],
                *, w_pad: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor,
                                                          WindowPlan]:
    """This rank's window of rows for a conv whose input is `frames` concatenated along T
    (each this rank's rows of some frames, or a count of zero frames) and padded along W by
    `w_pad` zeros: one buffer `(B, C, T, left + rows + right, W + w_pad)`, its halo rows
    exchanged in place (zeros beyond the global ends). Returns the buffer, its view of this
    rank's rows and the window plan; `agreed` keeps the exchange's agreement."""
    plan = plan_windows(stencil, site.length, site.mesh.size(site.axis))
    x = site.local
    b, c, _, n, w = x.shape
    length = sum(f if isinstance(f, int) else f.shape[2] for f in frames)
    buf = empty_like_layout(x, [b, c, length, plan.left + n + plan.right, sum(w_pad) + w])
    rows = buf.narrow(3, plan.left, n)
    if any(w_pad):
        rows.narrow(4, 0, w_pad[0]).zero_()
        rows.narrow(4, w_pad[0] + w, w_pad[1]).zero_()
    at = 0
    for piece in frames:
        count = piece if isinstance(piece, int) else piece.shape[2]
        target = rows.narrow(2, at, count).narrow(4, w_pad[0], w)
        if isinstance(piece, int):
            target.zero_()
        else:
            target.copy_(piece)
        at += count
    signature = ((b, c, length, site.length, w + sum(w_pad)), buf.dtype, site.placements,
                 id(site.mesh), site.axis)
    move, _ = prepare_halo(rows, plan.left, plan.right, 3, (site.mesh, site.axis),
                           pad="zeros", global_length=site.length,
                           reuse=(agreed, "window", signature))
    if move is not None:
        move.fill(buf, rows, move.start(rows))
    return buf, rows, plan


class FastConv3d(TorchFunctionMode):
    """Inside a causal conv on its window of rows: a `conv3d` that torch would run on its
    slow path (CPU, batch 1: it takes oneDNN only when `B * C * T * H > 20480`, so fewer
    rows per rank send more layers there than on one device) runs on oneDNN's kernel
    directly in inference (`_choice.onednn_direct`: float32), else, with no padding of
    its own, as one conv2d per tap along T, the frames folded into the batch
    (`conv3d_time_taps`). The slow path's im2col columns are 27 times its input for a
    3x3x3 kernel (measured: 1.5 times one device's peak per rank on 2 ranks, Wan's
    default decoder at 64x64); the taps hold one frames-first copy of the input and copy
    each tap's weights. The same sums in another order (float rounding only)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.conv3d and not kwargs and len(args) == 7 and slow_conv3d(*args):
            x, weight, bias, stride, padding, dilation, groups = args
            if onednn_direct(x, weight, bias):
                return onednn_convolution(x, weight, bias, list(padding), list(stride),
                                          list(dilation), groups)
            if tuple(padding) == (0, 0, 0):
                return conv3d_time_taps(*args)
        return func(*args, **kwargs)


def slow_conv3d(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                groups: Any) -> bool:
    """Whether torch would run this `F.conv3d` call (sizes as int sequences) on its slow
    path."""
    sizes = (stride, padding, dilation)
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and not isinstance(x, DTensor) and x.ndim == 5 and x.device.type == "cpu"
            and x.numel() > 0 and isinstance(groups, int)
            and all(isinstance(v, (tuple, list)) and len(v) == 3
                    and all(isinstance(i, int) for i in v) for v in sizes)):
        return False
    return slow_window(x, list(x.shape), weight, list(stride), list(padding),
                       list(dilation), groups)


def conv3d_time_taps(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     stride: Any, padding: Any, dilation: Any, groups: int) -> torch.Tensor:
    """`F.conv3d(x, weight, bias, stride, 0, dilation, groups)` as the sum over taps `j`
    along T of `conv2d(frames j*d, j*d + s, ..., weight[:, :, j])`, frames folded into the
    batch: `(B, C, T, H, W) -> (B, O, T_out, H_out, W_out)`."""
    k, s, d = weight.shape[2], stride[0], dilation[0]
    count = (x.shape[2] - d * (k - 1) - 1) // s + 1
    frames = x.permute(2, 0, 1, 3, 4).contiguous()  # (T, B, C, H, W): a tap's frames
    y: torch.Tensor | None = None
    for j in range(k):
        picked = frames.narrow(0, j * d, s * (count - 1) + 1)[::s]
        out = F.conv2d(picked.flatten(0, 1), weight[:, :, j], bias if j == 0 else None,
                       tuple(stride[1:]), 0, tuple(dilation[1:]), groups)
        y = out if y is None else y.add_(out)
    assert y is not None
    return y.unflatten(0, (count, x.shape[0])).permute(1, 2, 0, 3, 4)
