"""What haloshard's own code does differently while torch.compile traces it.

Dynamo traces through haloshard's pure planners and its argument checks. Two things need care:
- a `functools.lru_cache` wrapper makes dynamo warn, on every rank and per wrapper, that it
  ignores the cache; `planner_cache` caches in eager mode and hands dynamo the plain function
  (what dynamo traces anyway: its result becomes a constant of the graph).
- a `HaloError` raised in traced code reaches the user as dynamo's own `Unsupported:
  Observed exception` under `fullgraph=True`; `surfaces_errors` re-raises it, at trace time,
  as a `HaloError` that dynamo lets through.
- an agreement between ranks cannot run inside a graph without sending metadata on every
  call; `runs_while_tracing` runs it once, for real, while dynamo traces (every rank traces
  the same calls in the same order), and the graph keeps its result as a constant
  (`haloshard._agree.agree_while_tracing`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from haloshard._errors import HaloError

_P = ParamSpec("_P")
_R = TypeVar("_R")


def planner_cache(maxsize: int) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """`functools.lru_cache(maxsize)` in eager mode; under torch.compile the uncached function.

    Only for pure functions of hashable arguments (plans, index tensors built from ints):
    tracing them fresh gives what the cache holds.

    Example::
        >>> @planner_cache(64)
        ... def taps(kernel: int) -> tuple[int, ...]: ...
    """

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return cached(*args, **kwargs)

        return call

    return decorate


class _TracedHaloError(HaloError, IndexError):
    """A `HaloError` found while dynamo traces, raised by code dynamo runs for real.

    Dynamo rewraps an exception from such code (`InternalTorchDynamoError`) unless it is one
    of the kinds torch's own checks raise, `IndexError` among them (an out-of-range dim),
    which it re-raises unchanged; so the user catches `HaloError` with its own text (dynamo
    appends the user code's location).
    """


@torch.compiler.assume_constant_result
def _raise_traced(message: str) -> None:
    # Dynamo calls an `assume_constant_result` function for real (its arguments are trace
    # constants) instead of tracing it: the raise is not dynamo's "observed" exception.
    raise _TracedHaloError(message)


def runs_while_tracing(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a function that dynamo must call for real while it traces (its arguments
    are trace constants; its result becomes a constant of the graph), e.g. an agreement
    between ranks that every rank runs once per trace instead of once per call. A
    `HaloError` it raises reaches the caller as `HaloError`.

    Example::
        >>> @runs_while_tracing
        ... def agree(group_name: str, row: tuple[int, ...]) -> tuple[tuple[int, ...], ...]: ...
    """

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except HaloError as error:
            raise _TracedHaloError(str(error)) from error

    return torch.compiler.assume_constant_result(call)  # type: ignore[no-any-return]


def surfaces_errors(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a haloshard entry point: a `HaloError` it raises while torch.compile traces
    reaches the caller as `HaloError` (fullgraph or not), with the same message.

    Example::
        >>> @surfaces_errors
        ... def halo_exchange(x: torch.Tensor, *, left: int) -> torch.Tensor: ...
    """

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except HaloError as error:
            _raise_traced(str(error))
            raise  # not reached: `_raise_traced` always raises

    return call
