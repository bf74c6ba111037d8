"""`python -m benchmarks.matrix` runs end to end on its tiny row (so it never rots, on every
supported torch: its collective counter follows c10d's names), and prints the columns its
docstring names, `fixed ms`, `wrap ms`, `layer ms` and `layer cpu` included."""

from __future__ import annotations

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
