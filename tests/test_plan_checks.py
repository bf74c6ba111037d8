"""Issue 26: plan builders leave nothing to a raw torch error.

- `halo_plan(include_convs=True)` plans GroupNorms with `include_norms=True` and otherwise
  names every module it leaves uncovered that touches the sharded dim;
- a layer a hand-written plan leaves out, met by a DTensor, is named by fqn with its missing
  plan entry in `verify_plan`; a plain run keeps torch's own error (haloshard installs no
  process-wide module hook: torch.compile warns about those, and they slow every model);
- `plan_for` checks every module, with or without parameters, and the VAE's own switches;
  it plans LTX-Video 0.9.5/0.9.7's encoder (`LTXVideoDownsampler3d`) exactly.

Tolerances: float64 toy models at 1e-10 (absolute and relative to the value's scale): the
sharded run adds the same products in another order (GroupNorm statistics combined across
ranks, parameter gradients summed over ranks), a few ulps apart, while a wrong frame is
O(1). LTX at 1e-5: diffusers' RMSNorm computes its statistics in float32 even in a float64
model, each side rounding in its own order (measured 5e-7 relative at most, as in
tests/test_diffusers.py); a misplaced frame is O(0.1-1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    GroupNormParallel,
    HaloError,
    HaloParallel,
    halo_plan,
    verify_plan,
)
from haloshard.testing import seeded_randn, simulated_mesh, single_device, worker_mesh

TOL = {"atol": 1e-10, "rtol": 1e-10}
LTX_TOL = {"atol": 1e-5, "rtol": 1e-5}
# every rank sees the same mistake and raises without a collective: well under a second of
# work, 5 s with margin for a loaded 2-core machine (the group's timeout is 60 s)
AT_ONCE_S = 5.0


class Block(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv3d(4, 4, 3, padding=1)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.norm(self.conv(x)))


class Net(nn.Module):
    """conv, then blocks of conv + GroupNorm, then a 1x1 conv."""

    def __init__(self, norm: Callable[[], nn.Module] = lambda: nn.GroupNorm(2, 4)) -> None:
        super().__init__()
        self.conv_in = nn.Conv3d(2, 4, 3, padding=1)
        self.blocks = nn.ModuleList([Block(norm()) for _ in range(2)])
        self.proj = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for block in self.blocks:
            h = block(h)
        return self.proj(h)


def net(seed: int = 0, norm: Callable[[], nn.Module] = lambda: nn.GroupNorm(2, 4)) -> Net:
    with single_device():
        torch.manual_seed(seed)
        return Net(norm).double()


# ---------------------------------------------------------------- halo_plan
def test_halo_plan_include_norms() -> None:
    plan = halo_plan(net(), include_convs=True, include_norms=True)
    assert list(plan) == ["conv_in", "blocks.0.conv", "blocks.0.norm", "blocks.1.conv",
                          "blocks.1.norm", "proj"]
    assert all(isinstance(plan[f"blocks.{i}.norm"], GroupNormParallel) for i in (0, 1))
    # include_norms alone plans the norms only
    assert list(halo_plan(net(), include_norms=True)) == ["blocks.0.norm", "blocks.1.norm"]


@pytest.mark.simulated
@pytest.mark.parametrize("world", [2, 3, 4])  # T = 7: 4, 3 / 3, 3, 1 / 2, 2, 2, 1
def test_halo_plan_include_norms_exact(world: int) -> None:
    model = net(1)
    with simulated_mesh(world) as mesh:
        report = verify_plan(model, halo_plan(model, include_convs=True, include_norms=True),
                             seeded_randn((1, 2, 7, 3, 3), 2), mesh, **TOL)
    assert report.ok, report
    assert {"blocks.0.norm", "blocks.1.norm"} <= {d.fqn for d in report.outputs}


def test_halo_plan_names_every_uncovered_module() -> None:
    """A GroupNorm left out (no include_norms) is named; so is every other module that
    touches the sharded dim: norms with statistics along it, pooling, parameters."""
    with pytest.raises(HaloError, match=r"2 module\(s\).*blocks\.0\.norm \(GroupNorm: "
                                        r"statistics.*include_norms=True.*blocks\.1\.norm"):
        halo_plan(net(), include_convs=True)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4),
                          nn.InstanceNorm3d(4), nn.MaxPool3d(2), nn.AdaptiveAvgPool3d(1),
                          nn.Upsample(scale_factor=2), nn.Linear(3, 3), nn.SiLU())
    with pytest.raises(HaloError) as info:
        halo_plan(model, include_convs=True)
    text = str(info.value)
    for named in ("1 (BatchNorm3d: statistics", "2 (InstanceNorm3d: statistics",
                  "3 (MaxPool3d: a kernel", "4 (AdaptiveAvgPool3d: pooling",
                  "5 (Upsample: a kernel", "6 (Linear: parameters ['weight', 'bias'])"):
        assert named in text, text
    assert "7 (SiLU" not in text and "0 (Conv3d" not in text
    # a module the filter leaves out is the caller's to plan
    kept = halo_plan(model, include_convs=True, module_filter_fn=lambda m, fqn: fqn == "0")
    assert list(kept) == ["0"]


def test_halo_plan_parameters_of_the_root() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(1, 1, 3, padding=1)
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) * self.scale

    with pytest.raises(HaloError, match=r"<root> \(Scaled: parameters \['scale'\]\)"):
        halo_plan(Scaled(), include_convs=True)


# ---------------------------------------------------------------- errors at run time
def run_with_missing_norm(mesh: Any) -> None:
    """The norm of block 1 left out of a hand-written plan: the run names it."""
    model = net(3)
    plan = halo_plan(model, include_convs=True, include_norms=True)
    del plan["blocks.1.norm"]
    parallelize_module(model, mesh, plan)
    x = distribute_tensor(seeded_randn((1, 2, 5, 3, 3), 4), mesh, [Shard(2)])
    model(x)


@pytest.mark.simulated
def test_missing_entry_named_at_run_time() -> None:
    """A plain run names the norm left out (DTensor's own unnamed error before, issue
    #26), still a RuntimeError; no process-wide hook (see tests/test_reliability4.py)."""
    with simulated_mesh(2) as mesh, pytest.raises(
            RuntimeError, match=r"^blocks\.1\.norm \(GroupNorm\) has no plan entry: .*got "
                                r"mixed torch\.Tensor and DTensor"):
        run_with_missing_norm(mesh)
    assert not torch.nn.modules.module._global_forward_hooks


@pytest.mark.simulated
def test_unplanned_model_keeps_torch_error() -> None:
    """A model without any haloshard style keeps DTensor's own message, even after another
    model was planned in this process."""
    with simulated_mesh(2) as mesh:
        parallelize_module(net(), mesh, halo_plan(net(), include_convs=True,
                                                  include_norms=True))
        x = distribute_tensor(seeded_randn((1, 4, 5, 3, 3), 4), mesh, [Shard(2)])
        with pytest.raises(RuntimeError, match=r"^aten\.convolution\.default: got mixed"):
            nn.Conv3d(4, 4, 3, padding=1).double()(x)


def test_verify_plan_names_missing_entry() -> None:
    """verify_plan with a conv left out: the module and the missing entry, not the raw
    DTensor error alone."""
    model = net(5)
    plan = halo_plan(model, include_convs=True, include_norms=True)
    del plan["proj"]
    with simulated_mesh(3) as mesh:
        report = verify_plan(model, plan, seeded_randn((1, 2, 5, 3, 3), 6), mesh, **TOL)
    assert report.error_fqn == "proj", report
    assert report.error is not None and report.error.startswith(
        "proj (Conv3d) has no plan entry"), report.error
    assert "Add an entry for 'proj'" in report.error and "HaloParallel()" in report.error
    assert "plan FAILS: the sharded run raised in 'proj': proj (Conv3d)" in str(report)


def missing_norm_on_rank() -> tuple[str, float]:
    mesh = worker_mesh(dist.get_world_size())
    start = time.perf_counter()
    try:
        run_with_missing_norm(mesh)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


@pytest.mark.gloo
def test_missing_entry_named_on_every_rank(gloo: Callable[[int], Any]) -> None:
    """Real processes: every rank raises the named error at once; none is left waiting."""
    outcomes = gloo(3).run(missing_norm_on_rank, timeout=120)
    for rank, (text, seconds) in enumerate(outcomes):
        assert text.startswith("MissingEntryError: blocks.1.norm (GroupNorm) has no plan "
                               "entry"), (rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds)


# ---------------------------------------------------------------- plan_for
def hunyuan() -> nn.Module:
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKLHunyuanVideo

    with single_device():
        torch.manual_seed(0)
        return AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            spatial_compression_ratio=4, temporal_compression_ratio=4).double().eval()


def ltx095(causal: bool = True, patch_size_t: int = 1) -> nn.Module:
    """LTX-Video 0.9.5's configuration, 8-32 channels: spatial, temporal and
    spatio-temporal `LTXVideoDownsampler3d`s in the encoder, timestep conditioning and
    residual upsamplers in the decoder."""
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKLLTXVideo

    with single_device():
        torch.manual_seed(0)
        return AutoencoderKLLTXVideo(
            latent_channels=4, block_out_channels=(8, 16, 32, 32),
            down_block_types=("LTXVideo095DownBlock3D",) * 4,
            downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            spatio_temporal_scaling=(True,) * 4, layers_per_block=(1,) * 5,
            decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1,) * 4,
            decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
            upsample_residual=(True,) * 3, upsample_factor=(2,) * 3,
            timestep_conditioning=True, encoder_causal=causal, decoder_causal=False,
            patch_size_t=patch_size_t).double().eval()


def test_plan_for_refuses_framewise_flags() -> None:
    """HunyuanVideo's default framewise encoding and decoding (blended temporal tiles past
    16 frames) are refused at plan time, each named with how to turn it off."""
    from haloshard.integrations.diffusers import plan_for

    vae = hunyuan()
    with pytest.raises(HaloError, match=r"AutoencoderKLHunyuanVideo\.use_framewise_encoding "
                                        r"is on.*use_framewise_encoding = False"):
        plan_for(vae)
    vae.use_framewise_encoding = False
    with pytest.raises(HaloError, match=r"use_framewise_decoding is on.*"
                                        r"use_framewise_decoding = False"):
        plan_for(vae)
    vae.use_framewise_decoding = False
    assert "encoder.conv_in" in plan_for(vae)
    ltx = ltx095()
    ltx.use_framewise_decoding = True  # LTX's encode() keys on it too
    with pytest.raises(HaloError, match=r"AutoencoderKLLTXVideo\.use_framewise_decoding is on"):
        plan_for(ltx)


class Roll(nn.Module):
    """No parameters, and reads across T: a neighbour's frame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(x, 1, dims=2)


def test_plan_for_refuses_unknown_modules_without_parameters() -> None:
    from haloshard.integrations.diffusers import plan_for

    vae = hunyuan()
    vae.decoder.up_blocks[0].shift = Roll()
    with pytest.raises(HaloError, match=r"up_blocks\.0\.shift \(Roll\) has no parameters but "
                                        r"its own forward, and the HunyuanVideoDecoder3D plan "
                                        r"does not know its class"):
        plan_for(vae.decoder)
    with pytest.raises(HaloError, match=r"LTXVideoEncoder3d with patch_size_t=2 folds frames"):
        plan_for(ltx095(patch_size_t=2).encoder)


@pytest.mark.simulated
@pytest.mark.parametrize(("length", "world", "causal"), [
    (9, 2, True),    # 9 -> 5 -> 3 -> 2 frames (spatial, temporal, spatio-temporal, conv)
    (9, 4, True),    # 3, 2, 2, 2 -> 2, 1, 1, 1: windows reach two ranks back
    (17, 3, True),   # 6, 6, 5 -> 9: 3, 3, 3 -> 5: 2, 2, 1 -> 3
    (9, 3, False),   # a centred conv: windows reach forward too
])
def test_ltx095_encoder_exact(length: int, world: int, causal: bool) -> None:
    from haloshard.integrations.diffusers import plan_for

    encoder = ltx095(causal).encoder
    plan = plan_for(encoder)
    with simulated_mesh(world) as mesh:
        report = verify_plan(encoder, plan, seeded_randn((1, 3, length, 32, 32), 1), mesh,
                             **LTX_TOL)
    assert report.ok, report
    assert "down_blocks.1.downsamplers.0" in {d.fqn for d in report.outputs}
    styles = [repr(plan.get(f"down_blocks.{i}.downsamplers.0")) for i in range(3)]
    assert styles == ["LTXDownsamplerParallel(dim=2)"] * 3, styles


@pytest.mark.simulated
def test_ltx095_encoder_length_checked() -> None:
    """A T the downsampler cannot fold (one device raises in a reshape) is a HaloError."""
    from haloshard.integrations.diffusers import plan_for

    encoder = ltx095().encoder
    with simulated_mesh(2) as mesh:
        parallelize_module(encoder, mesh, plan_for(encoder))
        x = distribute_tensor(seeded_randn((1, 3, 10, 32, 32), 1), mesh, [Shard(2)])
        with pytest.raises(HaloError, match=r"down_blocks\.1\.downsamplers\.0 "
                                            r"\(LTXVideoDownsampler3d\).*needs 1 \+ k \* 2 "
                                            r"frames, got 10"):
            encoder(x)


def ltx095_on_gloo() -> None:
    from haloshard.integrations.diffusers import plan_for

    encoder = ltx095().encoder
    report = verify_plan(encoder, plan_for(encoder), seeded_randn((1, 3, 17, 32, 32), 1),
                         worker_mesh(dist.get_world_size()), **LTX_TOL)
    assert report.ok, report


@pytest.mark.gloo
def test_ltx095_encoder_gloo(gloo: Callable[[int], Any]) -> None:
    gloo(3).run(ltx095_on_gloo, timeout=300)


def test_halo_parallel_still_plain() -> None:
    """HaloParallel entries of halo_plan are unchanged by include_norms."""
    plan = halo_plan(net(), include_convs=True, include_norms=True)
    assert repr(plan["conv_in"]) == repr(HaloParallel()) == "HaloParallel(spec=None, dim=2)"
