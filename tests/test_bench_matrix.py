"""`python -m benchmarks.matrix` runs end to end on its tiny row (so it never rots, on every
supported torch: its collective counter follows c10d's names), and prints the columns its
docstring names, `fixed ms`, `wrap ms`, `layer ms` and `layer cpu` included; each rank on its
own cores unless `--no-pin`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import matrix  # noqa: E402


def test_matrix_tiny_row(capsys: pytest.CaptureFixture[str]) -> None:
    matrix.main(["--only", "C8 T64", "--iters", "2", "--ranks", "2"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("shape"))
    assert header.split()[-8:] == ["fixed", "ms", "wrap", "ms", "layer", "ms", "layer", "cpu"]
    row = next(line for line in out.splitlines() if line.startswith("conv1d C8 T64"))
    cols = row.split()
    # the halo layer sends only halo bytes (plus its flag row's share on a tiny layer) and
    # no metadata collective in steady state
    assert float(cols[-11]) < 1.1 and cols[-10] == "0", row


def _cores(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("ranks' cores: "))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning two ranks needs os.sched_setaffinity and two cores")
def test_matrix_pins_each_rank_to_its_own_cores(capsys: pytest.CaptureFixture[str]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    matrix.main(["--only", "C8 T64", "--iters", "1", "--ranks", "2"])
    assert _cores(capsys.readouterr().out) == (
        f"ranks' cores: rank 0: {cpus[:half]}, rank 1: {cpus[half:2 * half]}")
    matrix.main(["--only", "C8 T64", "--iters", "1", "--ranks", "2", "--no-pin"])
    assert _cores(capsys.readouterr().out) == "ranks' cores: any (not pinned)"
