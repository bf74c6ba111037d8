"""diffusers 0.42.1 video VAEs with T sharded, against one device, through `verify_plan`.

Tiny random-init instances with the real configuration (attention on, tiling, slicing and
framewise batching off): few channels, one layer per block, H = W = 8. Each part (encoder,
decoder) runs forward and backward with a fixed random cotangent; every module's output and
input gradient and every parameter gradient (summed over the cp ranks) is compared.

Tolerances: float64 at atol = rtol = 1e-10 (relative to the value's largest magnitude): the
sharded run adds the same products in another order (GroupNorm statistics combined across
ranks, K/V gathered, parameter gradients summed over ranks), a few ulps of O(1) values
apart (measured: below 3e-14), while a misplaced or missing frame is O(1). The float32 case
uses 1e-4: each conv sums ~10^2 products of O(1) values in float32 (eps 1.2e-7) and the
parameter gradients sum over every frame and pixel, split over ranks, through ~30 layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import HaloError, LocalParallel, verify_plan
from haloshard.integrations.diffusers import plan_for
from haloshard.testing import (
    check_plan,
    seeded_randn,
    simulated_mesh,
    single_device,
    worker_mesh,
)

pytest.importorskip("diffusers")

# the first sin/cos of a gloo worker too (see conftest.py): before any one-device reference
for _dtype in (torch.float32, torch.float64):
    torch.sin(torch.arange(4096, dtype=_dtype)).cos_()

TOL = {"atol": 1e-10, "rtol": 1e-10}
F32_TOL = {"atol": 1e-4, "rtol": 1e-4}


def hunyuan(dtype: torch.dtype = torch.float64) -> nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            spatial_compression_ratio=4, temporal_compression_ratio=4)
        return vae.to(dtype).eval()


def cogvideox(dtype: torch.dtype = torch.float64) -> nn.Module:
    from diffusers import AutoencoderKLCogVideoX

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("CogVideoXDownBlock3D",) * 3,
            up_block_types=("CogVideoXUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            temporal_compression_ratio=4)
        return vae.to(dtype).eval()


def mochi(dtype: torch.dtype = torch.float64) -> nn.Module:
    from diffusers import AutoencoderKLMochi

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)
        return vae.to(dtype).eval()


def ltx(dtype: torch.dtype = torch.float64) -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    with single_device():  # LTX-Video 0.9.0's configuration, 8 channels
        torch.manual_seed(0)
        vae = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
            layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5)
        return vae.to(dtype).eval()


def ltx_residual(dtype: torch.dtype = torch.float64) -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    with single_device():  # the later decoders' residual upsamplers halving the channels
        torch.manual_seed(0)
        vae = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
            decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1,) * 4,
            decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
            upsample_residual=(True,) * 3, upsample_factor=(2,) * 3)
        return vae.to(dtype).eval()


def ltx_timestep(dtype: torch.dtype = torch.float64) -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    with single_device():  # 0.9.1+: the decoder conditioned on the decode timestep
        torch.manual_seed(0)
        vae = AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
            decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1,) * 4,
            decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
            upsample_residual=(True,) * 3, upsample_factor=(2,) * 3,
            timestep_conditioning=True)
        return vae.to(dtype).eval()


# model: (factory, encoder input shape, decoder input shape); T = 9 frames, 3 latent frames
MODELS: dict[str, tuple[Callable[..., nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "hunyuan": (hunyuan, (1, 3, 9, 8, 8), (1, 4, 3, 2, 2)),
    "cogvideox": (cogvideox, (1, 3, 8, 8, 8), (1, 4, 3, 2, 2)),  # even T: pairs from frame 0
    # temporal factors 1, 2, 3: 7 frames -> 4 -> 2 latent frames; latents 2x2 (per-frame
    # GroupNorm needs more than one value per group)
    "mochi": (mochi, (1, 3, 7, 16, 16), (1, 4, 3, 2, 2)),
    # patch 4, three stride-2 causal downsamplers: 9 frames 32x32 -> 2 latent frames 1x1
    "ltx": (ltx, (1, 3, 9, 32, 32), (1, 4, 3, 1, 1)),
    "ltx_residual": (ltx_residual, (1, 3, 9, 32, 32), (1, 4, 3, 1, 1)),
}
# diffusers' RMSNorm computes its variance in float32 even for a float64 model: both runs
# round it at float32 eps (1.2e-7) in their own order, through ~15 norms, and the backward
# amplifies that to about 1e-6 (measured: 2e-6 at most); a misplaced frame is O(0.1-1).
LTX_TOL = {"atol": 1e-5, "rtol": 1e-5}
# the parts that return (output, conv_cache)
TUPLES = {"cogvideox", "mochi"}


def check(name: str, part: str, mesh: Any, dtype: torch.dtype = torch.float64,
          tol: dict[str, float] = TOL) -> None:
    factory, enc_shape, dec_shape = MODELS[name]
    vae = factory(dtype)
    module = getattr(vae, part)
    x = seeded_randn(enc_shape if part == "encoder" else dec_shape, 1, dtype)
    run = (lambda m, t: m(t)[0]) if name in TUPLES else None
    tol = LTX_TOL if name.startswith("ltx") and tol is TOL else tol
    report = verify_plan(module, plan_for(module), x, mesh, run=run, **tol)
    assert report.ok, f"{name} {part}: {report}"
    assert len(report.outputs) > 20 and len(report.param_grads) > 20, report


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "part", "world"), [
    ("hunyuan", "encoder", 2),  # 9 frames: 5, 4; mid-block at 3 frames: 2, 1
    ("hunyuan", "encoder", 4),  # 3, 3, 3, 0: an empty shard all the way
    ("hunyuan", "decoder", 4),  # 1, 1, 1, 0
    ("cogvideox", "encoder", 3),  # 8 frames: 3, 3, 2; downsampled to 4 (2, 2, 0) and 2
    ("cogvideox", "decoder", 4),  # 1, 1, 1, 0
    ("mochi", "encoder", 3),  # 3, 3, 1 -> 2, 2, 0 (causal attention along T) -> 1, 1, 0
    # 2, 1 latent frames -> x3 (depth-to-space along T): 9 as 5, 4, rank 1's first frame
    # from rank 0's last latent frame -> x2: 18 as 9, 9
    ("mochi", "decoder", 2),
    ("ltx", "encoder", 4),  # 3, 3, 3, 0 -> 5: 2, 2, 1, 0 -> 3 -> 2: 1, 1, 0, 0
    # 3 latent frames: 1, 1, 1 -> conv before depth-to-space: 5 as 2, 2, 1 -> 9 -> 17
    ("ltx", "decoder", 3),
    ("ltx_residual", "decoder", 3),  # residual depth-to-space, upscale_factor 2
])
def test_exact_simulated(name: str, part: str, world: int) -> None:
    with simulated_mesh(world) as mesh:
        check(name, part, mesh)


def case_cogvideox_loop(mesh: Any, part: str, length: int) -> None:
    """`cogvideox_encode` / `cogvideox_decode` against the VAE's own loops over frame
    batches (`_encode`: 8 frames, `_decode`: 2 latent frames, GroupNorm per batch)."""
    from haloshard.integrations.diffusers import cogvideox_decode, cogvideox_encode

    vae = cogvideox()
    if part == "encoder":
        check_plan(mesh, vae, plan_for(vae), seeded_randn((1, 3, length, 8, 8), 3), 4,
                   run=cogvideox_encode, reference=lambda m, x: m._encode(x), **TOL)
    else:
        check_plan(mesh, vae, plan_for(vae), seeded_randn((1, 4, length, 2, 2), 3), 4,
                   run=cogvideox_decode, reference=lambda m, z: m._decode(z).sample, **TOL)


@pytest.mark.simulated
@pytest.mark.parametrize(("part", "length", "world"), [
    ("encoder", 17, 3),  # batches 9, 8 -> 5, 4 -> 3, 2; shards 6, 6, 5 cross the batch edge
    ("encoder", 24, 2),  # batches 8, 8, 8: even, pairs from frame 0
    ("decoder", 7, 4),   # latent batches 3, 2, 2 -> 5, 4, 4 -> 9, 8, 8; shards 2, 2, 2, 1
])
def test_cogvideox_loop_simulated(part: str, length: int, world: int) -> None:
    with simulated_mesh(world) as mesh:
        case_cogvideox_loop(mesh, part, length)


# The timestep reaches every resnet, through diffusers' float32 RMSNorm statistics (~10)
# and its float32 sinusoidal timestep projection, each rounded in another order on each
# side: measured 1.2e-4 at worst on a weight gradient's small element, 1.6e-5 relative on
# the scalar `timestep_scale_multiplier`. With RMSNorm computing in float64 the same runs
# agree to 3e-14 (1e-6 on that scalar, whose gradient crosses the float32 projection). A
# misplaced frame or a per-rank gradient counted twice is O(1) relative.
TIMESTEP_TOL = {"atol": 1e-3, "rtol": 1e-3}


def case_ltx_timestep(mesh: Any) -> None:
    """LTX-Video's timestep-conditioned decoder (`ReplicatedArgsParallel` on the decoder
    and its resnets) against one device, with the decode timestep as a plain tensor."""
    dec = ltx_timestep().decoder
    temb = torch.tensor([0.05], dtype=torch.float64)
    check_plan(mesh, dec, plan_for(dec), seeded_randn((1, 4, 3, 1, 1), 1), 2,
               run=lambda m, z: m(z, temb), reference=lambda m, z: m(z, temb),
               **TIMESTEP_TOL)


@pytest.mark.simulated
def test_float32_simulated() -> None:
    with simulated_mesh(3) as mesh:
        check("hunyuan", "encoder", mesh, torch.float32, F32_TOL)


@pytest.mark.simulated
def test_wrong_plan_names_the_module() -> None:
    """The mid-block run per shard (its causal convs and block-causal attention would see
    this rank's frames only) is named: LocalParallel finds a conv inside reading along T."""
    vae = hunyuan()
    plan = {**plan_for(vae.encoder), "mid_block": LocalParallel()}
    with simulated_mesh(3) as mesh:
        report = verify_plan(vae.encoder, plan, seeded_randn((1, 3, 9, 8, 8), 1), mesh, **TOL)
    assert not report.ok and report.error_fqn == "mid_block", report
    assert "reads kernel 3" in str(report.error), report


@pytest.mark.simulated
def test_errors_name_the_module() -> None:
    """A style's run-time HaloError names the module by its fqn in the planned model."""
    vae = hunyuan()
    with simulated_mesh(2) as mesh:
        parallelize_module(vae.decoder, mesh, plan_for(vae.decoder))
        named = r"^mid_block \(HunyuanVideoMidBlock3D\): .*needs a Shard\(2\) DTensor input"
        with pytest.raises(HaloError, match=named):
            vae.decoder.mid_block(torch.zeros(1, 8, 1, 2, 2, dtype=torch.float64))


def test_plan_errors() -> None:
    vae = hunyuan()
    with pytest.raises(HaloError, match="no haloshard plan for Linear"):
        plan_for(nn.Linear(2, 2))
    vae.decoder.extra = nn.Linear(2, 2)
    with pytest.raises(HaloError, match=r"extra \(Linear\) has parameters"):
        plan_for(vae.decoder)
    vae.use_tiling = True
    with pytest.raises(HaloError, match="use_tiling is on"):
        plan_for(vae)
    from diffusers import AutoencoderKLWan

    wan = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                           temperal_downsample=[True])
    with pytest.raises(HaloError, match="use wan_encoder_plan"):
        plan_for(wan)
    from diffusers import AutoencoderKLLTXVideo

    noisy = AutoencoderKLLTXVideo(
        latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
        decoder_block_out_channels=(8,) * 4, decoder_layers_per_block=(1,) * 5,
        decoder_inject_noise=(True,) * 5, timestep_conditioning=True)
    with pytest.raises(HaloError, match="injects noise drawn per call"):
        plan_for(noisy.decoder)


def on_gloo(part: str) -> None:
    mesh = worker_mesh(dist.get_world_size())
    check("hunyuan", part, mesh)
    case_cogvideox_loop(mesh, part, 17 if part == "encoder" else 5)
    if part == "decoder":
        case_ltx_timestep(mesh)


@pytest.mark.gloo
@pytest.mark.parametrize(("part", "world"), [
    ("decoder", 2),  # 3 latent frames: 2, 1
    ("encoder", 4),  # 3, 3, 3, 0: a real process with no frame runs no diffusers attention
])
def test_gloo(gloo: Callable[[int], Any], part: str, world: int) -> None:
    gloo(world).run(on_gloo, part, timeout=300)
