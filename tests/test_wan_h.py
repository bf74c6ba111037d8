"""Wan 2.1's VAE (and CogVideoX's) sharded on H through their own public calls, against
one device: `parallelize_module(vae, mesh, plan_for(vae, dims=(3,)))`, a `Shard(3)`
input, then diffusers' unchanged `vae.decode(z).sample` and
`vae.encode(x).latent_dist.mode()` (their chunk loops with their feature caches), and a
training step through both.

A tiny random-init `AutoencoderKLWan` (diffusers 0.42.1; two spatial and two temporal
down/upsamplings, the mid-blocks' attention), float64. Output, input gradient and every
parameter gradient (summed over ranks by `reduce_grads`) are compared with one device's.
Rows per rank are uneven, and some rank holds no row at the lowest resolution (an empty H
shard all the way through the mid-block's attention and the resamplers).

Tolerances: float64 at atol = rtol = 1e-10, as in tests/test_diffusers_dims.py: the
sharded run adds the same products in another order (convs on windows of rows, K/V
gathered along H, parameter gradients summed over ranks), a few ulps of O(1) values apart,
while a misplaced row is O(1). diffusers' `WanUpsample` interpolates in float32 even for a
float64 model (`x.float()`, forward and backward), which rounds those ulps to float32's
1.2e-7 and the backward amplifies them (measured 5.8e-7 on the decoder's input gradient,
2 ranks): the Wan cases run with the interpolation in the input's dtype
(`_upsample_in_input_dtype`), so that they too hold at 1e-10.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import HaloError, reduce_grads
from haloshard.integrations.diffusers import plan_for
from haloshard.testing import seeded_randn, simulated_mesh, single_device, worker_mesh

diffusers = pytest.importorskip("diffusers")

TOL = {"atol": 1e-10, "rtol": 1e-10}


def tiny_wan(**config: Any) -> nn.Module:
    with single_device():
        torch.manual_seed(0)
        vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2],
                                         num_res_blocks=1, temperal_downsample=[True, True],
                                         **config)
        return vae.double()


def tiny_cogvideox() -> nn.Module:
    with single_device():
        torch.manual_seed(0)
        vae = diffusers.AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("CogVideoXDownBlock3D",) * 3,
            up_block_types=("CogVideoXUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            temporal_compression_ratio=4)
        return vae.double()


@contextmanager
def _upsample_in_input_dtype() -> Iterator[None]:
    """diffusers' `WanUpsample` interpolating in the input's dtype (float64 here)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    previous = WanUpsample.forward
    WanUpsample.forward = nn.Upsample.forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        WanUpsample.forward = previous  # type: ignore[method-assign]


def decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z).sample


def encode(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return vae.encode(x).latent_dist.mode()


def train_step(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Encode, then decode the posterior's mode: one step's forward through both loops."""
    return decode(vae, encode(vae, x))


def check(mesh: DeviceMesh, vae: nn.Module, full: torch.Tensor,
          run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    """`run(vae, x)` with `plan_for(vae, dims=(3,))` on a `Shard(3)` input against one
    device: output, input gradient, every parameter gradient summed over ranks."""
    with single_device():
        twin = copy.deepcopy(vae)
        x_ref = full.clone().requires_grad_()
        y_ref = run(twin, x_ref)
        gy = seeded_randn(tuple(y_ref.shape), 7, full.dtype)
        (y_ref * gy).sum().backward()
    parallelize_module(vae, mesh, plan_for(vae, dims=(3,)))
    x = distribute_tensor(full, mesh, [Shard(3)]).requires_grad_()
    y = run(vae, x)
    assert isinstance(y, DTensor) and tuple(y.placements) == (Shard(3),), y
    torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
    (y * distribute_tensor(gy, mesh, [Shard(3)])).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
    reduce_grads(vae, mesh)
    for (name, p), q in zip(vae.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            got = DTensor.from_local(p.grad, mesh, [Replicate()], run_check=False)
            torch.testing.assert_close(got.full_tensor(), q.grad, **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- Wan, simulated ranks
@pytest.mark.simulated
def test_wan_decode_rows_simulated() -> None:
    """2 latent frames (the loop's first chunk, then one through the caches: the causal
    convs' cached frames take their H halo too, the temporal upsamplers' "Rep" and cached
    time_conv) on 2 ranks: 1 latent row is 1, 0, so one rank holds no row through the
    mid-block (its attention gathers K/V along H) until the first upsampling."""
    with simulated_mesh(2) as mesh, _upsample_in_input_dtype():
        check(mesh, tiny_wan(), 0.3 * seeded_randn((1, 4, 2, 1, 2), 1), decode)


@pytest.mark.simulated
def test_wan_encode_rows_simulated() -> None:
    """5 frames (the loop's chunks of 1, then 4: the downsamplers' cached path) on 3 ranks:
    8 rows are 3, 3, 2, then 2, 1, 1 after one downsampling and 1, 1, 0 after two."""
    with simulated_mesh(3) as mesh:
        check(mesh, tiny_wan(), seeded_randn((1, 3, 5, 8, 4), 2), encode)


# ---------------------------------------------------------------- CogVideoX, simulated ranks
@pytest.mark.simulated
@pytest.mark.parametrize(("run", "shape"), [
    # batches of 1 latent frame (2 with a conv_cache); 3 rows: 2, 1
    (decode, (1, 4, 2, 3, 2)),
    # batches of 4 frames (5, 4 with a conv_cache); 4 rows: 2, 2 -> 1, 1 -> 1, 0
    (encode, (1, 3, 9, 4, 4)),
])
def test_cogvideox_public_rows_simulated(run: Callable[..., Any], shape: tuple[int, ...]
                                         ) -> None:
    """CogVideoX's public calls on H: its own frame-batch loops with `conv_cache`, the
    posterior's `mode()`, forward and backward (training mode).

    The backward of the posterior's `torch.chunk` (only the mean used) fills the logvar's
    gradient with plain zeros, which DTensor refused ("got mixed torch.Tensor and
    DTensor") in a process that had built no `HaloShard` yet, the case of CogVideoX on H
    (its plan builds none): `plan_for` now installs haloshard's zero fill itself."""
    from haloshard import _dtensor_ops

    _dtensor_ops.uninstall()  # as in a fresh process (other tests built HaloShards)
    vae = tiny_cogvideox()
    # smaller frame batches than the defaults (8 frames, 2 latent frames): two batches
    # from a short clip
    vae.num_sample_frames_batch_size, vae.num_latent_frames_batch_size = 4, 1
    with simulated_mesh(2) as mesh:
        check(mesh, vae, seeded_randn(shape, 1), run)


# ---------------------------------------------------------------- conv3d tap by tap
@pytest.mark.parametrize(("stride", "dilation"), [((1, 1, 1), (1, 1, 1)),
                                                  ((2, 1, 1), (1, 1, 1)),
                                                  ((1, 2, 1), (2, 1, 1))])
def test_conv3d_time_taps(stride: tuple[int, ...], dilation: tuple[int, ...]) -> None:
    """A Wan conv's window that torch would convolve on its slow path (CPU, batch 1,
    `B * C * T * H <= 20480`: im2col columns 27 times the input) runs as one conv2d per
    tap along T: the same values and gradients (float64, summed in another order: 1e-12
    on O(1) values), and torch's choice is asked of the window's own sizes."""
    from haloshard.integrations.diffusers._rows import conv3d_time_taps, slow_conv3d

    x = seeded_randn((1, 8, 7, 6, 5), 1).requires_grad_()
    w = seeded_randn((4, 8, 3, 3, 3), 2).requires_grad_()
    b = seeded_randn((4,), 3).requires_grad_()
    args = (stride, (0, 0, 0), dilation, 1)
    y = conv3d_time_taps(x, w, b, *args)
    y_ref = torch.nn.functional.conv3d(x, w, b, *args)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    gy = seeded_randn(tuple(y.shape), 4)
    grads = torch.autograd.grad(y, (x, w, b), gy)
    for got, want in zip(grads, torch.autograd.grad(y_ref, (x, w, b), gy), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    small = torch.zeros(1, 96, 6, 34, 66)  # 96 * 6 * 34 = 19584: torch's slow path
    assert slow_conv3d(small, torch.zeros(96, 96, 3, 3, 3), None, *args)
    large = torch.zeros(1, 96, 6, 66, 66)  # one device's rows: mkldnn
    assert not slow_conv3d(large, torch.zeros(96, 96, 3, 3, 3), None, *args)


class _Kernels(TorchDispatchMode):
    """The names of the conv kernels aten runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if "conv" in func.__name__:
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padding", [(0, 0, 0), (0, 0, 1)])
def test_fast_conv3d_calls_onednn_in_inference(padding: tuple[int, ...]) -> None:
    """A window's conv3d that torch would send to its slow path (CPU, batch 1, `C * T * H
    <= 20480`) runs on oneDNN's kernel directly under `FastConv3d` in inference, float32,
    with or without padding of its own (CogVideoX's conv pads W): the same values as
    torch's own call up to float32 rounding (sums of 27 * 96 products of O(1) values:
    1e-4 absolute); with a gradient asked, or in float64 (which oneDNN does not take), a
    conv with no padding runs tap by tap, and one with padding as torch runs it."""
    from haloshard.integrations.diffusers._rows import FastConv3d

    x = seeded_randn((1, 96, 4, 10, 18), 1, torch.float32)  # 96 * 4 * 10: the slow path
    conv = nn.Conv3d(96, 32, 3, padding=padding)
    with torch.no_grad():
        want = conv(x)
        with _Kernels() as kernels, FastConv3d():
            got = conv(x)
    assert kernels.names == ["mkldnn_convolution"], kernels.names
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    taps = ["convolution"] * 3 if padding == (0, 0, 0) else ["convolution"]
    for dtype in (torch.float32, torch.float64):
        grad = dtype == torch.float32
        layer, x_t = copy.deepcopy(conv).to(dtype), x.to(dtype)
        with torch.set_grad_enabled(grad), _Kernels() as kernels, FastConv3d():
            layer(x_t)
        assert [n for n in kernels.names if n == "convolution"] == taps, (dtype, kernels.names)


# ---------------------------------------------------------------- refusals, the cache
def test_wan_dims_refused() -> None:
    """On T Wan has its own plans and calls; on T and H at once its loops cannot run."""
    vae = tiny_wan()
    with pytest.raises(HaloError, match=r"^AutoencoderKLWan: .*plan_for\(vae, dims=\(3,\)\)"):
        plan_for(vae)
    for part in (vae, vae.encoder, vae.decoder):
        with pytest.raises(HaloError, match=r"cannot be planned on dims \(2, 3\): Wan's "
                                            r"encode and decode loops walk T.*dims=\(3,\)"):
            plan_for(part, dims=(2, 3))


def test_wan_unknown_refused() -> None:
    """Wan 2.2 (residual blocks, patchify) and a module the plan does not know are refused
    when the plan is built, named by fqn."""
    with pytest.raises(HaloError, match=r"^<root> \(AutoencoderKLWan\): .*is_residual=True "
                                        r"\(Wan 2.2\)"):
        plan_for(tiny_wan(is_residual=True), dims=(3,))
    with pytest.raises(HaloError, match=r"^down_blocks.0 \(WanResidualDownBlock\): .*Wan 2.2"):
        plan_for(tiny_wan(is_residual=True).encoder, dims=(3,))
    vae = tiny_wan()
    vae.decoder.mid_block.resnets[0].norm1 = nn.LayerNorm(8)
    with pytest.raises(HaloError, match=r"^decoder.mid_block.resnets.0.norm1 \(LayerNorm\) "
                                        r"has parameters"):
        plan_for(vae, dims=(3,))


@pytest.mark.simulated
def test_wan_cache_cleared_simulated() -> None:
    """The decode loop's feature cache holds `Shard(3)` DTensors while it runs (the causal
    convs' cached frames) and `clear_cache()` at its end still frees them: once the call
    returns, no cached tensor is alive."""
    vae = tiny_wan()
    cached: list[weakref.ref[torch.Tensor]] = []

    def keep(module: nn.Module, args: tuple[Any, ...]) -> None:
        if len(args) > 1 and args[1] is not None:
            assert isinstance(args[1], DTensor) and args[1].placements == (Shard(3),)
            cached.extend((weakref.ref(args[1]), weakref.ref(args[1]._local_tensor)))

    with simulated_mesh(2) as mesh:
        parallelize_module(vae, mesh, plan_for(vae, dims=(3,)))
        for m in vae.decoder.modules():
            if type(m).__name__ == "WanCausalConv3d":
                m.register_forward_pre_hook(keep)
        z = distribute_tensor(0.3 * seeded_randn((1, 4, 3, 4, 2), 1), mesh, [Shard(3)])
        with torch.no_grad():
            y = decode(vae, z)
        gc.collect()
        assert y.shape == (1, 3, 9, 16, 8)
        assert cached and all(ref() is None for ref in cached)
        assert all(t is None for t in vae._feat_map)


def check_no_grad(mesh: DeviceMesh, vae: nn.Module, full: torch.Tensor,
                  run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    """`run(vae, x)` in inference with `plan_for(vae, dims=(3,))` on a `Shard(3)` input
    against one device (on real ranks the causal convs build their windows of rows in one
    buffer where every rank holds rows)."""
    with single_device(), torch.no_grad():
        twin = copy.deepcopy(vae)
        y_ref = run(twin, full)
    parallelize_module(vae, mesh, plan_for(vae, dims=(3,)))
    with torch.no_grad():
        y = run(vae, distribute_tensor(full, mesh, [Shard(3)]))
    torch.testing.assert_close(y.full_tensor(), y_ref, **TOL)


# ---------------------------------------------------------------- gloo
def on_gloo() -> None:
    world = dist.get_world_size()
    with _upsample_in_input_dtype():
        # inference: 17 rows as 6, 6, 5 -> ... -> 5 latent rows 2, 2, 1 and back
        check_no_grad(worker_mesh(world), tiny_wan(), seeded_randn((1, 3, 5, 20, 4), 4),
                      encode)
        check_no_grad(worker_mesh(world), tiny_wan(), 0.3 * seeded_randn((1, 4, 3, 5, 2), 5),
                      decode)
        # 5 latent rows on 3 ranks: 2, 2, 1 -> 4, 4, 2 -> 7, 7, 6
        check(worker_mesh(world), tiny_wan(), 0.3 * seeded_randn((1, 4, 3, 5, 2), 1), decode)
        # 12 rows: 4, 4, 4 -> 2, 2, 2 -> 1, 1, 1
        check(worker_mesh(world), tiny_wan(), seeded_randn((1, 3, 5, 12, 4), 2), encode)
        # 8 rows: 3, 3, 2 -> ... -> 2 latent rows 1, 1, 0 -> decoded back to 8
        check(worker_mesh(world), tiny_wan(), 0.5 * seeded_randn((1, 3, 5, 8, 4), 3),
              train_step)


@pytest.mark.gloo
class TestGloo:
    def test_wan_rows(self, gloo: Callable[[int], Any]) -> None:
        gloo(3).run(on_gloo, timeout=300)


def _cog_loops_rows() -> dict[str, float]:
    """On this gloo rank (4 ranks): CogVideoX's own `_encode` (17 frames: batches of 9
    and 8, 9 rows as 3, 2, 2, 2, then 2, 1, 1, 1 and 1, 1, 1, 0 after the downsamplers)
    and `_decode` (5 latent frames: batches of 3 and 2; 3 rows as 1, 1, 1, 0, then 2, 2,
    1, 1 after an upsampler) with H sharded, under no_grad: causal convs building their
    windows in one buffer where every rank holds rows, the module's own forward where one
    holds none. Each result's largest difference to one device's."""
    mesh = worker_mesh(dist.get_world_size())
    vae = tiny_cogvideox().eval()
    twin = copy.deepcopy(vae)
    parallelize_module(vae, mesh, plan_for(vae, dims=(3,)))
    x = seeded_randn((1, 3, 17, 9, 6), 1)
    z = seeded_randn((1, 4, 5, 3, 2), 2)
    with torch.no_grad():
        got = {"encode": (vae._encode(distribute_tensor(x, mesh, [Shard(3)])),
                          twin._encode(x)),
               "decode": (vae._decode(distribute_tensor(z, mesh, [Shard(3)])).sample,
                          twin._decode(z).sample)}
    return {name: float((y.full_tensor() - ref).abs().max()) for name, (y, ref) in got.items()}


@pytest.mark.gloo
def test_cog_loops_rows_gloo(gloo: Any) -> None:
    """4 gloo ranks: CogVideoX's public loops over frame batches (the conv cache carried
    from batch to batch) with H sharded, in inference, against one device (float64,
    1e-12: the same sums in another order; a misplaced row or frame is O(1))."""
    for rank, row in enumerate(gloo(4).run(_cog_loops_rows, timeout=300)):
        assert all(d <= 1e-12 for d in row.values()), (rank, row)
