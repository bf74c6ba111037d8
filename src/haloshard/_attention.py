"""Attention along a sharded dim: each rank's queries attend to the all-gathered keys/values.

A VAE mid-block attends over every frame, so halos are not enough: each rank needs all keys
and values. All-gathering K and V over the `cp` axis is exact and simple; it costs
`2 * (P - 1) / P` of the global K/V bytes on the wire and the full K and V in memory on every
rank (the queries, the scores and the output stay sharded). Its backward is a reduce-scatter
of dK and dV, so gradients are exact too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.distributed._local_tensor import enabled_local_tensor_mode, maybe_run_for_local_tensor

from haloshard import _comm
from haloshard._comm import GroupLike
from haloshard._errors import HaloError
from haloshard._layout import shard_sizes


@maybe_run_for_local_tensor
def _valid_rows(lengths: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    """Rows of the padded all-gather that hold real slices, in global order."""
    return torch.tensor([r * chunk + i for r, n in enumerate(lengths) for i in range(n)],
                        dtype=torch.int64, device=device)


def gather_along(x: torch.Tensor, dim: int, group: GroupLike, *, global_length: int,
                 frame: int = 1) -> torch.Tensor:
    """All-gather `Shard(dim)` chunks (uneven and empty included) into the global tensor.

    Forward: `(..., T_r, ...) -> (..., T, ...)`; backward: each rank's chunk gets the sum over
    ranks of the gradient of its slices (a reduce-scatter).

    Args:
        global_length: the global number of frames along `dim`.
        frame: slices per frame: a rank holds `frame` times its `Shard` split of the frames
            (tokens of T*H*W come in frames of H*W).

    Example::
        >>> gather_along(x, 2, mesh, global_length=13).shape  # x: (1, 8, T_r, 4, 4)
        torch.Size([1, 8, 13, 4, 4])
    """
    grp = _comm.resolve_group(group)
    lengths = tuple(n * frame for n in shard_sizes(global_length, grp.size))
    chunk = max(lengths)
    names = [f"d{i}" for i in range(x.ndim)]
    moved = " ".join([names[dim], *names[:dim], *names[dim + 1 :]])
    front = rearrange(x, f"{' '.join(names)} -> {moved}")
    # all-gather needs equal blocks: pad each chunk to the longest, then keep the real rows.
    padded = torch.cat([front, front.new_zeros((chunk - front.shape[0], *front.shape[1:]))])
    every = _comm.all_gather_autograd(padded.contiguous(), grp)
    rows = every.index_select(0, _valid_rows(lengths, chunk, x.device))
    return rearrange(rows, f"{moved} -> {' '.join(names)}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike, *,
              global_length: int, dim: int = 2, scale: float | None = None) -> torch.Tensor:
    """`F.scaled_dot_product_attention` over tokens sharded along `dim` of q, k and v.

    Args:
        q, k, v: `(B, heads, L_r, E)` chunks of the token dim (`dim=2`), `Shard(dim)` split.
        group: the ranks sharing the token dim.
        global_length: the global number of tokens L.
        scale: as for `F.scaled_dot_product_attention`.

    Returns:
        This rank's chunk of the global attention output, `(B, heads, L_r, E)`.

    Example::
        >>> attention(q, k, v, mesh, global_length=96).shape  # q: (1, 1, 24, 16) on 4 ranks
        torch.Size([1, 1, 24, 16])
    """
    if dim != q.ndim - 2:
        raise HaloError(f"attention expects the token dim to be dim {q.ndim - 2} of "
                        f"{tuple(q.shape)} (B, heads, L, E), got dim={dim}")
    k_all = gather_along(k, dim, group, global_length=global_length)
    v_all = gather_along(v, dim, group, global_length=global_length)
    if enabled_local_tensor_mode() is not None:
        # LocalTensorMode picks the SDPA kernel once for all simulated ranks; the CPU flash
        # kernel divides by zero on a rank without queries, so spell the math out there.
        s = scale if scale is not None else q.shape[-1] ** -0.5
        return torch.softmax(q @ k_all.transpose(-2, -1) * s, dim=-1) @ v_all
    return F.scaled_dot_product_attention(q, k_all, v_all, scale=scale)
