"""Type checking: a user's frozen-dataclass stencil satisfies `haloshard.Stencil` under mypy,
and the public API modules stay mypy-clean (pyproject's `[tool.mypy]`, also run by CI)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (the test extra has it)")


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    # From the repository root: pyproject's [tool.mypy] applies, and the cache CI's own mypy
    # run left in .mypy_cache makes this a few seconds instead of a fresh look at torch.
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


@needs_mypy
def test_type_check() -> None:
    """One `mypy` run with pyproject's settings (CI runs the same first, so its cache makes
    this quick): the public API modules have no type errors, and tests/typed_stencil.py's
    user stencils (fields or a property for `pad`, `fill`, `min_input`) and the library's
    own are accepted by `HaloParallel` and `annotate`. Its one deliberate error must still
    be one: that module warns about unused ignores (pyproject's override). With a protocol
    of settable attributes every frozen dataclass was rejected."""
    done = _mypy()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
