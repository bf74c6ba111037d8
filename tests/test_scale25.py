"""Issue 25 ("Real scale"), the misses left at P = 2: against one device.

- LTX-Video's upsampler convolves 512 -> 4096 channels; oneDNN copies the conv's whole weight
  (216 MiB at the default config) into its blocked layout at every call, which on a rank's
  few frames was the decode's peak. `LTXUpsamplerParallel` now runs that conv, under
  `torch.no_grad()`, over slices of at most `SLICE_CHANNELS` output channels: the conv is
  never called with more (counted), and the output matches one device's.
- GroupNorm with T sharded made six chunk-sized passes and temporaries beside the output
  (`x - mean` and its square for the statistics; `- mean`, `* rstd`, `* weight`, `+ bias`
  for the output), where torch's own GroupNorm makes none: the deviations are now summed
  block by block along T and the output is one `x * a + b` (torch's own form). Counted.
- Mochi's attention along T (inference) ran on slices of W, which are not contiguous, so
  each of q, k, v's linears copied its part first; slices of rows are (batch 1). Checked
  on the linears' inputs, and exact against one device.

- Mochi's decode on T and H at once: `mochi_decode` drops the first frames along T with a
  hooked slice; with the video also sharded on H that slice refused ("_DropFirst got an
  input also sharded on dim 3"). Dropping frames along T reads each row alone, so the drop
  keeps each rank's rows (and, with H sharded alone, slices T locally).

Tolerances: float64 at atol = rtol = 1e-10, as tests/test_diffusers_dims.py states: the
sharded run adds the same products in another order (GroupNorm statistics combined across
ranks, K/V gathered, parameter gradients summed over ranks), a few ulps of O(1) values
apart, while a misplaced frame or row is O(1).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import _norms, group_norm, reduce_grads
from haloshard.integrations.diffusers import LTXUpsamplerParallel, mochi_decode, plan_for
from haloshard.integrations.diffusers.ltx import SLICE_CHANNELS
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    seeded_randn,
    shard,
    simulated_mesh,
    single_device,
)

pytest.importorskip("diffusers")

TOL = {"atol": 1e-10, "rtol": 1e-10}
# float32 (oneDNN's conv, as in the benchmark): each output is a sum of 64 x 27 products
# of O(1) values, added in the kernel's order; a slice's channels run the same sums (the
# benchmark's run and benchmarks/README.md: bitwise equal there), while a misplaced channel
# or frame is O(1). 1e-5 leaves room for a kernel that blocks the sums otherwise.
TOL32 = {"atol": 1e-5, "rtol": 1e-5}


def mochi() -> nn.Module:
    from diffusers import AutoencoderKLMochi

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)
        return vae.double().eval()


def check_decode(mesh: DeviceMesh, vae: nn.Module, plan: dict[str, Any], full: torch.Tensor,
                 placements: list[Any]) -> None:
    """`mochi_decode` of the parallelized `vae` (plan on the mesh's first axis) against
    one device's `vae.decode(z).sample`: the output (still on `placements`), the input
    gradient, every parameter gradient summed over the mesh's axes."""
    with single_device():
        twin = copy.deepcopy(vae)
        z_ref = full.clone().requires_grad_()
        y_ref = twin.decode(z_ref).sample
        gy = seeded_randn(tuple(y_ref.shape), 7, full.dtype)
        (y_ref * gy).sum().backward()
    parallelize_module(vae, mesh[mesh.mesh_dim_names[0]] if mesh.ndim > 1 else mesh, plan)
    z = distribute_tensor(full, mesh, placements).requires_grad_()
    y = mochi_decode(vae, z)
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements), y
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
    (y * distribute_tensor(gy, mesh, placements)).sum().backward()
    torch.testing.assert_close(z.grad.full_tensor(), z_ref.grad, **TOL)
    for axis in range(mesh.ndim):
        reduce_grads(vae, mesh, mesh_axis=axis)
    for (name, p), q in zip(vae.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            got = DTensor.from_local(p.grad, mesh, [Replicate()] * mesh.ndim, run_check=False)
            torch.testing.assert_close(got.full_tensor(), q.grad, **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- Mochi decode on T+H
@pytest.mark.simulated
@pytest.mark.parametrize("shape", [
    # latent T 2, 1 x H 2, 1 -> 12, 6 frames -> drop 5: 13 as 7, 6, rank 0's last frame
    # from rank 1; rows 2, 1 -> x8: 16, 8 (uneven)
    (1, 4, 3, 3, 2),
    # latent T 1, 0 -> 6, 0 frames -> 1, 0 (an empty shard on t); rows 1, 0 (empty on h)
    (1, 4, 1, 1, 2),
    # latent T 2, 2 -> 12, 12 -> 19 as 10, 9: every rank takes 5 frames from the next
    (1, 4, 4, 2, 2),
])
def test_mochi_decode_time_rows_simulated(shape: tuple[int, ...]) -> None:
    """`mochi_decode` on `[Shard(2), Shard(3)]` on a 2x2 `(t, h)` mesh (`plan_for(vae,
    dims=(2, 3))`): output, input gradient and every parameter gradient; the video stays
    `[Shard(2), Shard(3)]`."""
    vae = mochi()
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        check_decode(mesh, vae, plan_for(vae, dims=(2, 3)),
                     seeded_randn(shape, 1, torch.float64), [Shard(2), Shard(3)])


@pytest.mark.simulated
def test_mochi_decode_rows_simulated() -> None:
    """`mochi_decode` with H sharded alone (T whole on every rank): as `vae.decode`."""
    vae = mochi()
    with simulated_mesh(2) as mesh:
        check_decode(mesh, vae, plan_for(vae, dims=(3,)),
                     seeded_randn((1, 4, 2, 3, 2), 1, torch.float64), [Shard(3)])


# ---------------------------------------------------------------- LTX upsampler's conv
class ConvCalls(TorchFunctionMode):
    """The output channels of every `conv3d` call made under it (per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.channels: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in (torch.conv3d, torch.nn.functional.conv3d):
            self.channels.append(int(args[1].shape[0]))
        return func(*args, **(kwargs or {}))


def ltx_upsampler(in_channels: int) -> nn.Module:
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoUpsampler3d

    with single_device():
        torch.manual_seed(0)
        return LTXVideoUpsampler3d(in_channels, stride=(2, 2, 2), is_causal=False).eval()


@pytest.mark.simulated
@pytest.mark.parametrize(("dims", "shape"), [
    ((2,), (1, 72, 5, 3, 2)),  # 3, 2 frames
    ((3,), (1, 72, 2, 3, 2)),  # 2, 1 rows
    ((2, 3), (1, 72, 3, 3, 2)),  # 2, 1 frames x 2, 1 rows
])
def test_ltx_upsampler_conv_in_slices(dims: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """Decode (`torch.no_grad()`): the upsampler's conv (72 -> 576 channels) is called on
    at most `SLICE_CHANNELS` output channels at a time (oneDNN then copies one slice of
    the weight, not all of it), on every rank, and the output matches one device's."""
    up = ltx_upsampler(shape[1])
    full = seeded_randn(shape, 1, torch.float32)
    with single_device(), torch.no_grad():
        want = up(full)
    placements = [Shard(d) for d in dims]
    mesh_shape, names = ((2, 2), ("t", "h")) if len(dims) == 2 else (2, None)
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        parallelize_module(up, mesh[names[0]] if names else mesh,
                           LTXUpsamplerParallel(dim=dims[0]))
        with torch.no_grad(), ConvCalls() as calls:
            y = up(distribute_tensor(full, mesh, placements))
        assert tuple(y.placements) == tuple(placements)
        torch.testing.assert_close(y.full_tensor(), want, **TOL32)
    assert calls.channels and max(calls.channels) <= SLICE_CHANNELS, calls.channels
    assert sum(calls.channels) % 576 == 0, calls.channels  # whole convs, slice by slice


@pytest.mark.simulated
def test_ltx_upsampler_conv_whole_with_grad() -> None:
    """With autograd on (training) the conv runs in one call: each slice's weight gradient
    would arrive as a zero-filled tensor of the whole weight's size. Forward and
    gradients match one device's."""
    up = ltx_upsampler(72)
    full = seeded_randn((1, 72, 5, 3, 2), 1, torch.float32)
    with single_device():
        twin = copy.deepcopy(up)
        x_ref = full.clone().requires_grad_()
        y_ref = twin(x_ref)
        gy = seeded_randn(tuple(y_ref.shape), 2, torch.float32)
        (y_ref * gy).sum().backward()
    with simulated_mesh(2) as mesh:
        parallelize_module(up, mesh, LTXUpsamplerParallel())
        x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
        with ConvCalls() as calls:
            y = up(x)
        torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL32)
        (y * distribute_tensor(gy, mesh, [Shard(2)])).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL32)
        reduce_grads(up, mesh)
        for p, q in zip(up.parameters(), twin.parameters(), strict=True):
            got = DTensor.from_local(p.grad, mesh, [Replicate()], run_check=False)
            # a weight gradient sums ~10^2 products per rank, added across the 2 ranks in
            # another order than one device's single sum
            torch.testing.assert_close(got.full_tensor(), q.grad, atol=1e-4, rtol=1e-5)
    assert calls.channels and min(calls.channels) == 576, calls.channels


# ---------------------------------------------------------------- GroupNorm's passes
class Outputs(TorchDispatchMode):
    """The shape of every aten op's tensor output under it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.simulated
def test_group_norm_one_chunk_sized_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """`group_norm` on a `Shard(2)` chunk (T = 16 as 8, 8) writes one chunk-sized tensor,
    its output (it wrote six: the deviations and their squares, then four steps of the
    normalisation), and matches `F.group_norm` on one device. Its deviations come in
    blocks of a 16th of the chunk; a block holds at least 2^18 elements (`_MIN_BLOCK`), more
    than this whole chunk, so the test lifts that floor."""
    monkeypatch.setattr(_norms, "_MIN_BLOCK", 1)
    full = seeded_randn((1, 8, 16, 4, 4), 1, torch.float32) * 3 + 5  # an offset
    weight, bias = seeded_randn((8,), 2, torch.float32), seeded_randn((8,), 3, torch.float32)
    with single_device():
        want = torch.nn.functional.group_norm(full, 2, weight, bias, 1e-5)
    with simulated_mesh(2) as mesh, torch.no_grad():
        x = rank_map(mesh, lambda r: shard(full, 2, 2, r).clone())
        with Outputs() as outputs:
            y = group_norm(x, 2, weight, bias, 1e-5, mesh)
        chunk = (1, 8, 8, 4, 4)
        assert outputs.shapes.count(chunk) == 1, outputs.shapes
        # float32: the statistics and `x * a + b` round as torch's own kernel does, in
        # another order (values O(1); a misplaced group or frame is O(1))
        assert_close_per_rank(y, lambda r: shard(want, 2, 2, r), mesh, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Mochi's attention parts
class LinearInputs(TorchFunctionMode):
    """Whether each input of an `F.linear` of `weights` under it is contiguous (a strided
    one is copied first)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = {id(w) for w in weights}
        self.contiguous: list[bool] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.nn.functional.linear and id(args[1]) in self.weights:
            self.contiguous.append(args[0].is_contiguous())
        return func(*args, **(kwargs or {}))


@pytest.mark.simulated
def test_mochi_attention_parts_contiguous() -> None:
    """Mochi's encoder under `torch.no_grad()` on T (2 ranks): every linear of the
    attention along T reads a contiguous part (no copy), and the latent matches one
    device's."""
    vae = mochi()
    full = seeded_randn((1, 3, 7, 32, 16), 1, torch.float64)  # 4, 3 frames
    with single_device(), torch.no_grad():
        want = vae.encoder(full)[0]
    with simulated_mesh(2) as mesh:
        parallelize_module(vae, mesh, plan_for(vae))
        weights = [p for name, p in vae.encoder.named_parameters() if ".attentions." in name]
        with torch.no_grad(), LinearInputs(weights) as linears:
            got = vae.encoder(distribute_tensor(full, mesh, [Shard(2)]))[0]
        torch.testing.assert_close(got.full_tensor(), want, **TOL)
    assert linears.contiguous and all(linears.contiguous), linears.contiguous
