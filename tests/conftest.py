"""Shared fixtures: gloo worlds started once per session and reused by every test."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings

from haloshard.testing import GlooWorld

# CI draws the same examples every run (a red CI is then reproducible); a developer's run
# explores new ones each time.
settings.register_profile("ci", derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


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
