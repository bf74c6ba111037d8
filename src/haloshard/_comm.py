"""Every collective and point-to-point call haloshard makes lives in this module.

Groups arrive as a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair and are
resolved once into a `Group`: group-local rank and size (symbolic per-rank ints under
`LocalTensorMode`), the ProcessGroup, and the form functional collectives accept. Peers are
group-local ranks; P2P converts them to global ranks with `dist.get_global_rank`, so a `cp`
sub-mesh of a `(dp, cp)` mesh works.

The exchange's own moves (`start_all_to_all`, `start_p2p`) return a `Pending`: plain eager
tensors go through c10d's async calls (no functional-collective wrapper on the hot path);
traced, fake and simulated tensors through functional collectives, which torch.compile and
LocalTensorMode understand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import LocalIntNode, enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh

from haloshard._errors import HaloError

GroupLike = dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str]


@dataclass(frozen=True)
class Group:
    """A resolved group: what the exchange needs to know about it."""

    pg: dist.ProcessGroup
    funcol_group: Any
    size: int
    rank: int | torch.SymInt


def _mesh_axis(mesh: DeviceMesh, mesh_axis: int | str) -> int:
    names = mesh.mesh_dim_names or ()
    if isinstance(mesh_axis, str):
        if mesh_axis not in names:
            raise HaloError(f"mesh axis {mesh_axis!r} is not one of the mesh's names {names}")
        return names.index(mesh_axis)
    if not 0 <= mesh_axis < mesh.ndim:
        raise HaloError(f"mesh axis {mesh_axis} is out of range for a {mesh.ndim}-D mesh")
    return mesh_axis


def _from_mesh(mesh: DeviceMesh, mesh_axis: int | str) -> Group:
    axis = _mesh_axis(mesh, mesh_axis)
    if mesh.get_coordinate() is None:
        raise HaloError(f"this rank is not in the device mesh {mesh}")
    return Group(mesh.get_group(axis), (mesh, axis), mesh.size(axis), mesh.get_local_rank(axis))


def _from_pg(pg: dist.ProcessGroup) -> Group:
    lm = enabled_local_tensor_mode()
    if lm is None:
        rank = dist.get_rank(pg)
        if rank < 0:
            raise HaloError(
                f"this rank ({dist.get_rank()}) is not in the group with ranks "
                f"{dist.get_process_group_ranks(pg)}"
            )
        return Group(pg, pg, pg.size(), rank)
    members = dist.get_process_group_ranks(pg)
    if set(lm.ranks) - set(members):
        raise HaloError(
            f"under LocalTensorMode a ProcessGroup must hold every simulated rank "
            f"{sorted(lm.ranks)}, got {members}; pass a DeviceMesh axis instead"
        )
    local = {r: dist.get_group_rank(pg, r) for r in lm.ranks}
    return Group(pg, pg, pg.size(), torch.SymInt(LocalIntNode(local)))


def resolve_group(group: GroupLike) -> Group:
    """Resolve a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair.

    Raises:
        HaloError: for any other value, a mesh of more than one dim without an axis, or a
            group the calling rank is not in.
    """
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return _from_mesh(group[0], group[1])
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise HaloError(
                f"a {group.ndim}-D DeviceMesh needs an axis: pass (mesh, mesh_axis), "
                f"e.g. (mesh, {(group.mesh_dim_names or (group.ndim - 1,))[-1]!r})"
            )
        return _from_mesh(group, 0)
    if isinstance(group, dist.ProcessGroup):
        return _from_pg(group)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group returns on ranks it does not include.
        raise HaloError(f"this rank ({dist.get_rank()}) is not in the group: dist.new_group "
                        "returned GroupMember.NON_GROUP_MEMBER here")
    raise HaloError(
        "group must be a ProcessGroup, a 1-D DeviceMesh or a (DeviceMesh, mesh_axis) pair, "
        f"got {type(group).__name__}"
    )


def _eager(buf: torch.Tensor) -> bool:
    """Plain tensors in eager mode take c10d's own async calls (a `Work` to wait on); traced,
    fake and simulated (`LocalTensorMode`) tensors take functional collectives."""
    return (type(buf) is torch.Tensor and not torch.compiler.is_compiling()
            and enabled_local_tensor_mode() is None)


@dataclass(frozen=True)
class Pending:
    """A collective in flight: `wait()` returns its result once it has arrived."""

    tensor: torch.Tensor
    works: tuple[Any, ...] = ()

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.tensor


def gather_ints(values: torch.Tensor, group: Group) -> list[list[int]]:
    """All-gather one small int64 vector per rank; every rank gets every rank's row."""
    try:
        if _eager(values):
            out = values.new_empty(group.size * values.numel())
            dist.all_gather_single(out, values, group=group.pg)
            flat = out.tolist()
        else:
            flat = funcol.all_gather_single(values, 0, group.funcol_group).tolist()
    except RuntimeError as exc:  # gloo/nccl timeouts and broken groups (DistBackendError)
        raise HaloError(
            "the halo metadata exchange did not complete: another rank of the group did not "
            "reach this halo layer within the process group's timeout (did it raise?), or "
            f"the group is broken. Backend said: {str(exc).splitlines()[0]}"
        ) from exc
    n = len(flat) // group.size
    return [flat[i * n : (i + 1) * n] for i in range(group.size)]


def start_all_to_all(
    buf: torch.Tensor, recv_splits: list[Any], send_splits: list[Any], group: Group
) -> Pending:
    """Start an all-to-all along dim 0 with per-peer split sizes (zero: no bytes to that
    peer). The receive buffer is allocated uninitialised: the collective fills all of it."""
    if not _eager(buf):
        return Pending(funcol.all_to_all_single(buf, recv_splits, send_splits,
                                                group.funcol_group))
    buf = buf.contiguous()
    out = buf.new_empty((sum(recv_splits), *buf.shape[1:]))
    work = dist.all_to_all_single(out, buf, list(recv_splits), list(send_splits),
                                  group=group.pg, async_op=True)
    return Pending(out, (work,))


def all_to_all(
    buf: torch.Tensor, recv_splits: list[Any], send_splits: list[Any], group: Group
) -> torch.Tensor:
    """All-to-all along dim 0 with per-peer split sizes, waited for."""
    return start_all_to_all(buf, recv_splits, send_splits, group).wait()


def all_gather(buf: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along dim 0: every rank gets every rank's `buf`, in rank order."""
    return funcol.all_gather_single(buf, 0, group.funcol_group)


def reduce_scatter(buf: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over ranks, then rank r keeps block r of dim 0 (the adjoint of `all_gather`)."""
    return funcol.reduce_scatter_single(buf, "sum", 0, group.funcol_group)


def start_p2p(
    buf: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: Group
) -> Pending:
    """The all-to-all move done with `batch_isend_irecv`; eager, real groups only.

    Send buffers are contiguous chunks of one buffer: gloo rejects strided sends, and a
    failure mid-batch would leave posted ops dangling.
    """
    if torch.compiler.is_compiling():
        raise HaloError(
            "transport='p2p' cannot run under torch.compile (batch_isend_irecv is not "
            "traceable safely); use transport='all_to_all'"
        )
    if enabled_local_tensor_mode() is not None:
        raise HaloError(
            "transport='p2p' needs real processes; under LocalTensorMode use 'all_to_all' "
            "or 'allgather'"
        )
    buf = buf.contiguous()
    out = buf.new_empty((sum(recv_splits), *buf.shape[1:]))
    if buf.shape[1:].numel() == 0:
        return Pending(out)
    ops = [
        dist.P2POp(dist.isend, chunk, group=group.pg, group_peer=peer)
        for peer, chunk in enumerate(buf.split(send_splits))
        if chunk.shape[0]
    ] + [
        dist.P2POp(dist.irecv, chunk, group=group.pg, group_peer=peer)
        for peer, chunk in enumerate(out.split(recv_splits))
        if chunk.shape[0]
    ]
    return Pending(out, tuple(dist.batch_isend_irecv(ops)) if ops else ())


def all_reduce_sum(buf: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `buf` over the group (not differentiable: for gradients after backward)."""
    return funcol.wait_tensor(funcol.all_reduce(buf, "sum", group.funcol_group))


def all_gather_autograd(buf: torch.Tensor, group: Group) -> torch.Tensor:
    """Differentiable all-gather along dim 0; backward is a reduce-scatter of the gradient."""
    return funcol.all_gather_single_autograd(buf, 0, group.funcol_group)
