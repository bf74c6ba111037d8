"""Issue 25 ("Real scale") on H: the memory misses of HunyuanVideo's encode and Mochi's
decode and encode with `plan_for(vae, dims=(3,))`, against one device.

- A causal conv (HunyuanVideo's, Mochi's replicate CogVideoX conv) with H sharded got its
  H window (the rows and their halo) from the style, then padded a copy of it itself (its
  `F.pad` of T, causal, and of W): the window and its padded copy lived at once, where one
  device holds its padded input only. The plan now names those widths too, so the rows
  are padded along T and W before the H exchange and the wrapper's `F.pad` copies nothing:
  one padded window per rank when the conv starts (counted).
- Mochi's attention along T per pixel, with H sharded, called torch's attention on 6-D
  `(B, H_r, W, heads, T, E)` tensors, for which CPU's attention falls back to its math
  path: every pixel's `(T, T)` scores and their softmax at once. The processor (one
  device) calls it on 4-D `(pixels, heads, T, E)`, which runs the flash kernel and
  holds no scores. The rows now attend on 4-D too: no `(T, T)` tensor (counted), the peak
  under one device's share, and exact against one device, forward and backward.
- HunyuanVideo's upsampler with H sharded ran its own forward on a window of rows: the
  interpolated window, its concatenation with the first frame and the conv wrapper's
  padded copy, each taller than the rows its outputs read. It now gathers those up-rows
  (every up-frame and padded up-column) from the exchanged rows in one index, as it does
  with T sharded, and runs its conv on them (counted: one gathered buffer per rank).
- CogVideoX's and Wan 2.1's causal convs concatenate cached frames before their input
  (Wan's pads T, H and W too): with H sharded, the module's `torch.cat` (and `F.pad`) and
  the exchanged window of rows were two or three buffers of the chunk's size at once. In
  inference on real ranks every piece is now written into one window (counted on gloo).

Memory is counted on simulated ranks (`simulated_mesh`, `LocalTensorMode`: every op runs
for all ranks at once, so the bytes live at a moment are the sum over ranks of what each
rank holds then), or per gloo rank where the path runs on real ranks only, with the
allocator-tracked counter `benchmarks.vae` uses (torch's profiler allocation records on
CPU).

Tolerances: float64 exactness tests at atol = 1e-12, rtol = 1e-10: the sharded run adds
the same products in another order (parameter gradients summed over ranks), a few ulps of
O(1) values apart, while a misplaced frame or row is O(1). The memory tests run in float32
(the benchmark's dtype) and compare at 1e-5 (sums of a few hundred O(1) products, in
oneDNN's or the attention kernel's order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import reduce_grads
from haloshard.integrations.diffusers import plan_for
from haloshard.testing import (
    allocations,
    assert_close_per_rank,
    peak_bytes,
    per_rank,
    rank_map,
    seeded_randn,
    shard,
    sharded,
    simulated_mesh,
    single_device,
)

pytest.importorskip("diffusers")

TOL = {"atol": 1e-12, "rtol": 1e-10}
TOL32 = {"atol": 1e-5, "rtol": 1e-5}


# ---------------------------------------------------------------- counters
def live_at_conv(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes allocated during `fn()` and still live when its first conv starts: the
    buffers that conv reads, whatever its kernel then allocates. And `fn`'s result."""
    sizes, convs, out = allocations(fn, ("aten::convolution", "aten::mkldnn_convolution"))
    assert convs, "no aten::convolution ran"
    return sum(size for t, size in sizes if t < min(convs)), out


class Outputs(TorchDispatchMode):
    """The shape of every aten op's tensor output under it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


# ---------------------------------------------------------------- the layers
def _rows_style(part: nn.Module, cls: str, dims: tuple[int, ...] = (3,)) -> Any:
    """The style `plan_for(part, dims=dims)` gives the first module of class `cls`."""
    plan = plan_for(part, dims=dims)
    fqn = next(n for n, m in part.named_modules() if type(m).__name__ == cls and n in plan)
    return plan[fqn]


def hunyuan_conv(cin: int, cout: int, stride: int = 1, dims: tuple[int, ...] = (3,)
                 ) -> tuple[nn.Module, Any]:
    """HunyuanVideo's causal conv (k 3, replicate `F.pad` of T, H, W) and its style on
    `dims` (H by default)."""
    from diffusers import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
        HunyuanVideoCausalConv3d,
    )

    with single_device():
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            norm_num_groups=2)
    style = _rows_style(vae.encoder, "HunyuanVideoCausalConv3d", dims)
    with single_device():
        torch.manual_seed(0)
        return HunyuanVideoCausalConv3d(cin, cout, 3, stride=stride), style


def mochi_vae() -> nn.Module:
    from diffusers import AutoencoderKLMochi

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        return AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)


def mochi_conv(cin: int, cout: int, stride: int = 1, dims: tuple[int, ...] = (3,)
               ) -> tuple[nn.Module, Any]:
    """Mochi's causal conv (CogVideoX's class, replicate mode) and its style on `dims` (H
    by default)."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d

    style = _rows_style(mochi_vae().decoder, "CogVideoXCausalConv3d", dims)
    with single_device():
        torch.manual_seed(0)
        return CogVideoXCausalConv3d(cin, cout, 3, stride=stride, pad_mode="replicate"), style


CONVS = {"hunyuan": hunyuan_conv, "mochi": mochi_conv}


def _first(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple) else y


# ---------------------------------------------------------------- causal convs on H
@pytest.mark.simulated
@pytest.mark.parametrize("name", sorted(CONVS))
def test_rows_causal_conv_holds_one_window(name: str) -> None:
    """Inference, H sharded: when the conv starts, a rank holds one padded window (its 8
    of 16 rows and 2 halo rows, 2 causal frames before its 32, W padded by 1 each side),
    as one device holds its padded input: over both ranks 20 of one device's 18 padded
    rows (1.11 of it; the bound 1.25 leaves room for small buffers), where the reverted
    plan held the exchanged window and the wrapper's padded copy of it (2.1)."""
    module, style = CONVS[name](16, 16)
    full = seeded_randn((1, 16, 32, 16, 16), 1, torch.float32)
    with single_device(), torch.no_grad():
        one, y_ref = live_at_conv(lambda: _first(module(full)))
    with simulated_mesh(2) as mesh:
        parallelize_module(module, mesh, style)
        x = DTensor.from_local(rank_map(mesh, lambda r: shard(full, 3, 2, r)), mesh,
                               [Shard(3)], shape=full.shape, stride=full.stride())
        with torch.no_grad():
            _first(module(x))  # agrees the site
            ranks, y = live_at_conv(lambda: _first(module(x)))
        assert_close_per_rank(y.to_local(), lambda r: shard(y_ref, 3, 2, r), mesh, **TOL32)
    assert one == 16 * 34 * 18 * 18 * 4, one  # one device: its padded input alone
    assert ranks <= 1.25 * one, ranks / one


@pytest.mark.simulated
@pytest.mark.parametrize("name", sorted(CONVS))
def test_time_rows_causal_conv_holds_one_window(name: str) -> None:
    """Inference, T and H sharded on a 2 x 2 mesh: the chunk is padded along W (which
    neither shards) before the exchanges, so when the conv starts a rank holds one padded
    window (2 causal frames and its 16 of 32, a halo row each side of its 8 of 16, W padded
    by 1 each side). Over the four ranks 4 x 18 x 10 x 18 of one device's padded 34 x 18 x
    18 (1.18 of it; the bound 1.25 leaves room for small buffers), where the exchanged
    window and the wrapper's padded copy of it held 2.2 (HunyuanVideo's T+H encode peak)."""
    module, style = CONVS[name](16, 16, dims=(2, 3))
    full = seeded_randn((1, 16, 32, 16, 16), 1, torch.float32)
    with single_device(), torch.no_grad():
        one, y_ref = live_at_conv(lambda: _first(module(full)))
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        parallelize_module(module, mesh["t"], style)
        x = distribute_tensor(full, mesh, [Shard(2), Shard(3)])
        with torch.no_grad():
            _first(module(x))  # agrees the site
            ranks, y = live_at_conv(lambda: _first(module(x)))
        got = per_rank(y.to_local())
    for rank, local in got.items():  # global rank r: t = r // 2, h = r % 2
        t, h = divmod(rank, 2)
        torch.testing.assert_close(local, shard(shard(y_ref, 2, 2, t), 3, 2, h), **TOL32)
    assert one == 16 * 34 * 18 * 18 * 4, one  # one device: its padded input alone
    assert ranks <= 1.25 * one, ranks / one


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "rows", "world", "stride"), [
    ("hunyuan", 7, 2, 1),  # 4, 3 rows
    ("hunyuan", 9, 2, 2),  # 5, 4 rows, the downsampler's stride 2 -> 3, 2 of 5
    ("hunyuan", 7, 3, 1),  # 3, 2, 2
    ("mochi", 7, 2, 1),
    ("mochi", 5, 3, 2),  # 2, 2, 1 -> stride 2: 1, 1, 1 of 3
    ("mochi", 3, 4, 1),  # 1, 1, 1, 0: an empty chunk keeps the wrapper's own padding
])
def test_rows_causal_conv_exact(name: str, rows: int, world: int, stride: int) -> None:
    """H sharded: forward, input gradient and parameter gradients against one device,
    float64 (uneven rows, stride 2, an empty shard)."""
    module, style = CONVS[name](3, 4, stride)
    module = module.double()
    twin = copy.deepcopy(module)
    full = seeded_randn((1, 3, 5, rows, 6), 1)
    with single_device():
        x_ref = full.clone().requires_grad_()
        y_ref = _first(twin(x_ref))
        gy = seeded_randn(tuple(y_ref.shape), 2)
        (y_ref * gy).sum().backward()
    with simulated_mesh(world) as mesh:
        parallelize_module(module, mesh, style)
        x, local = sharded(mesh, full, dim=3)
        y = _first(module(x))
        got = y.to_local()
        assert_close_per_rank(got, lambda r: shard(y_ref.detach(), 3, world, r), mesh, **TOL)
        (got * rank_map(mesh, lambda r: shard(gy, 3, world, r))).sum().backward()
        assert_close_per_rank(local.grad, lambda r: shard(x_ref.grad, 3, world, r), mesh,
                              **TOL)
        reduce_grads(module, mesh)
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            assert_close_per_rank(p.grad, lambda r, g=q.grad: g, mesh, **TOL)


# ---------------------------------------------------------------- Mochi's attention on H
def mochi_attention() -> nn.Module:
    """`MochiDownBlock3D`'s attention: 64 channels, 2 heads, l2 q/k norms, causal."""
    from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0

    with single_device():
        torch.manual_seed(0)
        return Attention(query_dim=64, heads=2, dim_head=32, qk_norm="l2", is_causal=True,
                         processor=MochiVaeAttnProcessor2_0()).eval()


def _one_device_attention(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's steps around its attention on one device (`MochiDownBlock3D.forward`,
    one chunk of pixels), without the block's residual."""
    b, _, _, h, w = x.shape
    tokens = x.permute(0, 3, 4, 2, 1).flatten(0, 2).contiguous()
    return attn(tokens).unflatten(0, (b, h, w)).permute(0, 4, 3, 1, 2)


@pytest.mark.simulated
def test_rows_attention_holds_no_scores() -> None:
    """Inference, H sharded (16 rows as 8, 8; 24 frames): Mochi's attention along T makes
    no `(T, T)` tensor (the reverted rows made the scores and their softmax for every
    pixel at once, 6-D attention on CPU's math path), and the two ranks together peak
    below one device's peak (its attention on 4-D runs the flash kernel alike), where the
    reverted rows peaked at 1.6 times it. Exact up to float32 rounding (sums over 24
    frames of O(1) products, in the kernel's order)."""
    from haloshard.integrations.diffusers.mochi import _pixel_attention_rows

    attn = mochi_attention()
    frames, full = 24, seeded_randn((1, 64, 24, 16, 4), 1, torch.float32)
    with single_device(), torch.no_grad():
        one, want = peak_bytes(lambda: _one_device_attention(attn, full))
    with simulated_mesh(2) as mesh, torch.no_grad():
        x = distribute_tensor(full, mesh, [Shard(3)])

        def run() -> torch.Tensor:
            return _pixel_attention_rows(attn, x, 3)

        with Outputs() as outputs:
            run()
        ranks, y = peak_bytes(run)
        assert_close_per_rank(y.to_local(), lambda r: shard(want, 3, 2, r), mesh, **TOL32)
    assert ranks <= 1.1 * one, ranks / one
    scores = [s for s in outputs.shapes if s[-2:] == (frames, frames)]
    assert not scores, scores


@pytest.mark.simulated
@pytest.mark.parametrize(("rows", "world"), [(10, 2), (6, 3)])
def test_rows_mochi_block_exact(rows: int, world: int) -> None:
    """Mochi's first down block (conv_in of stride 2 on H, a resnet, the attention along
    T per pixel) with H sharded, with autograd: forward, input gradient and every
    parameter gradient against one device, float64. 10 rows as 5, 5 -> 3, 2 after
    conv_in; 6 as 2, 2, 2 -> 1, 1, 1."""
    vae = mochi_vae().double()
    full = seeded_randn((1, 32, 5, rows, 4), 1)
    block = vae.encoder.down_blocks[0]
    with single_device():
        twin = copy.deepcopy(block)
        x_ref = full.clone().requires_grad_()
        y_ref = twin(x_ref)[0]
        gy = seeded_randn(tuple(y_ref.shape), 2)
        (y_ref * gy).sum().backward()
    with simulated_mesh(world) as mesh:
        parallelize_module(vae.encoder, mesh, plan_for(vae.encoder, dims=(3,)))
        x = distribute_tensor(full, mesh, [Shard(3)]).requires_grad_()
        y = block(x)[0]
        assert isinstance(y, DTensor) and tuple(y.placements) == (Shard(3),), y
        torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
        (y * distribute_tensor(gy, mesh, [Shard(3)])).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
        reduce_grads(block, mesh)
        for (name, p), q in zip(block.named_parameters(), twin.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert_close_per_rank(p.grad, lambda r, g=q.grad: g, mesh, **TOL)


# ---------------------------------------------------------------- HunyuanVideo's upsampler on H
def hunyuan_upsampler(channels: int, factor: tuple[int, int, int], dims: tuple[int, ...] = (3,)
                      ) -> tuple[nn.Module, Any]:
    """HunyuanVideo's upsampler (nearest by `factor`, the first frame by its spatial
    factors only, then a causal replicate conv, k 3) and the style its plan on `dims`
    gives it."""
    from diffusers import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
        HunyuanVideoUpsampleCausal3D,
    )

    with single_device():
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            norm_num_groups=2)
    style = _rows_style(vae.decoder, "HunyuanVideoUpsampleCausal3D", dims)
    with single_device():
        torch.manual_seed(0)
        return HunyuanVideoUpsampleCausal3D(channels, channels, upsample_factor=factor), style


@pytest.mark.simulated
def test_rows_upsampler_gathers_once() -> None:
    """Inference, H sharded (16 rows as 8, 8; 9 frames -> 17): when the conv starts, the
    two ranks hold together 0.44 of what one device holds there (its interpolated frames,
    their concatenation and its padded copy of them), since each rank gathers once the
    up-rows its outputs read (16 and 1 on each side, W padded); the reverted style ran
    the module on a window of 10 rows (20 up-rows): 1.33 of one device's."""
    module, style = hunyuan_upsampler(8, (2, 2, 2))
    full = seeded_randn((1, 8, 9, 16, 8), 1, torch.float32)
    with single_device(), torch.no_grad():
        one, y_ref = live_at_conv(lambda: module(full))
    with simulated_mesh(2) as mesh:
        parallelize_module(module, mesh, style)
        x = distribute_tensor(full, mesh, [Shard(3)])
        with torch.no_grad():
            module(x)  # agrees the site
            ranks, y = live_at_conv(lambda: module(x))
        assert_close_per_rank(y.to_local(), lambda r: shard(y_ref, 3, 2, r), mesh, **TOL32)
    # per rank, the gathered up-frames: 8 channels, 2 of history + 17 frames, 16 + 2
    # up-rows, 16 + 2 up-columns (float32); beside them only the small index tensors
    gathered = 2 * 8 * 19 * 18 * 18 * 4
    assert gathered <= ranks <= 1.05 * gathered, ranks / gathered
    assert ranks <= 0.5 * one, ranks / one


@pytest.mark.simulated
def test_time_rows_upsampler_gathers_once() -> None:
    """Inference, T and H sharded on a 2 x 2 mesh (9 frames as 5, 4 -> 17 as 9, 8; 16 rows
    as 8, 8 -> 32 as 16, 16): each rank gathers once the up-frames and up-rows its outputs
    read, from the window exchanged along T then H, instead of running the module on that
    window: when the conv starts the four ranks hold together 0.51 of what one device holds
    there (0.13 each, against 1/4); the window path held 1.77 (0.44 each), where
    HunyuanVideo's T+H decode peaked."""
    module, style = hunyuan_upsampler(8, (2, 2, 2), dims=(2, 3))
    full = seeded_randn((1, 8, 9, 16, 8), 1, torch.float32)
    with single_device(), torch.no_grad():
        one, y_ref = live_at_conv(lambda: module(full))
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        parallelize_module(module, mesh["t"], style)
        x = distribute_tensor(full, mesh, [Shard(2), Shard(3)])
        with torch.no_grad():
            module(x)  # agrees the site
            ranks, y = live_at_conv(lambda: module(x))
        got = per_rank(y.to_local())
    for rank, local in got.items():  # global rank r: t = r // 2, h = r % 2
        t, h = divmod(rank, 2)
        torch.testing.assert_close(local, shard(shard(y_ref, 2, 2, t), 3, 2, h), **TOL32)
    # per rank (simulated: the longest chunk's), 8 channels, 2 of history + 9 up-frames,
    # 16 + 2 up-rows, 16 + 2 up-columns (float32); beside them only small index tensors
    gathered = 4 * 8 * 11 * 18 * 18 * 4
    assert gathered <= ranks <= 1.05 * gathered, ranks / gathered
    assert ranks <= 0.55 * one, ranks / one


@pytest.mark.simulated
@pytest.mark.parametrize(("rows", "world", "factor"), [
    (5, 2, (2, 2, 2)),  # 3, 2 rows -> 10 up-rows as 5, 5 (a rank's outputs cross rows)
    (7, 3, (2, 2, 2)),  # 3, 2, 2 -> 14 as 5, 5, 4
    (3, 2, (1, 2, 2)),  # no temporal factor
    (2, 4, (2, 2, 2)),  # 4 up-rows as 1, 1, 1, 1 on 1, 1, 0, 0 rows: halos from afar
    (1, 3, (2, 2, 2)),  # 2 up-rows as 1, 1, 0: a rank without outputs (the window path)
])
def test_rows_upsampler_exact(rows: int, world: int, factor: tuple[int, int, int]) -> None:
    """H sharded: forward, input gradient and parameter gradients against one device,
    float64."""
    module, style = hunyuan_upsampler(3, factor)
    module = module.double()
    twin = copy.deepcopy(module)
    full = seeded_randn((1, 3, 4, rows, 3), 1)
    with single_device():
        x_ref = full.clone().requires_grad_()
        y_ref = twin(x_ref)
        gy = seeded_randn(tuple(y_ref.shape), 2)
        (y_ref * gy).sum().backward()
    with simulated_mesh(world) as mesh:
        parallelize_module(module, mesh, style)
        x = distribute_tensor(full, mesh, [Shard(3)]).requires_grad_()
        y = module(x)
        assert isinstance(y, DTensor) and tuple(y.placements) == (Shard(3),), y
        torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
        (y * distribute_tensor(gy, mesh, [Shard(3)])).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
        reduce_grads(module, mesh)
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            assert_close_per_rank(p.grad, lambda r, g=q.grad: g, mesh, **TOL)


# ---------------------------------------------------------------- real ranks (gloo)
@pytest.fixture(scope="module")
def gloo2() -> Any:
    from haloshard.testing import GlooWorld

    world = GlooWorld(2, timeout=300)
    yield world
    world.close()


def _rows_conv_layout(name: str) -> dict[str, Any]:
    """On this gloo rank: whether the causal conv with H sharded gets a channels-last
    window from a channels-last chunk (Mochi's encoder runs channels-last after its
    `proj_in`), and the output's and input gradient's differences to one device's."""
    import torch.distributed as dist

    from haloshard.testing import worker_mesh

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    module, style = CONVS[name](8, 8)
    twin = copy.deepcopy(module)
    seen: list[bool] = []
    module.conv.register_forward_pre_hook(lambda m, a: seen.append(
        a[0].is_contiguous(memory_format=torch.channels_last_3d)))
    parallelize_module(module, mesh, style)
    full = seeded_randn((1, 8, 6, 7, 6), 1, torch.float32).to(
        memory_format=torch.channels_last_3d)  # 4, 3 rows
    x_ref = full.clone().requires_grad_()
    _first(twin(x_ref)).sum().backward()
    y_ref = _first(twin(full)).detach()
    local = shard(full, 3, world, rank).contiguous(
        memory_format=torch.channels_last_3d).requires_grad_()
    y = _first(module(DTensor.from_local(local, mesh, [Shard(3)], shape=full.shape,
                                         stride=full.stride()))).to_local()
    y.sum().backward()
    return {"channels_last": seen,
            "diff": float((y - shard(y_ref, 3, world, rank)).abs().max()),
            "grad": float((local.grad - shard(x_ref.grad, 3, world, rank)).abs().max())}


@pytest.mark.gloo
@pytest.mark.parametrize("name", sorted(CONVS))
def test_rows_causal_conv_keeps_channels_last(gloo2: Any, name: str) -> None:
    """2 gloo ranks, H sharded (7 rows as 4, 3), padded before the exchange: a
    channels-last chunk still gives the conv a channels-last window, as one device's
    padded input is (a contiguous one would make the conv reorder it into another
    buffer). Exact against one device, forward and input gradient (float32: a few ulps
    of sums of 27 * 8 products of O(1) values)."""
    for rank, row in enumerate(gloo2.run(_rows_conv_layout, name)):
        assert row["channels_last"] == [True], (rank, row)
        assert row["diff"] <= 1e-5 and row["grad"] <= 1e-5, (rank, row)


@pytest.mark.simulated
@pytest.mark.parametrize("norm_dim", [-1, 3])
def test_time_attention_normalises_each_token(norm_dim: int) -> None:
    """Mochi's attention along T (2 simulated ranks) with q/k `LpNorm(dim=3)`, which the
    style accepts: dim 3 is each token's E in the processor's 4-D `(B, heads, T, E)`, so it
    must normalise E in the style's 6-D rows too (it normalised the heads axis there,
    silently wrong). Exact against one device up to float32 rounding (sums over 12 frames
    of O(1) products in another order)."""
    from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0

    from haloshard.integrations.diffusers.mochi import _pixel_attention

    torch.manual_seed(0)
    attn = Attention(query_dim=64, heads=2, dim_head=32, qk_norm="l2", is_causal=True,
                     processor=MochiVaeAttnProcessor2_0()).eval()
    attn.norm_q.dim = attn.norm_k.dim = norm_dim
    full = torch.randn((1, 64, 12, 4, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = full.permute(0, 3, 4, 2, 1).flatten(0, 2)
        ref = attn(tokens).unflatten(0, (1, 4, 4)).permute(0, 4, 3, 1, 2)
    with simulated_mesh(2) as mesh, torch.no_grad():
        local = rank_map(mesh, lambda r: shard(full, 2, 2, r).clone())
        y = _pixel_attention(attn, DTensor.from_local(
            local, mesh, [Shard(2)], shape=full.shape, stride=full.stride()), 2)
        assert_close_per_rank(y.to_local(), lambda r: shard(ref, 2, 2, r), mesh,
                              atol=1e-5, rtol=1e-5)


def _pixel_attention_steady() -> dict[str, Any]:
    """On this gloo rank: Mochi's attention along T (inference, 12 frames of 8x8 pixels,
    6 per rank: 4 parts of rows) called twice; the second call's collectives, counted by
    torch's profiler, and its output's difference to one device's."""
    import torch.distributed as dist
    from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0
    from torch.profiler import ProfilerActivity, profile

    from haloshard.integrations.diffusers.mochi import _pixel_attention
    from haloshard.testing import worker_mesh

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)
    attn = Attention(query_dim=64, heads=2, dim_head=32, qk_norm="l2", is_causal=True,
                     processor=MochiVaeAttnProcessor2_0()).eval()
    full = seeded_randn((1, 64, 12, 8, 8), 1, torch.float32)
    with torch.no_grad():
        tokens = full.permute(0, 3, 4, 2, 1).flatten(0, 2)  # the block's own steps
        ref = attn(tokens).unflatten(0, (1, 8, 8)).permute(0, 4, 3, 1, 2)
        x = DTensor.from_local(shard(full, 2, world, rank).contiguous(), mesh, [Shard(2)],
                               shape=full.shape, stride=full.stride())
        _pixel_attention(attn, x, 2)  # agrees each part
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = _pixel_attention(attn, x, 2).to_local()
    names = [e.name for e in prof.events()]
    return {"broadcasts": names.count("c10d::broadcast_"),
            "gathers": sum(n.startswith("c10d::_allgather") or n == "c10d::allgather_"
                           for n in names),
            "diff": float((y - shard(ref, 2, world, rank)).abs().max())}


@pytest.mark.gloo
def test_time_attention_parts_agree_once(gloo2: Any) -> None:
    """2 gloo ranks: Mochi's attention along T runs inference in 4 parts of rows; in
    steady state each part is one broadcast of K/V per rank and nothing else. Each part
    agreed at the attention's one key, so every part saw its signature change: a
    placeholder round of broadcasts and a metadata all-gather per part (2 of Mochi's
    encode's ~9 s a rank at 64 px). Exact against one device up to float32 rounding (sums
    over 12 frames of O(1) products in another order)."""
    for rank, row in enumerate(gloo2.run(_pixel_attention_steady)):
        assert row["broadcasts"] == 4 * 2 and row["gathers"] == 0, (rank, row)
        assert row["diff"] <= 1e-5, (rank, row)


def _padded_window_inference(name: str, dims: tuple[int, ...]) -> dict[str, float]:
    """On this gloo rank: the causal conv sharded on `dims` (T: 7 frames as 4, 3; T and H:
    a 2x2 `(t, h)` mesh, 6 rows as 3, 3) run under no_grad, contiguous and channels-last,
    with the apart-padded chunk forbidden (`_padded_chunk` raises): the wrapper's W (and
    H) padding is written straight into the window. Each output's difference to one
    device's."""
    import torch.distributed as dist

    import haloshard._halo_forward as halo_forward
    from haloshard.testing import worker_mesh

    names = ("t",) if dims == (2,) else ("t", "h")
    mesh = worker_mesh((dist.get_world_size(),) if dims == (2,) else (2, 2),
                       mesh_dim_names=names)
    module, style = CONVS[name](8, 8, dims=dims)
    twin = copy.deepcopy(module)
    parallelize_module(module, mesh["t"], style)

    def forbidden(*args: Any) -> None:
        raise AssertionError("the chunk was padded apart before its window")

    diffs = {}
    for layout in (torch.contiguous_format, torch.channels_last_3d):
        full = seeded_randn((1, 8, 7, 6, 5), 1, torch.float32).to(memory_format=layout)
        with torch.no_grad():
            ref = _first(twin(full))
            x = distribute_tensor(full, mesh, [Shard(d) for d in dims])
            saved, halo_forward._padded_chunk = halo_forward._padded_chunk, forbidden
            try:
                y = _first(module(x))
            finally:
                halo_forward._padded_chunk = saved
            diffs[str(layout)] = float((y.full_tensor() - ref).abs().max())
    return diffs


@pytest.mark.gloo
@pytest.mark.parametrize("dims", [(2,), (2, 3)])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_causal_conv_pads_into_its_window(gloo: Any, name: str, dims: tuple[int, ...]
                                          ) -> None:
    """Inference on real ranks (2 on T, 4 on T and H): the causal wrapper's own padding of
    the dims not sharded is written into the exchanged window's buffer (replicate edges
    copied in place), where the chunk was padded into a buffer of its own first and then
    copied into the window (one more pass over the chunk per conv). Exact against one
    device up to float32 rounding (a few ulps of sums of 27 * 8 products of O(1) values)."""
    for rank, row in enumerate(gloo(2 if dims == (2,) else 4).run(
            _padded_window_inference, name, dims)):
        assert all(d <= 1e-5 for d in row.values()), (rank, row)


class _ZeroPadCausal(nn.Module):
    """A causal wrapper padding T (2 frames before), H and W itself with zeros, then a
    3x3x3 conv without padding (CogVideoX's constant-mode causal conv, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (1, 1, 1, 1, 2, 0)))


def _zero_pad_empty_chunk() -> dict[str, Any]:
    """On this gloo rank (4 ranks, T = 3 as 1, 1, 1, 0): the zero-padding causal wrapper on
    T under no_grad, its H and W padding written into the window in place on the ranks
    holding frames (the apart-padded chunk forbidden there; the empty rank's window is
    trimmed, so it pads apart, and both build the same exchange): the output's shape and
    difference to one device's shard."""
    import torch.distributed as dist

    import haloshard._halo_forward as halo_forward
    from haloshard import CausalConvParallel
    from haloshard.testing import worker_mesh

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    with single_device():
        torch.manual_seed(0)
        module = _ZeroPadCausal()
    twin = copy.deepcopy(module)
    parallelize_module(module, mesh, CausalConvParallel(pad="zeros",
                                                        pads={3: (1, 1), 4: (1, 1)}))
    full = seeded_randn((1, 4, 3, 5, 4), 1, torch.float32)

    def forbidden(*args: Any) -> None:
        raise AssertionError("the chunk was padded apart before its window")

    with torch.no_grad():
        ref = twin(full)
        saved = halo_forward._padded_chunk
        if rank < 3:
            halo_forward._padded_chunk = forbidden
        try:
            y = module(distribute_tensor(full, mesh, [Shard(2)])).to_local()
        finally:
            halo_forward._padded_chunk = saved
    want = shard(ref, 2, world, rank)
    return {"shape": tuple(y.shape), "want": tuple(want.shape),
            "diff": float((y - want).abs().max()) if y.numel() else 0.0}


@pytest.mark.gloo
def test_zero_pads_into_window_with_an_empty_chunk(gloo: Any) -> None:
    """4 gloo ranks, T = 3 (the last rank holds no frame): a zero-padding causal wrapper's
    H and W padding is written into the windows of the ranks holding frames in place (the
    empty rank pads apart, in the same exchange), and every rank's output is its shard of
    one device's (the empty rank's empty), up to float32 rounding (sums of 27 * 4 products
    of O(1) values)."""
    for rank, row in enumerate(gloo(4).run(_zero_pad_empty_chunk)):
        assert row["shape"] == row["want"], (rank, row)
        assert row["diff"] <= 1e-5, (rank, row)


# ---------------------------------------------------------------- CogVideoX's causal conv
def _cog_conv_window() -> dict[str, Any]:
    """On this gloo rank (2 ranks, 16 rows as 8, 8): CogVideoX's constant-mode causal conv
    with H sharded, under no_grad, called as its loop calls it (a first batch, then a
    batch with the first's conv cache). The bytes live when the second conv starts, and
    each output's and cache's difference to one device's."""
    import torch.distributed as dist
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d

    from haloshard.integrations.diffusers.cogvideox import CogRowsCausalParallel
    from haloshard.testing import worker_mesh

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    style = CogRowsCausalParallel(dim=3)  # what plan_for(vae, dims=(3,)) gives it
    with single_device():
        torch.manual_seed(0)
        module = CogVideoXCausalConv3d(16, 16, 3)
    twin = copy.deepcopy(module)
    parallelize_module(module, mesh, style)
    first, second = (seeded_randn((1, 16, t, 16, 16), s, torch.float32)
                     for t, s in ((12, 1), (16, 2)))
    with torch.no_grad():
        y1_ref, cache_ref = twin(first)
        y2_ref, cache2_ref = twin(second, cache_ref)
        y1, cache = module(distribute_tensor(first, mesh, [Shard(3)]))
        x2 = distribute_tensor(second, mesh, [Shard(3)])
        module(x2, cache)  # agrees the cached call's window
        live, (y2, cache2) = live_at_conv(lambda: module(x2, cache))
    diffs = {name: float((got.to_local() - shard(want, 3, world, rank)).abs().max())
             for name, got, want in (("y1", y1, y1_ref), ("cache", cache, cache_ref),
                                     ("y2", y2, y2_ref), ("cache2", cache2, cache2_ref))}
    return {"live": live, "diffs": diffs}


@pytest.mark.gloo
def test_cog_rows_causal_conv_holds_one_window(gloo2: Any) -> None:
    """2 gloo ranks, H sharded, inference: CogVideoX's causal conv writes its cached frames
    and its input straight into the conv's window of rows, so when the conv starts a rank
    holds that window (2 + 16 frames, its 8 rows and a halo row each side), the new
    cache (2 frames of its rows) and at most the exchange's rows: 1.09 to 1.29 of the
    window, where the module's `torch.cat` and
    the window built from it held 2.0 (CogVideoX's encode on H peaked there). Exact
    against one device up to float32 rounding (sums of 27 * 16 products of O(1) values),
    output and cache, with and without a cache."""
    window, row_bytes, cache = 16 * 18 * 10 * 16 * 4, 16 * 18 * 16 * 4, 16 * 2 * 8 * 16 * 4
    for rank, row in enumerate(gloo2.run(_cog_conv_window)):
        # gloo's worker thread may still hold the exchange's sent and received row when
        # the conv starts; 16 KiB of small buffers
        assert row["live"] <= window + cache + 2 * row_bytes + 2**14, (
            rank, row["live"] / window)
        assert all(d <= 1e-5 for d in row["diffs"].values()), (rank, row)


def _wan_conv_window() -> dict[str, Any]:
    """On this gloo rank (3 ranks, 36 rows as 12, 12, 12): Wan's causal conv (3x3x3, zeros
    around; 64 channels, so that torch runs it on oneDNN, not through `FastConv3d`'s taps,
    which copy their input frames-first) with H sharded, under no_grad, called as its
    loops call it: without a cache, then with the last 2 frames of the previous chunk.
    The bytes live when the second conv starts, and each output's difference to one
    device's."""
    import torch.distributed as dist
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from haloshard.integrations.diffusers.wan import WanCausalConvParallel
    from haloshard.testing import worker_mesh

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    with single_device():
        torch.manual_seed(0)
        module = WanCausalConv3d(64, 8, 3, padding=1)
    twin = copy.deepcopy(module)
    parallelize_module(module, mesh, WanCausalConvParallel())
    first, second = (seeded_randn((1, 64, t, 36, 16), s, torch.float32)
                     for t, s in ((4, 1), (40, 2)))
    cache = first[:, :, -2:]
    with torch.no_grad():
        y1_ref, y2_ref = twin(first), twin(second, cache)
        y1 = module(distribute_tensor(first, mesh, [Shard(3)]))
        x2, c2 = (distribute_tensor(t, mesh, [Shard(3)]) for t in (second, cache))
        module(x2, c2)  # agrees the cached call's window
        live, y2 = live_at_conv(lambda: module(x2, c2))
    return {"live": live, "rows": shard(second, 3, world, rank).shape[3],
            "diffs": [float((y.to_local() - shard(ref, 3, world, rank)).abs().max())
                      for y, ref in ((y1, y1_ref), (y2, y2_ref))]}


@pytest.mark.gloo
def test_wan_rows_causal_conv_holds_one_window(gloo: Any) -> None:
    """3 gloo ranks, inference: Wan's causal conv writes its cached frames and its
    input into one window of rows, W padded in it too, so when the conv starts a rank
    holds that window (2 + 40 frames, its rows and a halo row each side, W 16 + 2)
    and at most the exchange's rows, where the halo windows of input and cache, the
    module's `torch.cat` and its `F.pad` held 1.89 of it. Exact against one device up
    to float32 rounding (sums of 27 * 64 products of O(1) values), with and without a
    cache."""
    for rank, row in enumerate(gloo(3).run(_wan_conv_window)):
        window, row_bytes = 64 * 42 * (row["rows"] + 2) * 18 * 4, 64 * 42 * 18 * 4
        # gloo's worker thread may still hold the exchange's sent and received rows
        # (one each per neighbour) when the conv starts; 16 KiB of small buffers
        moved = 2 * (1 if rank in (0, 2) else 2) * row_bytes
        assert row["live"] <= window + moved + 2**14, (rank, row["live"] / window)
        assert all(d <= 1e-5 for d in row["diffs"]), (rank, row)


# ---------------------------------------------------------------- LTX-Video's causal conv
def _ltx_conv_window() -> dict[str, Any]:
    """On this gloo rank (2 ranks, 16 rows as 8, 8): LTX-Video's causal conv and its
    centred form (the 0.9.0 decoder's) with H sharded, under no_grad, as plan_for(vae,
    dims=(3,)) plans it. The bytes live when the conv starts (after a first call agreed
    the window) and each output's difference to one device's."""
    import torch.distributed as dist
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoCausalConv3d

    from haloshard.integrations.diffusers.ltx import LTXRowsCausalParallel, _rows_ltx_conv
    from haloshard.testing import worker_mesh

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    out: dict[str, Any] = {}
    for causal in (True, False):
        with single_device():
            torch.manual_seed(0)
            module = LTXVideoCausalConv3d(16, 16, 3, is_causal=causal)
        assert isinstance(_rows_ltx_conv(module), LTXRowsCausalParallel)  # plan_for's
        twin = copy.deepcopy(module)
        parallelize_module(module, mesh, LTXRowsCausalParallel(dim=3))
        full = seeded_randn((1, 16, 12, 16, 16), 1, torch.float32)
        with torch.no_grad():
            want = twin(full)
            x = distribute_tensor(full, mesh, [Shard(3)])
            module(x)  # agrees the window
            live, y = live_at_conv(lambda m=module, t=x: m(t))
        out[f"causal={causal}"] = (live, float((y.to_local()
                                                - shard(want, 3, world, rank)).abs().max()))
    return out


@pytest.mark.gloo
def test_ltx_rows_causal_conv_holds_one_window(gloo2: Any) -> None:
    """2 gloo ranks, H sharded, inference: LTX-Video's causal conv (and its centred form)
    writes its repeated edge frames and its input straight into the conv's window of rows,
    so when the conv starts a rank holds that window (2 + 12 frames, its 8 rows and a halo
    row each side) and at most the exchange's rows, where the module's concatenation and
    the window built from it held 2.0 (LTX-Video's decode on H peaked there). Exact
    against one device up to float32 rounding (sums of 27 * 16 products of O(1) values)."""
    window, row_bytes = 16 * 14 * 10 * 16 * 4, 16 * 14 * 16 * 4
    for rank, row in enumerate(gloo2.run(_ltx_conv_window)):
        for form, (live, diff) in row.items():
            # gloo's worker thread may still hold the exchange's sent and received row
            # when the conv starts; 16 KiB of small buffers
            assert live <= window + 2 * row_bytes + 2**14, (rank, form, live / window)
            assert diff <= 1e-5, (rank, form, diff)


@pytest.mark.simulated
def test_cog_rows_causal_conv_refuses_other_padding() -> None:
    """The window built in one buffer pads H with zeros: a CogVideoX causal conv whose
    conv pads otherwise (padding_mode "reflect") is refused when the style is applied,
    naming the module, rather than run with zero halos."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d

    from haloshard import HaloError
    from haloshard.integrations.diffusers.cogvideox import CogRowsCausalParallel

    with single_device():
        module = CogVideoXCausalConv3d(4, 4, 3)
    module.conv.padding_mode = "reflect"
    with simulated_mesh(2) as mesh, pytest.raises(HaloError, match=r"CogVideoXCausalConv3d"
                                                                   r".*\(reflect\)"):
        parallelize_module(module, mesh, CogRowsCausalParallel(dim=3))
