"""Exact GroupNorm over a dimension sharded across ranks.

GroupNorm's statistics run over (C/G, T, H, W) for each (batch, group): with T sharded, each
rank holds part of every group. Each rank reduces its part to (count, mean, M2) per
(batch, group), the ranks all-gather those few numbers (B * G * 3 per rank, no activations),
and every rank combines them in rank order with Chan's parallel update: shifted sums, so no
catastrophic cancellation, and the same result on every rank. The all-gather is
differentiable, so gradients through the statistics are exact too.
"""

from __future__ import annotations

import math

import torch

from haloshard import _comm
from haloshard._comm import GroupLike
from haloshard._errors import HaloError


def _local_stats(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """`(B, C, ...) -> (3, B, G)`: count, mean and M2 (sum of squared deviations).

    Reduced per channel first, with `x` left in its own layout (no reshape of a strided,
    possibly empty shard), then channels are combined into groups on `(B, C)`-sized tensors.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    within = tuple(range(2, x.ndim))
    per_channel = math.prod(x.shape[2:])
    mean_c = xf.sum(within) / torch.sym_max(per_channel, 1)
    m2_c = ((xf - mean_c.view(*mean_c.shape, *([1] * len(within)))) ** 2).sum(within)
    mean_c, m2_c = (t.unflatten(1, (num_groups, -1)) for t in (mean_c, m2_c))
    mean = mean_c.mean(-1)
    m2 = m2_c.sum(-1) + per_channel * ((mean_c - mean.unsqueeze(-1)) ** 2).sum(-1)
    count = mean.new_ones(mean.shape) * (per_channel * mean_c.shape[-1])
    return torch.stack([count, mean, m2])


def _combine(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(P, 3, B, G)` per-rank stats -> global mean and biased variance, each `(B, G)`."""
    count, mean, m2 = stats[0]
    for other in stats[1:]:
        n_b, mean_b, m2_b = other
        total = count + n_b
        delta = mean_b - mean
        share = n_b / total.clamp(min=1.0)
        mean = mean + delta * share
        m2 = m2 + m2_b + delta * delta * count * share
        count = total
    return mean, m2 / count.clamp(min=1.0)


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group: GroupLike,
) -> torch.Tensor:
    """`F.group_norm` of the global tensor, on this rank's shard of any non-channel dim.

    Forward: `(B, C, *S_r) -> (B, C, *S_r)` normalised with the global statistics.
    Backward flows through the all-gathered statistics (a reduce-scatter of B*G*3 numbers).

    Args:
        x: this rank's shard `(B, C, ...)`, sharded on a dim other than 0 and 1.
        num_groups: groups, dividing C.
        weight, bias: per-channel affine parameters `(C,)` or None.
        eps: added to the variance.
        group: the ranks sharing the sharded dim (as for `halo_exchange`).

    Raises:
        HaloError: when C is not divisible by num_groups.

    Example::
        >>> y = group_norm(x, 4, gn.weight, gn.bias, gn.eps, mesh)  # x: (2, 8, T_r, 16, 16)
        >>> y.shape == x.shape
        True
    """
    if x.ndim < 2 or x.shape[1] % num_groups:
        raise HaloError(f"group_norm needs C divisible by num_groups={num_groups}, "
                        f"got shape {tuple(x.shape)}")
    grp = _comm.resolve_group(group)
    stats = _comm.all_gather_autograd(_local_stats(x, num_groups).unsqueeze(0), grp)
    mean, var = _combine(stats)
    # y = x * scale + shift per (batch, channel): no reshape of the shard itself.
    scale = torch.rsqrt(var + eps).repeat_interleave(x.shape[1] // num_groups, dim=1)
    shift = -mean.repeat_interleave(x.shape[1] // num_groups, dim=1) * scale
    if weight is not None:
        scale, shift = scale * weight, shift * weight
    if bias is not None:
        shift = shift + bias
    expand = (*scale.shape, *([1] * (x.ndim - 2)))
    work = torch.promote_types(x.dtype, torch.float32)
    return (x.to(work) * scale.view(expand) + shift.view(expand)).to(x.dtype)
