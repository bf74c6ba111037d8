"""`verify_plan`: find the first module where a context-parallel plan departs from one device.

A plan that runs without error can still be wrong: a per-frame style on a layer that mixes
frames, a norm planned with local statistics, a model-specific layer a style does not know.
The final output then differs, but not where. `verify_plan` runs the model twice, on one
device and parallelized, forward and backward with the same cotangent, records every
module's output and input gradient on both, and names the first module that differs.

What is compared: a module whose output (or input) on the sharded side is a DTensor, i.e.
a global tensor. Modules run inside a style see local windows, not global tensors; they are
covered by the style's own output. The sharded side's values are gathered into full tensors
with the mesh axis' group after the backward has finished (never inside a hook, so every rank
issues the same collectives in the same order). Every module's output is kept in full on both
sides: for tiny models.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils.hooks import RemovableHandle

from haloshard import _comm
from haloshard._attention import gather_along
from haloshard._errors import HaloError
from haloshard._per_rank import per_rank, rank_map, seeded_randn, shard, single_device
from haloshard._plan_gaps import MIXED, MissingEntryError, missing_entry
from haloshard._redistribute import unwrap

_INPUT = "<input>"


@dataclass(frozen=True)
class Difference:
    """One compared value: where, what, and how far apart.

    `max_rel` is `max_abs` over the largest magnitude of the single-device value (an
    elementwise relative error is meaningless next to zeros). `note` says why a value could
    not be compared numerically (a shape mismatch, a module that did not run).
    """

    fqn: str
    kind: str  # "output", "input grad" or "param grad"
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""
    scale: float = 0.0  # max |single-device value|

    def __str__(self) -> str:
        where = f"{self.kind} of {self.fqn or '<model>'}"
        if self.note:
            return f"{where}: {self.note}"
        return f"{where}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"


@dataclass(frozen=True)
class PlanReport:
    """What `verify_plan` found; `ok` when every compared value is within tolerance.

    `outputs` are in forward order (a module after the modules it calls), `input_grads` in
    backward order (the order autograd computes them, the model's input last). `first` is
    the first difference among outputs, else among input gradients, else among parameter
    gradients; or None. `error` is the exception the sharded run raised, with `error_fqn`
    the innermost module that was running (None when nothing raised).
    """

    outputs: tuple[Difference, ...]
    input_grads: tuple[Difference, ...]
    param_grads: tuple[Difference, ...]
    atol: float
    rtol: float
    error: str | None = None
    error_fqn: str | None = None
    skipped: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.error is None and all(
            d.ok for d in (*self.outputs, *self.input_grads, *self.param_grads))

    @property
    def first(self) -> Difference | None:
        for group in (self.outputs, self.input_grads, self.param_grads):
            for d in group:
                if not d.ok:
                    return d
        return None

    def worst(self, kind: str) -> float:
        """The largest relative difference among values of `kind` whose scale exceeds
        `atol` (a gradient that is zero on one device, such as a key bias under softmax,
        has no meaningful relative error); 0.0 when none."""
        every = (*self.outputs, *self.input_grads, *self.param_grads)
        return max([d.max_rel for d in every
                    if d.kind == kind and not d.note and d.scale > self.atol] or [0.0])

    def __repr__(self) -> str:
        return (f"PlanReport(ok={self.ok}, first={self.first!r}, error={self.error!r}, "
                f"error_fqn={self.error_fqn!r}, outputs={len(self.outputs)}, "
                f"input_grads={len(self.input_grads)}, param_grads={len(self.param_grads)})")

    def __str__(self) -> str:
        tol = f"atol={self.atol:g}, rtol={self.rtol:g}"
        if self.error is not None:
            return (f"plan FAILS: the sharded run raised in {self.error_fqn or '<model>'!r}: "
                    f"{self.error}")
        counts = (f"{len(self.outputs)} outputs, {len(self.input_grads)} input grads, "
                  f"{len(self.param_grads)} param grads")
        worst = ", ".join(f"{k} {self.worst(k):.2g}"
                          for k in ("output", "input grad", "param grad"))
        if self.ok:
            return f"plan ok ({counts} within {tol}; worst rel: {worst})"
        return f"plan FAILS ({counts}, {tol}): first difference: {self.first}"


@dataclass
class _Value:
    """A recorded tensor: full on one device; a local piece and its layout when sharded."""

    tensor: torch.Tensor | None
    shard_dim: int | None = None  # None: replicated (or plain) on the sharded side
    mesh: DeviceMesh | None = None
    axis: int = 0
    length: int = 0
    note: str = ""


def _record(t: Any) -> _Value:
    if isinstance(t, DTensor):
        local = t.to_local().detach().clone()
        shards = [(a, p.dim) for a, p in enumerate(t.placements) if isinstance(p, Shard)]
        if any(not isinstance(p, (Shard, Replicate)) for p in t.placements) or len(shards) > 1:
            return _Value(None, note=f"placements {tuple(t.placements)} not compared")
        if not shards:
            return _Value(local)
        axis, dim = shards[0]
        return _Value(local, dim, t.device_mesh, axis, int(t.shape[dim]))
    if isinstance(t, torch.Tensor):
        return _Value(t.detach().clone())
    return _Value(None, note=f"{type(t).__name__} not compared")


def _first_tensor(value: Any) -> Any:
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return value


class _Tap(torch.autograd.Function):
    """Identity that hands the gradient flowing into one module's input to `sink`.

    Forward: x -> x (a new autograd node, so the gradient is this module's alone, not the sum
    over every user of x). Backward: g -> g, recorded. A DTensor goes through its local
    tensor: DTensor's own view would recompute per-rank strides under LocalTensorMode.
    Not `unwrap`: a DTensor stays a DTensor here (the module still receives one), and the
    backward records the gradient in whatever placement it arrives.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: Callable[[Any], None]  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.sink = sink
        if isinstance(x, DTensor):
            local = x.to_local()
            return DTensor.from_local(local.view_as(local), x.device_mesh, x.placements,
                                      run_check=False, shape=x.shape, stride=x.stride())
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.sink(grad)
        return grad, None


class _Recorder:
    """Hooks on every submodule: outputs and input gradients keyed `fqn` (`fqn#k` for the
    k-th call after the first), plus the stack of running modules (for errors)."""

    def __init__(self, model: nn.Module, sharded: bool) -> None:
        self.sharded = sharded
        self.outputs: dict[str, _Value] = {}
        self.grads: dict[str, _Value] = {}
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.handles: list[RemovableHandle] = []
        for fqn, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre(fqn)))
            self.handles.append(module.register_forward_hook(self._post(fqn)))

    def _key(self, fqn: str) -> str:
        n = self.calls.get(fqn, 0)
        self.calls[fqn] = n + 1
        return fqn if n == 0 else f"{fqn}#{n}"

    def _pre(self, fqn: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            key = self._key(fqn)
            self.stack.append(key)
            if not args or not isinstance(args[0], torch.Tensor) or not (
                    args[0].requires_grad and torch.is_grad_enabled()):
                return None
            if self.sharded and not isinstance(args[0], DTensor):
                return None  # inside a style: a local window, not a global tensor
            sink = self._sink(key)
            return (_Tap.apply(args[0], sink), *args[1:])
        return hook

    def _sink(self, key: str) -> Callable[[Any], None]:
        def sink(grad: Any) -> None:
            self.grads[key] = _record(grad)
        return sink

    def _post(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            key = self.stack.pop()
            out = _first_tensor(output)
            if self.sharded and not isinstance(out, DTensor):
                return
            self.outputs[key] = _record(out)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _full(value: _Value) -> torch.Tensor | None:
    """The global tensor of a sharded-side value (collectives: call on every rank)."""
    if value.tensor is None or value.shard_dim is None:
        return _one(value.tensor) if value.tensor is not None else None
    assert value.mesh is not None
    full = gather_along(value.tensor, value.shard_dim, (value.mesh, value.axis),
                        global_length=value.length)
    return _one(full)


def _one(t: torch.Tensor) -> torch.Tensor:
    """One plain copy of a value that every (simulated) rank holds alike."""
    values = list(per_rank(t).values())
    return values[0]


def _compare(fqn: str, kind: str, ref: torch.Tensor | None, got: torch.Tensor | None,
             atol: float, rtol: float, note: str = "") -> Difference:
    if got is None or ref is None:
        return Difference(fqn, kind, math.inf, math.inf, False, note or "missing")
    if got.shape != ref.shape:
        return Difference(fqn, kind, math.inf, math.inf, False,
                          f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    with single_device():
        ref64, got64 = ref.double(), got.double()
        scale = float(ref64.abs().max()) if ref.numel() else 0.0
        err = float((got64 - ref64).abs().max()) if ref.numel() else 0.0
    if math.isnan(err):
        err = math.inf
    return Difference(fqn, kind, err, err / scale if scale else err,
                      err <= atol + rtol * scale, scale=scale)


@contextmanager
def _removing(recorder: _Recorder) -> Iterator[_Recorder]:
    try:
        yield recorder
    finally:
        recorder.remove()


def _reference(model: nn.Module, full: torch.Tensor, run: Callable[[nn.Module, Any], Any],
               seed: int) -> tuple[_Recorder, torch.Tensor, torch.Tensor, dict[str, Any]]:
    with single_device():
        twin = copy.deepcopy(model)
        x = full.detach().clone().requires_grad_()
        with _removing(_Recorder(twin, sharded=False)) as rec:
            y = run(twin, x)
            if not isinstance(y, torch.Tensor):
                raise HaloError(f"verify_plan needs one tensor out of the model, got "
                                f"{type(y).__name__}; pass run= to pick it")
            cotangent = seeded_randn(y.shape, seed, y.dtype, y.device)
            (y * cotangent).sum().backward()
        grads = {n: p.grad for n, p in twin.named_parameters()}
    assert x.grad is not None
    return rec, cotangent, x.grad, grads


def _sharded_input(full: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int) -> tuple[
        DTensor, torch.Tensor]:
    world = mesh.size(axis)
    local = rank_map(mesh, lambda r: shard(full, dim, world, r).clone(), mesh_axis=axis)
    local.requires_grad_()
    placements = [Shard(dim) if a == axis else Replicate() for a in range(mesh.ndim)]
    x = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                           stride=full.stride())
    return x, local


def _apply_plan(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]
                ) -> tuple[str, str] | None:
    """Apply the plan entry by entry; the failing entry's fqn and error, or None."""
    for fqn, style in plan.items():
        try:
            parallelize_module(model, mesh, {fqn: style})
        except Exception as exc:
            return fqn, (f"plan entry {fqn!r} ({style!r}) could not be applied: "
                         f"{type(exc).__name__}: {exc}")
    return None


def verify_plan(
    model: nn.Module,
    plan: dict[str, ParallelStyle],
    example_input: torch.Tensor,
    mesh: DeviceMesh,
    *,
    mesh_axis: int | str = 0,
    dim: int = 2,
    run: Callable[[nn.Module, Any], Any] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
) -> PlanReport:
    """Check a `parallelize_module` plan module by module against one device.

    Deep-copies `model` twice: one copy runs on one device, the other is parallelized with
    `plan` on the `mesh_axis` sub-mesh and runs on `example_input` sharded along `dim`. Both run
    forward and backward with the same random cotangent (drawn with `seed`). Every module's
    output (forward order) and input gradient (the gradient flowing into that module alone)
    are compared where the sharded side holds a DTensor; parameter gradients, per-rank partial
    sums on the sharded side, are summed over the cp ranks first. `model` itself is not
    changed. Call it on every rank (it issues collectives), or under `simulated_mesh`.

    A value passes when `max|got - ref| <= atol + rtol * max|ref|`.

    Args:
        model: the module, unparallelized.
        plan: the `parallelize_module` plan (globs allowed), applied entry by entry so that
            a failing entry is named.
        example_input: the full input on one device.
        mesh: a 1-D cp mesh, or a larger mesh with `mesh_axis` naming the cp axis.
        mesh_axis: the cp axis of `mesh`.
        dim: the sharded dim of `example_input`.
        run: `run(model, x) -> tensor`, how to call the model (default `model(x)`).
        atol, rtol: the tolerance (see above).
        seed: seeds the cotangent.

    Returns:
        A `PlanReport`: `ok`, `first` (the first module that differs), every comparison.

    Raises:
        HaloError: when the single-device run does not return one tensor.

    Example::
        >>> class Step(nn.Module):  # frame t less frame t - 1 (the first repeated)
        ...     def forward(self, x):
        ...         p = F.pad(x, (0, 0, 0, 0, 1, 0), mode="replicate")
        ...         return p[:, :, 1:] - p[:, :, :-1]
        >>> model, x = nn.Sequential(CausalConv3d(2), Step()), torch.randn(1, 2, 9, 4, 4)
        >>> with simulated_mesh(3) as mesh:  # the step run per shard: wrong from there
        ...     wrong = verify_plan(model, {"0": CausalConvParallel(), "1": LocalParallel()},
        ...                         x, mesh)
        ...     halo = HaloParallel(HaloShard(2, left=1, right=0, pad="replicate"))
        ...     right = verify_plan(model, {"0": CausalConvParallel(), "1": halo}, x, mesh)
        >>> wrong.ok, wrong.first.fqn, right.ok
        (False, '1', True)
    """
    run = run or (lambda m, x: m(x))
    axis = _comm._mesh_axis(mesh, mesh_axis)
    ref, cotangent, ref_gx, ref_grads = _reference(model, example_input, run, seed)
    with single_device():
        twin = copy.deepcopy(model)
    rec = _Recorder(twin, sharded=True)
    if mesh.ndim > 1 and not mesh.mesh_dim_names:
        raise HaloError(f"verify_plan needs mesh_dim_names on a {mesh.ndim}-D mesh to take "
                        f"its cp axis {mesh_axis!r}")
    cp = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[axis]]
    x, local = _sharded_input(example_input, mesh, axis, dim)
    failed = _apply_plan(twin, cp, plan)
    if failed is not None:
        rec.remove()
        return PlanReport((), (), (), atol, rtol, failed[1], failed[0])
    try:
        y = run(twin, x)
        if not isinstance(y, DTensor):
            raise HaloError(f"the parallelized model returned {type(y).__name__}, expected "
                            f"a DTensor sharded along dim {dim}")
        out = _record(y)
        g_local = cotangent if out.shard_dim is None else rank_map(
            mesh, lambda r: shard(cotangent, out.shard_dim, mesh.size(axis), r),
            mesh_axis=axis)
        (unwrap(y) * g_local).sum().backward()
    except Exception as exc:
        at = rec.stack[-1] if rec.stack else None
        rec.remove()
        return PlanReport((), (), (), atol, rtol, _error_text(exc, twin, at), at)
    rec.remove()
    return _report(ref, rec, (ref_gx, local, dim, axis, mesh, example_input.shape[dim]),
                   ref_grads, twin, cp, atol, rtol)


def _error_text(exc: Exception, twin: nn.Module, at: str | None) -> str:
    """What the sharded run raised; DTensor's mixed-tensor error names the module that ran
    it and its missing plan entry (`at` is a recorder key: `fqn#k` for a later call)."""
    if isinstance(exc, MissingEntryError):  # named already, as in a plain run
        return str(exc)
    if not (isinstance(exc, RuntimeError) and MIXED in str(exc)) or at is None:
        return f"{type(exc).__name__}: {exc}"
    fqn = at.split("#")[0]
    return missing_entry(fqn, twin.get_submodule(fqn), str(exc))


def _report(ref: _Recorder, rec: _Recorder, inp: tuple[Any, ...], ref_grads: dict[str, Any],
            twin: nn.Module, cp: DeviceMesh, atol: float, rtol: float) -> PlanReport:
    tol = (atol, rtol)
    outputs = [_compare(k, "output", ref.outputs[k].tensor, _full(rec.outputs[k]), *tol,
                        rec.outputs[k].note) for k in ref.outputs if k in rec.outputs]
    grads = [_compare(k, "input grad", ref.grads[k].tensor, _full(rec.grads[k]), *tol,
                      rec.grads[k].note) for k in ref.grads if k in rec.grads]
    ref_gx, local, dim, axis, mesh, length = inp
    got_gx = _full(_Value(local.grad, dim, mesh, axis, length)) if local.grad is not None \
        else None
    grads.append(_compare(_INPUT, "input grad", ref_gx, got_gx, *tol))
    group = _comm.resolve_group(cp)
    params = []
    for name, p in twin.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        total = _one(_comm.all_reduce_sum(g.detach().clone(), group))
        expected = ref_grads[name] if ref_grads[name] is not None else torch.zeros_like(total)
        params.append(_compare(name, "param grad", expected, total, *tol))
    skipped = tuple(k for k in ref.outputs if k not in rec.outputs)
    return PlanReport(tuple(outputs), tuple(grads), tuple(params), atol, rtol,
                      skipped=skipped)
