"""Simulated ranks (`LocalTensorMode`) in one place: per-rank functions with named results.

Under `LocalTensorMode` one process plays every rank, and a function of the rank (an index
plan, a window) must run once per rank with its results combined into per-rank values.
torch's `maybe_run_for_local_tensor` does that for plain values and flat tuples only;
`per_rank(cls)` lets such a function return a dataclass, whose fields are combined by name
and the dataclass rebuilt, so callers read `fill.recv_pos`, not the third item of a tuple.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from haloshard._compat import enabled_local_tensor_mode, maybe_run_for_local_tensor

_R = TypeVar("_R")


def per_rank(cls: type[_R]) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """Decorate a function of one rank returning a `cls` dataclass of leaf values (ints or
    tensors): outside simulation it runs as is; under `LocalTensorMode` once per rank, each
    field combined over the ranks.

    Example::
        @per_rank(Window)
        def window(rank: int, plan: WindowPlan) -> Window: ...
    """
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]

    def decorate(fn: Callable[..., _R]) -> Callable[..., _R]:
        @maybe_run_for_local_tensor
        def flat(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            out = fn(*args, **kwargs)
            return tuple(getattr(out, name) for name in names)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> _R:
            if enabled_local_tensor_mode() is None:
                return fn(*args, **kwargs)
            return cls(*flat(*args, **kwargs))

        return run

    return decorate
