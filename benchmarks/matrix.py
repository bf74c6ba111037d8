"""A halo conv step across a matrix of shapes, through the path a user takes.

`python -m benchmarks.matrix` runs P gloo ranks (1 thread each), each on its own block of
the machine's cores (`pin_rank`; `--no-pin` leaves them to the OS scheduler). For every shape
it builds the layer, parallelizes copies of it with `parallelize_module(..., HaloParallel(...))`
and feeds a `Shard(2)` DTensor, forward + backward, against the floor: the same layer on the
same local chunk with its own padding along T (no communication, no halo). Contenders run
round-robin after an untimed warm-up round, each leading the round in turn; a round's time is
its slowest rank's. Ratios are the median over the --iters rounds of the ratio within one round
(paired: a busy spell of the shared machine slows both alike), or (`--stat min`) compare
each contender's fastest round, as `timeit` does.

Columns, per shape (time over the floor's):
- `default`: `HaloParallel()`: the faster of the two below, picked by timing both once at
  the layer's first call (the untimed warm-up round here);
- `overlap`: `HaloParallel(overlap=True)`: `halo_conv`, the chunk's own conv while the halo
  travels, then boundary corrections (equal halos; a causal wrapper always exchanges first);
- `no ovl`: `HaloParallel(overlap=False)`: exchange first, then the layer;
- `chose`: the formulation the default picked (`ovl` / `xf`, exchange first);
- `chosen/best`: what the choice costs: the chosen formulation's time over the faster
  forced one's in this run (the one with the lower ratio to the floor); 1 when it chose the
  faster. `in limit`: the same over the faster of those whose peak memory is within the
  target (`limit`), the formulations the default may choose. The default runs the chosen
  formulation's code, so `default` against it (`dflt/chsn`) is this machine's noise on one
  layer (same code, other rounds);
- `taps`: kernel taps any exact formulation computes over the floor's (`Case.taps`): the
  floor skips the taps reading its zero padding, the halo's are real work, so no exact
  path can go below it where the conv's cost follows its taps;
- `fl+mv`: the floor with a bare all-to-all of the halo bytes beside its forward and of
  their gradients beside its backward (prebuilt buffers, nothing else), over the floor:
  what moving the halo alone costs on this machine, which every exact formulation pays on
  top of its `taps`;
- `exact`: the best exact formulation written plainly with torch ops (`raw_exact`: the
  window's conv, or the chunk's own conv plus per-tap corrections), its halo at hand, with a
  bare move of the halo bytes beside it, over the floor: what these kernels and this wire
  allow, a lower bound: its gradients' move starts before its backward, so their wait hides
  behind it (the halo gradients and their buffers held beside the conv's workspace: `pk
  exact`, its peak over the floor's); `dflt/exact`: the default over it;
- `sent / halo`: bytes the rank sent in all-to-alls per step over the halo bytes it owes
  (forward: its edge slices its neighbours need; backward: the gradients of the halo slices
  it received), 1.00: only halo bytes cross the wire;
- `meta`: metadata collectives (all-gathers of ints) the default path issued per step;
- `peak / floor`: peak memory allocated during one step (torch's memory profiler), default
  over the floor, `pk ovl` and `pk xf` the same for `overlap` and `no ovl`, and `limit`:
  what the target allows
  (floor + halo slices) * 1.05;
- `fixed ms`: the default's time minus the best plain exact formulation's (`exact`), in
  ms per step, paired round by round: what the library adds per step whatever the layer's
  size. The last default row (conv1d C8 T64) is tiny, its conv well under 1 ms: there this
  column is the library's fixed cost per step, the user's wrapping included;
- `wrap ms`: what the step's own DTensor wrapping costs (the user's `from_local` of the
  input and `to_local` of the output, forward and backward), measured alone around the
  floor's conv: part of `fixed ms`, paid once per model step whatever its layers, not per
  halo layer;
- `layer ms`: the halo layer's own fixed cost per step, `fixed ms` less `wrap ms`, paired
  round by round (the median over rounds of `(default - exact) - (floor+wrap - floor)`):
  on the tiny row, what one more halo layer adds to a model's step (target: at most 1 ms).
  Each round of the tiny row times 20 steps in a row (`Case.reps`; ms per step reported):
  its single step, about 2 ms here, is at the scale of the timer's and scheduler's noise;
- `layer cpu`: `layer ms` on each rank's main-thread CPU time (`time.thread_time`), the
  same pairing: the library's own work per step, without the time its rank spends waiting
  for the halo; the rest of `layer ms` is waiting (on the wire, and on a 2-core machine
  on the gloo threads' turn at a core). Both move between runs of the same code on a
  shared machine: here on the tiny row, 20 runs each in one hour, `layer ms` 0.48 to 1.00
  (median 0.65) with each rank on its own core, 0.55 to 1.38 (median 0.96) with `--no-pin`.

The device follows the mesh: on a machine with GPUs (`--device cuda`) the same script runs on
NCCL. Ratios, not times: absolute times on a 2-core VM vary by 3% or more between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from benchmarks import steady_allocator
from haloshard import HaloParallel, HaloShard
from haloshard._compat import c10d_name
from haloshard._conv import halo_taps
from haloshard._plan import exchange_plan
from haloshard.testing import GlooWorld, peak_bytes, shard, worker_mesh


class CausalConv(nn.Module):
    """`F.pad` of `k - 1` frames (replicate) along T, then a conv with no T padding."""

    def __init__(self, conv: nn.Module, k: int) -> None:
        super().__init__()
        self.conv, self.k = conv, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        widths = [0, 0] * (x.ndim - 3) + [self.k - 1, 0]
        return self.conv(F.pad(x, widths, mode="replicate"))


class Case(NamedTuple):
    """One layer and the global input shape it runs on; T (dim 2) is sharded. (A tuple: the
    gloo workers load this file by path, where a dataclass cannot be built or unpickled.)"""

    kind: str  # conv3d, conv2d, conv1d, dwconv1d
    channels: int
    length: int  # global T
    spatial: tuple[int, ...]
    k: int
    causal: bool
    dtype: torch.dtype = torch.float32
    # steps timed together per round (ms per step reported): a tiny layer's single step
    # (about 2 ms here) is at the scale of the timer's and the scheduler's noise
    reps: int = 1

    @property
    def name(self) -> str:
        sp = "x".join(map(str, self.spatial))
        dt = "" if self.dtype == torch.float32 else " bf16"
        return (f"{self.kind} C{self.channels} T{self.length}{' ' + sp if sp else ''} "
                f"k{self.k}{' causal' if self.causal else ''}{dt}")

    def taps(self, ranks: int) -> float:
        """Kernel taps an exact formulation computes over the floor's, on the shortest
        chunk `T_r`: the floor's conv skips the taps that read its zero padding (`k - 1` in
        all), the halo's are real, so `k T_r / (k T_r - (k - 1))` (1 for a causal wrapper,
        whose floor convolves replicated frames)."""
        if self.causal:
            return 1.0
        taps = self.k * (self.length // ranks)
        return taps / (taps - (self.k - 1))

    def layer(self) -> tuple[nn.Module, HaloShard | None]:
        n = 1 + len(self.spatial)
        conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[n]
        groups = self.channels if self.kind == "dwconv1d" else 1
        other = [self.k // 2] * (n - 1)
        if self.causal:
            conv = conv_cls(self.channels, self.channels, self.k, padding=(0, *other),
                            groups=groups)
            return CausalConv(conv, self.k), HaloShard(2, left=self.k - 1, pad="replicate")
        return conv_cls(self.channels, self.channels, self.k, padding=self.k // 2,
                        groups=groups), None


def matrix(full: bool) -> list[Case]:
    """The issue's matrix: conv3d (C 32..256, 2..16 frames per rank, 32..64 px, k3 centred
    and causal), conv2d, conv1d dense and depthwise (causal k4, centred k5, L 4k..16k),
    float32 and bfloat16. The default run takes a corner of each axis."""
    cases = [
        Case("conv3d", 32, 32, (32, 32), 3, False), Case("conv3d", 64, 16, (48, 48), 3, False),
        Case("conv3d", 128, 16, (64, 64), 3, False), Case("conv3d", 256, 8, (32, 32), 3, False),
        Case("conv3d", 64, 8, (48, 48), 3, True), Case("conv3d", 32, 4, (32, 32), 3, False),
        Case("conv2d", 64, 512, (64,), 3, False),
        Case("conv1d", 512, 8192, (), 5, False), Case("dwconv1d", 1024, 8192, (), 4, True),
        Case("conv3d", 64, 16, (48, 48), 3, False, torch.bfloat16),
        # tiny: the conv itself takes well under 1 ms, so `fixed ms` is the fixed cost
        # (`layer ms` the halo layer's own)
        Case("conv1d", 8, 64, (), 3, False, reps=20),
    ]
    if full:
        cases += [Case("conv3d", c, t, (s, s), 3, causal)
                  for c in (32, 128) for t in (4, 32) for s in (32, 64) for causal in (False, True)]
        cases += [Case("conv1d", 256, n, (), 5, False) for n in (4096, 16384)]
        cases += [Case("dwconv1d", 1024, n, (), 4, True) for n in (4096, 16384)]
    return cases


class _Count:
    """Bytes this rank sends in all-to-alls and the int all-gathers it issues (c10d's eager
    calls, the ones haloshard's `_comm` makes outside torch.compile)."""

    def __init__(self) -> None:
        self.sent = self.meta = 0
        # c10d's all-gather into one tensor by its name in the installed torch (2.12 calls
        # it `all_gather_into_tensor`)
        self._gather_name = c10d_name("all_gather_single")
        self._a2a, self._ag = dist.all_to_all_single, getattr(dist, self._gather_name)

    def __enter__(self) -> _Count:
        rank = dist.get_rank()

        def a2a(out: torch.Tensor, buf: torch.Tensor, recv: Any = None, send: Any = None,
                *args: Any, **kwargs: Any) -> Any:
            row = buf[0].numel() * buf.element_size() if buf.shape[0] else 0
            splits = list(send) if send else [buf.shape[0] // dist.get_world_size()] * (
                dist.get_world_size())
            self.sent += row * sum(n for r, n in enumerate(splits) if r != rank)
            return self._a2a(out, buf, recv, send, *args, **kwargs)

        def gather(*args: Any, **kwargs: Any) -> Any:
            self.meta += 1
            return self._ag(*args, **kwargs)

        dist.all_to_all_single = a2a
        setattr(dist, self._gather_name, gather)
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._a2a
        setattr(dist, self._gather_name, self._ag)


def _raw_halos(full: torch.Tensor, case: Case, rank: int, world: int, left: int, right: int
               ) -> torch.Tensor:
    """This rank's halo `[left ++ right]` along T, cut from the global input: its
    neighbours' edge frames, zeros beyond the global ends (a causal wrapper: the first frame
    repeated)."""
    sizes = [shard(full, 2, world, r).shape[2] for r in range(world)]
    start, end = sum(sizes[:rank]), sum(sizes[: rank + 1])
    if case.causal:
        edge = full.narrow(2, 0, 1).expand(*full.shape[:2], left, *full.shape[3:])
        padded = torch.cat([edge, full], 2)
        return padded.narrow(2, start, left).contiguous()
    widths = [0, 0] * (full.ndim - 3) + [left, right]
    padded = F.pad(full, widths)
    return torch.cat([padded.narrow(2, start, left),
                      padded.narrow(2, end + left, right)], 2).contiguous()


def _raw_tap(frame: torch.Tensor, weight: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """One halo frame's contribution through one kernel tap (the weight's slice there):
    the conv one dim down, the other dims' padding as the layer's."""
    if frame.ndim == 2:  # conv1d: a matmul (groups 1) or a per-channel product (depthwise)
        return frame @ weight.t() if conv.groups == 1 else frame * weight[:, 0]
    fn = F.conv1d if frame.ndim == 3 else F.conv2d
    return fn(frame, weight, padding=conv.padding[1:], groups=conv.groups)


Raw = Callable[[torch.Tensor, torch.Tensor, Callable[[], object]], torch.Tensor]


def raw_exact(case: Case, layer: nn.Module, left: int, right: int) -> dict[str, Raw]:
    """The exact formulations written plainly with torch ops (no library: no planning, checks
    or packing), `f(x, halos, arrived) -> this rank's output`, `arrived()` waiting for the
    halo:
    - `window`: the conv of `[left halo ++ chunk ++ right halo]` with no padding along T
      (exchange first);
    - `corrected` (centred): the chunk's own conv (the floor's) while the halo travels, then,
      in place, each halo frame through each kernel tap that reads it.
    With a bare move of the halo bytes beside them they are the best a library can do with
    these kernels."""
    conv = layer.conv if case.causal else layer
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[conv.weight.ndim - 2]
    no_pad_t = (0, *conv.padding[1:])

    def window(x: torch.Tensor, h: torch.Tensor, arrived: Callable[[], object]
               ) -> torch.Tensor:
        arrived()
        buf = torch.cat([h.narrow(2, 0, left), x, h.narrow(2, left, right)], 2)
        return fn(buf, conv.weight, conv.bias, padding=no_pad_t, groups=conv.groups)

    def corrected(x: torch.Tensor, h: torch.Tensor, arrived: Callable[[], object]
                  ) -> torch.Tensor:
        y = layer(x)
        arrived()
        for o, t, s in halo_taps(left, right, 1, case.k):
            y.select(2, o if o >= 0 else y.shape[2] + o).add_(
                _raw_tap(h.select(2, s), conv.weight.select(2, t), conv))
        return y

    return {"window": window} if case.causal else {"window": window, "corrected": corrected}


def rank_case(fields: tuple[Any, ...], iters: int, device: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    case = Case(*fields)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    gen = torch.Generator().manual_seed(0)
    shape = (1, case.channels, case.length, *case.spatial)
    full = torch.randn(shape, generator=gen).to(device, case.dtype)
    layer, spec = case.layer()
    layer = layer.to(device, case.dtype)
    local = shard(full, 2, world, rank).contiguous()
    floor_layer = copy.deepcopy(layer)
    default, overlap, no_overlap = (copy.deepcopy(layer) for _ in range(3))
    parallelize_module(default, mesh, HaloParallel(spec))
    parallelize_module(overlap, mesh, HaloParallel(spec, overlap=True))
    parallelize_module(no_overlap, mesh, HaloParallel(spec, overlap=False))

    def through(module: nn.Module) -> Callable[[], None]:
        def step() -> None:
            leaf = local.detach().requires_grad_()
            x = DTensor.from_local(leaf, mesh, [Shard(2)], shape=full.shape,
                                   stride=full.stride())
            module(x).to_local().float().sum().backward()
        return step

    def floor() -> None:
        floor_layer(local.detach().requires_grad_()).float().sum().backward()

    def floor_wrap() -> None:
        """The floor inside the step's DTensor wrapping (`through`'s `from_local` and
        `to_local`, forward and backward), with no layer of the library."""
        leaf = local.detach().requires_grad_()
        x = DTensor.from_local(leaf, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
        floor_layer(x.to_local()).float().sum().backward()

    lengths = tuple(shard(full, 2, world, r).shape[2] for r in range(world))
    left, right = (spec.left, spec.right) if spec else (case.k // 2, case.k // 2)
    plan = exchange_plan(rank, lengths, left, right, "zeros")
    row = full.narrow(2, 0, 1).numel()
    sent, received = ([n * row for n in splits]
                      for splits in (plan.send_splits, plan.recv_splits))
    halo_send, grad_recv, halo_recv, grad_send = (
        torch.zeros(sum(n), dtype=case.dtype, device=device)
        for n in (sent, sent, received, received))

    def floor_move() -> None:
        """The floor with a bare all-to-all of the halo bytes beside its forward and of
        their gradients beside its backward (prebuilt buffers, nothing else): what any
        exact formulation pays at least, the floor plus moving the halo on this machine."""
        work = dist.all_to_all_single(halo_recv, halo_send, received, sent, async_op=True)
        y = floor_layer(local.detach().requires_grad_()).float().sum()
        work.wait()
        work = dist.all_to_all_single(grad_recv, grad_send, sent, received, async_op=True)
        y.backward()
        work.wait()

    halos = _raw_halos(full, case, rank, world, left, right)
    raws = raw_exact(case, floor_layer, left, right)

    def raw_move(formulation: Raw) -> Callable[[], None]:
        def step() -> None:
            """A plain exact formulation with a bare move of the halo bytes beside it, and of
            their gradients beside its backward (started before it: a lower bound)."""
            work = dist.all_to_all_single(halo_recv, halo_send, received, sent, async_op=True)
            x, h = local.detach().requires_grad_(), halos.detach().requires_grad_()
            y = formulation(x, h, work.wait)
            work = dist.all_to_all_single(grad_recv, grad_send, sent, received, async_op=True)
            y.float().sum().backward()
            work.wait()
        return step

    if case.dtype == torch.float32:  # the plain formulations are exact: same outputs
        x = DTensor.from_local(local, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
        expected = no_overlap(x).to_local()
        for name, f in raws.items():
            torch.testing.assert_close(f(local, halos, lambda: None), expected,
                                       msg=f"raw {name} differs on {case.name}")

    raw_steps = {f"raw {name}": raw_move(f) for name, f in raws.items()}
    steps = {"floor": floor, "floor+wrap": floor_wrap, "default": through(default),
             "overlap": through(overlap),
             "no overlap": through(no_overlap), "floor+move": floor_move, **raw_steps}
    for step in steps.values():  # untimed: plans, buffers, first collectives, the heap
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}  # this thread's CPU time
    names = list(steps)
    for i in range(iters):  # round-robin: a busy spell of the machine hits every step alike
        for name in names[i % len(names):] + names[: i % len(names)]:  # each leads in turn
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(case.reps):
                steps[name]()
            times[name].append((time.perf_counter() - start) * 1e3 / case.reps)
            cpu[name].append((time.thread_time() - start_cpu) * 1e3 / case.reps)
    with _Count() as count:
        steps["default"]()
    slice_bytes = row * full.element_size()
    # forward: the edge slices neighbours need; backward: the gradients of the halo slices
    # this rank received, back to their owners
    halo = (sum(plan.send_splits) + sum(plan.recv_splits)) * slice_bytes
    peaks = {name: peak_bytes(steps[name])[0]
             for name in ("floor", "default", "overlap", "no overlap", *raw_steps)}
    return {"ms": times, "cpu": cpu,
            "sent": count.sent / halo if halo else float("nan"), "meta": count.meta,
            "peak": peaks, "halo": (left + right) * slice_bytes,
            # the default's choice (a causal wrapper always exchanges first)
            "chose": ("overlap" if any(c.overlap for c in default.forward.chosen.values())
                      else "no overlap")}


_SHORT = {"overlap": "ovl", "no overlap": "xf"}


def _slowest(ranks: list[dict[str, Any]], name: str, clock: str = "ms") -> list[float]:
    """`name`'s time per round, a round's time being its slowest rank's (ms): wall time
    (`clock="ms"`) or the rank's main-thread CPU time (`"cpu"`)."""
    return [max(r) for r in zip(*(rank[clock][name] for rank in ranks), strict=True)]


def _fixed_ms(ranks: list[dict[str, Any]], name: str, plain: str) -> float:
    """What `name` pays per step beyond `plain`, in ms: the median over rounds of their
    difference in the same round. On a tiny layer, whose conv takes well under a
    millisecond, this is the library's fixed cost per step (planning lookups, checks,
    hooks, autograd nodes) over the plain exact formulation with its bare halo move."""
    return statistics.median(
        a - b for a, b in zip(_slowest(ranks, name), _slowest(ranks, plain), strict=True))


def _layer_ms(ranks: list[dict[str, Any]], plain: str, clock: str = "ms") -> float:
    """The halo layer's own fixed cost per step, in ms: the default's time over `plain`'s
    less the step's DTensor wrapping over the floor, in the same round, the median over
    rounds (the wrapping is the user's, once per model step, not per halo layer); on the
    wall clock, or (`clock="cpu"`) on each rank's main-thread CPU time."""
    per_round = zip(*(_slowest(ranks, n, clock)
                      for n in ("default", plain, "floor+wrap", "floor")), strict=True)
    return statistics.median((d - p) - (w - f) for d, p, w, f in per_round)


def _ratios(ranks: list[dict[str, Any]], stat: str) -> Callable[[str, str], float]:
    """`ratio(a, b)`: `a`'s time over `b`'s, a round's time being its slowest rank's. With
    `stat="min"`, the fastest round of each (as `timeit` does: on a shared machine another
    process's work only adds time); with "median", the median over rounds of the ratio in
    the same round (paired: a busy spell of the machine slows both alike)."""
    def slowest(name: str) -> list[float]:
        return _slowest(ranks, name)

    def ratio(a: str, b: str) -> float:
        if stat == "min":
            return min(slowest(a)) / min(slowest(b))
        return statistics.median(x / y for x, y in zip(slowest(a), slowest(b), strict=True))
    return ratio


def pin_rank(pin: bool) -> list[int]:
    """Bind every thread of this rank's process (its main thread, gloo's, the result queue's,
    and those it starts later, which inherit the mask) to this rank's own block of the cores
    the process may use, as a launcher binds each rank to its cores (torchrun's
    `--numa-binding`, `taskset`); the cores, or [] where it leaves placement to the OS
    scheduler: `pin` false, fewer cores than ranks, or no `os.sched_setaffinity`.

    On this 2-core machine a tiny layer's step keeps four threads busy (each rank's main and
    gloo thread): unpinned, the scheduler moves them between the cores, and a rank's wait for
    its halo changes from one world to the next (the tiny row's `layer ms` 0.61 to 1.33 over
    18 runs of the same code; 0.48 to 1.00 pinned, 20 runs). Every contender of a round runs
    in the same world, pinned alike.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if not pin or len(cpus) < world:
        return []
    share = cpus[rank * (len(cpus) // world):(rank + 1) * (len(cpus) // world)]
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), share)
    return share


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the whole matrix")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stat", choices=("min", "median"), default="median",
                        help="fastest round of each contender, or median of paired ratios")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the ranks' threads to the OS scheduler, as the runs "
                             "before session 18 in benchmarks/README.md were taken, instead "
                             "of each rank on its own block of cores")
    args = parser.parse_args(argv)
    steady_allocator()
    cases = [c for c in matrix(args.full) if args.only in c.name]
    print(f"halo conv step (fwd+bwd) over the floor, {args.ranks} gloo ranks, 1 thread each, "
          f"{args.stat} of {args.iters} rounds, through parallelize_module on a Shard(2) "
          "DTensor")
    worst = worst_best = worst_fit = worst_exact = ("", 0.0)
    with GlooWorld(args.ranks, timeout=3600) as gloo:
        cores = gloo.run(pin_rank, args.pin)
        print("ranks' cores: " + (", ".join(f"rank {r}: {c}" for r, c in enumerate(cores))
                                  if all(cores) else "any (not pinned)"))
        print(f"{'shape':<36} {'default':>8} {'overlap':>8} {'no ovl':>8} {'chose':>6} "
              f"{'chosen/best':>11} {'in limit':>8} {'dflt/chsn':>9} {'taps':>6} {'fl+mv':>6} "
              f"{'exact':>6} {'dflt/exact':>10} {'sent/halo':>10} {'meta':>5} {'peak/floor':>11} "
              f"{'pk ovl':>7} {'pk xf':>6} {'pk exact':>8} {'limit':>6} {'fixed ms':>8} "
              f"{'wrap ms':>7} {'layer ms':>8} {'layer cpu':>9}")
        for case in cases:
            ranks = gloo.run(rank_case, tuple(case), args.iters, args.device)
            ratio = _ratios(ranks, args.stat)
            peak, peak_ovl, peak_xf = (
                max(r["peak"][n] / max(r["peak"]["floor"], 1) for r in ranks)
                for n in ("default", "overlap", "no overlap"))
            limit = max((r["peak"]["floor"] + r["halo"]) * 1.05 / max(r["peak"]["floor"], 1)
                        for r in ranks)
            default = ratio("default", "floor")
            best = min(("overlap", "no overlap"), key=lambda n: ratio(n, "floor"))
            chose = ranks[0]["chose"]
            # the default runs its chosen formulation's code: what the choice costs is that
            # formulation's time over the best's (1 when it chose the best)
            # (a causal wrapper has one formulation: its two forced columns run the same)
            cost = (1.0 if chose == best or case.causal
                    else ratio(chose, "floor") / ratio(best, "floor"))
            # the same among the formulations whose peak memory is within the target
            fit = [n for n, pk in (("overlap", peak_ovl), ("no overlap", peak_xf))
                   if pk <= limit] or ["overlap", "no overlap"]
            best_fit = min(fit, key=lambda n: ratio(n, "floor"))
            cost_fit = (1.0 if chose == best_fit or case.causal
                        else ratio(chose, "floor") / ratio(best_fit, "floor"))
            raws = [n for n in ranks[0]["ms"] if n.startswith("raw ")]
            best_raw = min(raws, key=lambda n: ratio(n, "floor"))
            exact = ratio(best_raw, "floor")
            peak_exact = max(r["peak"][best_raw] / max(r["peak"]["floor"], 1) for r in ranks)
            # the library's default over the best plain formulation, paired round by round
            over_exact = ratio("default", best_raw)
            worst_exact = max(worst_exact, (case.name, over_exact), key=lambda w: w[1])
            worst = max(worst, (case.name, default), key=lambda w: w[1])
            worst_best = max(worst_best, (case.name, cost), key=lambda w: w[1])
            worst_fit = max(worst_fit, (case.name, cost_fit), key=lambda w: w[1])
            print(f"{case.name:<36} {default:>8.3f} {ratio('overlap', 'floor'):>8.3f} "
                  f"{ratio('no overlap', 'floor'):>8.3f} {_SHORT[chose]:>6} {cost:>11.3f} "
                  f"{cost_fit:>8.3f} "
                  f"{ratio('default', chose):>9.3f} "
                  f"{case.taps(args.ranks):>6.3f} {ratio('floor+move', 'floor'):>6.3f} "
                  f"{exact:>6.3f} {over_exact:>10.3f} "
                  f"{max(r['sent'] for r in ranks):>10.2f} "
                  f"{max(r['meta'] for r in ranks):>5} {peak:>11.3f} {peak_ovl:>7.3f} "
                  f"{peak_xf:>6.3f} {peak_exact:>8.3f} {limit:>6.3f} "
                  f"{_fixed_ms(ranks, 'default', best_raw):>8.3f} "
                  f"{_fixed_ms(ranks, 'floor+wrap', 'floor'):>7.3f} "
                  f"{_layer_ms(ranks, best_raw):>8.3f} "
                  f"{_layer_ms(ranks, best_raw, 'cpu'):>9.3f}")
    print(f"worst default / floor: {worst[1]:.3f} ({worst[0]}); worst chosen / best: "
          f"{worst_best[1]:.3f} ({worst_best[0]}); worst chosen / best within the memory "
          f"limit: {worst_fit[1]:.3f} ({worst_fit[0]}); worst default / best plain exact: "
          f"{worst_exact[1]:.3f} ({worst_exact[0]})")


if __name__ == "__main__":
    main()
