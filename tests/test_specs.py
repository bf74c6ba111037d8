"""Halo spec arithmetic: derived stencils, window plans, and the plans replayed on one device.

`_replay` runs a plan without any process group: each rank's exchanged tensor is
`reference_halo` of the global tensor (what `halo_exchange` returns, tested in
test_exchange.py), the module runs on the planned window with its own padding along the dim
removed, and the kept outputs are concatenated. That must equal the module on the global
tensor. Float64 throughout; the module sums the same products in a different blocking on a
window than on the whole tensor, so values may differ by a few ulps of the output scale:
atol=1e-12, rtol=1e-10 (inputs are O(1), reductions have at most a few hundred terms).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from haloshard import (
    ConvStencil,
    HaloError,
    HaloShard,
    ResampleStencil,
    TransposeStencil,
    shard_size_and_offset,
)
from haloshard._layout import check_pad_fits
from haloshard._no_pad import NoPadAlong as _NoPadAlong
from haloshard._specs import (
    check_spec,
    conv_padding,
    derive_stencil,
    local_attrs,
    plan_windows,
    stencil_of_spec,
)
from haloshard.testing import reference_halo

TOL = {"atol": 1e-12, "rtol": 1e-10}


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


def _replay(module: nn.Module, full: torch.Tensor, dim: int, world: int, *,
            uniform: bool = False, spec: HaloShard | None = None) -> torch.Tensor:
    """The sharded computation of every rank, on one device, concatenated."""
    stencil = stencil_of_spec(spec) if spec else derive_stencil(module, dim)
    plan = plan_windows(stencil, full.shape[dim], world, uniform=uniform)
    local = copy.deepcopy(module)
    for name, value in local_attrs(local, dim).items():
        setattr(local, name, value)
    # What halo_exchange checks first: uniform halos must fit the pad mode on every rank.
    check_pad_fits(full.shape[dim], plan.left, plan.right, stencil.pad)
    pieces = []
    for r in range(world):
        x = reference_halo(full, plan.left, plan.right, dim, world, r, stencil.pad)
        if stencil.fill is not None:
            size, offset = shard_size_and_offset(full.shape[dim], world, r)
            pos = torch.arange(offset - plan.left, offset + size + plan.right)
            shape = [1] * full.ndim
            shape[dim] = -1
            x = x.masked_fill(((pos < 0) | (pos >= full.shape[dim])).reshape(shape),
                              stencil.fill)
        x = x.narrow(dim, plan.win_start[r], plan.win_len[r])
        tail = x.new_zeros((*x.shape[:dim], plan.win_zeros[r], *x.shape[dim + 1 :]))
        x = torch.cat([x, tail], dim)
        with _NoPadAlong(dim, spec, x) if spec else contextlib.nullcontext():
            y = local(x)
        pieces.append(y.narrow(dim, plan.out_start[r], plan.out_len[r]))
    return torch.cat(pieces, dim)


LAYERS = {
    "conv1d_same": lambda: nn.Conv1d(2, 3, 3, padding=1),
    "conv1d_valid": lambda: nn.Conv1d(2, 3, 4, padding="valid"),
    "conv1d_same_even": lambda: nn.Conv1d(2, 2, 4, padding="same"),
    "conv1d_dilated": lambda: nn.Conv1d(2, 2, 3, dilation=3, padding=2),
    "conv1d_stride": lambda: nn.Conv1d(2, 2, 3, stride=2, padding=1),
    "conv1d_stride3_nopad": lambda: nn.Conv1d(2, 2, 2, stride=3),
    "conv1d_reflect": lambda: nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect"),
    "conv1d_replicate_stride": lambda: nn.Conv1d(2, 2, 5, stride=2, padding=2,
                                                 padding_mode="replicate"),
    "conv1d_circular": lambda: nn.Conv1d(2, 2, 3, padding=1, padding_mode="circular"),
    "conv1d_depthwise_nobias": lambda: nn.Conv1d(4, 4, 3, padding=1, groups=4, bias=False),
    "conv2d_same_str": lambda: nn.Conv2d(2, 2, (3, 3), padding="same"),
    "conv3d_causal_t": lambda: nn.Conv3d(2, 2, (3, 3, 3), padding=(2, 1, 1)),
    "convT1d": lambda: nn.ConvTranspose1d(2, 2, 4, stride=2, padding=1),
    "convT1d_outpad": lambda: nn.ConvTranspose1d(2, 2, 3, stride=2, padding=0,
                                                 output_padding=1),
    "convT1d_gap": lambda: nn.ConvTranspose1d(2, 2, 2, stride=3, dilation=1),
    "convT1d_dilated": lambda: nn.ConvTranspose1d(2, 2, 3, stride=2, dilation=2, padding=2),
    "convT3d": lambda: nn.ConvTranspose3d(2, 2, (3, 3, 3), stride=(2, 1, 1),
                                          padding=(1, 1, 1), output_padding=(1, 0, 0)),
    "maxpool1d": lambda: nn.MaxPool1d(3, 2, 1),
    "maxpool1d_dilated": lambda: nn.MaxPool1d(2, 1, 1, dilation=3),
    "avgpool1d": lambda: nn.AvgPool1d(3, 2, 1),
    "avgpool3d": lambda: nn.AvgPool3d((2, 1, 1)),
    "upsample_nearest": lambda: nn.Upsample(scale_factor=2),
    "upsample_nearest3": lambda: nn.Upsample(scale_factor=3, mode="nearest-exact"),
    "upsample_linear": lambda: nn.Upsample(scale_factor=2, mode="linear"),
    "upsample_linear3": lambda: nn.Upsample(scale_factor=3, mode="linear"),
    "upsample_trilinear": lambda: nn.Upsample(scale_factor=(2, 1, 2), mode="trilinear"),
}
SPATIAL = {"1d": (), "2d": (3,), "3d": (3, 2)}


def _shape(name: str, module: nn.Module, length: int) -> tuple[int, ...]:
    rank = 3 if "3d" in name or name == "upsample_trilinear" else 2 if "2d" in name else 1
    channels = getattr(module, "in_channels", 2)
    return (2, channels, length, *SPATIAL[f"{rank}d"])


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize(("length", "world"), [(7, 2), (9, 3), (2, 4), (13, 4)])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_replay_matches_module(name: str, length: int, world: int, uniform: bool) -> None:
    module = _seeded(LAYERS[name](), 0)
    full = torch.randn(_shape(name, module, length), generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
    try:
        expected = module(full)
    except RuntimeError:
        pytest.skip("the single-device module rejects this length too")
    torch.testing.assert_close(_replay(module, full, 2, world, uniform=uniform), expected, **TOL)


@st.composite
def _layers(draw: st.DrawFn) -> tuple[nn.Module, int, int]:
    kernel, dilation = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    stride = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["conv", "transposed", "maxpool", "avgpool", "upsample"]))
    if kind == "upsample":
        mode = draw(st.sampled_from(["nearest", "nearest-exact", "linear"]))
        module: nn.Module = nn.Upsample(scale_factor=draw(st.integers(1, 4)), mode=mode)
    elif kind == "maxpool":
        padding = draw(st.integers(0, kernel // 2))
        module = nn.MaxPool1d(kernel, stride, padding, dilation)
    elif kind == "avgpool":
        module = nn.AvgPool1d(kernel, stride, draw(st.integers(0, kernel // 2)))
    elif kind == "transposed":
        padding = draw(st.integers(0, dilation * (kernel - 1)))
        out_pad = draw(st.integers(0, max(stride, dilation) - 1))
        module = nn.ConvTranspose1d(1, 2, kernel, stride, padding, out_pad,
                                               dilation=dilation)
    else:
        padding = draw(st.integers(0, dilation * (kernel - 1)))
        mode = draw(st.sampled_from(["zeros", "replicate", "reflect", "circular"]))
        module = nn.Conv1d(1, 2, kernel, stride, padding, dilation, padding_mode=mode)
    return module, draw(st.integers(1, 16)), draw(st.integers(1, 5))


@settings(max_examples=100, deadline=None)
@given(case=_layers(), uniform=st.booleans())
def test_replay_random_layers(case: tuple[nn.Module, int, int], uniform: bool) -> None:
    module, length, world = case
    module = _seeded(module, 2)
    full = torch.randn((1, 1, length), generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)
    try:
        expected = module(full)
    except RuntimeError:
        return  # too short for the kernel, or reflect/circular wider than the input
    try:
        got = _replay(module, full, 2, world, uniform=uniform)
    except HaloError:
        # Only a pad mode that cannot fill the (extended) halo may refuse.
        assert getattr(module, "padding_mode", "zeros") in ("reflect", "circular")
        return
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.Conv1d(1, 1, 3, padding=1), ConvStencil(3, 1, 1, 1)),
        (nn.Conv1d(1, 1, 4, padding="same"), ConvStencil(4, 1, 1, 2)),
        (nn.Conv1d(1, 1, 3, dilation=2, padding="same"), ConvStencil(5, 1, 2, 2)),
        (nn.Conv1d(1, 1, 3, padding="valid", stride=2), ConvStencil(3, 2, 0, 0)),
        (nn.Conv3d(1, 1, (3, 1, 1), padding=(2, 0, 0), padding_mode="replicate"),
         ConvStencil(3, 1, 2, 2, "replicate")),
        (nn.Conv2d(1, 1, (1, 3), padding=(0, 1)), ConvStencil(1, 1, 0, 0)),
        (nn.ConvTranspose3d(1, 1, (4, 3, 3), (2, 1, 1), (1, 1, 1)),
         TransposeStencil(4, 2, 1, 1, 0)),
        (nn.MaxPool1d(3, padding=1), ConvStencil(3, 3, 1, 1, fill=-math.inf)),
        (nn.AvgPool2d((2, 3)), ConvStencil(2, 2, 0, 0)),
        (nn.Upsample(scale_factor=(2, 1, 1), mode="trilinear"), ResampleStencil(2, "linear")),
        (nn.Upsample(scale_factor=4.0), ResampleStencil(4, "nearest")),
    ],
)
def test_derive(module: nn.Module, expected: object) -> None:
    assert derive_stencil(module, 2) == expected


@pytest.mark.parametrize(
    ("stencil", "length", "world", "expected"),
    [
        # symmetric conv, T=5 on 4 ranks (2, 2, 1, 0): halo (1, 1); rank 3 owns no output
        # and runs on its 2 halo slices plus 1 zero slice (the kernel's minimum)
        (ConvStencil(3, 1, 1, 1), 5, 4, (5, 1, 1, (0, 0, 0, 0), (4, 4, 3, 2), (0, 0, 0, 1))),
        # causal conv: left halo only
        (ConvStencil(3, 1, 2, 0), 5, 4, (5, 2, 0, (0, 0, 0, 0), (4, 4, 3, 2), (0, 0, 0, 1))),
        # stride 2 on an odd length: outputs (2, 2) need inputs [-1, 4) and [3, 8)
        (ConvStencil(3, 2, 1, 1), 7, 2, (4, 1, 1, (0, 0), (5, 5), (0, 0))),
        # nearest x2: outputs (3, 3, 3, 1) of 10 from chunks (2, 2, 1, 0); rank r >= 1
        # starts its outputs mid-slice, so it needs the slice before its chunk
        (ResampleStencil(2), 5, 4, (10, 1, 0, (1, 0, 0, 0), (2, 2, 2, 1), (0, 0, 0, 0))),
    ],
)
def test_plan_windows(stencil: object, length: int, world: int, expected: tuple) -> None:
    p = plan_windows(stencil, length, world)
    assert (p.out_length, p.left, p.right, p.win_start, p.win_len, p.win_zeros) == expected


def test_plan_uniform_windows() -> None:
    p = plan_windows(ConvStencil(3, 2, 1, 1), 9, 3, uniform=True)
    sizes = {n + z for n, z in zip(p.win_len, p.win_zeros, strict=True)}
    assert sizes == {5} and p.out_len == (2, 2, 1) and (p.left, p.right) == (1, 2)


def test_plan_rejects_empty_output() -> None:
    with pytest.raises(HaloError, match="no output for global length 2"):
        plan_windows(ConvStencil(5), 2, 2)


@pytest.mark.parametrize(
    ("module", "dim", "match"),
    [
        (nn.GroupNorm(1, 2), 2, "cannot derive a halo for GroupNorm"),
        (nn.Conv1d(1, 1, 3), 3, "dim 3 is not a spatial dim of Conv1d"),
        (nn.Conv3d(1, 1, 3), 1, "dim 1 is not a spatial dim of Conv3d"),
        (nn.MaxPool1d(3, ceil_mode=True), 2, "ceil_mode=True"),
        (nn.MaxPool1d(3, return_indices=True), 2, "return_indices=True"),
        (nn.AvgPool1d(3, padding=1, count_include_pad=False), 2, "count_include_pad=False"),
        (nn.Upsample(scale_factor=2, mode="linear", align_corners=True), 2, "align_corners"),
        (nn.Upsample(size=8), 2, "integer scale_factor"),
        (nn.Upsample(scale_factor=1.5), 2, "scale_factor=1.5"),
        (nn.Upsample(scale_factor=2, mode="bicubic"), 2, "mode 'bicubic'"),
    ],
)
def test_derive_rejects(module: nn.Module, dim: int, match: str) -> None:
    with pytest.raises(HaloError, match=re.escape(match)):
        derive_stencil(module, dim)


def test_same_even_kernel_off_dim_rejected() -> None:
    conv = nn.Conv2d(1, 1, (3, 2), padding="same")
    with pytest.raises(HaloError, match=r"dim\(s\) \[3\]"):
        local_attrs(conv, 2)
    # with a non-zeros padding_mode torch pads by F.pad, which can be uneven
    assert local_attrs(nn.Conv2d(1, 1, (3, 2), padding="same", padding_mode="replicate"), 2)


def test_local_attrs_zero_only_the_dim() -> None:
    conv = nn.Conv3d(1, 1, 3, padding=(1, 2, 3), padding_mode="reflect")
    attrs = local_attrs(conv, 2)
    assert attrs["padding"] == (0, 2, 3)
    assert attrs["_reversed_padding_repeated_twice"] == [3, 3, 2, 2, 0, 0]
    assert local_attrs(nn.ConvTranspose1d(1, 1, 3, 2, 1, 1), 2) == {
        "padding": (0,), "output_padding": (0,)}


class _Causal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, (3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(nn.functional.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate"))


@pytest.mark.parametrize(
    ("module", "spec", "match"),
    [
        (nn.Conv1d(1, 1, 3, padding=1), HaloShard(2, left=0, right=1), "does not match"),
        (nn.Conv1d(1, 1, 3, padding=1), HaloShard(2, left=1, right=1, pad="replicate"),
         "does not match"),
        (nn.Conv1d(1, 1, 3, padding=1), HaloShard(3, left=1, right=1), "shards dim 3"),
        (_Causal(), HaloShard(2, left=1), "too small for conv"),
    ],
)
def test_check_spec_rejects(module: nn.Module, spec: HaloShard, match: str) -> None:
    with pytest.raises(HaloError, match=match):
        check_spec(module, spec, 2)


def test_check_spec_accepts() -> None:
    check_spec(nn.Conv1d(1, 1, 3, padding=1), HaloShard(2, left=1, right=1), 2)
    check_spec(_Causal(), HaloShard(2, left=2, pad="replicate"), 2)


def test_explicit_spec_replay() -> None:
    module = _seeded(_Causal(), 4)
    full = torch.randn((1, 1, 7, 2, 2), generator=torch.Generator().manual_seed(5),
                       dtype=torch.float64)
    spec = HaloShard(2, left=2, pad="replicate")
    for world in (2, 3, 4, 6):
        got = _replay(module, full, 2, world, spec=spec)
        torch.testing.assert_close(got, module(full), **TOL)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ConvStencil(span=0), "span >= 1"),
    (lambda: TransposeStencil(kernel=0), "kernel, stride, dilation >= 1"),
    (lambda: TransposeStencil(kernel=3, stride=2, output_padding=2), "output_padding=2"),
    (lambda: TransposeStencil(kernel=3, padding=-1), "padding=-1"),
    (lambda: ResampleStencil(0), "factor=0"),
    (lambda: ResampleStencil(1.5), "factor=1.5"),  # type: ignore[arg-type]
    (lambda: ResampleStencil(2, "cubic"), "mode='cubic'"),
])
def test_stencils_validate_fields(make: Any, match: str) -> None:
    with pytest.raises(HaloError, match=re.escape(match)):
        make()


def test_conv_padding_reads_the_public_attribute() -> None:
    """A subclass that resets `padding` after __init__ (diffusers' Wan conv) is read from
    `padding`; torch's private record is stale then."""
    conv = nn.Conv3d(1, 1, 3, padding=1)
    conv.padding = (0, 1, 1)
    assert conv_padding(conv) == [(0, 0), (1, 1), (1, 1)]
    assert derive_stencil(conv, 2) == ConvStencil(span=3)
    assert local_attrs(conv, 3)["_reversed_padding_repeated_twice"] == [1, 1, 0, 0, 0, 0]
    conv.padding_mode = "replicate"  # torch would pad by the stale record now
    with pytest.raises(HaloError, match="torch will pad"):
        derive_stencil(conv, 2)
