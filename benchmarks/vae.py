"""`python -m benchmarks.vae`: the five diffusers video VAEs with T, H or both sharded over
P ranks, against one device's public call and diffusers' own tiling.

For each model (`--models`: HunyuanVideo, CogVideoX, LTX-Video 0.9.0, a 0.9.5-style LTX
decoder, Mochi, Wan 2.1; `benchmarks.vae_models`) at its default constructor config (random
weights; `--config tiny` for tests) and each mode (`--modes`):

- `decode`: `vae.decode(z).sample` under `torch.no_grad`, eval;
- `encode`: `vae.encode(x).latent_dist.mode()` under `torch.no_grad`, eval;
- `train`: one training step: forward of encode + decode, backward of `sum(y * g)` for a
  fixed random `g`, parameter gradients accumulated into preallocated buffers;

on P = 1 (the public call itself, the reference) and P = 2, 4 (`--ranks`: the calls a user
makes after `parallelize_module(vae, mesh, plan_for(vae, dims=dims))` on a DTensor sharded
on `dims`, gloo on CPU; NCCL with `--device cuda`), after `--warmup` untimed runs, it
reports per rank:

- `params`: bytes of the parameters (train: and their gradients), held before the run;
- `act`: the peak of the bytes the run allocates above what it started with (allocator
  tracked, the same counter on every P: on CPU the allocations and frees torch's profiler
  records, in time order; on CUDA `torch.cuda.max_memory_allocated`): activations and the
  transient buffers of the ops;
- `compute`: the rank's CPU time in its own thread (`time.thread_time`: waits on other ranks
  and gloo's transport threads excluded; on CUDA: the synchronised wall time, an upper
  bound) and `wall`: the run's wall time after a barrier;
- `sent`: bytes the rank handed to c10d collectives, eager and functional (DTensor's own)
  (all-to-all: rows to other ranks; all-gather: its input times P - 1; reduce-scatter:
  (P - 1) / P of its input; all-reduce: 2 (P - 1) / P of its buffer, a ring's share; P2P:
  the tensors it sends); `agreed`: the metadata all-gathers among them (rank agreements:
  after a warm-up run, `--warmup 1`, a steady call makes none; the table shows a nonzero
  count beside the bytes, `+N agreed`);
- `diff` / `rel`: the largest absolute difference of the rank's shard to the one-device
  result (train: output, input gradient and the parameter gradients summed over ranks),
  and relative to the largest value of the same tensor;
- with `--repeat N`, the measured call runs N times in the same world: `compute` and
  `wall` are the fastest of them (as `timeit`: another process's work only adds time),
  `act` the highest (the same at every steady call);
- `where` / `largest` (CPU): the op and module scopes around the allocation that reached
  the peak, and the three largest buffers live then, with where each was allocated.

`--dims` picks the sharded dims: `2` (T, the default: a 1-D mesh, input `Shard(2)`), `3`
(H: `plan_for(vae, dims=(3,))`, a 1-D mesh, input `Shard(3)`; every model runs its own
public call, frame loops included, on every rank) or `2 3` (T and H: `plan_for(vae,
dims=(2, 3))` applied on the `t` axis of a `(t, h)` mesh of P/2 x 2, input
`[Shard(2), Shard(3)]`; P >= 4 even). Repeat the flag to run several settings against one
reference run. A model whose plan refuses the dims (`HaloError`, asked on the meta device
before any world starts) gets a `refused: <message>` row instead of a run. With T sharded,
the public calls that are frame loops or gather the video are replaced by what
docs/diffusers.md says to call: `cogvideox_*`, `wan_*`, `mochi_decode`.

Tables, one per mode and dims setting: the busiest rank of each P, the ratios `act * P /
act(P=1)` and `compute * P / compute(P=1)` against the targets 1.15 and 1.10 (halo slices
not subtracted). `--floor` adds, per P and setting, a run of the same P processes in which
each calls one device's public call on its own share of the input (its latent frames and
rows; no halo, no communication, attention over the share alone), at once, as the sharded
ranks run, so they share the machine's cores and memory bandwidth alike: the compute a
rank pays at least with the model's own kernels at that size, exact formulation or not.
Its columns: `floor*P/one` (over 1.10, no formulation meets the compute target at this
size on this machine) and `compute/floor` (what the busiest rank pays beyond it).
`--floor-plus` adds, with T sharded, the same floor with one latent frame more on every
rank after the first: a causal model's rank after the first owns `k t` video frames of its
`k` latent frames, one device's call on them makes `1 + (k - 1) t`, so the floor
under-counts that rank's work and this one (`1 + k t`) over-counts it by a frame; its
columns `floor+*P/one` and `compute/floor+`. `--floor-alone` adds, in the one-device world
after the reference, one device's call on each rank's share of each P, one share at a
time: the floor without the P processes sharing the machine's cores and memory bandwidth
(`alone*P/one`: what the model's own kernels cost the busiest share alone; its ratio to
`floor*P/one`, what sharing this machine costs every formulation, up to its drift between
the two worlds). `--paired` adds, right after each sharded run, one device's call on the
whole input on rank 0 of the same world, the other ranks waiting (`paired/one`: its time
over the reference world's, the machine's drift between them; `compute*P/paired`: the
compute target's ratio against it, the two timed minutes rather than worlds apart). With
`--approx`, on one device: `enable_tiling()` with two spatial tiles per axis (stride half
the clip's side, tiles a quarter of a stride longer: smaller than the clip, so tiling
happens), and temporal tiles of half the clip where the model has them (HunyuanVideo: its
default; LTX), for decode and encode: time, peak, and the error against the exact result
(max abs, PSNR over the exact result's range).

    python -m benchmarks.vae --models hunyuan wan --modes decode train --ranks 1 2 4 \\
        --latent-frames 16 --size 128 --dims 2 --dims 3 --approx --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from benchmarks import steady_allocator, vae_models
from haloshard import HaloError, reduce_grads, shard_sizes
from haloshard.testing import (
    GlooWorld,
    WorkerDied,
    counted_collectives,
    seeded_randn,
    shard,
    worker_mesh,
)

MODES = ("decode", "encode", "train")
MiB = 2**20


# ---------------------------------------------------------------- counters
@contextlib.contextmanager
def peak_bytes(device: str) -> Iterator[dict[str, Any]]:
    """`out["peak"]`: the peak bytes allocated in the block above its start; on CPU also
    `out["where"]`: the scopes open at that moment (see `module_scopes`), outermost first."""
    out: dict[str, Any] = {"peak": 0, "where": "", "largest": []}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out["peak"] = torch.cuda.max_memory_allocated() - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    out["peak"], out["where"], out["largest"] = _profiled_peak(prof)


def _profiled_peak(prof: Any) -> tuple[int, str, list[str]]:
    """The running sum of the allocations (positive) and frees (negative) the profiler
    recorded, in time order: its maximum (benchmarks/matrix.py's counter), the scopes
    around the allocation that reached it, and the three largest buffers live then (MiB,
    where each was allocated).

    The profiler records the frees of the threads it profiles only: a buffer whose last
    reference a collective's worker thread drops (gloo's, after a halo move) is freed
    unseen, and the plain sum would keep counting it. An allocation at the address of a
    buffer still counted live proves that buffer freed (the allocator hands out no live
    address): it is uncounted there, at the latest."""
    from torch._C._profiler import _EventType

    pending, events = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node))
    events.sort(key=lambda e: e[0])
    live = peak = top = 0
    counted: dict[int, int] = {}  # address -> bytes of a buffer allocated here, live
    for i, (_, size, node) in enumerate(events):
        ptr = node.extra_fields.ptr
        if size > 0:
            live += size - counted.get(ptr, 0)  # a reused address: its free went unseen
            counted[ptr] = size
        else:
            live -= counted.pop(ptr, -size)  # a buffer from before the block: its bytes
        if live > peak:
            peak, top = live, i
    held: dict[int, tuple[int, Any]] = {}
    for _, size, node in events[: top + 1]:
        if size > 0:
            held[node.extra_fields.ptr] = (size, node)
        else:
            held.pop(node.extra_fields.ptr, None)
    largest = sorted(held.values(), key=lambda e: -e[0])[:3]
    return (peak, _scopes(events[top][2]) if events else "",
            [f"{size / MiB:.1f} {_scopes(node)}" for size, node in largest])


def _scopes(node: Any) -> str:
    """The module scopes around a profiler event and the op it belongs to."""
    names: list[str] = []
    while node is not None and node.parent is not None:
        node = node.parent
        if (node.name.startswith(("module:", "autograd::engine::evaluate_function"))
                or not names):
            names.append(node.name.removeprefix("module:"))
    return " < ".join(names)


@contextlib.contextmanager
def module_scopes(model: nn.Module) -> Iterator[None]:
    """A profiler scope named `module:<fqn>` around each submodule's call (forward only;
    the backward's peak shows the autograd node instead)."""
    stack: list[Any] = []

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            scope = torch.autograd.profiler.record_function(f"module:{name}")
            scope.__enter__()
            stack.append(scope)
        return hook

    def leave(*_: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        if name:
            handles += [module.register_forward_pre_hook(enter(name)),
                        module.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _ring(group: Any) -> int:
    return dist.get_world_size(group)


def _a2a(a: dict[str, Any]) -> int:
    buf, group = a["input"], a.get("group")
    n, me = _ring(group), dist.get_rank(group)
    splits = a.get("input_split_sizes") or [buf.shape[0] // n] * n
    row = buf[0].numel() * buf.element_size() if buf.shape[0] else 0
    return row * sum(s for r, s in enumerate(splits) if r != me)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# name -> bytes this rank sends, from the call's bound arguments
_SENT: dict[str, Callable[[dict[str, Any]], float]] = {
    "all_to_all_single": _a2a,
    "all_gather_single": lambda a: _nbytes(a["input_tensor"]) * (_ring(a.get("group")) - 1),
    "all_gather_into_tensor": lambda a: (_nbytes(a["input_tensor"])
                                         * (_ring(a.get("group")) - 1)),
    "reduce_scatter_single": lambda a: (_nbytes(a["input"]) * (_ring(a.get("group")) - 1)
                                        / _ring(a.get("group"))),
    "all_reduce": lambda a: (2 * _nbytes(a["tensor"]) * (_ring(a.get("group")) - 1)
                             / _ring(a.get("group"))),
    "batch_isend_irecv": lambda a: sum(_nbytes(op.tensor) for op in a["p2p_op_list"]
                                       if op.op is dist.isend),
    # the source hands its block to every peer (attention's K/V blocks under no_grad)
    "broadcast": lambda a: (_nbytes(a["tensor"]) * (_ring(a.get("group")) - 1)
                            if a["src"] == dist.get_rank() else 0),
}


def _funcol_ring(a: dict[str, Any]) -> int:
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed._functional_collectives import _resolve_group

    return int(c10d._get_group_size_by_name(_resolve_group(a["group"])))


# functional collectives (DTensor's own redistributions, haloshard under torch.compile):
# name -> bytes this rank sends
_FUNCOL_SENT: dict[str, Callable[[dict[str, Any]], float]] = {
    **{name: lambda a: _nbytes(a["self"]) * (_funcol_ring(a) - 1)
       for name in ("all_gather_single", "all_gather_tensor", "all_gather_single_autograd",
                    "all_gather_tensor_autograd")},
    **{name: lambda a: _nbytes(a["self"]) * (_funcol_ring(a) - 1) / _funcol_ring(a)
       for name in ("reduce_scatter_single", "reduce_scatter_tensor",
                    "reduce_scatter_tensor_autograd")},
    "all_reduce": lambda a: 2 * _nbytes(a["self"]) * (_funcol_ring(a) - 1) / _funcol_ring(a),
}


@contextlib.contextmanager
def bytes_sent() -> Iterator[dict[str, float]]:
    """`out["bytes"]`: what this process hands to the eager c10d calls in `_SENT` (the only
    ones haloshard's `_comm` issues outside torch.compile) and to the functional
    collectives in `_FUNCOL_SENT` (DTensor's own). A call made inside another counted call
    (one functional collective implemented by another) is not counted again."""
    import torch.distributed._functional_collectives as funcol

    out, depth = {"bytes": 0.0}, [0]
    wrapped = [(dist, name, rule) for name, rule in _SENT.items() if hasattr(dist, name)]
    wrapped += [(funcol, name, rule) for name, rule in _FUNCOL_SENT.items()
                if hasattr(funcol, name)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in wrapped]

    def wrap(fn: Callable[..., Any], rule: Callable[[dict[str, Any]], float]
             ) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                out["bytes"] += rule(signature.bind(*args, **kwargs).arguments)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for (module, name, rule), (_, _, fn) in zip(wrapped, saved, strict=True):
        setattr(module, name, wrap(fn, rule))
    try:
        yield out
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


# ---------------------------------------------------------------- one rank
_CACHE: dict[Any, Any] = {}
# the sharded dims of (B, C, T, H, W) -> the mesh axes' names (one axis per dim)
_AXES: dict[tuple[int, ...], tuple[str, ...]] = {(2,): ("t",), (3,): ("h",), (2, 3): ("t", "h")}


def _mesh(device: str, dims: tuple[int, ...] = (2,)) -> DeviceMesh:
    """The world as a mesh with one axis per sharded dim: 1-D, or `(t, h)` of P/2 x 2."""
    world = dist.get_world_size()
    shape = (world,) if len(dims) == 1 else (world // 2, 2)
    if device != "cuda":
        return worker_mesh(shape, mesh_dim_names=_AXES[dims])
    if ("mesh", dims) not in _CACHE:
        # NCCL for CUDA tensors beside gloo for CPU ones (haloshard's metadata rows)
        assert len(dims) == 1, "main() refuses two sharded dims on CUDA"
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        _CACHE["mesh", dims] = DeviceMesh.from_group(
            dist.new_group(backend="cpu:gloo,cuda:nccl"), "cuda", mesh_dim_names=_AXES[dims])
    return _CACHE["mesh", dims]


def _coords(device: str, dims: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """This rank's `(dim, ranks along it, its rank along it)` per sharded dim (P = 1: none)."""
    if dist.get_world_size() == 1:
        return []
    mesh = _mesh(device, dims)
    return [(dim, mesh.size(i), mesh.get_local_rank(i)) for i, dim in enumerate(dims)]


def _shard_of(full: torch.Tensor, coords: list[tuple[int, int, int]]) -> torch.Tensor:
    """This rank's chunk of a global tensor (torch.chunk's split along every sharded dim)."""
    for dim, n, rank in coords:
        full = shard(full, dim, n, rank)
    return full


def _model(name: str, config: str, device: str, dims: tuple[int, ...], planned: bool = True
           ) -> nn.Module:
    """The VAE, built once per world and dims (parallelized when P > 1 and `planned`:
    `plan_for(vae, dims=dims)` on the mesh's first axis, T's where T is sharded); the
    previous one freed."""
    key = (name, config, device, dims, planned)
    if _CACHE.get("key") != key:
        _CACHE.pop("vae", None)
        gc.collect()
        # the mesh (a collective on every rank; on CUDA it sets the GPU) for a planned model:
        # a plain one may be built on one rank alone (`--paired`)
        mesh = (_mesh(device, dims) if dist.get_world_size() > 1 and (planned or device == "cuda")
                else None)
        vae = vae_models.build(name, config).to(device)
        if mesh is not None and planned:
            parallelize_module(vae, mesh[_AXES[dims][0]], vae_models.plan(vae, dims))
        _CACHE["key"], _CACHE["vae"] = key, vae
    return _CACHE["vae"]


def _sharded(full: torch.Tensor, device: str, grad: bool, dims: tuple[int, ...]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input: the full tensor (P = 1) or a DTensor sharded on `dims`, and its
    leaf."""
    local = _shard_of(full, _coords(device, dims)).clone().requires_grad_(grad)
    if dist.get_world_size() == 1:
        return local, local
    return DTensor.from_local(local, _mesh(device, dims), [Shard(d) for d in dims],
                              shape=full.shape, stride=full.stride()), local


def _share(full: torch.Tensor, name: str, config: str, mode: str,
           coords: list[tuple[int, int, int]], plus: bool = False) -> torch.Tensor | None:
    """This rank's share of the input on every sharded dim (`coords`): as many latent frames
    and rows as it holds (the `Shard` split of the latent), as the latent or as the video
    that encodes to them (`1 + k t` frames, rows times the spatial factor), cut from the
    start (the sizes matter here, not the values); None where it holds none. With `plus`,
    a rank after the first on T takes one latent frame more: one device's call on `k`
    latent frames makes `1 + (k - 1) t` video frames, while a rank after the first owns
    `k t` of the clip's (the causal first frame is rank 0's), so the floor on its share
    alone under-counts its work and the floor one frame longer (`1 + k t`) over-counts it
    by one frame."""
    model = vae_models.MODELS[name]
    for dim, n, rank in coords:
        factor = 1 if mode == "decode" else model.temporal if dim == 2 else model.spatial[
            config]
        latent = full.shape[dim] if mode == "decode" else (
            (full.shape[2] - 1) // factor + 1 if dim == 2 else full.shape[dim] // factor)
        count = shard_sizes(latent, n)[rank]
        if not count:
            return None
        count += int(plus and dim == 2 and rank > 0)
        length = count if mode == "decode" else (
            1 + (count - 1) * factor if dim == 2 else count * factor)
        full = full.narrow(dim, 0, length)
    return full


def _local(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The rank's shard on `dims`. A public call that ends in a slice along a sharded dim
    (Mochi's decode drops its first frames) returns a `Replicate` DTensor there (DTensor
    gathered it): the rank keeps its chunk, as a user would, differentiably."""
    if not isinstance(t, DTensor):
        return t
    want = tuple(Shard(d) for d in dims)
    if t.placements != want:
        t = t.redistribute(t.device_mesh, want)
    return t.to_local()


class _Run:
    """One (model, mode) on this rank: its inputs and the step `run()` measures."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job, self.name, self.mode = job, job["name"], job["mode"]
        self.device, self.dims = job["device"], tuple(job["dims"])
        # one device's calls on this rank's share ("plus": one latent frame longer on T;
        # "alone": on one P-rank share of `coords`, in a world of one; "one": on the whole
        # input, `coords` empty, on rank 0 of the P-rank world)
        self.floor = bool(job.get("floor"))
        self.vae = _model(self.name, job["config"], self.device, self.dims, not self.floor)
        self.coords = [tuple(c) for c in job["coords"]] if "coords" in job else _coords(
            self.device, self.dims)
        video, latent = vae_models.shapes(self.name, job["config"], job["frames"], job["size"])
        if self.mode == "decode":
            shape = (1, vae_models.latent_channels(self.vae), *latent)
            self.full = seeded_randn(shape, 1, torch.float32).to(self.device)
        else:
            self.full = seeded_randn(video, 1, torch.float32).to(self.device)
        self.share = None
        if self.floor:
            self.share = _share(self.full, self.name, job["config"], self.mode, self.coords,
                                job["floor"] == "plus")
            self.x = self.leaf = (self.full.narrow(2, 0, 0) if self.share is None else
                                  self.share.clone().requires_grad_(self.mode == "train"))
        else:
            self.x, self.leaf = _sharded(self.full, self.device, self.mode == "train",
                                         self.dims)
        self.upstream: torch.Tensor | None = None
        if self.mode == "train":
            for p in self.vae.parameters():
                p.grad = torch.zeros_like(p)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the latent, the output): DTensors on P > 1, the public calls' on P = 1 (and
        on a rank's share, `floor`)."""
        if dist.get_world_size() == 1 or self.floor:
            enc, dec = vae_models.encode, vae_models.decode
        else:
            def enc(name: str, vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
                return vae_models.sharded_encode(name, vae, x, self.dims)

            def dec(name: str, vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
                return vae_models.sharded_decode(name, vae, z, self.dims)
        if self.mode == "decode":
            return self.x, dec(self.name, self.vae, self.x)
        z = enc(self.name, self.vae, self.x)
        return (z, z) if self.mode == "encode" else (z, dec(self.name, self.vae, z))

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the latent, the output) as this rank's local shards."""
        if self.floor and self.share is None:  # this rank holds nothing
            return self.x, self.x
        if self.mode != "train":
            with torch.no_grad():
                z, y = self.forward()
                return _local(z, self.dims), _local(y, self.dims)
        z, y = self.forward()
        shape = y.shape  # the global shape of a DTensor
        z, y = _local(z, self.dims), _local(y, self.dims)
        if self.upstream is None:
            self.upstream = (seeded_randn(tuple(y.shape), 1000, y.dtype).to(y.device)
                             if self.floor else _upstream(y, shape, self.coords))
        (y * self.upstream).sum().backward()
        return z.detach(), y.detach()

    def zero_grads(self) -> None:
        if self.leaf.grad is not None:
            self.leaf.grad = None
        for p in self.vae.parameters():
            if p.grad is not None:
                p.grad.zero_()

    def close(self) -> None:
        for p in self.vae.parameters():
            p.grad = None


def _upstream(y: torch.Tensor, shape: torch.Size, coords: list[tuple[int, int, int]]
              ) -> torch.Tensor:
    """This rank's shard of a fixed random upstream gradient of global shape `shape`:
    global frame t drawn whole from seed 1000 + t, then cut to the rank's rows, so no rank
    builds the whole video (with no warm-up run, each P then allocates its own shard
    inside the measured run alike)."""
    frames = torch.arange(shape[2])
    rows = [(d - 1, n, r) for d, n, r in coords if d != 2]  # dims of one frame (B, C, H, W)
    for dim, n, rank in coords:
        if dim == 2:
            frames = shard(frames, 0, n, rank)
    frame = (*shape[:2], *shape[3:])
    drawn = [_shard_of(seeded_randn(frame, 1000 + int(t), y.dtype), rows) for t in frames]
    upstream = torch.stack(drawn, 2).to(y.device) if drawn else torch.zeros_like(y)
    assert upstream.shape == y.shape, (upstream.shape, y.shape)
    return upstream


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(step: Callable[[], Any], device: str, model: nn.Module, together: bool = True
             ) -> tuple[Any, dict[str, Any]]:
    """`step()` once (`together`: every rank of the world starts it at once): its result,
    peak bytes (and where), compute and wall seconds, bytes sent."""
    if together:
        dist.barrier()
    with module_scopes(model), peak_bytes(device) as peak, bytes_sent() as sent, \
            counted_collectives(by_dtype=True) as calls:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = step()
        _sync(device)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    compute = wall if device == "cuda" else cpu
    agreed = sum(n for name, n in calls.items() if name.endswith("(metadata)"))
    return out, {"act": peak["peak"], "where": peak["where"], "largest": peak["largest"],
                 "compute": compute, "wall": wall, "sent": sent["bytes"], "agreed": agreed}


def _fastest(row: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """Two measurements of the same call as one: the lower compute and wall (on a shared
    machine another process's work only adds time), the higher peak (the same at every
    steady call; where they differ, the worse is kept)."""
    out = {**row, "compute": min(row["compute"], again["compute"]),
           "wall": min(row["wall"], again["wall"]), "reps": row.get("reps", 1) + 1}
    if again["act"] > row["act"]:
        out.update(act=again["act"], where=again["where"], largest=again["largest"])
    return out


def _timed(run: _Run, repeat: int) -> tuple[Any, dict[str, Any]]:
    """`run.run()` measured `repeat` times: the last result, and the fastest time with the
    highest peak (`_fastest`)."""
    alone = run.job.get("floor") == "one"  # rank 0 only: no barrier with the others
    out, row = _measure(run.run, run.device, run.vae, not alone)
    for _ in range(repeat - 1):
        run.zero_grads()
        out, again = _measure(run.run, run.device, run.vae, not alone)
        row = _fastest(row, again)
    return out, row


def rank_run(job: dict[str, Any]) -> dict[str, Any] | None:
    """One model in one mode on this rank: its measurements and its difference to the
    one-device result (P = 1: writes that result to `job["ref_dir"]`)."""
    if job.get("floor") == "one" and dist.get_rank() != 0:
        # rank 0 alone runs one device's call, which replaces its model; the others drop
        # theirs too, so that every rank builds (and agrees) the next one afresh
        _CACHE.pop("vae", None)
        _CACHE.pop("key", None)
        return None
    torch.manual_seed(0)
    run = _Run(job)
    for _ in range(job["warmup"] if dist.get_world_size() > 1 or run.floor
                   else job["ref_warmup"]):
        run.run()
        run.zero_grads()
    (z, y), row = _timed(run, job.get("repeat", 1))
    params = sum(_nbytes(p) for p in run.vae.parameters())
    row.update(params=params * (2 if run.mode == "train" else 1),
               latent_frames=z.shape[2], latent_rows=z.shape[3], frames=run.leaf.shape[2])
    path = os.path.join(job["ref_dir"], f"{job['name']}-{job['mode']}.pt")
    if run.floor:  # nothing to compare: a share's result is not the global one's
        row["diff"] = row["rel"] = float("nan")
        run.close()
        return row
    result = _result(run, y)
    if dist.get_world_size() == 1:
        torch.save(result, path)
        if run.mode == "train":
            torch.save({n: p.grad.cpu() for n, p in run.vae.named_parameters()
                        if p.grad is not None}, path + ".grads")
        row["diff"] = row["rel"] = 0.0
        if job["approx"] and run.mode != "train":
            row["approx"] = _approximations(run, y)
    else:
        row["diff"], row["rel"] = _difference(run, result, path)
    run.close()
    return row


def _result(run: _Run, y: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"out": y.cpu()}
    if run.mode == "train":
        assert run.leaf.grad is not None
        out["input grad"] = run.leaf.grad.cpu()
    return out


def _difference(run: _Run, mine: dict[str, torch.Tensor], path: str
                ) -> tuple[float, float]:
    """Largest |shard - reference| over the outputs, the reference cut as the rank's shard
    on every sharded dim (and the gradients: parameter gradients summed over the ranks of
    every mesh axis first, outside the measured run), absolute and relative:
    over the largest |reference| of the same tensor, for a parameter gradient at least
    1e-3 of the largest one (some are analytically zero, as an attention key's bias, and
    hold only rounding noise on both sides)."""
    ref = torch.load(path, mmap=True, weights_only=True)
    diffs = [_diff(got, _shard_of(ref[key], run.coords)) for key, got in mine.items()]
    if run.mode == "train":
        mesh = _mesh(run.device, run.dims)
        for axis in _AXES[run.dims]:  # each rank's partial sums, over every sharded dim
            reduce_grads(run.vae, mesh, mesh_axis=axis)
        grads = torch.load(path + ".grads", mmap=True, weights_only=True)
        params = [_diff(p.grad.cpu(), grads[n]) for n, p in run.vae.named_parameters()
                  if p.grad is not None]
        floor = 1e-3 * max(scale for _, scale in params)
        diffs += [(d, max(scale, floor)) for d, scale in params]
    return (max(d for d, _ in diffs), max((d / scale if scale else d) for d, scale in diffs))


def _diff(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, max |ref|)."""
    return _max_abs(got, ref), ref.abs().max().item() if ref.numel() else 0.0


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"shape {tuple(a.shape)} against the reference's "
                             f"{tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ---------------------------------------------------------------- one device's approximations
def _tiled(run: _Run, side: int, frames: int) -> Callable[[], None] | None:
    """`enable_tiling()` with two spatial tiles per axis: stride half the clip's side, tiles
    a quarter of a stride longer (the blended overlap); None when the clip is too small."""
    spatial = vae_models.MODELS[run.name].spatial[run.job["config"]]
    stride = side // 2 // spatial * spatial
    tile = stride + max(spatial, stride // 4 // spatial * spatial)
    if stride == 0 or tile >= side:
        return None
    known = inspect.signature(run.vae.enable_tiling).parameters
    given = {f"tile_sample_{kind}_{axis}": value
             for kind, value in (("min", tile), ("stride", stride))
             for axis in ("height", "width")}
    # CogVideoX sets its stride as an overlap factor of the tile
    given.update({f"tile_overlap_factor_{axis}": 1 - stride / tile
                  for axis in ("height", "width")})
    run.vae.enable_tiling(**{k: v for k, v in given.items() if k in known})
    return run.vae.disable_tiling


def _framewise(run: _Run, side: int, frames: int) -> Callable[[], None] | None:
    """The model's temporal tiles (HunyuanVideo's default, LTX's option) of half the clip,
    stride 3/4 of a tile; None where the model has none (or, Mochi, changes its convs'
    padding for good)."""
    vae, temporal = run.vae, vae_models.MODELS[run.name].temporal
    if run.name not in ("hunyuan", "ltx", "ltx095") or frames <= temporal + 1:
        return None
    tile = temporal * max(1, (frames - 1) // temporal // 2)
    saved = (vae.tile_sample_min_num_frames, vae.tile_sample_stride_num_frames)
    vae.tile_sample_min_num_frames = tile
    vae.tile_sample_stride_num_frames = temporal * max(1, tile * 3 // 4 // temporal)
    vae.use_framewise_encoding = vae.use_framewise_decoding = True

    def undo() -> None:
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        vae.tile_sample_min_num_frames, vae.tile_sample_stride_num_frames = saved
    return undo


def _approximations(run: _Run, exact: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Tiled and framewise runs of the one-device public call: measured as the exact one,
    with their error against it."""
    video, _ = vae_models.shapes(run.name, run.job["config"], run.job["frames"],
                                 run.job["size"])
    out: dict[str, dict[str, Any]] = {}
    for variant, enable in (("tiled", _tiled), ("framewise", _framewise)):
        undo = enable(run, video[-1], video[2])
        if undo is None:
            continue
        try:
            (_, y), row = _measure(run.run, run.device, run.vae)
            row.update(_error(y.cpu(), exact.cpu()))
        except Exception as exc:  # a diffusers variant that fails is reported, not fatal
            row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            undo()
        out[variant] = row
    return out


def _error(got: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """Max abs error, and PSNR in dB over the exact result's range (max - min)."""
    if got.shape != exact.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, exact {tuple(exact.shape)}")
    err = got.double() - exact.double()
    mse, span = err.square().mean().item(), (exact.max() - exact.min()).item()
    psnr = math.inf if mse == 0 else 10 * math.log10(span**2 / mse)
    return {"max_abs": err.abs().max().item(), "psnr": psnr}


# ---------------------------------------------------------------- the driver
def _label(dims: Sequence[int] | None) -> str:
    """`T`, `H` or `T+H` for the sharded dims."""
    return "+".join("TH"[d - 2] for d in dims) if dims else "none"


def _refusal(name: str, config: str, dims: tuple[int, ...]) -> str | None:
    """The `HaloError` the plan raises for `name` on `dims`, or None where it plans the
    model (asked of a copy on the meta device: no weights drawn)."""
    try:
        with torch.device("meta"):
            vae_models.plan(vae_models.build(name, config), dims)
    except HaloError as exc:
        return str(exc)
    return None


def _settings(args: argparse.Namespace, p: int) -> list[tuple[int, ...]]:
    """The `--dims` settings a world of P ranks runs: none on one device (the reference);
    T and H at once only on a `(t, h)` mesh of P/2 x 2 with P/2 >= 2."""
    if p == 1:
        return [()]
    return [d for d in args.dims if len(d) == 1 or (p >= 4 and p % 2 == 0)]


def _jobs(args: argparse.Namespace, ref_dir: str, p: int,
          refused: dict[tuple[str, tuple[int, ...]], str]) -> list[dict[str, Any]]:
    """One device: every model some `--dims` setting plans; P > 1: each setting's models."""
    jobs = []
    for dims in _settings(args, p):
        for name in args.models:
            skip = ((name, dims) in refused if dims
                    else all((name, d) in refused for d in args.dims))
            jobs += [] if skip else [
                {"name": name, "mode": mode, "config": args.config, "dims": dims,
                 "frames": _frames(name, args), "size": args.size, "device": args.device,
                 "warmup": args.warmup, "ref_warmup": args.ref_warmup,
                 "repeat": args.repeat,
                 "approx": args.approx, "ref_dir": ref_dir}
                for mode in args.modes]
    if p > 1:
        # each sharded run then its paired one-device run, minutes apart at most; after
        # them the floors: the sharded models are built once, then the plain ones
        return ([run for job in jobs
                 for run in [job, *[{**job, "floor": "one", "coords": []}] * args.paired]]
                + [{**job, "floor": True} for job in jobs] * args.floor
                + [{**job, "floor": "plus"} for job in jobs if 2 in job["dims"]]
                * args.floor_plus)
    if args.floor_alone:  # after the references: each P-rank share, one at a time
        jobs += [{**job, "dims": dims, "floor": "alone", "of": (n, rank),
                  "coords": _share_coords(dims, n, rank)}
                 for job in jobs for n in sorted(set(args.ranks) - {1})
                 for dims in _settings(args, n) if (job["name"], dims) not in refused
                 for rank in range(n)]
    return jobs


def _share_coords(dims: tuple[int, ...], n: int, rank: int) -> list[tuple[int, int, int]]:
    """`_coords` of rank `rank` of a world of `n` (a `(t, h)` mesh of n/2 x 2 for T+H:
    rank-major, as `worker_mesh` lays it out)."""
    if len(dims) == 1:
        return [(dims[0], n, rank)]
    return [(2, n // 2, rank // 2), (3, 2, rank % 2)]


def _frames(name: str, args: argparse.Namespace) -> int:
    """`--frames`, or the frames that give `--latent-frames` latent frames."""
    if args.latent_frames is None:
        return int(args.frames)
    return 1 + vae_models.MODELS[name].temporal * (args.latent_frames - 1)


def _run_world(p: int, jobs: list[dict[str, Any]], timeout: float,
               done: Callable[[dict[str, Any]], None]) -> None:
    """Every job on one world of P ranks, each record handed to `done`; a job that fails
    is recorded (the world is restarted if it timed out or a worker died). No jobs: no
    world."""
    if not jobs:
        return
    world = GlooWorld(p, timeout=timeout, pg_timeout=timeout)
    try:
        for job in jobs:
            record = {"model": job["name"], "mode": job["mode"], "P": p,
                      "dims": list(job["dims"])}
            if job.get("floor"):
                record["floor"] = job["floor"]
            if "of" in job:  # "alone": rank `of[1]`'s share of P = `of[0]`, in one process
                record["P"], record["rank"] = job["of"]
            try:
                record["ranks"] = [row for row in world.run(rank_run, job) if row is not None]
            except (AssertionError, TimeoutError, WorkerDied) as exc:
                record["error"] = str(exc)[-2000:]
                if not world.alive:
                    world = GlooWorld(p, timeout=timeout, pg_timeout=timeout)
            done(record)
    finally:
        world.close(force=not world.alive)


def _progress(record: dict[str, Any]) -> str:
    head = (f"# {record['model']} {record['mode']} P={record['P']} "
            f"sharded {_label(record['dims'])}"
            f"{_FLOORS[record['floor']][1] if 'floor' in record else ''}"
            f"{' rank ' + str(record['rank']) if 'rank' in record else ''}:")
    if "refused" in record:
        return f"{head} refused: {record['refused']}"
    if "error" in record:
        return f"{head} FAILED {record['error'].strip().splitlines()[-1]}"
    ranks = record["ranks"]
    top = max(ranks, key=lambda r: r["act"])
    return (f"{head} act {top['act'] / MiB:.1f} MiB, compute "
            f"{max(r['compute'] for r in ranks):.2f} s, diff {max(r['diff'] for r in ranks):.1e}"
            f"; peak in {top['where'] or '?'}")


# Each run beside the sharded one (a record's "floor"): the flag that asks for it, its
# label in the progress lines and its name in the table's columns, in column order.
_FLOORS: dict[Any, tuple[str, str, str]] = {
    "one": ("paired", " (paired: one device's call on the whole input, on rank 0)", "paired"),
    True: ("floor", " (floor)", "floor"),
    "plus": ("floor_plus", " (floor, one latent frame longer)", "floor+"),
    "alone": ("floor_alone", " (floor alone: one device's call on one rank's share)", "alone"),
}


def _dims(text: list[str]) -> tuple[int, ...]:
    return tuple(sorted({int(d) for part in text for d in part.split(",")}))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(vae_models.MODELS),
                        default=list(vae_models.MODELS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                        help="P values; P = 1 (the reference) always runs")
    parser.add_argument("--dims", nargs="+", action="append", metavar="DIM",
                        help="the sharded dims: 2 (T, the default), 3 (H) or 2 3 (T and H on "
                             "a (t, h) mesh of P/2 x 2); repeat the flag for several settings "
                             "against one reference run")
    parser.add_argument("--frames", type=int, default=65,
                        help="video frames at most (each model takes 1 + k * its factor)")
    parser.add_argument("--latent-frames", type=int,
                        help="instead of --frames: this many latent frames for every model")
    parser.add_argument("--size", type=int, default=128, help="height = width, pixels")
    parser.add_argument("--config", choices=("default", "tiny"), default="default")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--ref-warmup", type=int,
                        help="untimed runs first on one device (default: --warmup); its "
                             "allocations are the same at every call, only its time changes")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs of each case: compute and wall the fastest, "
                             "memory the highest (this machine's speed drifts 5-20%%)")
    parser.add_argument("--approx", action="store_true",
                        help="also diffusers' tiling and framewise runs on one device")
    parser.add_argument("--floor", action="store_true",
                        help="also each of the P ranks running one device's call on its "
                             "own share, at once: the compute a rank pays at least")
    parser.add_argument("--floor-plus", action="store_true",
                        help="also, with T sharded, the same with one latent frame more on "
                             "every rank but the first (a causal model's rank after the "
                             "first owns 1 video frame more than one device's call on its "
                             "share makes): the floor bracketed from above")
    parser.add_argument("--floor-alone", action="store_true",
                        help="also, on one device after the reference, one device's call on "
                             "each rank's share of each P, one at a time: the floor without "
                             "the P processes sharing the machine")
    parser.add_argument("--paired", action="store_true",
                        help="also, right after each sharded run, one device's call on the "
                             "whole input on rank 0 of the same world (the others waiting): "
                             "the compute ratio against a reference timed minutes, not a "
                             "world, apart")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    parser.add_argument("--out", help="write every rank's numbers here (JSON, after each run)")
    return parser


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ref_warmup is None:
        args.ref_warmup = args.warmup
    try:
        args.dims = list(dict.fromkeys(_dims(d) for d in args.dims or [["2"]]))
    except ValueError:
        parser.error(f"--dims takes 2, 3 or 2 3, got {args.dims}")
    if args.repeat < 1:
        parser.error(f"--repeat takes a count of at least 1, got {args.repeat}")
    for dims in args.dims:
        if dims not in _AXES:
            parser.error(f"--dims takes 2 (T), 3 (H) or 2 3 (T and H), got {dims}")
        if len(dims) > 1 and args.device == "cuda":
            parser.error("--dims 2 3 runs on CPU (gloo) only; on CUDA shard one dim")
        if len(dims) > 1 and not any(p >= 4 and p % 2 == 0 for p in args.ranks):
            parser.error(f"--dims 2 3 needs an even P >= 4 in --ranks (a (t, h) mesh of "
                         f"P/2 x 2), got --ranks {args.ranks}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = _args(argv)
    steady_allocator()
    records: list[dict[str, Any]] = []

    def done(record: dict[str, Any]) -> None:
        records.append(record)
        print(_progress(record), flush=True)
        if args.out:  # after every run: a long matrix stopped halfway keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "machine": machine(args.device),
                           "records": records}, f, indent=1)

    refused = {(name, dims): text for dims in args.dims for name in args.models
               if (text := _refusal(name, args.config, dims)) is not None}
    for (name, dims), text in refused.items():
        for mode in args.modes:
            done({"model": name, "mode": mode, "P": None, "dims": list(dims),
                  "refused": text})
    with tempfile.TemporaryDirectory(prefix="haloshard-vae-") as ref_dir:
        for p in sorted({1, *args.ranks}):
            _run_world(p, _jobs(args, ref_dir, p, refused), args.timeout, done)
    print(tables(records, args))
    return records


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip()


def _mark(ratio: float, target: float) -> str:
    return f"{ratio:.3f} {'ok' if ratio <= target else 'MISS'}"


def _where(row: dict[str, Any]) -> str:
    """The op that reached the peak, in its innermost module."""
    return " in ".join(row["where"].split(" < ")[:2]) or "?"


def _row(record: dict[str, Any], one: dict[str, Any] | None,
         floors: tuple[tuple[Any, dict[str, Any] | None], ...] = ()) -> str:
    """A table row; per entry of `floors` (a floor's kind and record, or None where it has
    none), its two columns (`_floor_cells`) after it."""
    head, gap = f"| {record['model']} | {record['P'] or '-'} |", "||" * len(floors)
    if "refused" in record:
        return f"{head} refused: {record['refused'][:300]} ||||||||||{gap}"
    if "error" in record:
        return f"{head} failed: {record['error'].strip().splitlines()[-1][:200]} ||||||||||{gap}"
    ranks, p = record["ranks"], record["P"]
    top = max(ranks, key=lambda r: r["act"])
    act, compute = top["act"], max(r["compute"] for r in ranks)
    ratios = ["", ""]
    if one is not None and "ranks" in one:
        base_act = max(r["act"] for r in one["ranks"])
        base_compute = max(r["compute"] for r in one["ranks"])
        ratios = [_mark(act * p / base_act, 1.15) if p > 1 else "1",
                  _mark(compute * p / base_compute, 1.10) if p > 1 else "1"]
    latent = min((r["latent_frames"], r.get("latent_rows", 0)) for r in ranks)
    return (f"{head} {latent[0]}x{latent[1]} | {ranks[0]['params'] / MiB:.0f} | "
            f"{act / MiB:.1f} | {ratios[0]} | {compute:.2f} | {ratios[1]} | "
            f"{max(r['wall'] for r in ranks):.2f} | "
            f"{max(r['sent'] for r in ranks) / MiB:.2f}{_agreed(ranks)} | "
            f"{max(r['diff'] for r in ranks):.1e} ({max(r['rel'] for r in ranks):.0e}) | "
            f"{_where(top)} |"
            f"{''.join(_floor_cells(compute, p, one, f, k) for k, f in floors)}")


def _agreed(ranks: list[dict[str, Any]]) -> str:
    """` +N agreed`: the busiest rank's metadata all-gathers in the measured call (none
    in a steady call), or nothing."""
    most = max(r.get("agreed", 0) for r in ranks)
    return f" +{most} agreed" if most else ""


def _floor_cells(compute: float, p: int, one: dict[str, Any] | None,
                 floor: dict[str, Any] | None, kind: Any = True) -> str:
    """`floor*P/one` and `compute/floor`: the busiest rank's compute bound by the model
    itself (one device's calls on each rank's share at once, `--floor`) and the busiest
    rank's compute over it. For the paired one-device run (`kind` "one"), `paired/one`
    (its time over the reference world's: the machine's drift between them) and
    `compute*P/paired` (the compute target's ratio against it)."""
    if p == 1 or floor is None or "ranks" not in floor or one is None or "ranks" not in one:
        return " - | - |"
    least = max(r["compute"] for r in floor["ranks"])
    base = max(r["compute"] for r in one["ranks"])
    if kind == "one":
        return f" {least / base:.3f} | {compute * p / least:.3f} |"
    return f" {least * p / base:.3f} | {compute / least:.3f} |"


def _approx_rows(record: dict[str, Any]) -> list[str]:
    exact = record["ranks"][0]
    rows = []
    for variant, row in exact.get("approx", {}).items():
        if "error" in row:
            rows.append(f"| {record['model']} | {variant} | failed: {row['error'][:120]} ||||||")
            continue
        rows.append(f"| {record['model']} | {variant} | {row['compute']:.2f} | "
                    f"{exact['compute']:.2f} | {row['act'] / MiB:.1f} | "
                    f"{row['act'] / exact['act']:.3f} | {row['max_abs']:.2e} | "
                    f"{row['psnr']:.1f} |")
    return rows


_HEADER = ["| model | P | latent T x H / rank | params MiB | act MiB | act*P/one (<=1.15) | "
           "compute s | compute*P/one (<=1.10) | wall s | MiB sent | max diff (rel) | where |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _table(records: list[dict[str, Any]], args: argparse.Namespace, mode: str,
           dims: tuple[int, ...]) -> list[str]:
    """One mode with `dims` sharded: per model, one device's row, then each P's busiest
    rank (or the plan's refusal)."""
    shown = [(kind, label) for kind, (flag, _, label) in _FLOORS.items()
             if getattr(args, flag) and (kind != "plus" or 2 in dims)]
    header = [_HEADER[0] + "".join(
        " paired/one | compute*P/paired |" if kind == "one"
        else f" {label}*P/one | compute/{label} |" for kind, label in shown),
        _HEADER[1] + "---|---|" * len(shown)]
    lines = ["", f"{mode}, {_label(dims)} sharded:", "", *header]
    for name in args.models:
        mine = [r for r in records if r["model"] == name and r["mode"] == mode]
        one = next((r for r in mine if r["P"] == 1), None)
        groups: dict[tuple[int, Any], list[dict[str, Any]]] = {}
        for r in mine:
            if r.get("floor") and tuple(r["dims"]) == dims:
                groups.setdefault((r["P"], r["floor"]), []).append(r)
        floors = {key: _merged(group) for key, group in groups.items()}
        lines += [_row(r, one, tuple((kind, floors.get((r["P"], kind))) for kind, _ in shown))
                  for r in sorted(mine, key=lambda r: r["P"] or 0)
                  if not r.get("floor") and (r["P"] == 1 or tuple(r["dims"]) == dims)]
    return lines


def _merged(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One floor's records as one (`--floor-alone` has one per rank's share): every rank's
    row, or the first that failed."""
    failed = [r for r in records if "ranks" not in r]
    return failed[0] if failed else {**records[0],
                                     "ranks": [row for r in records for row in r["ranks"]]}


def tables(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One markdown table per mode and `--dims` setting (busiest rank per P), and one of
    diffusers' tiling per mode."""
    length = (f"{args.latent_frames} latent frames" if args.latent_frames
              else f"<= {args.frames} frames")
    lines = [f"VAEs at their {args.config} configs, float32, video (1, 3, {length}, "
             f"{args.size}, {args.size}), {args.device} ({machine(args.device)}), "
             f"{time.strftime('%Y-%m-%d')}"]
    for mode in args.modes:
        for dims in args.dims:
            lines += _table(records, args, mode, dims)
        approx = [row for name in args.models for r in records
                  if r["mode"] == mode and r["model"] == name and r["P"] == 1
                  and "ranks" in r for row in _approx_rows(r)]
        if approx:
            lines += ["", f"{mode}, diffusers' approximations on one device:", "",
                      "| model | run | compute s | exact s | act MiB | act/exact | max abs "
                      "| PSNR dB |", "|---|---|---|---|---|---|---|---|", *approx]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
