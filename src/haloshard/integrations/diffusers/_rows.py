"""A causal conv's window of rows built in one buffer, for the frame-loop VAEs with H sharded.

CogVideoX's and Wan 2.1's causal convs concatenate frames before their input along T (a
conv cache carried from the previous frame batch, or the first frame repeated), Wan's pads
T, H and W with zeros too, then convolve. With H sharded, the conv needs a halo of rows
for every one of those frames. Built the module's way, a rank holds the concatenation, its
padded copy and the window of rows exchanged from it at once (each the chunk's size), where
one device holds the first two. In inference on real ranks, `rows_window` writes every
piece straight into one buffer of the window's shape, and the exchange fills its halo rows
in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from haloshard._comm import is_eager
from haloshard._exchange import empty_like_layout, prepare_halo
from haloshard._layout import shard_sizes
from haloshard._site import Site, dtensor_site
from haloshard._specs import Stencil, WindowPlan, plan_windows

Frames = torch.Tensor | int  # this rank's rows of some frames, or a count of zero frames


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
