"""The all-to-all from `Shard(T)` to rows and back (`haloshard._swap`), and Mochi's attention
along T run on it: real gloo ranks against one device, forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from haloshard.testing import seeded_randn, shard, worker_mesh

pytest.importorskip("diffusers")

pytestmark = pytest.mark.gloo


def _group() -> Any:
    from haloshard._comm import resolve_group

    mesh = worker_mesh(dist.get_world_size())
    return mesh, resolve_group(mesh)


_MOVES = [((1, 3, 7, 5, 4), 3), ((2, 3, 5, 3, 6), 4), ((1, 2, 3, 4, 4), 3)]


def _round_trips() -> list[dict[str, Any]]:
    """On this gloo rank: every case of `_MOVES`, contiguous and channels-last."""
    return [{"case": (shape, along, channels_last),
             **_round_trip(shape, along, channels_last)}
            for shape, along in _MOVES for channels_last in (False, True)]


def _round_trip(shape: tuple[int, ...], along: int, channels_last: bool) -> dict[str, Any]:
    """On this gloo rank: a chunk moved to rows and back, forward and backward."""
    from haloshard._layout import shard_sizes
    from haloshard._swap import rows_to_time, time_to_rows

    _, grp = _group()
    rank, world = grp.rank, grp.size
    full = seeded_randn(shape, 1, torch.float64)
    if channels_last:
        full = full.to(memory_format=torch.channels_last_3d)
    lengths = shard_sizes(shape[2], world)
    local = shard(full, 2, world, rank).clone().requires_grad_()
    rows = time_to_rows(local, grp, lengths, along)
    want = shard(full, along, world, rank).permute(2, 0, 3, 4, 1)
    back = rows_to_time(rows * 2, grp, lengths, along, local)
    back.backward(torch.ones_like(back))
    with torch.no_grad():
        fused = rows_to_time(rows, grp, lengths, along, local, residual=local)
    leaf = local.detach().requires_grad_()  # a backward that builds a graph, then its own
    (g,) = torch.autograd.grad((time_to_rows(leaf, grp, lengths, along) ** 2).sum(), leaf,
                               create_graph=True)
    g.sum().backward()
    return {"rows": bool(torch.equal(rows, want)),
            "double": bool(torch.equal(g, leaf * 2))
            and bool(torch.equal(leaf.grad, torch.full_like(leaf, 2.0))),
            "back": bool(torch.equal(back, local * 2)),
            "fused": bool(torch.equal(fused, local * 2)),
            "layout": back.stride() == local.stride() and fused.stride() == local.stride(),
            "grad": bool(torch.equal(local.grad, torch.full_like(local, 2.0)))}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_round_trip_exact(gloo: Any, world: int) -> None:
    """Data moves are exact: to rows and back gives the chunk bit for bit, in its own
    layout (contiguous and channels-last), uneven and empty chunks of T (3 frames on 4
    ranks) and of the rows; the backward of the two moves is the identity too, and a
    backward that builds a graph differentiates through them again."""
    for rank, rows in enumerate(gloo(world).run(_round_trips)):
        for row in rows:
            assert all(v for k, v in row.items() if k != "case"), (rank, row)


def _mochi_attention(grad: bool, shape: tuple[int, ...], channels_last: bool
                     ) -> dict[str, float]:
    """On this gloo rank: `h + attention(h)` of Mochi's causal attention along T (the
    block's own steps on one device) against the swapped form on `Shard(T)`; with `grad`,
    the input and parameter gradients too (parameters summed over the ranks)."""
    from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0

    from haloshard.integrations.diffusers.mochi import _swapped_attention, _swapped_rows

    mesh, grp = _group()
    rank, world = grp.rank, grp.size
    torch.manual_seed(0)
    attn = Attention(query_dim=shape[1], heads=2, dim_head=shape[1] // 2, qk_norm="l2",
                     is_causal=True, processor=MochiVaeAttnProcessor2_0()).double()
    full = seeded_randn(shape, 1, torch.float64)
    if channels_last:
        full = full.to(memory_format=torch.channels_last_3d)
    g = seeded_randn(shape, 2, torch.float64)
    b, _, _, h, w = shape

    def reference(x: torch.Tensor) -> torch.Tensor:
        tokens = x.permute(0, 3, 4, 2, 1).flatten(0, 2).contiguous()
        return x + attn(tokens).unflatten(0, (b, h, w)).permute(0, 4, 3, 1, 2)

    x_ref = full.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        ref = reference(x_ref)
        if grad:
            (ref * g).sum().backward()
    ref_grads = [p.grad.clone() for p in attn.parameters()] if grad else []
    attn.zero_grad(set_to_none=True)
    local = shard(full, 2, world, rank).clone().requires_grad_(grad)
    x = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=full.shape,
                           stride=full.stride())
    along = _swapped_rows(x)
    with torch.set_grad_enabled(grad):
        y = _swapped_attention(attn, torch.nn.Identity(), x, along).to_local()
        if grad:
            (y * shard(g, 2, world, rank)).sum().backward()
    out = {"along": along, "diff": float((y - shard(ref, 2, world, rank)).abs().max()),
           "layout": float(all(y.is_contiguous(memory_format=f)
                               == local.is_contiguous(memory_format=f)
                               for f in (torch.contiguous_format, torch.channels_last_3d)))}
    if grad:
        out["grad"] = float((local.grad - shard(x_ref.grad, 2, world, rank)).abs().max())
        worst = 0.0
        for p, want in zip(attn.parameters(), ref_grads, strict=True):
            summed = p.grad.clone()
            dist.all_reduce(summed)
            worst = max(worst, float((summed - want).abs().max()))
        out["params"] = worst
    return out


def _mochi_attentions() -> list[dict[str, Any]]:
    """On this gloo rank: `_mochi_attention` for two shapes (H or W the longer, batch 1
    and 2), inference and training, contiguous and channels-last."""
    return [{"case": (shape, grad, channels_last),
             **_mochi_attention(grad, shape, channels_last)}
            for shape in ((1, 8, 7, 6, 4), (2, 8, 7, 3, 5)) for grad in (False, True)
            for channels_last in (False, True)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mochi_attention_swapped(gloo: Any, world: int) -> None:
    """Mochi's attention along T through the all-to-all to rows: the same as one device's
    block steps, inference and training (output, input gradient, parameter gradients
    summed over ranks), 7 frames uneven over 2-4 ranks, contiguous and channels-last, H
    or W taken (the longer). Float64: the sharded attention runs the same kernels on the
    same sequences; what differs is the linear layers' row blocking and the parameter
    gradients' sum over ranks (1e-12 bounds both at these O(1) values)."""
    for rank, rows in enumerate(gloo(world).run(_mochi_attentions)):
        for row in rows:
            shape = row["case"][0]
            assert row["along"] == (3 if shape[3] >= shape[4] else 4), row
            assert row["layout"] == 1.0, (rank, row)
            assert max(v for k, v in row.items() if k not in ("along", "layout", "case")) \
                <= 1e-12, (rank, row)


def _mochi_encoder(shape: tuple[int, ...]) -> str:
    """On this gloo rank: Mochi's encoder (32 channels, one layer a block) planned on T,
    against one device through `verify_plan` (forward, input and parameter gradients)."""
    from diffusers import AutoencoderKLMochi

    from haloshard import verify_plan
    from haloshard.integrations.diffusers import plan_for
    from haloshard.testing import single_device

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5).double().eval()
    mesh, _ = _group()
    report = verify_plan(vae.encoder, plan_for(vae.encoder), seeded_randn(shape, 1), mesh,
                         run=lambda m, t: m(t)[0], atol=1e-10, rtol=1e-10)
    assert report.ok and len(report.param_grads) > 20, report
    return "ok"


def test_mochi_encoder_on_time(gloo: Any) -> None:
    """Mochi's whole encoder on T on real ranks, whose attention takes the all-to-all to
    rows (simulated ranks keep the K/V path): exact against one device, float64, forward,
    input gradient and every parameter gradient (the tolerance, as tests/test_diffusers.py's:
    sums of O(1) values in another order through ~20 layers; a bias before a GroupNorm has
    a gradient of ~1e-12, zero up to that rounding)."""
    # 3 ranks, 7 frames as 3, 3, 1 -> 2, 2, 0 at the attention (an empty chunk), whose
    # 4x8 pixels move along W (the longer)
    assert gloo(3).run(_mochi_encoder, (1, 3, 7, 8, 16), timeout=300) == ["ok"] * 3


def _wrong_frames() -> None:
    """On this gloo rank: the swapped attention where the last rank's chunk holds one frame
    more than its DTensor's global shape gives it."""
    from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0

    from haloshard.integrations.diffusers.mochi import _swapped_attention

    mesh, grp = _group()
    attn = Attention(query_dim=8, heads=2, dim_head=4, qk_norm="l2", is_causal=True,
                     processor=MochiVaeAttnProcessor2_0()).double()
    full = seeded_randn((1, 8, 6, 4, 4), 1, torch.float64)
    local = shard(full, 2, grp.size, grp.rank)
    if grp.rank == grp.size - 1:
        local = torch.cat([local, local[:, :, :1]], 2)
    x = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=full.shape,
                           stride=full.stride())
    with torch.no_grad():
        _swapped_attention(attn, torch.nn.Identity(), x, 3)


def test_mistake_on_one_rank_raises_everywhere(gloo: Any) -> None:
    """A chunk that does not fit the agreed frames on one rank raises `HaloError` naming
    the lengths on every rank (the ranks agree before the all-to-all, whose sizes would
    otherwise differ), none left waiting."""
    for ok, value in gloo(2).outcomes(_wrong_frames, timeout=60):
        assert not ok and value[0] == "HaloError", value
        assert "chunk lengths [3, 4]" in value[1] and "global_length=6" in value[1], value


def _mochi_attention_two_axes() -> dict[str, float]:
    """On this gloo rank of a `(t, h)` mesh of 2 x 2: the swapped attention on a chunk
    sharded on T and H, against one device's block steps (inference and training)."""
    from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0

    from haloshard.integrations.diffusers.mochi import _swapped_attention, _swapped_rows

    mesh = worker_mesh((2, 2), mesh_dim_names=("t", "h"))
    t_rank, h_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
    torch.manual_seed(0)
    attn = Attention(query_dim=8, heads=2, dim_head=4, qk_norm="l2", is_causal=True,
                     processor=MochiVaeAttnProcessor2_0()).double()
    full = seeded_randn((1, 8, 7, 5, 6), 1, torch.float64)
    x_ref = full.clone().requires_grad_()
    tokens = x_ref.permute(0, 3, 4, 2, 1).flatten(0, 2)
    ref = x_ref + attn(tokens).unflatten(0, (1, 5, 6)).permute(0, 4, 3, 1, 2)
    ref.sum().backward()

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard(shard(t, 2, 2, t_rank), 3, 2, h_rank)

    local = mine(full).clone().requires_grad_()
    x = DTensor.from_local(local, mesh, [Shard(2), Shard(3)], run_check=False,
                           shape=full.shape, stride=full.stride())
    y = _swapped_attention(attn, torch.nn.Identity(), x, _swapped_rows(x)).to_local()
    y.sum().backward()
    with torch.no_grad():
        y_inf = _swapped_attention(attn, torch.nn.Identity(), x, 4).to_local()
    return {"along": _swapped_rows(x), "diff": float((y - mine(ref)).abs().max()),
            "inference": float((y_inf - mine(ref)).abs().max()),
            "grad": float((local.grad - mine(x_ref.grad)).abs().max())}


def test_mochi_attention_two_axes(gloo: Any) -> None:
    """T and H sharded at once (2 x 2, 7 frames as 4, 3 and 5 rows as 3, 2): the moves run
    within each T group along W (6 columns, longer than a rank's rows), exact against one
    device in float64 (output, inference output, input gradient; 1e-12 as above)."""
    for rank, row in enumerate(gloo(4).run(_mochi_attention_two_axes)):
        assert row.pop("along") == 4, (rank, row)
        assert max(row.values()) <= 1e-12, (rank, row)
