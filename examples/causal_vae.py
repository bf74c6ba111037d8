"""A small causal video VAE under context parallelism (T sharded over the ranks).

The model has what CogVideoX / Mochi / Hunyuan style VAEs have: 3-D convs with causal
replicate padding on T, ResNet blocks with GroupNorm and SiLU, a mid-block attention over all
T*H*W tokens, a stride-2 causal conv and "keep the first frame, resample the rest" temporal
down- and upsampling, a per-frame norm. `cp_plan` is the whole integration: one style per
layer kind. Run it:

    python examples/causal_vae.py --ranks 4

It runs the model on 4 gloo processes with T sharded, prints the largest difference to the
single-device model (forward, input gradient, every parameter gradient summed over cp) and the
saved activation bytes per rank (what autograd keeps for the backward: the activation peak).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from haloshard import (
    AttentionParallel,
    CausalConvParallel,
    FirstFrameParallel,
    GroupNormParallel,
    HaloParallel,
    LocalParallel,
    group_norm,
    halo_handles,
    reduce_grads,
)
from haloshard.testing import GlooWorld, rank_map, shard, single_device, worker_mesh


# ---------------------------------------------------------------- the model
class CausalConv3d(nn.Module):
    """Replicate-pads T by `k - 1` frames on the left, then a conv (any stride on T)."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1) -> None:
        super().__init__()
        self.time_pad = k - 1
        self.conv = nn.Conv3d(cin, cout, k, stride=(stride, 1, 1), padding=(0, k // 2, k // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, self.time_pad, 0), mode="replicate"))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), CausalConv3d(cin, cout)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), CausalConv3d(cout, cout)
        self.skip = nn.Conv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class Attention(nn.Module):
    """Single-head self-attention over all T*H*W tokens (the VAE mid-block)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.q, self.k, self.v, self.proj = (nn.Conv3d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (rearrange(f(h), "b c t h w -> b 1 (t h w) c") for f in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v)
        t, hh, ww = x.shape[2:]
        return x + self.proj(rearrange(o, "b 1 (t h w) c -> b c t h w", t=t, h=hh, w=ww))


class TimeDown(nn.Module):
    """Keep the first frame, average each following pair (T -> 1 + (T - 1) // 2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rest = x[:, :, 1:]
        n = rest.shape[2] // 2 * 2
        return torch.cat([x[:, :, :1], (rest[:, :, 0:n:2] + rest[:, :, 1:n:2]) / 2], dim=2)


class TimeUp(nn.Module):
    """Keep the first frame, repeat each following one twice (T -> 1 + 2 (T - 1)): what
    CogVideoX does with F.interpolate(nearest) on frames 1..T-1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :, :1], x[:, :, 1:].repeat_interleave(2, dim=2)], dim=2)


class FrameNorm(nn.Module):
    """GroupNorm of each frame alone (a spatial-only norm): statistics over (C/G, H, W).

    Written with the channel dim unflattened, not `rearrange(x, "b c t h w -> (b t) c h w")`:
    under simulated ranks (LocalTensorMode) chunks of different lengths have different
    strides, and the backward of that reshape is a view on some ranks only (a torch issue).
    """

    def __init__(self, channels: int, groups: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.unflatten(1, (self.groups, -1))  # (B, G, C/G, T, H, W)
        var, mean = torch.var_mean(g, dim=(2, 4, 5), keepdim=True, correction=0)
        y = ((g - mean) * torch.rsqrt(var + self.eps)).flatten(1, 2)
        return y * self.weight.view(-1, 1, 1, 1) + self.bias.view(-1, 1, 1, 1)


class Encoder(nn.Module):
    def __init__(self, cin: int, ch: int, latent: int, groups: int) -> None:
        super().__init__()
        self.conv_in = CausalConv3d(cin, ch)
        self.down = nn.Sequential(ResBlock(ch, ch, groups), CausalConv3d(ch, ch, stride=2),
                                  ResBlock(ch, 2 * ch, groups), TimeDown())
        self.mid = nn.Sequential(ResBlock(2 * ch, 2 * ch, groups), Attention(2 * ch, groups),
                                 ResBlock(2 * ch, 2 * ch, groups))
        self.norm_out, self.conv_out = nn.GroupNorm(groups, 2 * ch), CausalConv3d(2 * ch, latent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.down(self.conv_in(x)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cout: int, ch: int, latent: int, groups: int) -> None:
        super().__init__()
        self.conv_in = CausalConv3d(latent, 2 * ch)
        self.mid = nn.Sequential(ResBlock(2 * ch, 2 * ch, groups), Attention(2 * ch, groups))
        self.up = nn.Sequential(TimeUp(), ResBlock(2 * ch, ch, groups), TimeUp(),
                                CausalConv3d(ch, ch), FrameNorm(ch, groups))
        self.norm_out, self.conv_out = nn.GroupNorm(groups, ch), CausalConv3d(ch, cout)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.up(self.mid(self.conv_in(z)))
        return self.conv_out(F.silu(self.norm_out(h)))


class CausalVAE(nn.Module):
    """Encoder and decoder (deterministic: the latent is the encoder's output).

    T frames in, `1 + 4 * ((1 + ((T - 1) // 2) - 1) // 2)` frames out (T = 1 + 4n: T).
    """

    def __init__(self, channels: int = 3, ch: int = 8, latent: int = 4, groups: int = 4):
        super().__init__()
        self.encoder = Encoder(channels, ch, latent, groups)
        self.decoder = Decoder(channels, ch, latent, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


# ---------------------------------------------------------------- the plan
def cp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """One style per layer kind; modules inside a planned one are left to it, except inside
    an attention block, which runs on the local chunk: its norm still needs global T and
    its 1x1 convs an empty-chunk guard."""
    kinds: dict[type, Any] = {
        CausalConv3d: CausalConvParallel, nn.GroupNorm: GroupNormParallel,
        Attention: AttentionParallel, FrameNorm: LocalParallel, nn.Conv3d: LocalParallel,
        TimeDown: lambda: FirstFrameParallel(2, "down", even="first"),
        TimeUp: lambda: FirstFrameParallel(2, "up", even="first")}
    return _plan_kinds(model, kinds)


def _plan_kinds(model: nn.Module, kinds: dict[type, Any]) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    for fqn, module in model.named_modules():
        owner = next((p for p in plan if fqn.startswith(p + ".")), None)
        if type(module) in kinds and (owner is None or isinstance(plan[owner],
                                                                  AttentionParallel)):
            plan[fqn] = kinds[type(module)]()
    return plan


class FrameNormParallel(ParallelStyle):
    """`FrameNorm` with a spatial dim sharded (H for decode): each frame's statistics span
    every rank's rows, so the frames become the batch of `haloshard.group_norm` (exact),
    over the mesh axis that shards `dim` (T may be sharded on another: frames are local).
    A style a user writes for a layer of their own, from the public API."""

    def __init__(self, *, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, FrameNorm)

        def forward(x: DTensor) -> DTensor:
            local = x.to_local()
            frames = rearrange(local, "b c t h w -> (b t) c h w")
            axis = list(x.placements).index(Shard(self.dim))
            y = group_norm(frames, module.groups, module.weight, module.bias, module.eps,
                           (x.device_mesh, axis))
            y = rearrange(y, "(b t) c h w -> b c t h w", b=local.shape[0])
            return DTensor.from_local(y, x.device_mesh, x.placements, shape=x.shape,
                                      stride=x.stride())

        module.forward = forward
        return module


def spatial_plan(model: nn.Module, dim: int = 3) -> dict[str, ParallelStyle]:
    """The same model with H (dim 3) or W (dim 4) sharded instead of T, as serving stacks
    shard decode: every kernel along H gets its halo (the causal wrappers pad T locally and
    their conv takes the H halo), norms combine statistics over the ranks, attention gathers
    K/V, and the temporal resamplers and 1x1 convs are local along H."""
    plan: dict[str, ParallelStyle] = {}
    for fqn, module in model.named_modules():
        owner = next((p for p in plan if fqn.startswith(p + ".")), None)
        if owner is not None and not isinstance(plan[owner], AttentionParallel | LocalParallel):
            continue
        if isinstance(module, CausalConv3d):
            plan[fqn], plan[f"{fqn}.conv"] = LocalParallel(dim=dim), HaloParallel(dim=dim)
        elif isinstance(module, nn.GroupNorm):
            plan[fqn] = GroupNormParallel(dim=dim)
        elif isinstance(module, Attention):
            plan[fqn] = AttentionParallel(dim=dim)
        elif isinstance(module, FrameNorm):
            plan[fqn] = FrameNormParallel(dim=dim)
        elif isinstance(module, TimeDown | TimeUp) or (
                isinstance(module, nn.Conv3d) and fqn not in plan):
            plan[fqn] = LocalParallel(dim=dim)
    return plan


def time_height_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The same model with T and H sharded at once, on a `(t, h)` mesh: the causal wrappers
    take their T halo from their padding and their H halo from their conv (corners
    included), norms combine statistics over both axes, attention gathers K/V over both,
    the temporal resamplers are local along H and `FrameNorm` is per frame."""
    kinds: dict[type, Any] = {
        CausalConv3d: CausalConvParallel, nn.GroupNorm: GroupNormParallel,
        Attention: AttentionParallel, FrameNorm: FrameNormParallel, nn.Conv3d: LocalParallel,
        TimeDown: lambda: FirstFrameParallel(2, "down", even="first", local_dims=(3,)),
        TimeUp: lambda: FirstFrameParallel(2, "up", even="first", local_dims=(3,))}
    return _plan_kinds(model, kinds)


# ---------------------------------------------------------------- measuring
@contextmanager
def saved_bytes() -> Iterator[dict[str, int]]:
    """Bytes of the distinct storages autograd saves for the backward, during the block.

    That is the activation memory a training step holds at the end of the forward (its
    peak, before the backward frees it). DTensors count their local tensor.
    """
    seen: dict[int, int] = {}
    out = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        local = getattr(local, "elem", local)  # funcol's AsyncCollectiveTensor wrapper
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass without storage: count the tensor
            key, size = id(local), local.numel() * local.element_size()
        seen.setdefault(key, size)
        out["bytes"] = sum(seen.values())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


def make(frames: int, size: int, seed: int, ch: int = 8) -> tuple[CausalVAE, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = CausalVAE(ch=ch).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return model, torch.randn(1, 3, frames, size, size, generator=gen, dtype=torch.float64)


def reference(model: nn.Module, full: torch.Tensor, seed: int) -> dict[str, Any]:
    """The single-device run: output, upstream gradient, gradients, saved bytes."""
    with single_device():
        ref = copy.deepcopy(model)
        for handle in halo_handles(ref).values():
            handle.remove()
        x = full.clone().requires_grad_()
        with saved_bytes() as mem:
            y = ref(x)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed),
                         dtype=y.dtype)
        (y * gy).sum().backward()
    return {"y": y.detach(), "gy": gy, "gx": x.grad, "bytes": mem["bytes"],
            "grads": [p.grad for p in ref.parameters()]}


def sharded(model: nn.Module, mesh: DeviceMesh, full: torch.Tensor, ref: dict[str, Any],
            dim: int = 2) -> dict[str, Any]:
    """The parallel run on `model` (already parallelized for `Shard(dim)`): output,
    gradients, saved bytes, bytes this rank handed to collectives."""
    world = mesh.size()
    local = rank_map(mesh, lambda r: shard(full, dim, world, r).clone()).requires_grad_()
    x = DTensor.from_local(local, mesh, [Shard(dim)], shape=full.shape, stride=full.stride())
    with sent_bytes() as sent, saved_bytes() as mem:
        y = model(x)
        assert isinstance(y, DTensor) and y.placements == (Shard(dim),)
        assert y.shape == ref["y"].shape
        gy = rank_map(mesh, lambda r: shard(ref["gy"], dim, world, r))
        (y.to_local() * gy).sum().backward()
    reduce_grads(model, mesh)
    return {"y": y.to_local(), "gx": local.grad, "bytes": mem["bytes"], "sent": sent["bytes"],
            "grads": [p.grad for p in model.parameters()]}


@contextmanager
def sent_bytes() -> Iterator[dict[str, int]]:
    """Bytes this rank hands to c10d collectives in the block (forward and backward; the
    gradient reduction after it is the same for any sharding): an all-to-all's input, an
    all-gather's input once per peer, an all-reduce's input twice (a ring)."""
    out = {"bytes": 0}
    peers = dist.get_world_size() - 1
    factor = {"all_to_all_single": lambda t: t, "all_gather_single": lambda t: t * peers,
              "all_gather_into_tensor": lambda t: t * peers, "all_reduce": lambda t: 2 * t}
    # torch before 2.13 has no `all_gather_single` (haloshard calls `all_gather_into_tensor`)
    saved = {name: getattr(dist, name) for name in factor if hasattr(dist, name)}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            data = args[1] if name != "all_reduce" else args[0]
            out["bytes"] += factor[name](data.numel() * data.element_size())
            return saved[name](*args, **kwargs)
        return call

    for name in saved:
        setattr(dist, name, counting(name))
    try:
        yield out
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().amax().item() if a.numel() else 0.0


def sharded_on(model: nn.Module, mesh: DeviceMesh, full: torch.Tensor, ref: dict[str, Any],
               dims: tuple[int, ...]) -> dict[str, Any]:
    """`sharded` on a mesh with one axis per sharded dim (T and H at once on `(t, h)`):
    the local chunks are `distribute_tensor`'s."""
    placements = [Shard(d) for d in dims]
    x = distribute_tensor(full, mesh, placements).requires_grad_()
    gy = distribute_tensor(ref["gy"], mesh, placements)
    with sent_bytes() as sent, saved_bytes() as mem:
        y = model(x)
        assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements)
        assert y.shape == ref["y"].shape
        (y * gy).sum().backward()
    for axis in range(mesh.ndim):
        reduce_grads(model, mesh, mesh_axis=axis)
    return {"y": y.to_local(), "gx": x.grad.to_local(), "bytes": mem["bytes"],
            "sent": sent["bytes"], "grads": [p.grad for p in model.parameters()]}


def on_rank(frames: int, size: int, seed: int, ch: int = 8, dim: int | tuple[int, ...] = 2
            ) -> dict[str, float]:
    """One gloo rank: build, parallelize (T sharded, or H / W with `dim` 3 / 4, or T and H
    at once with `dim=(2, 3)` on a `(P/2, 2)` mesh), compare with the single-device run."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    world = dist.get_world_size()
    mesh = (worker_mesh(world) if len(dims) == 1
            else worker_mesh((world // 2, 2), mesh_dim_names=("t", "h")))
    model, full = make(frames, size, seed, ch)
    ref = reference(model, full, seed + 1)
    start = time.perf_counter()
    if dims == (2,):
        plan = cp_plan(model)
    elif len(dims) == 1:
        plan = spatial_plan(model, dims[0])
    else:
        plan = time_height_plan(model)
    parallelize_module(model, mesh if mesh.ndim == 1 else mesh["t"], plan)
    if len(dims) == 1:
        got = sharded(model, mesh, full, ref, dims[0])
        expected = {k: shard(ref[k], dims[0], world, dist.get_rank()) for k in ("y", "gx")}
    else:
        got = sharded_on(model, mesh, full, ref, dims)
        placements = [Shard(d) for d in dims]
        expected = {k: distribute_tensor(ref[k], mesh, placements).to_local()
                    for k in ("y", "gx")}
    diff = {
        "forward": max_diff(got["y"], expected["y"]),
        "input grad": max_diff(got["gx"], expected["gx"]),
        "param grads": max(max_diff(g, r) for g, r in zip(got["grads"], ref["grads"],
                                                          strict=True)),
    }
    return {**diff, "saved MiB": got["bytes"] / 2**20, "single MiB": ref["bytes"] / 2**20,
            "sent MiB": got["sent"] / 2**20, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--dim", default="2",
                        help="sharded dim: 2 (T), 3 (H), 4 (W), or 2,3 (T and H on a "
                             "(P/2, 2) mesh)")
    args = parser.parse_args()
    dims = tuple(int(d) for d in args.dim.split(","))
    with GlooWorld(args.ranks, timeout=300) as world:
        rows = world.run(on_rank, args.frames, args.size, 0, 8,
                         dims[0] if len(dims) == 1 else dims)
    print(f"T={args.frames}, {args.size}x{args.size}, float64, {args.ranks} gloo ranks, "
          f"dim {args.dim} sharded")
    for key in ("forward", "input grad", "param grads"):
        print(f"  max |sharded - single| {key:<11}: {max(r[key] for r in rows):.3e}")
    single = rows[0]["single MiB"]
    print(f"  saved activations, single device: {single:.3f} MiB")
    for rank, row in enumerate(rows):
        print(f"  saved activations, rank {rank}: {row['saved MiB']:.3f} MiB "
              f"({row['saved MiB'] / single:.2f} of single; 1/P = {1 / args.ranks:.2f})")
    print("  (each causal conv keeps its 2 halo frames: at short T they dominate; "
          "benchmarks/vae_memory.py measures T=129)")


if __name__ == "__main__":
    main()
