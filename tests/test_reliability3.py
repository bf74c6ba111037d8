"""Issue #26, third pass: what the second pass left open.

- a mistake one rank finds in its own arguments before an agreement (`frame_attention`'s q, k,
  v shapes, `group_norm`'s eps, dim or segments, `varlen_conv`'s documents under its pad
  mode) joins the agreement and raises on every rank at once, not on that rank alone;
- under torch.compile, `attention`, `group_norm`, `varlen_conv` and `frame_attention` raise
  `HaloError` (dynamo's `Unsupported: Observed exception` before);
- under torch.compile, a `global_length` wrong on one rank (`halo_exchange`, `attention`)
  raises on every rank: the ranks agree once, while dynamo traces (the others waited for
  the timeout before);
- `set_timeout` with a timeout that differs between ranks raises on every rank, naming each
  rank's value (silently accepted before); the longest timeout it accepts still lets gloo
  run collectives;
- a module a hand-written plan leaves out is named by fqn with its missing entry in a plain
  run (DTensor's "got mixed torch.Tensor and DTensor" before), with no module hook;
- (a rank that runs an extra forward before `reduce_grads` now raises at once on every
  rank: tests/test_reliability4.py.)
Every case records what each rank raised and how long it took, on real gloo processes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    HaloError,
    HaloParallel,
    attention,
    frame_attention,
    group_norm,
    halo_exchange,
    set_timeout,
    varlen_conv,
)
from haloshard._comm import _MAX_TIMEOUT
from haloshard.testing import GlooWorld, reference_halo, shard, simulated_mesh, worker_mesh

# A mistake every rank sees raises at once: well under a second of work, 5 s with margin for
# a loaded 2-core machine. The process group's timeout here is 60 s, so a wait would show.
AT_ONCE_S = 5.0


def _outcome(fn: Callable[[], object]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        fn()
    except HaloError as exc:
        return f"HaloError: {exc}", time.perf_counter() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


# ---------------------------------------------------------------- checks inside agreements
def _frames(rank: int) -> torch.Tensor:
    """This rank's chunk of 5 frames of 3 tokens (2 ranks: 3 and 2 frames)."""
    full = torch.randn(1, 2, 5, 3, 4, generator=torch.Generator().manual_seed(0))
    return shard(full, 2, 2, rank)


def _frame_attention_case(mesh: DeviceMesh, rank: int, case: str) -> None:
    q = k = v = _frames(rank)
    length: object = 5
    if case == "frame_attention_q_shape" and rank == 1:
        q = q[..., :2]  # E = 2, k and v keep 4
    elif case == "frame_attention_not_3d" and rank == 1:
        q = k = v = q.flatten(0, -2)[0]
    elif case == "frame_attention_no_length" and rank == 1:
        length = None
    frame_attention(q, k, v, mesh, global_length=length)  # type: ignore[arg-type]


def _frame_attention_agreed(mesh: DeviceMesh, rank: int, case: str) -> None:
    """A call site agreed before (a style's store): the second call's mistake on rank 1
    rides in the K/V all-gather's status rows (training) or broadcasts (inference)."""
    store: dict[object, object] = {}
    q = k = v = _frames(rank).requires_grad_(case == "frame_attention_agreed_training")
    frame_attention(q, k, v, mesh, global_length=5, _reuse=(store, "site"))
    assert store, "the first call cached its agreement"
    if rank == 1:
        q = q[..., :2]
    frame_attention(q, k, v, mesh, global_length=5, _reuse=(store, "site"))


def _group_norm_case(mesh: DeviceMesh, rank: int, case: str) -> None:
    x = torch.ones(2, 4, 3 - rank, 2)  # T = 5 split (3, 2)
    eps: object = 1e-5
    dim, segments = 2, None
    if case == "group_norm_eps" and rank == 1:
        eps = "1e-5"
    elif case == "group_norm_dim" and rank == 1:
        dim = 7
    elif case == "group_norm_segments" and rank == 1:
        segments = ["three", 2]
    group_norm(x, 2, None, None, eps, mesh, dim=dim, segments=segments,  # type: ignore[arg-type]
               global_length=5)


def _varlen_case(mesh: DeviceMesh, rank: int, case: str) -> None:
    x = torch.ones(1, 2, 4)  # T = 8 split (4, 4); documents of 1 and 7
    pad = "reflect" if rank == 1 else "zeros"  # reflect cannot pad a 1-slice document
    varlen_conv(x, torch.ones(2, 2, 3), dim=2, cu_seqlens=[0, 1, 8], group=mesh, padding=1,
                pad=pad)


AGREED: dict[str, tuple[Callable[[DeviceMesh, int, str], None], str]] = {
    "frame_attention_q_shape": (
        _frame_attention_case, r"q, k, v of one shape .*\(1, 2, 2, 3, 2\)|rank\(s\) \[1\] "),
    "frame_attention_not_3d": (_frame_attention_case, r"q, k, v of one shape|rank\(s\) \[1\] "),
    "frame_attention_no_length": (
        _frame_attention_case, r"needs global_length=|rank\(s\) \[1\] "),
    "frame_attention_agreed_training": (
        _frame_attention_agreed, r"q, k, v of one shape|rank\(s\) \[1\] "),
    "frame_attention_agreed_inference": (
        _frame_attention_agreed, r"q, k, v of one shape|rank\(s\) \[1\] "),
    "group_norm_eps": (_group_norm_case, r"eps must be a real number|rank\(s\) \[1\] "),
    "group_norm_dim": (_group_norm_case, r"needs 2 <= dim < 4, got 7|rank\(s\) \[1\] "),
    "group_norm_segments": (_group_norm_case, r"segments must be non-negative|rank\(s\) \[1\] "),
    "varlen_conv_document_pad": (
        _varlen_case, r"document 0 \(slices 0:1\): pad='reflect'|rank\(s\) \[1\] "),
}


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    """Two gloo ranks for this module; a 10 s process-group timeout, so that a rank left
    waiting (the failure these tests guard against) shows as a slow case, not a stall."""
    with GlooWorld(2, pg_timeout=10, timeout=180) as w:
        yield w


def agreed_case(name: str) -> tuple[tuple[str, float], str]:
    """The case on this rank (what it raised, seconds), then whether a good call works."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    got = _outcome(lambda: AGREED[name][0](mesh, rank, name))
    q = _frames(rank)
    return got, _outcome(lambda: frame_attention(q, q, q, mesh, global_length=5))[0]


@pytest.mark.gloo
@pytest.mark.parametrize("name", sorted(AGREED))
def test_own_mistakes_raise_inside_the_agreement(world: GlooWorld, name: str) -> None:
    results = world.run(agreed_case, name)
    texts = [text for (text, _), _ in results]
    for rank, ((text, seconds), afterwards) in enumerate(results):
        assert text.startswith("HaloError: "), (rank, texts)
        assert re.search(AGREED[name][1], text), (rank, texts)
        assert seconds < AT_ONCE_S, (rank, seconds, texts)
        assert afterwards == "ok", (rank, afterwards)


# ---------------------------------------------------------------- torch.compile
def _compiled(fn: Callable[..., torch.Tensor], fullgraph: bool = True) -> Callable[..., object]:
    """`fn` compiled afresh (dynamo forgets earlier graphs, so every rank traces again)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")


def _exchange_length(rank: int, case: str) -> int:
    """T = 8 split (4, 4); rank 1 states another global length."""
    if rank == 1 and case == "length_wrong_on_one_rank":
        return 10  # splits (5, 5): rank 1's own chunk of 4 does not fit
    if rank == 1 and case == "length_differs_on_one_rank":
        return 9  # splits (5, 4): rank 1's chunk fits; only rank 0's row tells
    return 8


def compiled_exchange_case(case: str, what: str = "halo_exchange") -> tuple[str, float]:
    """A compiled exchange (or attention) whose global length one rank states wrongly: what
    each rank raised and how long it took (tracing included)."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    length = _exchange_length(rank, case)
    if what == "attention":
        fn = _compiled(lambda t: attention(t, t, t, mesh, global_length=length))
        return _outcome(lambda: fn(torch.ones(1, 2, 4, 3)))
    fn = _compiled(lambda t: halo_exchange(t, left=1, right=1, dim=2, group=mesh,
                                           global_length=length))
    return _outcome(lambda: fn(torch.ones(1, 2, 4)))


# Tracing takes seconds on a loaded 2-core machine; a rank left waiting would take the
# module's 10 s process-group timeout on top, and raise the timeout's error instead.
TRACED_AT_ONCE_S = 30.0


@pytest.mark.gloo
@pytest.mark.parametrize("what", ["halo_exchange", "attention"])
@pytest.mark.parametrize("case, message", [
    ("length_wrong_on_one_rank",
     r"rank 1 must hold 5 slices along dim 2, but its chunk has 4|rank\(s\) \[1\] of the "
     "group rejected their (halo_exchange|gather) arguments"),
    ("length_differs_on_one_rank", r"ranks disagree on global_length: \[8, 9\]"),
])
def test_compiled_global_length_raises_on_every_rank(world: GlooWorld, case: str,
                                                     message: str, what: str) -> None:
    results = world.run(compiled_exchange_case, case, what)
    for rank, (text, seconds) in enumerate(results):
        assert text.startswith("HaloError: ") and re.search(message, text), (rank, results)
        assert seconds < TRACED_AT_ONCE_S, (rank, results)


def compiled_exchange_lengths() -> list[str]:
    """One compiled exchange over T = 7, 8, 9, 11 (the later ones recompile with a dynamic
    chunk length): forward and input gradient exact against one device, every time."""
    rank, mesh = dist.get_rank(), worker_mesh(2)

    def step(x: torch.Tensor, length: int) -> torch.Tensor:
        return halo_exchange(x, left=2, right=1, dim=2, group=mesh, pad="replicate",
                             global_length=length)

    fn, bad = _compiled(step), []
    for length in (7, 8, 9, 11):
        full = torch.randn(1, 3, length, generator=torch.Generator().manual_seed(length),
                           dtype=torch.float64)
        x = shard(full, 2, 2, rank).clone().requires_grad_()
        y = fn(x, length)
        weights = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)
        (y * weights).sum().backward()
        ref = full.clone().requires_grad_()
        outs = [reference_halo(ref, 2, 1, 2, 2, r, "replicate") for r in range(2)]
        sum((o * torch.arange(o.numel(), dtype=o.dtype).reshape(o.shape)).sum()
            for o in outs).backward()
        # A data move and its adjoint: sums of the same integer weights, exact.
        if not torch.equal(y, outs[rank]) or not torch.equal(x.grad, shard(ref.grad, 2, 2,
                                                                            rank)):
            bad.append(f"T={length}")
    return bad


@pytest.mark.gloo
def test_compiled_exchange_stays_exact_across_lengths(world: GlooWorld) -> None:
    assert world.run(compiled_exchange_lengths) == [[], []]


def _attention_everywhere(mesh: DeviceMesh, rank: int) -> Callable[[torch.Tensor], object]:
    return lambda t: attention(t, t, t, mesh, global_length=12)  # (6, 6); chunks hold 4


def _group_norm_everywhere(mesh: DeviceMesh, rank: int) -> Callable[[torch.Tensor], object]:
    return lambda t: group_norm(t, 3, None, None, 1e-5, mesh)  # C = 2


def _varlen_everywhere(mesh: DeviceMesh, rank: int) -> Callable[[torch.Tensor], object]:
    return lambda t: varlen_conv(t, torch.ones(2, 2, 3), dim=2, cu_seqlens=[1, 8],
                                 group=mesh, padding=1)


def _frame_attention_everywhere(mesh: DeviceMesh, rank: int
                                ) -> Callable[[torch.Tensor], object]:
    return lambda t: frame_attention(t, t[..., :1], t, mesh, global_length=8)


COMPILED: dict[str, tuple[Callable[[DeviceMesh, int], Callable[[torch.Tensor], object]], str]] = {
    "attention": (_attention_everywhere, "global_length=12 splits as [6, 6]"),
    "group_norm": (_group_norm_everywhere, "group_norm needs C divisible by num_groups=3"),
    "varlen_conv": (_varlen_everywhere, "cu_seqlens must start at 0"),
    "frame_attention": (_frame_attention_everywhere,
                        "frame_attention expects q, k, v of one shape"),
}


def compiled_entry_point(name: str) -> list[str]:
    """What the caller catches from a compiled call whose arguments are wrong on every
    rank, with fullgraph=True and without."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    fn = COMPILED[name][0](mesh, rank)
    x = torch.ones(1, 2, 4, 3) if name != "varlen_conv" else torch.ones(1, 2, 4)
    return [_outcome(lambda g=fullgraph: _compiled(fn, g)(x))[0] for fullgraph in (True, False)]


@pytest.mark.gloo
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_entry_points_raise_halo_error(world: GlooWorld, name: str) -> None:
    for rank, got in enumerate(world.run(compiled_entry_point, name)):
        for fullgraph, text in zip((True, False), got, strict=True):
            assert text.startswith(f"HaloError: {COMPILED[name][1]}"), (rank, fullgraph, text)


# ---------------------------------------------------------------- set_timeout, agreed
def timeouts_disagree(case: str) -> tuple[str, float, list[float]]:
    """Rank 1 (of 2) or global rank 3 (of a 2 x 2 mesh) passes another timeout: what each
    rank raised, how long it took, and its groups' timeouts afterwards (unchanged)."""
    rank = dist.get_rank()
    if case == "mesh_2d":
        mesh = worker_mesh((2, 2), mesh_dim_names=("dp", "cp"))
        timeout: object = 40 if rank == 3 else 30
    else:
        mesh = worker_mesh(2)
        timeout = {"differs": 40, "nan": float("nan")}[case] if rank == 1 else 30
    groups = [mesh.get_group(axis) for axis in range(mesh.ndim)]
    text, seconds = _outcome(lambda: set_timeout(mesh, timeout))  # type: ignore[arg-type]
    after = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
             for g in groups]
    return text, seconds, after


@pytest.mark.gloo
@pytest.mark.parametrize("case, message", [
    ("differs", r"ranks disagree on the set_timeout timeout: \{0: 30.0, 1: 40.0\} "
                r"\(global rank: seconds\)"),
    ("nan", r"timeout must be a positive, finite number of seconds .* got nan|rank\(s\) \[1\] "
            "of the group rejected their set_timeout arguments"),
])
def test_set_timeout_agreed(world: GlooWorld, case: str, message: str) -> None:
    results = world.run(timeouts_disagree, case)
    for rank, (text, seconds, after) in enumerate(results):
        assert text.startswith("HaloError: ") and re.search(message, text), (rank, results)
        assert seconds < AT_ONCE_S, (rank, results)
        assert after == [10.0], (rank, after)  # the module world's, unchanged


@pytest.mark.gloo
def test_set_timeout_agreed_over_a_2d_mesh() -> None:
    """Every rank of a (dp, cp) mesh raises, also the ranks whose own axis groups agree."""
    with GlooWorld(4, pg_timeout=10, timeout=180) as four:
        results = four.run(timeouts_disagree, "mesh_2d")
    want = r"\{0: 30.0, 1: 30.0, 2: 30.0, 3: 40.0\} \(global rank: seconds\)"
    for rank, (text, seconds, after) in enumerate(results):
        assert text.startswith("HaloError: ") and re.search(want, text), (rank, results)
        assert seconds < AT_ONCE_S, (rank, results)
        # init_device_mesh gives a 2-D mesh's axis groups the 30-minute default
        assert after == [1800.0, 1800.0], (rank, after)


def longest_timeout() -> list[str]:
    """A collective still completes under the longest timeout set_timeout accepts (gloo's
    deadline, int64 nanoseconds of its clock, overflowed at the former bound of 10**6
    days, and every later collective timed out at once); the former bound is refused."""
    mesh = worker_mesh(2)
    beyond = _outcome(lambda: set_timeout(mesh, timedelta(days=10**6)))[0]
    set_timeout(mesh, _MAX_TIMEOUT)
    try:
        y = halo_exchange(torch.ones(1, 1, 2), left=1, right=1, dim=2, group=mesh)
    finally:
        set_timeout(mesh, 10)
    return [beyond.split(" (at most")[0], str(tuple(y.shape))]


@pytest.mark.gloo
def test_longest_timeout_still_runs_collectives(world: GlooWorld) -> None:
    for got in world.run(longest_timeout):
        assert got == ["HaloError: timeout must be a positive, finite number of seconds",
                       "(1, 1, 4)"], got


# ---------------------------------------------------------------- a module left out
def _three_convs() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1),
                         nn.Conv3d(2, 2, 3, padding=1))


def _run_without_middle_entry(mesh: DeviceMesh) -> None:
    """The middle conv left out of a hand-written plan."""
    model = _three_convs()
    parallelize_module(model, mesh, {"0": HaloParallel(), "2": HaloParallel()})
    full = torch.randn(1, 2, 5, 3, 3, generator=torch.Generator().manual_seed(1))
    x = distribute_tensor(full, mesh, [Shard(2)])
    model(x)


@pytest.mark.simulated
def test_module_left_out_is_named() -> None:
    """The conv a plan leaves out is named by fqn with its missing entry, in a plain run;
    still a RuntimeError for code that catches DTensor's own refusal."""
    with simulated_mesh(2) as mesh:
        with pytest.raises(HaloError, match=r"^1 \(Conv3d\) has no plan entry: .* Add an "
                           r"entry for '1' .* DTensor said: aten\.convolution\.default: got "
                           "mixed torch.Tensor and DTensor"):
            _run_without_middle_entry(mesh)
        with pytest.raises(RuntimeError, match=r"^1 \(Conv3d\) has no plan entry"):
            _run_without_middle_entry(mesh)
    assert not torch.nn.modules.module._global_forward_hooks  # no process-wide hook
    assert not torch.nn.modules.module._global_forward_pre_hooks


@pytest.mark.simulated
def test_module_left_out_of_an_unplanned_model_keeps_torch_error() -> None:
    """Only a model that carries haloshard styles gets the named error; a plain conv on a
    DTensor (no style anywhere in its model) keeps DTensor's own message."""
    with simulated_mesh(2) as mesh:
        _ = parallelize_module(_three_convs(), mesh, {"0": HaloParallel()})  # watching now
        x = distribute_tensor(torch.ones(1, 2, 4, 3, 3), mesh, [Shard(2)])
        with pytest.raises(RuntimeError, match=r"^aten\.convolution\.default: got mixed") as got:
            nn.Conv3d(2, 2, 3, padding=1)(x)
        assert not isinstance(got.value, HaloError)


def module_left_out() -> tuple[str, float]:
    return _outcome(lambda: _run_without_middle_entry(worker_mesh(2)))


@pytest.mark.gloo
def test_module_left_out_named_on_every_rank(world: GlooWorld) -> None:
    for rank, (text, seconds) in enumerate(world.run(module_left_out)):
        assert text.startswith("HaloError: 1 (Conv3d) has no plan entry"), (rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds)
