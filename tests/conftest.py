"""Shared fixtures (gloo worlds started once per session, reused by every test) and the
`requires_torch` marker."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import settings

from haloshard._compat import torch_before
from haloshard.testing import GlooWorld

# CI draws the same examples every run (a red CI is then reproducible); a developer's run
# explores new ones each time.
settings.register_profile("ci", derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# torch's first sin/cos of a process sometimes rounds differently from every later call (seen
# with 2 threads: the first float64 call over Mochi's FourierFeatures 6.8e-09 apart in about
# one process of three, float32 1.5e-4; never after a first call): a one-device reference
# computed by that first call then differs from the sharded run, which is not haloshard's.
# The process makes that first call here, before any reference.
for _dtype in (torch.float32, torch.float64):
    torch.sin(torch.arange(4096, dtype=_dtype)).cos_()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "requires_torch(version, reason): skip on a torch release older than "
        "version, for a limit of torch's own that the reason names")
    # pytest-xdist's own marker, registered here too for a run without xdist (another
    # torch's venv, `-p no:xdist`), where the gloo tests still get it (below)
    config.addinivalue_line("markers", "xdist_group(name): tests xdist runs on one worker")


# An object's default repr in a test id (`<function f at 0x7f...>`) differs from one process to
# the next: xdist's workers then collect different ids and the run stops at collection.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that runs gloo processes in one xdist group (`--dist loadgroup`): they
    run one after another on one worker, sharing its session's worlds (started once, as
    without xdist), while the single-process tests share out over the workers.

    A test id holding a memory address stops a run without xdist at collection, naming
    the tests. Under xdist such ids break collection only in the runs where the workers'
    addresses differ (xdist's own message then shows the ids); without xdist, every run
    finds them.
    """
    addressed = [item.nodeid for item in items if _ADDRESS.search(item.nodeid)]
    if addressed and "PYTEST_XDIST_WORKER" not in os.environ:
        raise pytest.UsageError(
            f"test ids hold memory addresses, which differ between xdist's workers: "
            f"{addressed[:3]}; give these parameters ids (pytest.param(..., id=...))")
    for item in items:
        if item.get_closest_marker("gloo") or "gloo" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("gloo"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.requires_torch("2.13", reason=...)`: torch's limit, not haloshard's."""
    for mark in item.iter_markers("requires_torch"):
        version, reason = mark.args[0], mark.kwargs["reason"]
        if torch_before(version):
            pytest.skip(f"needs torch>={version}: {reason}")


@pytest.fixture(scope="session")
def gloo() -> Iterator[Callable[[int], GlooWorld]]:
    """`gloo(n)`: a world of n gloo processes, started on first use, restarted if torn down."""
    worlds: dict[int, GlooWorld] = {}

    def get(n: int) -> GlooWorld:
        if n not in worlds or not worlds[n].alive:
            worlds[n] = GlooWorld(n)
        return worlds[n]

    yield get
    for world in worlds.values():
        if world.alive:
            world.close()
