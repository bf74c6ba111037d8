"""diffusers 0.42.1 video VAEs sharded on H, and on T and H at once (`plan_for(vae,
dims=...)`), against one device.

Tiny random-init instances (tests/test_diffusers.py's; LTX-Video with `patch_size=1` and
with its default 4, whose patchify and unpatchify DTensor's own reshape and flatten run on
each rank's rows). Each part runs forward and backward with a fixed
random cotangent; the output, the input gradient and every parameter gradient (summed over
the ranks of every sharded axis by `reduce_grads`) are compared with one device's.

Tolerances: float64 at atol = rtol = 1e-10, as in tests/test_diffusers.py: the sharded
run adds the same products in another order (GroupNorm statistics combined across ranks,
K/V gathered, parameter gradients summed over ranks), a few ulps of O(1) values apart,
while a misplaced row is O(1). diffusers' RMSNorm (LTX-Video) computes its variance in
float32 even for a float64 model, which rounds those ulps to float32's 1.2e-7 and the
backward amplifies them (measured 1.4e-4 on a weight gradient with H sharded): the LTX
cases run with that variance in the input's dtype (`_rms_in_input_dtype`), so that they
too hold at 1e-10.
"""

from __future__ import annotations

import copy
import gc
import time
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
from torch.utils._pytree import tree_leaves

from haloshard import CausalConvParallel, HaloError, reduce_grads
from haloshard.integrations.diffusers import plan_for
from haloshard.testing import seeded_randn, simulated_mesh, single_device, worker_mesh

pytest.importorskip("diffusers")

# the first sin/cos of a gloo worker too (see conftest.py): before any one-device reference
for _dtype in (torch.float32, torch.float64):
    torch.sin(torch.arange(4096, dtype=_dtype)).cos_()

TOL = {"atol": 1e-10, "rtol": 1e-10}


def hunyuan() -> nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            spatial_compression_ratio=4, temporal_compression_ratio=4)
        return vae.double().eval()


def ltx() -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    with single_device():  # LTX-Video 0.9.0's configuration, 8 channels, patch 1
        torch.manual_seed(0)
        vae = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
            layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5, patch_size=1)
        return vae.double().eval()


def ltx_patched() -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    # LTX-Video 0.9.0's configuration, its patch 4, 8 and 16 channels: the blocks that
    # change the width run a LayerNorm and a 1x1x1 causal conv on their shortcut
    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8, 8, 16, 16),
            decoder_block_out_channels=(8, 8, 16, 16), layers_per_block=(1,) * 5,
            decoder_layers_per_block=(1,) * 5)
        return vae.double().eval()


def ltx_residual() -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    with single_device():  # residual upsamplers halving the channels, timestep conditioned
        torch.manual_seed(0)
        vae = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
            decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1,) * 4,
            decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
            upsample_residual=(True,) * 3, upsample_factor=(2,) * 3, patch_size=1)
        return vae.double().eval()


def mochi() -> nn.Module:
    from diffusers import AutoencoderKLMochi

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)
        return vae.double().eval()


def cogvideox() -> nn.Module:
    from diffusers import AutoencoderKLCogVideoX

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("CogVideoXDownBlock3D",) * 3,
            up_block_types=("CogVideoXUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            temporal_compression_ratio=4)
        return vae.double().eval()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "cogvideox": cogvideox,
    "hunyuan": hunyuan, "ltx": ltx, "ltx_patched": ltx_patched, "ltx_residual": ltx_residual,
    "mochi": mochi}


@contextmanager
def _rms_in_input_dtype() -> Iterator[None]:
    """diffusers' RMSNorm with its variance in the input's dtype (float64 here)."""
    from diffusers.models.normalization import RMSNorm

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            x = x * self.weight
            if self.bias is not None:
                x = x + self.bias
        return x

    previous = RMSNorm.forward
    RMSNorm.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        RMSNorm.forward = previous  # type: ignore[method-assign]


def check(mesh: DeviceMesh, module: nn.Module, plan: dict[str, Any], full: torch.Tensor,
          placements: list[Any], tol: dict[str, float], run: Callable[..., Any] | None = None
          ) -> None:
    """`module` with `plan` (on the mesh's first axis) against one device: output, input
    gradient, every parameter gradient summed over the mesh's axes."""
    run = run or (lambda m, t: m(t))
    with single_device():
        twin = copy.deepcopy(module)
        x_ref = full.clone().requires_grad_()
        y_ref = run(twin, x_ref)
        gy = seeded_randn(tuple(y_ref.shape), 7, full.dtype)
        (y_ref * gy).sum().backward()
    parallelize_module(module, mesh[mesh.mesh_dim_names[0]] if mesh.ndim > 1 else mesh, plan)
    x = distribute_tensor(full, mesh, placements).requires_grad_()
    y = run(module, x)
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements), y
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **tol)
    (y * distribute_tensor(gy, mesh, placements)).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **tol)
    for axis in range(mesh.ndim):
        reduce_grads(module, mesh, mesh_axis=axis)
    for (name, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            got = DTensor.from_local(p.grad, mesh, [Replicate()] * mesh.ndim, run_check=False)
            torch.testing.assert_close(got.full_tensor(), q.grad, **tol,
                                       msg=lambda m, n=name: f"{n}: {m}")


def case(mesh: DeviceMesh, name: str, part: str, shape: tuple[int, ...],
         dims: tuple[int, ...]) -> None:
    vae = MODELS[name]()
    module = getattr(vae, part)
    # (output, conv_cache)
    run = (lambda m, t: m(t)[0]) if name in ("mochi", "cogvideox") else None
    with _rms_in_input_dtype():
        check(mesh, module, plan_for(module, dims=dims),
              seeded_randn(shape, 1, torch.float64), [Shard(d) for d in dims], TOL, run)


# (model, part, world, input shape): H and W differ, so that a style sharding the wrong
# spatial dim fails; the comments give the rows per rank
ROWS = [
    ("hunyuan", "encoder", 3, (1, 3, 5, 8, 6)),  # 3, 3, 2 -> 2, 2, 0 -> 1, 1, 0 (mid-block)
    ("hunyuan", "decoder", 4, (1, 4, 3, 3, 2)),  # 1, 1, 1, 0: an empty shard all the way
    ("ltx", "encoder", 3, (1, 3, 9, 16, 8)),  # 6, 5, 5 -> stride 2: 3, 3, 2 -> ...
    ("ltx", "decoder", 4, (1, 4, 3, 3, 2)),  # 1, 1, 1, 0 -> depth-to-space x2: 2, 2, 2, 0
    # patch 4: 16 rows, 2 patches a rank -> 1, 1 -> 1, 0 (empty) after the downsamplers
    ("ltx_patched", "encoder", 2, (1, 3, 9, 16, 8)),
    # 2, 1 latent rows -> x 8 (upsamplers): 16, 8 -> unpatchify x 4: 64, 32
    ("ltx_patched", "decoder", 2, (1, 4, 3, 3, 2)),
    ("ltx_residual", "decoder", 2, (1, 4, 3, 3, 2)),  # 2, 1; residual upsamplers
    # 6, 5, 5 -> 3, 3, 2 -> 2, 1, 1 -> 1, 1, 0: attention along T per pixel, on the rows
    ("mochi", "encoder", 3, (1, 3, 7, 16, 8)),
    ("mochi", "decoder", 4, (1, 4, 3, 3, 2)),  # 1, 1, 1, 0 -> x2 (depth-to-space): 2, ...
    # 9 frames (the first apart): 6, 5, 5 -> stride 2 after one zero row: 3, 3, 2 -> ...
    ("cogvideox", "encoder", 3, (1, 3, 9, 16, 8)),
    ("cogvideox", "decoder", 4, (1, 4, 3, 3, 2)),  # 1, 1, 1, 0 -> up x2 (nearest, conv)
]


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "part", "world", "shape"), ROWS)
def test_rows_simulated(name: str, part: str, world: int, shape: tuple[int, ...]) -> None:
    with simulated_mesh(world) as mesh:
        case(mesh, name, part, shape, (3,))


# As in tests/test_diffusers.py: the timestep reaches every resnet through diffusers'
# float32 sinusoidal projection, rounded in another order on each side (1.6e-5 relative
# on the scalar `timestep_scale_multiplier`'s gradient on T); a misplaced row is O(1).
TIMESTEP_TOL = {"atol": 1e-3, "rtol": 1e-3}


@pytest.mark.simulated
@pytest.mark.parametrize(("patch", "world", "shape"), [
    (1, 3, (1, 4, 3, 3, 2)),  # 1, 1, 1 latent rows
    # one latent row on two ranks (1, 0): beside a per-sample table DTensor returns its
    # products replicated, which ReplicatedArgsParallel cuts back to Shard(3)
    (1, 2, (1, 4, 3, 1, 2)),
    (4, 2, (1, 4, 3, 3, 2)),  # patch 4: 2, 1 latent rows -> 16, 8 -> 64, 32 pixel rows
])
def test_ltx_timestep_rows_simulated(patch: int, world: int, shape: tuple[int, ...]) -> None:
    """LTX-Video's timestep-conditioned decoder (`ReplicatedArgsParallel(dim=3)` on the
    decoder and its resnets) with H sharded, the decode timestep a plain tensor."""
    from diffusers import AutoencoderKLLTXVideo

    with single_device():
        torch.manual_seed(0)
        dec = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
            decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1,) * 4,
            decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
            upsample_residual=(True,) * 3, upsample_factor=(2,) * 3,
            timestep_conditioning=True, patch_size=patch).double().eval().decoder
    temb = torch.tensor([0.05], dtype=torch.float64)
    with simulated_mesh(world) as mesh, _rms_in_input_dtype():
        check(mesh, dec, plan_for(dec, dims=(3,)), seeded_randn(shape, 1, torch.float64),
              [Shard(3)], TIMESTEP_TOL, run=lambda m, z: m(z, temb))


@pytest.mark.simulated
@pytest.mark.parametrize(("part", "shape"), [
    ("encoder", (1, 3, 17, 8, 6)),  # frame batches 9, 8 with a conv_cache; 3, 3, 2 rows
    ("decoder", (1, 4, 5, 3, 2)),  # latent batches 3, 2; 1, 1, 1 rows
])
def test_cogvideox_loop_rows_simulated(part: str, shape: tuple[int, ...]) -> None:
    """CogVideoX's own `_encode` / `_decode` loops over frame batches (T is whole on each
    rank, so the loop and its conv_cache run unchanged) with H sharded."""
    vae = cogvideox()
    run = ((lambda m, x: m._encode(x)) if part == "encoder"
           else (lambda m, z: m._decode(z).sample))
    with simulated_mesh(3) as mesh:
        check(mesh, vae, plan_for(vae, dims=(3,)), seeded_randn(shape, 1, torch.float64),
              [Shard(3)], TOL, run)


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "part", "shape"), [
    ("ltx", "encoder", (1, 3, 9, 16, 8)),  # 5, 4 frames x 8, 8 rows
    ("ltx", "encoder", (1, 3, 5, 6, 4)),  # 3, 2 x 3, 3 -> 2, 1 x 2, 1 -> 1, 0 x 1, 0
    ("ltx_patched", "encoder", (1, 3, 9, 32, 8)),  # 5, 4 frames x 16, 16 rows: 4, 4 patches
    ("ltx_patched", "decoder", (1, 4, 3, 3, 2)),  # 2, 1 x 2, 1 -> 16, 8 -> 64, 32 rows
    # 2, 1 x 2, 1: the upsamplers on windows of frames and of rows (conv, depth-to-space)
    ("ltx", "decoder", (1, 4, 3, 3, 2)),
    ("ltx_residual", "decoder", (1, 4, 3, 3, 2)),
    # causal convs padding H themselves (stride 2 on T, H, W), GroupNorm over both axes,
    # the mid-block's block-causal attention with K/V gathered along H, then T
    ("hunyuan", "encoder", (1, 3, 9, 8, 6)),  # 5, 4 x 4, 4 -> 3, 2 x 2, 2 -> 2, 1 x 1, 1
    ("hunyuan", "encoder", (1, 3, 5, 4, 6)),  # ... mid-block: 1, 1 frames x 1, 0 rows
    # 2, 1 x 2, 1: the upsampler on windows of frames and of rows
    ("hunyuan", "decoder", (1, 4, 3, 3, 2)),
    ("hunyuan", "decoder", (1, 4, 1, 3, 2)),  # 1, 0 frames: an empty shard on t
    # causal convs padding H themselves (returning their cache), per-frame GroupNorm over
    # H, attention along T per pixel, depth-to-space on windows of frames and of rows
    ("mochi", "encoder", (1, 3, 7, 16, 8)),  # 4, 3 x 8, 8 -> ... -> 1, 1 x 1, 1
    ("mochi", "decoder", (1, 4, 3, 3, 2)),  # 2, 1 x 2, 1
    ("mochi", "decoder", (1, 4, 1, 3, 2)),  # 1, 0 frames
])
def test_time_rows_simulated(name: str, part: str, shape: tuple[int, ...]) -> None:
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        case(mesh, name, part, shape, (2, 3))


# ---------------------------------------------------------------- causal wrappers padding H
def _wrappers() -> nn.Module:
    """HunyuanVideo's causal convs: `F.pad` of W, H (centred) and T (causal), replicate,
    then a conv with no padding; the second has stride 2 along T, H and W."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
        HunyuanVideoCausalConv3d,
    )

    with single_device():
        torch.manual_seed(0)
        return nn.Sequential(HunyuanVideoCausalConv3d(2, 3, 3),
                             HunyuanVideoCausalConv3d(3, 2, 3, stride=2)).double()


@pytest.mark.simulated
@pytest.mark.parametrize(("dims", "shape"), [
    ((2, 3), (1, 2, 7, 5, 3)),  # 4, 3 frames x 3, 2 rows -> 2, 2 x 2, 1
    ((2, 3), (1, 2, 3, 3, 2)),  # 2, 1 x 2, 1 -> 1, 1 x 1, 1 ... and 2, 1 x 1, 0 rows
    ((3,), (1, 2, 4, 7, 3)),  # 4, 3 rows (1-D mesh of 2) -> 2, 2
])
def test_wrapper_pads_rows_simulated(dims: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """A causal wrapper that pads H itself (`F.pad`) gets the H halo it needs: on T and H
    (it was refused: "pads dim 3 itself") and on H alone, stride 2 included."""
    model = _wrappers()
    if dims == (3,):
        plan = {str(i): CausalConvParallel(dim=3, pads={3: (1, 1)}) for i in range(2)}
    else:
        plan = {str(i): CausalConvParallel(pads={3: (1, 1)}) for i in range(2)}
    mesh_shape = (2, 2) if len(dims) == 2 else 2
    names = ("t", "h") if len(dims) == 2 else None
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        check(mesh, model, plan, seeded_randn(shape, 3, torch.float64),
              [Shard(d) for d in dims], TOL)


def test_wrapper_pads_checked() -> None:
    with pytest.raises(HaloError, match=r"pads as \{dim: \(left, right\)\}.*got 3: \(1,\)"):
        CausalConvParallel(pads={3: (1,)})  # type: ignore[dict-item]
    wrapper = nn.Sequential(nn.Conv3d(2, 2, 3, padding=(0, 1, 1)))
    with simulated_mesh(2) as mesh, pytest.raises(HaloError, match="no padding along dim 3"):
        parallelize_module(wrapper, mesh, CausalConvParallel(pads={3: (1, 1)}))


# ---------------------------------------------------------------- plans refused
@pytest.mark.parametrize(("factory", "dims", "named"), [
    # the first layer, in module order, that cannot be sharded on dims
    (cogvideox, (2, 3), r"^conv_in \(CogVideoXCausalConv3d\): .*dims \(2, 3\)"),
])
def test_refused_when_built(factory: Callable[[], nn.Module], dims: tuple[int, ...],
                            named: str) -> None:
    """A model or layer that cannot be sharded on `dims` raises naming it and the dims
    when the plan is built, not at run time."""
    with pytest.raises(HaloError, match=named):
        plan_for(factory().encoder, dims=dims)


def test_dims_checked() -> None:
    vae = ltx()
    for bad in ((4,), (3, 2), 3, (2, 2)):
        with pytest.raises(HaloError, match=r"plan_for takes dims=\(2,\).*got dims="):
            plan_for(vae, dims=bad)  # type: ignore[arg-type]
    assert repr(plan_for(vae)) == repr(plan_for(vae, dims=[2]))  # (2,): today's plan


@pytest.mark.simulated
@pytest.mark.parametrize(("part", "world", "shape", "message"), [
    # 12 rows over 2 ranks: 6 a rank, not whole patches of 4
    ("encoder", 2, (1, 3, 9, 12, 8), r"^<root> \(LTXVideoEncoder3d\): .*patch_size=4 rows .*"
     r"over 2 ranks.*H a multiple of patch_size x ranks = 8; got H = 12"),
    # 5 latent rows x 8 over 3 ranks
    ("decoder", 3, (1, 4, 3, 5, 2), r"^mid_block \(LTXVideoMidBlock3d\): LTXVideoDecoder3d "
     r"unfolds patch_size=4 rows .*\(8 rows a latent row\).*over 3 ranks.*a multiple of 3; "
     r"got 5 latent rows"),
])
def test_patch_rows_checked_simulated(part: str, world: int, shape: tuple[int, ...],
                                      message: str) -> None:
    """LTX-Video's patchify and unpatchify with H sharded: rows that DTensor's reshape or
    flatten cannot keep on their rank (it raises a RuntimeError of its own there) raise
    `HaloError` naming them before the module runs."""
    module = getattr(ltx_patched(), part)
    with simulated_mesh(world) as mesh:
        parallelize_module(module, mesh, plan_for(module, dims=(3,)))
        x = distribute_tensor(seeded_randn(shape, 1, torch.float64), mesh, [Shard(3)])
        with pytest.raises(HaloError, match=message):
            module(x)


def test_patch_rows_checks_its_module() -> None:
    """`LTXPatchRowsParallel` claims only the modules whose input rows it knows: the
    encoder (its own patchify) and, with `upsampled`, the decoder's mid-block."""
    from haloshard.integrations.diffusers import LTXPatchRowsParallel

    with simulated_mesh(2) as mesh:
        for style in (LTXPatchRowsParallel(4), LTXPatchRowsParallel(4, upsampled=8)):
            with pytest.raises(HaloError, match=r"LTXPatchRowsParallel applies to diffusers' "
                                                r"LTXVideo(Encoder3d|MidBlock3d), got Conv3d"):
                parallelize_module(nn.Conv3d(2, 2, 3), mesh, style)


# ---------------------------------------------------------------- inference keeps nothing
class _Made(TorchDispatchMode):
    """Weak references to every tensor an op makes while active, with the op's name."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[weakref.ref[torch.Tensor], str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((weakref.ref(t), str(func)))
        return out


def _storages(t: torch.Tensor) -> set[int]:
    """The storages behind a tensor (each simulated rank's for a LocalTensor)."""
    from torch.distributed._local_tensor import LocalTensor

    t = t._local_tensor if isinstance(t, DTensor) else t
    parts = t._local_tensors.values() if isinstance(t, LocalTensor) else [t]
    return {p.untyped_storage().data_ptr() for p in parts}


def case_no_grad(mesh: DeviceMesh, name: str, part: str, shape: tuple[int, ...],
                 dims: tuple[int, ...]) -> None:
    """A `torch.no_grad()` run through the plan, the first (agreements made) and a later
    one: once it returns, no tensor it made is alive but its output's and the constant
    metadata rows of its agreements (`torch.tensor` of a few ints, cached per signature):
    no window, gathered K/V or statistics."""
    module = getattr(MODELS[name](), part)
    parallelize_module(module, mesh[mesh.mesh_dim_names[0]] if mesh.ndim > 1 else mesh,
                       plan_for(module, dims=dims))
    x = distribute_tensor(seeded_randn(shape, 1, torch.float64), mesh, [Shard(d) for d in dims])
    for _ in range(2):
        with torch.no_grad(), _Made() as made:
            y = module(x)
        if isinstance(y, tuple):  # Mochi's encoder: (latents, conv caches of None)
            y, *rest = y
            assert "tensor" not in repr(rest), rest
        out = _storages(y)
        for _ in range(100):
            gc.collect()
            alive = [(op, tuple(t.shape)) for ref, op in made.made
                     if (t := ref()) is not None and not _storages(t) <= out]
            kept = [(op, s) for op, s in alive
                    if op != "aten.lift_fresh.default" or sum(s) > 8]
            if not kept:
                break
            # gloo's worker thread drops a finished collective's buffers just after the
            # caller's wait() returns: on a loaded machine, a moment later
            time.sleep(0.01)
        assert not kept, kept
        assert y.grad_fn is None
        del y


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "part", "shape", "dims"), [
    ("hunyuan", "encoder", (1, 3, 5, 8, 6), (3,)),  # mid-block: K/V gathered along H
    ("hunyuan", "encoder", (1, 3, 5, 8, 6), (2,)),  # along T: frame_attention, windows
    ("ltx", "decoder", (1, 4, 3, 3, 2), (3,)),  # upsampler windows along H
    ("ltx", "encoder", (1, 3, 9, 16, 8), (2, 3)),
])
def test_no_grad_keeps_nothing_simulated(name: str, part: str, shape: tuple[int, ...],
                                         dims: tuple[int, ...]) -> None:
    mesh_shape, names = ((2, 2), ("t", "h")) if len(dims) == 2 else (3, None)
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        case_no_grad(mesh, name, part, shape, dims)


def case_inference(mesh: DeviceMesh, name: str, part: str, shape: tuple[int, ...],
                   dims: tuple[int, ...]) -> None:
    """`torch.no_grad()` through the plan against one device: on real ranks the inference
    paths (windows of rows built in one buffer) run, which a run with gradients skips."""
    module = getattr(MODELS[name](), part)
    full = seeded_randn(shape, 1, torch.float64)
    with single_device(), torch.no_grad(), _rms_in_input_dtype():
        want = copy.deepcopy(module)(full)
    parallelize_module(module, mesh, plan_for(module, dims=dims))
    with torch.no_grad(), _rms_in_input_dtype():
        y = module(distribute_tensor(full, mesh, [Shard(d) for d in dims]))
    torch.testing.assert_close(y.full_tensor(), want, **TOL)


# ---------------------------------------------------------------- gloo
def on_gloo(dims: tuple[int, ...]) -> None:
    world = dist.get_world_size()
    if dims == (3,):
        mesh = worker_mesh(world)
        case(mesh, "hunyuan", "decoder", (1, 4, 3, 3, 2), dims)  # 2, 1 rows (1, 1, 1, 0)
        case(worker_mesh(world), "ltx", "decoder", (1, 4, 3, 3, 2), dims)
        # patch 4: DTensor's reshape and flatten on real ranks' rows; in inference the
        # causal convs build their windows of rows in one buffer
        case(worker_mesh(world), "ltx_patched", "encoder", (1, 3, 9, 16, 8), dims)
        for part, shape in (("encoder", (1, 3, 9, 32, 16)), ("decoder", (1, 4, 3, 4, 2))):
            case_inference(worker_mesh(world), "ltx_patched", part, shape, dims)
    else:
        mesh = worker_mesh((world // 2, 2), mesh_dim_names=("t", "h"))
        case(mesh, "ltx", "encoder", (1, 3, 5, 6, 4), dims)  # 3, 2 frames x 3, 3 rows
        case(worker_mesh((world // 2, 2), mesh_dim_names=("t", "h")), "ltx", "decoder",
             (1, 4, 3, 3, 2), dims)
        case(worker_mesh((world // 2, 2), mesh_dim_names=("t", "h")), "hunyuan", "decoder",
             (1, 4, 3, 3, 2), dims)  # 2, 1 frames x 2, 1 rows: the mid-block's attention
        # Mochi's per-frame norm and per-pixel attention on real ranks (eager: the norm's
        # frames are a view of the chunk), with and without a gradient
        mochi = worker_mesh((world // 2, 2), mesh_dim_names=("t", "h"))
        case(mochi, "mochi", "encoder", (1, 3, 7, 16, 8), dims)
        case_no_grad(mochi, "mochi", "encoder", (1, 3, 7, 16, 8), dims)
    case_no_grad(mesh, "hunyuan" if dims == (3,) else "ltx",
                 "decoder" if dims == (3,) else "encoder",
                 (1, 4, 3, 3, 2) if dims == (3,) else (1, 3, 5, 6, 4), dims)


@pytest.mark.gloo
@pytest.mark.parametrize(("dims", "world"), [((3,), 2), ((2, 3), 4)])
def test_gloo(gloo: Callable[[int], Any], dims: tuple[int, ...], world: int) -> None:
    gloo(world).run(on_gloo, dims, timeout=300)
