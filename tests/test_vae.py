"""The non-conv layers of a video VAE under Shard(T), and the example VAE as a whole.

Each case is one SPMD body run under simulated ranks (LocalTensorMode) and on gloo processes
(worlds 2, 3, 4; uneven T, empty shards). Float64 compares with the single-device module at
atol = rtol = 1e-10: the sharded layers compute the same sums in another order (per-rank
partial statistics combined by Chan's update, parameter gradients summed over ranks, K/V
gathered then reduced), a few ulps of O(1)-O(100) values apart, while any misplaced frame
or wrong statistic is O(1). bfloat16 GroupNorm is compared with a float64 reference at 2 bf16
ulps of the output's scale (|y| < 4: 2 * 2**-8 * 4): it computes in float32 and rounds once.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    AttentionParallel,
    CausalConvParallel,
    FirstFrameParallel,
    FirstFrameStencil,
    GroupNormParallel,
    HaloError,
    LocalParallel,
    halo_handles,
)
from haloshard._specs import plan_windows
from haloshard.testing import (
    assert_close_per_rank,
    check_module,
    shard,
    sharded,
    simulated_mesh,
    single_device,
    worker_mesh,
)

TOL = {"atol": 1e-10, "rtol": 1e-10}
BF16_TOL = 2 * 2**-8 * 4


def _example() -> Any:
    name = "haloshard_example_causal_vae"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / "causal_vae.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


vae = _example()


def _data(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64
          ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    module = module.double()
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_data(tuple(p.shape), seed + i) * 0.5 + (1.0 if p.ndim == 1 else 0.0))
    return module








# ---------------------------------------------------------------- layer cases
class CausalConv(nn.Module):
    """A causal wrapper with a (k, 1, 1) kernel: F.pad of (k - 1) * d frames, then a conv."""

    def __init__(self, k: int, stride: int, dilation: int = 1, pad: str = "replicate"):
        super().__init__()
        self.k, self.d, self.mode = k, dilation, pad
        self.conv = nn.Conv3d(2, 3, (k, 1, 3), stride=(stride, 1, 1),
                              dilation=(dilation, 1, 1), padding=(0, 0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = "constant" if self.mode == "zeros" else self.mode
        return self.conv(F.pad(x, (0, 0, 0, 0, (self.k - 1) * self.d, 0), mode=mode))


class PoolDown(nn.Module):
    """Keep the first frame, average-pool the rest by `factor` (any T)."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.f = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rest = x[:, :, 1:]
        n = rest.shape[2] // self.f * self.f
        pooled = sum(rest[:, :, i:n:self.f] for i in range(self.f)) / self.f
        return torch.cat([x[:, :, :1], pooled * 2.0], dim=2)


class ParityDown(nn.Module):
    """CogVideoX's `DownSample3D` along T: odd T keeps the first frame and averages the
    following pairs; even T averages pairs from frame 0 (it branches on its input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] % 2:
            rest = x[:, :, 1:]
            return torch.cat([x[:, :, :1], (rest[:, :, 0::2] + rest[:, :, 1::2]) / 2], dim=2)
        return (x[:, :, 0::2] + x[:, :, 1::2]) / 2


class ParityUp(nn.Module):
    """CogVideoX's `Upsample3D` along T: odd T > 1 keeps the first frame and repeats the
    others twice; even T repeats every frame twice; T = 1 stays one frame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] > 1 and x.shape[2] % 2:
            return torch.cat([x[:, :, :1], x[:, :, 1:].repeat_interleave(2, dim=2)], dim=2)
        return x.repeat_interleave(2, dim=2) if x.shape[2] > 1 else x * 1.0


class ChannelLayerNorm(nn.Module):
    """LayerNorm over channels of a (B, C, T, H, W) tensor (channels-last norm)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


# name: (module factory, style factory, input shape with T at dim 2 set per case)
LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], tuple[int, ...]]] = {
    "group_norm_6_3": (lambda: nn.GroupNorm(3, 6), GroupNormParallel, (2, 6, 0, 3, 2)),
    "group_norm_8_2_noaffine": (lambda: nn.GroupNorm(2, 8, affine=False), GroupNormParallel,
                                (1, 8, 0, 2, 2)),
    "group_norm_4_1": (lambda: nn.GroupNorm(1, 4), GroupNormParallel, (1, 4, 0, 2, 3)),
    "group_norm_5_5": (lambda: nn.GroupNorm(5, 5), GroupNormParallel, (1, 5, 0, 2, 2)),
    "group_norm_1d": (lambda: nn.GroupNorm(2, 4), GroupNormParallel, (2, 4, 0)),
    "frame_norm": (lambda: vae.FrameNorm(4, 2), LocalParallel, (2, 4, 0, 3, 3)),
    "frame_norm_rearrange": (lambda: RearrangeFrameNorm(4, 2), LocalParallel,
                             (2, 4, 0, 3, 3)),
    "channel_layer_norm": (lambda: ChannelLayerNorm(3), LocalParallel, (1, 3, 0, 2, 2)),
    "conv_1x1": (lambda: nn.Conv3d(3, 2, 1), LocalParallel, (1, 3, 0, 2, 2)),
    "causal_k3": (lambda: CausalConv(3, 1), CausalConvParallel, (1, 2, 0, 2, 3)),
    "causal_k3_stride2": (lambda: CausalConv(3, 2), CausalConvParallel, (1, 2, 0, 2, 3)),
    "causal_k4_stride2_dil2_zeros": (lambda: CausalConv(4, 2, 2, "zeros"),
                                     lambda: CausalConvParallel(pad="zeros"), (1, 2, 0, 1, 2)),
    "causal_k2_stride2": (lambda: CausalConv(2, 2), CausalConvParallel, (1, 2, 0, 1, 3)),
    "first_frame_down2": (vae.TimeDown, lambda: FirstFrameParallel(2, "down", even="first"),
                          (1, 2, 0, 2, 2)),
    "first_frame_down3": (lambda: PoolDown(3),
                          lambda: FirstFrameParallel(3, "down", even="first"), (1, 2, 0, 1, 2)),
    "first_frame_up2": (vae.TimeUp, lambda: FirstFrameParallel(2, "up", even="first"),
                        (1, 2, 0, 2, 2)),
    "parity_down2": (ParityDown, lambda: FirstFrameParallel(2, "down", even="all"),
                     (1, 2, 0, 2, 2)),
    "parity_up2": (ParityUp, lambda: FirstFrameParallel(2, "up", even="all"),
                   (1, 2, 0, 2, 2)),
    "attention": (lambda: vae.Attention(4, 2), AttentionParallel, (1, 4, 0, 2, 3)),
}


def case_layers(mesh: DeviceMesh, lengths: tuple[int, ...], seed: int) -> None:
    """Every layer kind alone through parallelize_module, forward and backward."""
    for name, (factory, style, shape) in LAYERS.items():
        if name == "frame_norm_rearrange" and enabled_local_tensor_mode() is not None:
            continue  # simulated uneven chunks have per-rank strides; its reshape breaks
        for length in lengths:
            with single_device():
                module = _seeded(factory(), seed)
                full = _data((*shape[:2], length, *shape[3:]), seed + 1)
            plan: dict[str, Any] = {"": style()}
            if name == "attention":
                plan.update({"norm": GroupNormParallel(), "q": LocalParallel(),
                             "k": LocalParallel(), "v": LocalParallel(),
                             "proj": LocalParallel()})
            for fqn, entry in plan.items():
                parallelize_module(module.get_submodule(fqn), mesh, entry)
            try:
                check_module(mesh, module, full, seed + 2, **TOL)
            except (AssertionError, RuntimeError) as exc:
                raise type(exc)(f"{name}, T={length}: {exc}") from exc


def case_group_norm_bf16(mesh: DeviceMesh, length: int, seed: int) -> None:
    """bfloat16 GroupNormParallel against the float64 single-device module."""
    world = mesh.size()
    with single_device():
        gn = _seeded(nn.GroupNorm(3, 6), seed)
        full = _data((2, 6, length, 3, 2), seed + 1) * 3 + 5  # offset: naive sums cancel
        expected = gn(full).detach()
    parallelize_module(gn.bfloat16(), mesh, GroupNormParallel())
    x, _ = sharded(mesh, full.bfloat16())
    y = gn(x)
    assert y.dtype == torch.bfloat16 and y.placements == (Shard(2),)
    assert_close_per_rank(y.to_local(), lambda r: shard(expected, 2, world, r).bfloat16(),
                          mesh, atol=BF16_TOL, rtol=0)


class RearrangeFrameNorm(nn.Module):
    """Per-frame nn.GroupNorm as models write it: `(b t) c h w` frames. On a Shard(2)
    DTensor its forward stays local but its backward raises (torch 2.13 has no sharding
    strategy for native_group_norm_backward): it needs LocalParallel."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = self.norm(rearrange(x, "b c t h w -> (b t) c h w"))
        return rearrange(frames, "(b t) c h w -> b c t h w", b=x.shape[0])


# Parameter-free ops that need no plan entry: DTensor keeps Shard(2) with no collective.
SPATIAL_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "residual": lambda x: x + F.silu(x) * 0.5,
    "layer_norm_channels": lambda x: F.layer_norm(x.movedim(1, -1), (4,)).movedim(-1, 1),
    "rms_norm_channels": lambda x: F.normalize(x, dim=1) * 2.0,
    "cat_channels": lambda x: torch.cat([x, F.silu(x)], dim=1),
}


def case_spatial_ops(mesh: DeviceMesh, length: int, seed: int) -> None:
    """Spatial-only ops on a Shard(2) DTensor: exact, Shard(2) kept, zero collectives."""
    world = mesh.size()
    with single_device():
        full = _data((2, 4, length, 3, 2), seed)
    for name, op in SPATIAL_OPS.items():
        with single_device():
            expected = op(full)
        x, _ = sharded(mesh, full)
        with CommDebugMode() as comm:
            y = op(x)
            y.to_local().sum().backward()
        assert comm.get_total_counts() == 0, (name, comm.get_comm_counts())
        assert isinstance(y, DTensor) and y.placements == (Shard(2),), (name, y)
        assert_close_per_rank(y.to_local(), lambda r, e=expected: shard(e, 2, world, r), mesh,
                              **TOL)
    # GroupNormParallel and LocalParallel themselves: the one small all-gather, and none.
    gn = _seeded(nn.GroupNorm(2, 4), seed)
    frame = _seeded(vae.FrameNorm(4, 2), seed)
    parallelize_module(gn, mesh, GroupNormParallel())
    parallelize_module(frame, mesh, LocalParallel())
    x, _ = sharded(mesh, full)
    with CommDebugMode() as comm:
        frame(x)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    with CommDebugMode() as comm:
        gn(x)
    assert comm.get_total_counts() == 1, comm.get_comm_counts()


def case_errors(mesh: DeviceMesh, seed: int) -> None:
    """User mistakes raise HaloError naming what is wrong, on every rank."""
    with single_device():
        full = _data((1, 4, 8, 2, 2), seed)  # no empty chunk on up to 4 ranks
    with pytest.raises(HaloError, match="per-slice modules"):
        parallelize_module(nn.Conv3d(4, 4, 3, padding=1), mesh, LocalParallel())
    with pytest.raises(HaloError, match=r"applies to nn\.GroupNorm"):
        parallelize_module(nn.LayerNorm(4), mesh, GroupNormParallel())
    with pytest.raises(HaloError, match="exactly one conv"):
        parallelize_module(vae.ResBlock(4, 4, 2), mesh, CausalConvParallel())
    with pytest.raises(HaloError, match="no padding along dim 2"):
        parallelize_module(nn.Sequential(nn.Conv3d(4, 4, 3, padding=1)), mesh,
                           CausalConvParallel())
    gn = nn.GroupNorm(2, 4).double()
    parallelize_module(gn, mesh, GroupNormParallel())
    with pytest.raises(HaloError, match="already applied"):
        parallelize_module(gn, mesh, GroupNormParallel())
    # a causal wrapper that pads zeros while the plan says replicate
    wrong = _seeded(CausalConv(3, 2, pad="zeros"), seed)
    parallelize_module(wrong, mesh, CausalConvParallel())
    with pytest.raises(HaloError, match="pads dim 2 by \\(2, 0\\) with mode='constant'"):
        wrong(sharded(mesh, _data((1, 2, 5, 1, 3), seed))[0])
    # an attention block whose norm is not planned would use local statistics
    attn = _seeded(vae.Attention(4, 2), seed)
    parallelize_module(attn, mesh, AttentionParallel())
    with pytest.raises(HaloError, match="GroupNormParallel entry"):
        attn(sharded(mesh, full)[0])
    # a hand-written attention (no SDPA call) would attend to local tokens only
    manual = _seeded(ManualAttention(), seed)
    parallelize_module(manual, mesh, AttentionParallel())
    with pytest.raises(HaloError, match="called it 0 times"):
        manual(sharded(mesh, full)[0])
    with pytest.raises(HaloError, match="direction"):
        FirstFrameParallel(2, "sideways")  # type: ignore[arg-type]
    # an even T with the module's rule for it undeclared: either guess could be wrong
    down = ParityDown()
    parallelize_module(down, mesh, {"": FirstFrameParallel(2, "down")})
    with pytest.raises(HaloError, match=r"\(ParityDown\): .*even length 6"):
        down(sharded(mesh, _data((1, 2, 6, 1, 2), seed))[0])


class ManualAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Conv3d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = rearrange(self.q(x), "b c t h w -> b (t h w) c")
        o = torch.softmax(q @ q.transpose(1, 2), -1) @ q
        return rearrange(o, "b (t h w) c -> b c t h w", t=x.shape[2], h=x.shape[3])


def case_remove(mesh: DeviceMesh, length: int, seed: int) -> None:
    """The handles undo every style of the example's plan; re-applying works again."""
    with single_device():
        model, full = vae.make(length, 4, seed, ch=4)
    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    plan = vae.cp_plan(model)
    parallelize_module(model, mesh, plan)
    handles = halo_handles(model)
    assert set(handles) == set(plan), set(plan) ^ set(handles)
    for handle in handles.values():
        handle.remove()
    assert {n: dict(vars(m)) for n, m in model.named_modules()} == before
    parallelize_module(model, mesh, vae.cp_plan(model))
    x, _ = sharded(mesh, full)
    assert model(x).placements == (Shard(2),)


def case_model(mesh: DeviceMesh, length: int, seed: int, size: int = 4, ch: int = 4) -> None:
    """The example VAE with its plan: forward, input gradient, every parameter gradient."""
    world = mesh.size()
    with single_device():
        model, full = vae.make(length, size, seed, ch=ch)
    ref = vae.reference(model, full, seed + 1)
    parallelize_module(model, mesh, vae.cp_plan(model))
    got = vae.sharded(model, mesh, full, ref)
    assert_close_per_rank(got["y"], lambda r: shard(ref["y"], 2, world, r), mesh, **TOL)
    assert_close_per_rank(got["gx"], lambda r: shard(ref["gx"], 2, world, r), mesh, **TOL)
    for got_g, ref_g in zip(got["grads"], ref["grads"], strict=True):
        assert_close_per_rank(got_g, lambda r, g=ref_g: g, mesh, **TOL)


def case_model_spatial(mesh: DeviceMesh, size: int, seed: int, dim: int = 3) -> None:
    """The example VAE with H (or W) sharded instead of T (`spatial_plan`): forward, input
    gradient, every parameter gradient."""
    world = mesh.size()
    with single_device():
        model, full = vae.make(5, size, seed, ch=4)
    ref = vae.reference(model, full, seed + 1)
    parallelize_module(model, mesh, vae.spatial_plan(model, dim))
    got = vae.sharded(model, mesh, full, ref, dim)
    assert_close_per_rank(got["y"], lambda r: shard(ref["y"], dim, world, r), mesh, **TOL)
    assert_close_per_rank(got["gx"], lambda r: shard(ref["gx"], dim, world, r), mesh, **TOL)
    for got_g, ref_g in zip(got["grads"], ref["grads"], strict=True):
        assert_close_per_rank(got_g, lambda r, g=ref_g: g, mesh, **TOL)


def case_model_time_height(mesh: DeviceMesh, length: int, size: int, seed: int, *,
                           encoder_only: bool = False) -> None:
    """The example VAE with T and H sharded at once on a `(t, h)` mesh
    (`time_height_plan`): forward, input gradient, every parameter gradient."""
    with single_device():
        model, full = vae.make(length, size, seed, ch=4)
        model = model.encoder if encoder_only else model
    ref = vae.reference(model, full, seed + 1)
    parallelize_module(model, mesh["t"], vae.time_height_plan(model))
    got = vae.sharded_on(model, mesh, full, ref, (2, 3))
    placements = [Shard(2), Shard(3)]
    for key in ("y", "gx"):
        want = DTensor.from_local(got[key], mesh, placements, run_check=False,
                                  shape=ref[key].shape, stride=ref[key].stride())
        torch.testing.assert_close(want.full_tensor(), ref[key], **TOL)
    for got_g, ref_g in zip(got["grads"], ref["grads"], strict=True):
        assert_close_per_rank(got_g, lambda r, g=ref_g: g, mesh, **TOL)


def case_model_float32(mesh: DeviceMesh, length: int, seed: int) -> None:
    """The example VAE in float32 against the single-device float32 run.

    Tolerance 1e-4 (relative and absolute, values are O(1)): both runs round every conv's
    sums of ~10^2-10^3 products (float32 eps 1.2e-7) in their own order, through ~20 layers
    and the normalisations' reciprocals; a misplaced or missing frame shows as O(1) error.
    """
    world = mesh.size()
    with single_device():
        model, full = vae.make(length, 4, seed, ch=4)
        model, full = model.float(), full.float()
    ref = vae.reference(model, full, seed + 1)
    parallelize_module(model, mesh, vae.cp_plan(model))
    got = vae.sharded(model, mesh, full, ref)
    tol = {"atol": 1e-4, "rtol": 1e-4}
    assert_close_per_rank(got["y"], lambda r: shard(ref["y"], 2, world, r), mesh, **tol)
    assert_close_per_rank(got["gx"], lambda r: shard(ref["gx"], 2, world, r), mesh, **tol)
    # A parameter gradient sums ~10^3-10^4 O(1) products over every frame and pixel, split
    # over P ranks and added up in another order: its absolute error grows with that count.
    for got_g, ref_g in zip(got["grads"], ref["grads"], strict=True):
        assert_close_per_rank(got_g, lambda r, g=ref_g: g, mesh, atol=2e-3, rtol=1e-4)


# ---------------------------------------------------------------- pure arithmetic
@pytest.mark.parametrize("direction", ["down", "up"])
@pytest.mark.parametrize(("factor", "even"), [(1, "first"), (2, "first"), (3, "first"),
                                              (2, "all")])
def test_first_frame_stencil(direction: str, factor: int, even: str) -> None:
    """The module run on each window, cut at the offset, gives exactly the wanted outputs.
    With even="all" the module branches on the parity of its input, as CogVideoX's do."""
    ruled = FirstFrameStencil(factor, direction, even=even)  # type: ignore[arg-type]

    def module(frames: list[int]) -> list[Any]:  # frame ids in, what each output reads out
        if even == "all" and len(frames) % 2 == 0:
            if direction == "up":
                return [i for i in frames for _ in range(factor)]
            return [tuple(frames[j : j + 2]) for j in range(0, len(frames), 2)]
        rest = frames[1:]
        if direction == "up":
            return frames[:1] + [i for i in rest for _ in range(factor)]
        n = len(rest) // factor * factor
        return frames[:1] + [tuple(rest[j : j + factor]) for j in range(0, n, factor)]

    for length in range(1, 12):
        whole = module(list(range(length)))
        stencil = ruled.at_length(length)
        assert stencil.out_length(length) == len(whole)
        for start in range(len(whole)):
            for stop in range(start + 1, len(whole) + 1):
                i0, i1, offset = stencil.window(start, stop)
                # a parity-widened window may read one frame past the end (a pad frame,
                # here -1, whose outputs are dropped)
                assert 0 <= i0 < i1 <= length + (even == "all"), (length, start, stop, i0, i1)
                local = module([i if i < length else -1 for i in range(i0, i1)])
                assert local[offset : offset + stop - start] == whole[start:stop]
        for world in (2, 3, 4):
            plan_windows(ruled, length, world)


# ---------------------------------------------------------------- simulated ranks
# torch's limit, not haloshard's: LocalTensorMode before 2.13 cannot matmul LocalTensors
# whose ranks hold different lengths (the mid-block attention on uneven chunks).
UNEVEN_MATMUL = ("LocalTensorMode cannot matmul simulated ranks of uneven lengths before "
                 "torch 2.13 (RuntimeError: Unable to cast torch.SymInt)")


@pytest.mark.simulated
@pytest.mark.requires_torch("2.13", reason=UNEVEN_MATMUL)
@pytest.mark.parametrize(("world", "lengths"), [(3, (7, 8)), (4, (3, 9, 10))])
def test_layers_simulated(world: int, lengths: tuple[int, ...]) -> None:
    with simulated_mesh(world) as mesh:
        case_layers(mesh, lengths, 3)


@pytest.mark.simulated
@pytest.mark.requires_torch("2.13", reason=UNEVEN_MATMUL)
def test_spatial_and_errors_simulated() -> None:
    with simulated_mesh(3) as mesh:
        case_spatial_ops(mesh, 7, 4)
        case_group_norm_bf16(mesh, 7, 5)
        case_errors(mesh, 6)
        case_remove(mesh, 9, 7)


@pytest.mark.simulated
def test_model_simulated() -> None:
    with simulated_mesh(3) as mesh:
        case_model(mesh, 11, 8)


@pytest.mark.simulated
@pytest.mark.parametrize("dim", [3, 4])
def test_model_spatial_simulated(dim: int) -> None:
    # equal chunks (8 rows over 4 ranks): under simulated ranks the frame norm's fold of T
    # into the batch cannot take per-rank lengths; the gloo runs take uneven ones
    with simulated_mesh(4) as mesh:
        case_model_spatial(mesh, 8, 10, dim)


@pytest.mark.simulated
@pytest.mark.requires_torch("2.13", reason=UNEVEN_MATMUL)
def test_model_time_height_simulated() -> None:
    # The encoder only: the decoder's frame norm folds T into the batch, which cannot take
    # per-rank lengths under simulated ranks (its T is odd); the gloo run has the whole VAE.
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        case_model_time_height(mesh, 9, 6, 11, encoder_only=True)


@pytest.mark.simulated
@pytest.mark.requires_torch("2.13", reason=UNEVEN_MATMUL)
def test_model_float32_simulated() -> None:
    with simulated_mesh(4) as mesh:
        case_model_float32(mesh, 10, 9)


# ---------------------------------------------------------------- gloo processes
def on_gloo(lengths: tuple[int, ...], model_lengths: tuple[int, ...]) -> None:
    mesh = worker_mesh(dist.get_world_size())
    case_layers(mesh, lengths, 3)
    case_spatial_ops(mesh, lengths[0], 4)
    case_group_norm_bf16(mesh, lengths[0], 5)
    case_errors(mesh, 6)
    for length in model_lengths:
        case_model(mesh, length, 8)
    case_model_float32(mesh, model_lengths[0], 9)
    if dist.get_world_size() > 2:  # H of 7 rows: (3, 2, 2) and (2, 2, 2, 1)
        case_model_spatial(mesh, 7, 10)
    if dist.get_world_size() == 4:  # T and H on (2, 2): 13 frames, 7 rows, uneven on both
        case_model_time_height(worker_mesh((2, 2), mesh_dim_names=("t", "h")), 13, 7, 12)


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "lengths", "model_lengths"),
                         [(2, (5, 6), (9,)), (3, (7,), (13,)), (4, (6,), (10, 17))])
def test_gloo(gloo: Callable[[int], Any], world: int, lengths: tuple[int, ...],
              model_lengths: tuple[int, ...]) -> None:
    gloo(world).run(on_gloo, lengths, model_lengths, timeout=300)
