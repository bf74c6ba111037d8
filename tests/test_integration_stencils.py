"""The window arithmetic of the diffusers integration's stencils, as frame ids.

Each stencil describes a module along T; the module is simulated on lists of frame ids
(what each output frame reads), run once on the whole clip and once on every window the
stencil gives for a range of outputs: the window's outputs, cut at the stencil's offset,
must read exactly the frames the whole clip's do. Beyond the global end a window holds
copies of the last frame (the stencils' `pad`), as the halo exchange fills it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from haloshard._specs import plan_windows
from haloshard.integrations.diffusers import (
    ConvDepthToSpaceStencil,
    RepeatStencil,
    UpCausalStencil,
)


def up_causal(factor: int, span: int) -> Callable[[list[int]], list[Any]]:
    """Keep the first frame, repeat the others, then a causal conv with replicate padding."""
    def module(frames: list[int]) -> list[Any]:
        up = frames[:1] + [f for f in frames[1:] for _ in range(factor)]
        padded = [up[0]] * (span - 1) + up
        return [tuple(padded[i : i + span]) for i in range(len(up))]
    return module


def conv_d2s(factor: int, before: int, after: int) -> Callable[[list[int]], list[Any]]:
    """A conv reading `before` and `after` frames (replicate padding), depth-to-space by
    `factor`, the first `factor - 1` frames dropped (LTX's upsampler)."""
    def module(frames: list[int]) -> list[Any]:
        padded = [frames[0]] * before + frames + [frames[-1]] * after
        conv = [tuple(padded[j : j + before + after + 1]) for j in range(len(frames))]
        return [(c, s) for c in conv for s in range(factor)][factor - 1 :]
    return module


def repeat(factor: int) -> Callable[[list[int]], list[Any]]:
    def module(frames: list[int]) -> list[Any]:
        return [(f, s) for f in frames for s in range(factor)]
    return module


CASES = [
    *((UpCausalStencil(f, k), up_causal(f, k)) for f in (1, 2, 3) for k in (1, 2, 3)),
    *((ConvDepthToSpaceStencil(f, b, a), conv_d2s(f, b, a))
      for f in (1, 2, 3) for b, a in ((1, 1), (2, 0), (0, 0))),
    *((RepeatStencil(f), repeat(f)) for f in (1, 2, 3)),
]


def _case_id(value: Any) -> str:
    """The stencil's repr, the module's factory name: no object address in a test id, so
    every xdist worker collects the same ids."""
    return value.__qualname__.split(".")[0] if callable(value) else repr(value)


@pytest.mark.parametrize(("stencil", "module"), CASES, ids=_case_id)
def test_windows_reproduce_the_clip(stencil: Any, module: Callable[[list[int]], list[Any]]
                                    ) -> None:
    for length in range(1, 10):
        whole = module(list(range(length)))
        assert stencil.out_length(length) == len(whole)
        for start in range(len(whole)):
            for stop in range(start + 1, len(whole) + 1):
                i0, i1, offset = stencil.window(start, stop)
                assert 0 <= i0 < length and i1 > i0, (length, start, stop, i0, i1)
                frames = [min(i, length - 1) for i in range(i0, i1)]  # replicate beyond T
                local = module(frames)
                assert local[offset : offset + stop - start] == whole[start:stop], (
                    stencil, length, start, stop)
        for world in (2, 3, 4):
            plan_windows(stencil, length, world)
