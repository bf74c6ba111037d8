"""Shared fixtures: gloo worlds started once per session and reused by every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from haloshard.testing import GlooWorld


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
