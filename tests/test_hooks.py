"""Halo modules against the single-device module: forward, input and parameter gradients.

Each case is one SPMD body, run under simulated ranks (LocalTensorMode) and on real gloo
processes (worlds 2, 3, 4; uneven T, and shards shorter than the halo). Float64 throughout.
Tolerances: the sharded module computes each output from the same products as the global
one but in another blocking (a window, not the whole tensor), and parameter gradients are
sums of per-rank partial sums (`reduce_grads`), another order of addition. Inputs and weights
are O(1) and every reduction has at most a few hundred terms, so atol=1e-12, rtol=1e-10
bounds those reorderings with room to spare while catching any misplaced slice (O(1)).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    HaloError,
    HaloParallel,
    HaloShard,
    LocalParallel,
    ReplicatedArgsParallel,
    ResampleStencil,
    annotate,
    halo_handles,
    halo_plan,
    reduce_grads,
)
from haloshard._annotation import annotation_of, resolve
from haloshard._forward import install
from haloshard._halo_forward import HaloForward
from haloshard.testing import (
    CausalConv3d,
    assert_close_per_rank,
    check_module,
    module_reference,
    rank_map,
    seeded_module,
    seeded_randn,
    shard,
    sharded,
    simulated_mesh,
    single_device,
    sum_over_ranks,
    unhooked,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}




def _seeded(module: nn.Module, seed: int) -> nn.Module:
    return seeded_module(module, seed)




class CatCausalConv3d(nn.Module):
    """A causal conv that pads T by concatenating copies of the first frame (CogVideoX)."""

    def __init__(self, channels: int, k: int = 3) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Conv3d(channels, channels, (k, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([x[:, :, :1]] * (self.k - 1) + [x], dim=2))


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.causal = CausalConv3d(channels)
        self.temporal = nn.Conv3d(channels, channels, (3, 1, 1), dilation=(2, 1, 1),
                                  padding=(2, 0, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.conv1(F.silu(x))
        h = h + self.causal(h)
        return h + self.temporal(h)


class Net(nn.Module):
    def __init__(self, channels: int = 3, depth: int = 1) -> None:
        super().__init__()
        self.conv_in = nn.Conv3d(2, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(Block(channels) for _ in range(depth)))
        self.conv_out = nn.Conv3d(channels, 2, (1, 3, 3), padding=(0, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.blocks(self.conv_in(x)))


class Interpolate(nn.Module):
    """Upsampling by `F.interpolate` in model code: no module to derive a halo from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=(3, 1, 1), mode="trilinear")


# name: (module factory, input shape with T at dim 2 set per case)
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=1), (2, 2, 0)),
    "conv1d_explicit_spec": (lambda: annotate(nn.Conv1d(2, 2, 3, padding=1),
                                              HaloShard(2, left=1, right=1)), (1, 2, 0)),
    "conv1d_same_even_dilated": (lambda: nn.Conv1d(2, 2, 4, dilation=2, padding="same"),
                                 (1, 2, 0)),
    "conv1d_valid_stride2": (lambda: nn.Conv1d(2, 2, 3, stride=2, padding="valid"), (1, 2, 0)),
    "conv1d_reflect_stride2": (lambda: nn.Conv1d(2, 2, 3, stride=2, padding=1,
                                                 padding_mode="reflect"), (1, 2, 0)),
    "conv1d_circular": (lambda: nn.Conv1d(2, 2, 5, padding=2, padding_mode="circular"),
                        (1, 2, 0)),
    "conv2d_depthwise_nobias": (lambda: nn.Conv2d(4, 4, (5, 3), padding=(2, 1), groups=4,
                                                  bias=False), (1, 4, 0, 3)),
    "conv3d_replicate": (lambda: nn.Conv3d(2, 2, 3, padding=1, padding_mode="replicate"),
                         (1, 2, 0, 3, 3)),
    "conv3d_causal_dilated": (lambda: nn.Conv3d(2, 2, (3, 1, 1), dilation=(2, 1, 1),
                                                padding=(4, 0, 0)), (1, 2, 0, 2, 2)),
    "convT1d": (lambda: nn.ConvTranspose1d(2, 2, 4, stride=2, padding=1), (1, 2, 0)),
    "convT3d_outpad": (lambda: nn.ConvTranspose3d(2, 2, 3, stride=(2, 1, 1), padding=1,
                                                  output_padding=(1, 0, 0)), (1, 2, 0, 2, 2)),
    "maxpool1d": (lambda: nn.MaxPool1d(3, 2, 1), (1, 2, 0)),
    "maxpool3d_dilated": (lambda: nn.MaxPool3d((2, 1, 1), 1, (1, 0, 0), dilation=(2, 1, 1)),
                          (1, 2, 0, 2, 2)),
    "avgpool3d": (lambda: nn.AvgPool3d((3, 2, 2), (2, 2, 2), (1, 0, 0)), (1, 2, 0, 2, 2)),
    "upsample_nearest": (lambda: nn.Upsample(scale_factor=2), (1, 2, 0)),
    "upsample_trilinear": (lambda: nn.Upsample(scale_factor=(2, 2, 1), mode="trilinear"),
                           (1, 2, 0, 2, 2)),
    "interpolate_fn": (lambda: annotate(Interpolate(), ResampleStencil(3, "linear")),
                       (1, 2, 0, 2, 2)),
    "cat_causal_wrapper": (lambda: annotate(CatCausalConv3d(2),
                                            HaloShard(2, left=2, pad="replicate")),
                           (1, 2, 0, 2, 2)),
    "causal_wrapper": (lambda: annotate(CausalConv3d(2), HaloShard(2, left=2, pad="replicate")),
                       (1, 2, 0, 3, 3)),
}








def case_layer(mesh: DeviceMesh, name: str, length: int, seed: int) -> None:
    """One layer kind through parallelize_module(HaloParallel()) on a Shard(2) DTensor."""
    factory, shape = LAYERS[name]
    with single_device():  # plain tensors, not one per simulated rank
        module = _seeded(factory(), seed)
        full = seeded_randn((*shape[:2], length, *shape[3:]), seed + 100)
    parallelize_module(module, mesh, HaloParallel())
    check_module(mesh, module, full, seed + 200)


def case_model(mesh: DeviceMesh, length: int, seed: int, depth: int = 2) -> None:
    """Symmetric convs, a causal wrapper, a dilated conv and residual adds, one plan each."""
    with single_device():
        model = _seeded(Net(depth=depth), seed)
        full = seeded_randn((1, 2, length, 4, 3), seed + 1)
    for block in model.blocks:
        annotate(block.causal, HaloShard(2, left=2, pad="replicate"))
    by_annotation = copy.deepcopy(model)
    plan = halo_plan(by_annotation, include_convs=True)
    blocks = [f"blocks.{i}.{name}" for i in range(depth)
              for name in ("conv1", "causal", "temporal")]
    assert list(plan) == ["conv_in", *blocks, "conv_out"]
    parallelize_module(by_annotation, mesh, plan)
    check_module(mesh, by_annotation, full, seed + 2)
    # The same model by a glob plan that also names the causal wrapper's inner conv: that one
    # passes through, since its wrapper already holds the halo.
    by_glob = copy.deepcopy(model)
    parallelize_module(by_glob, mesh, {"conv_in": HaloParallel(), "conv_out": HaloParallel(),
                                       "blocks.*.c*": HaloParallel(),
                                       "blocks.*.causal.conv": HaloParallel(),
                                       "blocks.*.temporal": HaloParallel()})
    check_module(mesh, by_glob, full, seed + 2)


def case_remove_reapply(mesh: DeviceMesh, seed: int) -> None:
    """remove() restores the module exactly; re-applying works; applying twice is refused."""
    with single_device():
        model = _seeded(Net(), seed)
        full = seeded_randn((1, 2, 5, 4, 3), seed + 1)
    annotate(model.blocks[0].causal, HaloShard(2, left=2, pad="replicate"))
    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    assert model.conv_in.padding == (0, 1, 1)
    with pytest.raises(HaloError, match="already attached"):
        parallelize_module(model, mesh, {"conv_in": HaloParallel()})
    for handle in halo_handles(model).values():
        handle.remove()
        handle.remove()  # a second call does nothing
    assert halo_handles(model) == {}
    assert {n: dict(vars(m)) for n, m in model.named_modules()} == before
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    check_module(mesh, model, full, seed + 2)


def case_plain_input(mesh: DeviceMesh, length: int, seed: int) -> None:
    """A plain local chunk in, with the mesh given to parallelize_module: a plain chunk out."""
    world = mesh.size()
    with single_device():
        module = _seeded(nn.Conv1d(2, 2, 3, stride=2, padding=1), seed)
        full = seeded_randn((1, 2, length), seed + 1)
    y_ref, gy, gx, _ = module_reference(module, full, seed + 2)
    parallelize_module(module, mesh, HaloParallel())
    local = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
    y = module(local)
    assert not isinstance(y, DTensor)
    assert_close_per_rank(y, lambda r: shard(y_ref, 2, world, r), mesh, **TOL)
    (y * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    assert_close_per_rank(local.grad, lambda r: shard(gx, 2, world, r), mesh, **TOL)


def case_2d_mesh(mesh: DeviceMesh, length: int, seed: int) -> None:
    """The cp axis of a (dp, cp) mesh: each dp row holds its own batch slice."""
    cp = mesh["cp"]
    world = cp.size()
    with single_device():
        model = _seeded(Net(), seed)
        full = seeded_randn((2, 2, length, 3, 3), seed + 1)
        rows = [full[d : d + 1] for d in range(2)]
    for block in model.blocks:
        annotate(block.causal, HaloShard(2, left=2, pad="replicate"))
    parallelize_module(model, cp, halo_plan(model, include_convs=True))

    def local_chunk(d: int, c: int) -> torch.Tensor:
        return shard(rows[d], 2, world, c).clone()

    both = (mesh.get_local_rank("dp"), mesh.get_local_rank("cp"))
    local = maybe_run_for_local_tensor(local_chunk)(*both).requires_grad_()
    x = DTensor.from_local(local, cp, [Shard(2)], shape=rows[0].shape,
                           stride=rows[0].stride())
    y = model(x)
    assert y.device_mesh == cp and y.placements == (Shard(2),)
    refs = [module_reference(model, rows[d], seed + 2) for d in range(2)]

    def expect(which: int) -> Callable[[int, int], torch.Tensor]:
        return lambda d, c: shard(refs[d][which], 2, world, c)

    _close(y.to_local(), expect(0), both)
    (y.to_local() * maybe_run_for_local_tensor(expect(1))(*both)).sum().backward()
    _close(local.grad, expect(2), both)
    reduce_grads(model, mesh, mesh_axis="cp")
    for i, p in enumerate(model.parameters()):
        _close(p.grad, lambda d, c, i=i: refs[d][3][i], both)


def _close(actual: Any, expected: Callable[[int, int], torch.Tensor], both: tuple) -> None:
    def check(a: torch.Tensor, d: int, c: int) -> None:
        torch.testing.assert_close(a, expected(d, c), **TOL)

    maybe_run_for_local_tensor(check)(actual, *both)


def case_2d_placements(mesh: DeviceMesh, length: int, seed: int) -> None:
    """A DTensor on the whole (dp, cp) mesh, (Shard(0), Shard(2)): placements are kept."""
    with single_device():
        module = _seeded(nn.Conv3d(2, 2, 3, padding=1), seed)
        full = seeded_randn((2, 2, length, 3, 2), seed + 1)
        rows = [full[d : d + 1] for d in range(2)]
    parallelize_module(module, mesh["cp"], HaloParallel())
    x = _distribute(full, rows, mesh)
    y = module(x)
    assert y.placements == (Shard(0), Shard(2)) and y.shape == (2, 2, length, 3, 2)
    with single_device():
        expected = unhooked(module)(full).detach()
    world = mesh["cp"].size()
    _close(y.to_local(), lambda d, c: shard(expected.narrow(0, d, 1), 2, world, c),
           (mesh.get_local_rank("dp"), mesh.get_local_rank("cp")))


def _distribute(full: torch.Tensor, rows: list[torch.Tensor], mesh: DeviceMesh) -> DTensor:
    world = mesh["cp"].size()
    local = maybe_run_for_local_tensor(lambda d, c: shard(rows[d], 2, world, c))(
        mesh.get_local_rank("dp"), mesh.get_local_rank("cp"))
    return DTensor.from_local(local, mesh, [Shard(0), Shard(2)], shape=full.shape,
                              stride=full.stride())




def case_runtime_errors(mesh: DeviceMesh, seed: int) -> None:
    """Errors that only the input or the model's own code can reveal, on every rank."""
    with single_device():
        conv = _seeded(nn.Conv1d(2, 2, 3, padding=1), seed)
        wrong_pad = _seeded(CausalConv3d(2), seed)
        too_wide = _seeded(nn.Sequential(nn.Conv1d(2, 2, 3)), seed)
        wrong_cat = _seeded(CatCausalConv3d(2), seed)
        up = _seeded(nn.ConvTranspose1d(2, 2, 2, 2), seed)
        full, video = seeded_randn((1, 2, 6), seed), seeded_randn((1, 2, 5, 3, 3), seed)
    parallelize_module(conv, mesh, HaloParallel())
    replicated = DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    with pytest.raises(HaloError, match="sharded along dim 2 on exactly one mesh axis"):
        conv(replicated)
    annotate(wrong_pad, HaloShard(2, left=2))  # but the module pads by replicate
    parallelize_module(wrong_pad, mesh, HaloParallel())
    x, _ = sharded(mesh, video)
    with pytest.raises(HaloError, match="pads dim 2 by \\(2, 0\\) with mode='replicate'"):
        wrong_pad(x)
    annotate(wrong_cat, HaloShard(2, left=1, right=1, pad="replicate"))
    parallelize_module(wrong_cat, mesh, HaloParallel())
    with pytest.raises(HaloError, match="concatenates 2 slices before and 0 after"):
        wrong_cat(x)
    # a spec wider than what the module consumes: the output would come out too long
    parallelize_module(annotate(too_wide, HaloShard(2, 2, 2)), mesh, HaloParallel())
    with pytest.raises(HaloError, match=r"returned \d+ slices along dim 2 from a window"):
        too_wide(sharded(mesh, full)[0])
    parallelize_module(up, mesh, HaloParallel())
    with pytest.raises(HaloError, match="output_size= is not supported"):
        up(sharded(mesh, full)[0], output_size=[12])
    unmeshed = nn.Conv1d(2, 2, 3)
    install(unmeshed, HaloForward.of(unmeshed, resolve(unmeshed), None))
    with pytest.raises(HaloError, match="plain-tensor input needs a mesh"):
        unmeshed(full)


# ---------------------------------------------------------------- simulated ranks
# (world, T): uneven, T < world (empty shards), shards shorter than the halo.
GEOMETRIES = [(3, 5), (4, 3)]  # gloo runs world 2 (and 3, 4 again)


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "length"), GEOMETRIES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_simulated(name: str, world: int, length: int) -> None:
    with simulated_mesh(world) as mesh:
        case_layer(mesh, name, length, 11)


@pytest.mark.simulated
def test_model_simulated() -> None:
    with simulated_mesh(4) as mesh:
        case_model(mesh, 5, 5, depth=1)


@pytest.mark.simulated
def test_remove_reapply_simulated() -> None:
    with simulated_mesh(3) as mesh:
        case_remove_reapply(mesh, 6)


@pytest.mark.simulated
def test_plain_input_simulated() -> None:
    with simulated_mesh(3) as mesh:
        case_plain_input(mesh, 8, 7)


@pytest.mark.simulated
def test_2d_mesh_simulated() -> None:
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "cp")) as mesh:
        case_2d_mesh(mesh, 5, 8)
        case_2d_placements(mesh, 5, 9)


@pytest.mark.simulated
def test_runtime_errors_simulated() -> None:
    with simulated_mesh(2) as mesh:
        case_runtime_errors(mesh, 10)


# ---------------------------------------------------------------- gloo processes
def run_cases(cases: list[tuple[Any, ...]]) -> None:
    """Inside a worker: every case on the 1-D mesh over the whole world."""
    mesh = worker_mesh(dist.get_world_size())
    for name, *args in cases:
        globals()[name](mesh, *args)


def run_2d(length: int, seed: int) -> None:
    mesh = worker_mesh((2, 2), mesh_dim_names=("dp", "cp"))
    case_2d_mesh(mesh, length, seed)
    case_2d_placements(mesh, length, seed + 1)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo(gloo: Callable[[int], Any], world: int) -> None:
    """Every layer kind, the model, removal, plain input and runtime errors in one call per
    world (the world's start-up dominates): T=7 on 2 ranks, T=8 on 3, T=5 on 4 (chunks
    (2, 2, 1, 0): an empty rank, halos longer than a chunk)."""
    length = {2: 7, 3: 8, 4: 5}[world]
    cases: list[tuple[Any, ...]] = [("case_layer", name, length, 21) for name in sorted(LAYERS)]
    cases += [("case_model", length, 22), ("case_remove_reapply", 23),
              ("case_plain_input", length, 24), ("case_runtime_errors", 25),
              ("case_replicated_args", length)]
    gloo(world).run(run_cases, cases)


@pytest.mark.gloo
def test_gloo_2d(gloo: Callable[[int], Any]) -> None:
    gloo(4).run(run_2d, 7, 26)


# ---------------------------------------------------------------- specs at annotation time
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: annotate(nn.GroupNorm(1, 2)), "cannot derive a halo for GroupNorm"),
        (lambda: annotate(nn.Conv1d(1, 1, 3, padding=1), HaloShard(2, left=2)),
         "does not match Conv1d"),
        (lambda: annotate(CausalConv3d(2), HaloShard(2, left=1, pad="replicate")),
         "too small for conv"),
        (lambda: annotate(nn.Conv1d(1, 1, 3), HaloShard(3, left=1), dim=2), "shards dim 3"),
        (lambda: annotate(nn.Conv1d(1, 1, 3), dim=3), "dim 3 is not a spatial dim"),
        (lambda: annotate(nn.Conv1d(1, 1, 3), (1, 1)), "spec must be a HaloShard"),  # type: ignore[arg-type]
        (lambda: annotate(nn.Upsample(scale_factor=2), ResampleStencil(3)), "does not match"),
        (lambda: HaloParallel(HaloShard(3, left=1), dim=2), "shards dim 3 but dim=2"),
        (lambda: annotate(nn.MaxPool3d(2, ceil_mode=True)), "ceil_mode=True"),
        (lambda: annotate(nn.Upsample(scale_factor=2, mode="linear", align_corners=True)),
         "align_corners=True"),
        (lambda: annotate(nn.Conv2d(1, 1, (3, 2), padding="same")), "dim(s) [3]"),
        (lambda: halo_plan(nn.Sequential(nn.Conv1d(1, 1, 2, padding="same"),
                                         nn.MaxPool1d(2, return_indices=True)),
                           include_convs=True), "1 (MaxPool1d: a kernel along"),  # not planned
    ],
)
def test_bad_specs(make: Callable[[], Any], match: str | None) -> None:
    if match is None:
        make()  # control: a plan validates only what it includes
        return
    with pytest.raises(HaloError, match=match.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        make()


class ValidSum(nn.Module):
    """A user's own layer kind: a learned 3-frame "valid" smoothing along T (T - 2 outputs),
    which no conv attribute describes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[2] - 2
        return sum(w * x.narrow(2, i, n) for i, w in enumerate(self.weight))


class ValidStencil(NamedTuple):
    """Its stencil, written by the user: outputs [start, stop) read inputs [start, stop + 2).
    (A NamedTuple, not a dataclass: gloo workers load this file by path.)"""

    pad: str = "zeros"
    fill: float | None = None
    min_input: int = 3

    def out_length(self, length: int) -> int:
        return length - 2

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        return start, stop + 2, 0


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "length"), [(2, 7), (3, 6), (4, 5)])
def test_user_stencil_simulated(world: int, length: int) -> None:
    """A stencil class of the user's own (the public protocol), given to HaloParallel."""
    with simulated_mesh(world) as mesh:
        module = parallelize_module(ValidSum(), mesh, HaloParallel(ValidStencil()))
        check_module(mesh, module, seeded_randn((1, 2, length, 3), 5).double(), 6)


def test_spec_states_dim() -> None:
    assert HaloParallel(HaloShard(3, left=1)).dim == 3
    assert HaloParallel(dim=4).dim == 4 and HaloParallel().dim == 2


def test_halo_plan_entries() -> None:
    model = Net(depth=2)
    annotate(model.blocks[0].causal, HaloShard(2, left=2, pad="replicate"))
    assert annotation_of(model.blocks[0].causal) is not None
    assert list(halo_plan(model)) == ["blocks.0.causal"]
    plan = halo_plan(model, include_convs=True,
                     module_filter_fn=lambda m, fqn: not fqn.startswith("blocks.1"))
    assert list(plan) == ["conv_in", "blocks.0.conv1", "blocks.0.causal", "blocks.0.temporal",
                          "conv_out"]
    assert repr(plan["blocks.0.causal"]) == (
        "HaloParallel(spec=HaloShard(dim=2, left=2, right=0, pad='replicate'), dim=2)")
    # a conv that cannot be sharded is refused when the plan is built, before anything runs
    with pytest.raises(HaloError, match=r"dim\(s\) \[3\]"):
        halo_plan(nn.Sequential(nn.Conv2d(1, 1, (3, 2), padding="same")), include_convs=True)


def test_deepcopy_of_a_halo_model_runs_the_copy() -> None:
    """A copy (EMA, checkpoint averaging) must not call back into the original module."""
    conv = nn.Conv1d(1, 1, 3, padding=1)
    handle = install(conv, HaloForward.of(conv, resolve(conv), None))
    clone = copy.deepcopy(conv)
    assert clone.forward.module is clone and clone.forward.mesh is None  # type: ignore[attr-defined]
    assert halo_handles(clone)[""].attached and clone.padding == (0,)
    halo_handles(clone)[""].remove()
    assert clone.padding == (1,) and "forward" not in vars(clone)
    assert handle.attached and conv.padding == (0,)  # the original keeps its halo


@pytest.mark.simulated
def test_output_layouts_simulated() -> None:
    """ParallelStyle conventions: `output_layouts=Replicate()` gathers the output along T,
    `use_local_output=True` returns the local chunk; `remove()` takes the hook away."""
    with simulated_mesh(3) as mesh:
        full = seeded_randn((1, 2, 7, 3), 1).double()
        conv = _seeded(nn.Conv2d(2, 2, 3, padding=1), 2).double()
        ref = module_reference(conv, full, 3)[0]
        module = parallelize_module(copy.deepcopy(conv), mesh,
                                    HaloParallel(output_layouts=Replicate()))
        y = module(sharded(mesh, full)[0])
        assert y.placements == (Replicate(),)
        assert_close_per_rank(y.to_local(), lambda r: ref, mesh, **TOL)
        local = parallelize_module(copy.deepcopy(conv), mesh,
                                   HaloParallel(use_local_output=True))
        y = local(sharded(mesh, full)[0])
        assert not isinstance(y, DTensor)
        assert_close_per_rank(y, lambda r: shard(ref, 2, 3, r), mesh, **TOL)
        for handle in halo_handles(local).values():
            handle.remove()
        assert not local._forward_hooks
        with pytest.raises(HaloError, match="input_layouts=Shard"):
            HaloParallel(input_layouts=Replicate())
        with pytest.raises(HaloError, match="output_layouts=Shard"):
            LocalParallel(output_layouts=Shard(3))


class Modulated(nn.Module):
    """A block whose own forward meets its frames with per-sample tensors: a timestep
    embedding and a learned scale/shift table (LTX-Video's timestep conditioning)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.table = nn.Parameter(torch.randn(2, 2, 1, 1, 1))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = (temb.view(-1, 1, 1, 1, 1) * self.table).unbind(0)
        return self.conv(x) * (1 + scale) + shift


def case_replicated_args(mesh: DeviceMesh, length: int) -> None:
    """`ReplicatedArgsParallel` against one device: output, input gradient, the gradients
    of the table and of the plain embedding (per-rank partial sums, summed here)."""
    world = mesh.size()
    module = _seeded(Modulated(), 3).double()
    with single_device():
        full = seeded_randn((1, 2, length, 3, 3), 4).double()
        twin = copy.deepcopy(module)
        x_ref, t_ref = full.clone().requires_grad_(), torch.tensor([0.7, -0.3]).double()
        t_ref.requires_grad_()
        y_ref = twin(x_ref, t_ref)
        gy = seeded_randn(tuple(y_ref.shape), 5).double()
        (y_ref * gy).sum().backward()
    plan = {"": ReplicatedArgsParallel(), "conv": HaloParallel()}
    parallelize_module(module, mesh, plan)
    x, local = sharded(mesh, full)
    temb = torch.tensor([0.7, -0.3]).double().requires_grad_()
    y = module(x, temb)
    assert isinstance(y, DTensor) and y.placements == (Shard(2),)
    assert_close_per_rank(y.to_local(), lambda r: shard(y_ref.detach(), 2, world, r), mesh,
                          **TOL)
    (y.to_local() * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    assert_close_per_rank(local.grad, lambda r: shard(x_ref.grad, 2, world, r), mesh, **TOL)
    reduce_grads(module, mesh)
    for p, q in zip(module.parameters(), twin.parameters(), strict=True):
        assert_close_per_rank(p.grad, lambda r, g=q.grad: g, mesh, **TOL)
    torch.testing.assert_close(sum_over_ranks(temb.grad, mesh), t_ref.grad, **TOL)


@pytest.mark.simulated
def test_replicated_args_simulated() -> None:
    # equal chunks: under simulated ranks DTensor's own dispatch (the mixed ops run there)
    # hashes per-rank strides; the gloo runs take uneven and empty chunks
    with simulated_mesh(3) as mesh:
        case_replicated_args(mesh, 6)


class MixesAChunk(nn.Module):
    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return x * other


@pytest.mark.simulated
def test_replicated_args_refuses_a_plain_chunk_simulated() -> None:
    """A plain tensor spanning the sharded dim may be a local chunk: taking it as replicated
    would be silently wrong, so it raises, naming the shapes."""
    with simulated_mesh(2) as mesh:
        module = parallelize_module(MixesAChunk(), mesh, ReplicatedArgsParallel())
        x, _ = sharded(mesh, seeded_randn((1, 2, 6, 3), 1).double())
        with pytest.raises(HaloError, match=r"plain tensor of shape \(1, 2, 3, 3\) spans "):
            module(x, torch.ones(1, 2, 3, 3, dtype=torch.float64))


class PadsAndKeeps(nn.Module):
    """A causal wrapper that records what its `F.pad` along T returned."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, (3, 1, 1))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = F.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate")
        self.seen.append(padded is x)
        return self.conv(padded)


@pytest.mark.simulated
def test_dropped_pad_hands_the_window_over_simulated() -> None:
    """The wrapper's own `F.pad` along T, dropped under the halo, returns the window itself:
    `F.pad` by zero widths would copy it (an input-sized buffer the conv then saves)."""
    with simulated_mesh(2) as mesh:
        wrapper = PadsAndKeeps()
        parallelize_module(wrapper, mesh, HaloParallel(HaloShard(2, left=2, pad="replicate")))
        x, _ = sharded(mesh, seeded_randn((1, 2, 8, 3, 3), 0, torch.float32))
        wrapper(x)
    assert wrapper.seen == [True]


def test_taps_everywhere_from_the_global_shape() -> None:
    """`HaloParallel()` exchanges first, with no trial of the overlapped conv, where torch
    would convolve even the longest chunk's window on its slow conv3d path: read from the
    global shape and the conv's own arguments (the padding of the other dims applied first
    for a padding mode other than zeros), so every rank decides alike."""
    from haloshard._choice import _taps_everywhere
    from haloshard._compat import maybe_disable_local_tensor_mode
    from haloshard._site import Site as _Site
    from haloshard._specs import derive_stencil, plan_windows

    def rule(conv: nn.Module, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
             ) -> bool:
        with simulated_mesh(2) as mesh, maybe_disable_local_tensor_mode():
            local = torch.zeros((*shape[:2], shape[2] // 2, *shape[3:]), dtype=dtype)
            plan = plan_windows(derive_stencil(conv, 2), shape[2], 2)
            return _taps_everywhere(conv.to(dtype), _Site(local, mesh, 0, None, shape, 2),
                                    plan)

    assert rule(nn.Conv3d(32, 32, 3, padding=1), (1, 32, 8, 32, 32))
    assert rule(nn.Conv3d(4, 4, 3, padding=1), (1, 4, 8, 6, 6), torch.float64)
    assert not rule(nn.Conv3d(256, 256, 3, padding=1), (1, 256, 8, 32, 32))  # oneDNN
    assert not rule(nn.Conv3d(64, 64, 3, padding=1), (2, 64, 8, 48, 48))  # a batch of 2
    # 4 + 2 frames of C64 over 52 rows: C * T * H = 19968, slow; a padding mode other than
    # zeros pads the rows first, 54: 20736, oneDNN
    assert rule(nn.Conv3d(64, 64, 3, padding=1), (1, 64, 8, 52, 52))
    assert not rule(nn.Conv3d(64, 64, 3, padding=1, padding_mode="replicate"),
                    (1, 64, 8, 52, 52))
