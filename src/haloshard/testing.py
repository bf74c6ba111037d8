"""Test helpers shipped with the package: simulated ranks, gloo worlds, references.

The same SPMD test body runs in two harnesses:
- `simulated_mesh(n)`: one process, a `fake` process group and `LocalTensorMode`, so every
  tensor holds one value per simulated rank and collectives move real data (seconds);
- `GlooWorld(n)`: n real processes on CPU with gloo, started once and reused for many calls
  (the truth). A call that does not return in time, or whose worker dies, kills the world
  and raises, never hangs.
`rank_map` and `assert_close_per_rank` make one body work in both; `per_rank` reads every
rank's value back as plain tensors. `shard`, `rank_map`, `per_rank`, `seeded_randn` and
`single_device` live in `haloshard._per_rank` (`verify_plan`, a library API, uses them
too and must not import this module) and are re-exported here.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import inspect
import math
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from haloshard._compat import (
    LocalTensor,
    LocalTensorMode,
    c10d_name,
    fake_store,
    local_tensors,
    maybe_disable_local_tensor_mode,
    maybe_run_for_local_tensor,
)
from haloshard._errors import HaloError
from haloshard._layout import F_PAD_MODES, shard_size_and_offset
from haloshard._per_rank import per_rank, rank_map, seeded_randn, shard, single_device  # noqa: F401


def reference_pad(full: torch.Tensor, left: int, right: int, dim: int, pad: str) -> torch.Tensor:
    """`F.pad` of `full` along any `dim`, every pad mode (the single-device reference).

    Example::
        >>> reference_pad(torch.arange(3.0), 1, 2, 0, "replicate")
        tensor([0., 0., 1., 2., 2., 2.])
    """
    flat = rearrange(full.movedim(dim, -1), "... t -> 1 (...) t")
    out = F.pad(flat, (left, right), mode=F_PAD_MODES[pad])
    moved = out.reshape(*full.movedim(dim, -1).shape[:-1], out.shape[-1])
    return moved.movedim(-1, dim)


def reference_halo(
    full: torch.Tensor, left: int, right: int, dim: int, world_size: int, rank: int,
    pad: str = "zeros",
) -> torch.Tensor:
    """Rank's `halo_exchange` output computed on one device: a slice of `reference_pad`."""
    size, offset = shard_size_and_offset(full.shape[dim], world_size, rank)
    return reference_pad(full, left, right, dim, pad).narrow(dim, offset, size + left + right)


def assert_close_per_rank(
    actual: torch.Tensor, expected: Callable[[int], torch.Tensor], mesh: DeviceMesh,
    *, mesh_axis: int | str = 0, atol: float = 0.0, rtol: float = 0.0,
) -> None:
    """Assert every rank's `actual` equals `expected(rank)`; exact unless tolerances given."""

    def check(local: torch.Tensor, rank: int) -> None:
        torch.testing.assert_close(local, expected(rank), atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank}: {m}")

    maybe_run_for_local_tensor(check)(actual, mesh.get_local_rank(mesh_axis))


@contextlib.contextmanager
def simulated_mesh(
    shape: int | Sequence[int], *, mesh_dim_names: Sequence[str] | None = None,
    device_type: str = "cpu",
) -> Iterator[DeviceMesh]:
    """A DeviceMesh of simulated ranks in this process, with real values, on `device_type`
    ("cpu", or "cuda": every simulated rank's tensors on the current GPU).

    Uses a `fake` process group (which moves no data by itself) under `LocalTensorMode`,
    which holds one tensor per rank and runs collectives for real. Inside, tensors built with
    `rank_map` differ per rank and `halo_exchange` moves real halos.

    Example::
        >>> with simulated_mesh(4) as mesh:
        ...     x = rank_map(mesh, lambda r: torch.full((2,), float(r)))
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    world = math.prod(dims)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", rank=0, world_size=world, store=fake_store())
    elif dist.get_world_size() != world or dist.get_backend() != "fake":
        raise HaloError(
            f"simulated_mesh({dims}) needs no process group or a fake one of {world} ranks, "
            f"found backend {dist.get_backend()!r} with {dist.get_world_size()} ranks"
        )
    try:
        names = tuple(mesh_dim_names) if mesh_dim_names else None
        mesh = init_device_mesh(device_type, dims, mesh_dim_names=names)
        with LocalTensorMode(world):
            yield mesh
    finally:
        if created:
            dist.destroy_process_group()


def _load(path: str, qualname: str, cache: dict[str, Any]) -> Callable[..., Any]:
    if path not in cache:
        spec = importlib.util.spec_from_file_location(f"_haloshard_case_{len(cache)}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # importable by name (torch.compile looks it up)
        spec.loader.exec_module(module)
        cache[path] = module
    obj: Any = cache[path]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _context() -> Any:
    """multiprocessing's forkserver, its server having imported torch and haloshard once:
    a world's workers fork from it instead of each importing torch afresh (spawn). Measured
    on 2 cores: a 4-rank world starts in 0.1 s instead of 5.7 s once the server runs (the
    first world pays the server's 2 s). The server runs nothing but imports, so no thread
    pool, process group or device is forked. Where there is no forkserver (Windows), spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["haloshard.testing"])  # imports torch and haloshard
    return ctx


def _worker(rank: int, world: int, store_path: str, pg_timeout: float,
            tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=pg_timeout))
    modules: dict[str, Any] = {}
    while (task := tasks.get()) is not None:
        path, qualname, args = task
        try:
            results.put((rank, True, _load(path, qualname, modules)(*args)))
        except BaseException as exc:  # reported to the parent, which decides
            results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    dist.barrier()
    dist.destroy_process_group()


class WorkerDied(RuntimeError):
    """A `GlooWorld` worker process ended while a call was running (killed by a signal, e.g.
    the kernel's OOM killer, or an abort in a backend): the world was torn down."""


def _exit_text(code: int | None) -> str:
    """A worker's exit code in words: a signal's name where it was killed by one."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-code).name
            return f"killed by {name}" + (" (the kernel's OOM killer sends it)"
                                          if name == "SIGKILL" else "")
    return f"exit code {code}"


class GlooWorld:
    """`world_size` real CPU processes in one gloo group, reused across calls.

    `run(fn, *args)` calls `fn(*args)` on every rank (fn must be a module-level function of a
    file; it is loaded by path in the workers) and returns the per-rank results. Each
    worker uses one thread; workers fork from a server that imported torch once. If any rank
    does not answer within `timeout` seconds, the world is torn down and `TimeoutError`
    names the silent ranks; if a worker process dies meanwhile (a signal, the OOM killer),
    the world is torn down within a second and `WorkerDied` names it and why, where the
    ranks still alive would otherwise wait for it until the timeout.

    Example::
        >>> with GlooWorld(2) as world:
        ...     world.run(dist.get_rank)  # doctest: +SKIP
        [0, 1]
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0, pg_timeout: float = 60.0):
        self.world_size, self.timeout = world_size, timeout
        ctx = _context()
        fd, self._store = tempfile.mkstemp(prefix="haloshard-gloo-")
        os.close(fd)
        os.unlink(self._store)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, self._store, pg_timeout, self._tasks[r],
                              self._results))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def outcomes(self, fn: Callable[..., Any], *args: Any,
                 timeout: float | None = None) -> list[tuple[bool, Any]]:
        """Per rank `(True, result)` or `(False, (error type, message, traceback))`."""
        task = (inspect.getfile(fn), fn.__qualname__, args)
        pickle.dumps(task)  # an unpicklable argument fails here, not as a worker timeout
        for q in self._tasks:
            q.put(task)
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world_size:
            try:  # a second at a time: a dead worker is seen within one
                rank, ok, value = self._results.get(
                    timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
            if not dead and time.monotonic() < deadline:
                continue
            silent = sorted(set(range(self.world_size)) - set(got))
            self.close(force=True)
            # The ranks that did answer with an error usually say why the others hang.
            errors = "".join(f"\nrank {r}: {v[2]}" for r, (ok, v) in sorted(got.items())
                             if not ok)
            if dead:
                which = ", ".join(f"rank {r} ({_exit_text(code)})" for r, code in dead)
                raise WorkerDied(f"{which} died during {fn.__qualname__}; ranks {silent} had "
                                 f"not answered (the world was torn down){errors}")
            raise TimeoutError(f"ranks {silent} did not answer {fn.__qualname__} within "
                               f"{limit}s (the world was torn down){errors}")
        return [got[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Per-rank results; raises AssertionError with every failing rank's traceback."""
        outcomes = self.outcomes(fn, *args, timeout=timeout)
        failed = [(r, v) for r, (ok, v) in enumerate(outcomes) if not ok]
        if failed:
            raise AssertionError("\n".join(f"rank {r}: {v[2]}" for r, v in failed))
        return [v for _, v in outcomes]

    def close(self, *, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.kill()
                p.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._store)

    def __enter__(self) -> GlooWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_WORKER_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...] | None], DeviceMesh] = {}


def worker_mesh(shape: int | Sequence[int], *,
                mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Inside a `GlooWorld` worker: a CPU mesh over the world, built once and cached."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    key = (dims, tuple(mesh_dim_names) if mesh_dim_names else None)
    if key not in _WORKER_MESHES:
        _WORKER_MESHES[key] = init_device_mesh("cpu", dims, mesh_dim_names=key[1])
    return _WORKER_MESHES[key]


_COLLECTIVES = ("all_gather_single", "all_to_all_single", "all_gather_into_tensor",
                "reduce_scatter_single", "all_reduce", "batch_isend_irecv", "broadcast")


@contextlib.contextmanager
def counted_collectives(*, by_dtype: bool = False) -> Iterator[collections.Counter[str]]:
    """Count the eager c10d collectives this process issues in the block, by name; with
    `by_dtype`, all-gathers of int64 rows (metadata) count apart from the rest (data).

    Example::
        with counted_collectives(by_dtype=True) as calls:  # in a real process
            y = model(x)  # a parallelized model after its first call
        dict(calls)  # {'all_to_all_single': 3}
    """
    calls: collections.Counter[str] = collections.Counter()
    # Before torch 2.13 two of them have older names: counted under the new ones.
    labels: dict[str, str] = {}
    for name in _COLLECTIVES:
        labels.setdefault(c10d_name(name), name)
    saved = {attr: getattr(dist, attr) for attr in labels}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            meta = by_dtype and name.startswith("all_gather") and args[1].dtype == torch.int64
            calls[f"{name} (metadata)" if meta else name] += 1
            return fn(*args, **kwargs)
        return call

    for attr, fn in saved.items():
        setattr(dist, attr, wrap(labels[attr], fn))
    try:
        yield calls
    finally:
        for attr, fn in saved.items():
            setattr(dist, attr, fn)


def allocations(fn: Callable[[], Any], ops: Sequence[str] = ()
                ) -> tuple[list[tuple[int, int]], list[int], Any]:
    """The allocation records torch's profiler takes during `fn()` as (time in ns, bytes;
    negative: a free), in time order; the start times of the ops named in `ops` (e.g.
    "aten::convolution"); and `fn`'s result. Frees made by another thread (gloo's workers)
    are not recorded: a buffer such a thread frees stays counted."""
    from torch.profiler import ProfilerActivity, profile

    from haloshard._compat import ALLOCATION_EVENT

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    pending, sizes, starts = list(prof.profiler.kineto_results.experimental_event_tree()), [], []
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.tag == ALLOCATION_EVENT:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name in ops:
            starts.append(node.start_time_ns)
    return sorted(sizes), starts, out


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """The peak of bytes allocated during `fn()` above its start, and `fn`'s result: the
    running sum of `allocations` in time order (the same numbers as the profiler's memory
    timeline, which asserts on some in-place update patterns while building its data-flow
    graph)."""
    sizes, _, out = allocations(fn)
    live = peak = 0
    for _, size in sizes:
        live += size
        peak = max(peak, live)
    return peak, out


def sum_over_ranks(t: torch.Tensor, mesh: DeviceMesh, *, mesh_axis: int | str = 0) -> torch.Tensor:
    """The sum of `t` over the ranks of `mesh_axis`, as a plain tensor on every rank.

    For comparing per-rank partial gradients (of replicated parameters) with a single-device
    gradient. Under `LocalTensorMode` it adds the simulated ranks' values of the axis group
    of simulated rank 0 (a 1-D mesh: all of them).
    """
    if isinstance(t, LocalTensor):
        with maybe_disable_local_tensor_mode():
            ranks = _axis_ranks(mesh, mesh_axis)
            return sum(local_tensors(t)[r] for r in ranks)  # type: ignore[return-value]
    out = t.detach().clone()
    dist.all_reduce(out, group=mesh.get_group(mesh_axis))
    return out


def _axis_ranks(mesh: DeviceMesh, mesh_axis: int | str) -> list[int]:
    """Global ranks of the mesh-axis group that contains global rank 0."""
    names = mesh.mesh_dim_names or ()
    axis = names.index(mesh_axis) if isinstance(mesh_axis, str) else mesh_axis
    grid = mesh.mesh.movedim(axis, -1).reshape(-1, mesh.mesh.shape[axis])
    return [int(r) for r in grid[0].tolist()]


def seeded_module(module: torch.nn.Module, seed: int, *, scale: float = 1.0
                  ) -> torch.nn.Module:
    """`module` in float64 with parameter i drawn by `seeded_randn(shape, seed + i) * scale`
    (the same values on every rank and in every process)."""
    module = module.double()
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(seeded_randn(tuple(p.shape), seed + i) * scale)
    return module


def sharded(mesh: DeviceMesh, full: torch.Tensor, dim: int = 2
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A `Shard(dim)` DTensor of `full` on a 1-D mesh, and its local leaf (for its grad)."""
    from torch.distributed.tensor import DTensor, Shard

    world = mesh.size()
    local = rank_map(mesh, lambda r: shard(full, dim, world, r).clone()).requires_grad_()
    return DTensor.from_local(local, mesh, [Shard(dim)], shape=full.shape,
                              stride=full.stride()), local


def unhooked(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` with every halo removed: its single-device twin."""
    import copy

    from haloshard._styles import halo_handles

    clone = copy.deepcopy(module)
    for handle in halo_handles(clone).values():
        handle.remove()
    return clone


def module_reference(module: torch.nn.Module, full: torch.Tensor, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Single-device output, upstream gradient (drawn with `seed`), input gradient and
    parameter gradients of `module`'s twin without halos."""
    with single_device():
        twin = unhooked(module)
        x = full.clone().requires_grad_()
        y = twin(x)
        gy = seeded_randn(y.shape, seed, device=y.device)
        (y * gy).sum().backward()
        grads = [p.grad for p in twin.parameters()]
    assert x.grad is not None
    return y.detach(), gy, x.grad, grads  # type: ignore[return-value]


def check_module(
    mesh: DeviceMesh, module: torch.nn.Module, full: torch.Tensor, seed: int,
    run: Callable[[Any], Any] | None = None, *, atol: float = 1e-12, rtol: float = 1e-10,
) -> None:
    """A parallelized module against its single-device twin, on a 1-D mesh along dim 2.

    Checks the `Shard(2)` output, the input gradient and the parameter gradients summed
    over ranks (`reduce_grads`), for an upstream gradient drawn with `seed`. The default
    tolerance is for float64 sums taken in another order; a misplaced slice is O(1).
    """
    from torch.distributed.tensor import DTensor, Shard

    from haloshard._styles import reduce_grads

    world, tol = mesh.size(), {"atol": atol, "rtol": rtol}
    y_ref, gy, gx, grads = module_reference(module, full, seed)
    x, local = sharded(mesh, full)
    y = (run or module)(x)
    assert isinstance(y, DTensor) and y.placements == (Shard(2),), y
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    assert_close_per_rank(y.to_local(), lambda r: shard(y_ref, 2, world, r), mesh, **tol)
    (y.to_local() * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    assert_close_per_rank(local.grad, lambda r: shard(gx, 2, world, r), mesh, **tol)
    reduce_grads(module, mesh)
    for p, g in zip(module.parameters(), grads, strict=True):
        assert_close_per_rank(p.grad, lambda r, g=g: g, mesh, **tol)


def check_plan(
    mesh: DeviceMesh, model: torch.nn.Module, plan: Any, full: torch.Tensor, seed: int, *,
    run: Callable[[Any, Any], Any] | None = None,
    reference: Callable[[Any, Any], Any] | None = None, atol: float = 1e-12,
    rtol: float = 1e-10,
) -> None:
    """`model` parallelized with `plan` (in place), `run(model, x)` on the `Shard(2)` input,
    against `reference(twin, x)` on one device (both default to calling the model): the
    output, the input gradient and every parameter gradient (summed over ranks by
    `reduce_grads`), for an upstream gradient drawn with `seed`.

    Example::
        >>> model = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1)).double()
        >>> full = torch.randn(1, 2, 9, 4, 4, dtype=torch.float64)
        >>> check_plan(mesh, model, {"0": HaloParallel()}, full, 1)  # passes: returns None

        # a diffusers VAE, with its own call and reference (not run here):
        check_plan(mesh, vae, wan_decoder_plan(vae), z, 1, run=wan_decode,
                   reference=lambda m, z: m._decode(z).sample)
    """
    import copy

    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard._styles import reduce_grads

    world, tol = mesh.size(), {"atol": atol, "rtol": rtol}
    with single_device():
        twin = copy.deepcopy(model)
        x_ref = full.clone().requires_grad_()
        y_ref = (reference or (lambda m, t: m(t)))(twin, x_ref)
        gy = seeded_randn(tuple(y_ref.shape), seed, full.dtype, full.device)
        (y_ref * gy).sum().backward()
    parallelize_module(model, mesh, plan)
    x, local = sharded(mesh, full)
    y = (run or (lambda m, t: m(t)))(model, x)
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    assert_close_per_rank(y.to_local(), lambda r: shard(y_ref.detach(), 2, world, r), mesh,
                          **tol)
    (y.to_local() * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    assert_close_per_rank(local.grad, lambda r: shard(x_ref.grad, 2, world, r), mesh, **tol)
    reduce_grads(model, mesh)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert_close_per_rank(p.grad, lambda r, g=q.grad: g, mesh, **tol)


class CausalConv3d(torch.nn.Module):
    """A causal video-VAE conv, as models write it: replicate-pads T by k - 1 itself, then a
    conv with no T padding. Annotate it with `HaloShard(2, left=k - 1, pad="replicate")`."""

    def __init__(self, channels: int, k: int = 3) -> None:
        super().__init__()
        self.k = k
        self.conv = torch.nn.Conv3d(channels, channels, (k, 3, 3), padding=(0, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, self.k - 1, 0), mode="replicate"))
