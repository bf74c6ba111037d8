"""Every notebook in notebooks/ runs top to bottom in a fresh kernel of this interpreter.

The kernel is ipykernel started from a kernelspec written for `sys.executable`, so the
notebooks import the haloshard under test, never another environment's. Each notebook ends
with an assert against the single-device reference, so "runs without error" is a numeric check.
Run `python tests/test_notebooks.py` to re-execute the notebooks and save their outputs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "haloshard-test"
# The bound per notebook on 2 CPU cores. Checked as the kernel's CPU time (user + sys), which
# bounds the wall time on 2 free cores and, unlike wall time, does not grow when other jobs
# share the machine; wall time only gets a hang guard per cell. They take ~10 s of CPU.
BUDGET_S = 60.0
CELL_TIMEOUT_S = 300
PROBE = ("import resource, sys\n"
         "usage = resource.getrusage(resource.RUSAGE_SELF)\n"
         "print(sys.prefix)\n"
         "print(usage.ru_utime + usage.ru_stime)")


def _paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def _kernel_env(root: Path) -> None:
    """Write a kernelspec for this interpreter under `root`; JUPYTER_PATH must point there."""
    write_kernel_spec(root / "kernels" / KERNEL, overrides={"display_name": KERNEL})


def _execute(nb: nbformat.NotebookNode) -> float:
    start = time.perf_counter()
    NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("jupyter")
    _kernel_env(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        yield KERNEL


def test_notebooks_exist() -> None:
    assert len(_paths()) >= 2, f"expected notebooks in {NOTEBOOKS}"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_notebook_runs(kernel: str, path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    elapsed = _execute(nb)  # raises CellExecutionError on any error
    prefix, cpu = "".join(o.get("text", "") for o in nb.cells[-1].outputs).split()
    assert Path(prefix).resolve() == Path(sys.prefix).resolve(), (
        f"the kernel ran {prefix}, not this interpreter's environment {sys.prefix}")
    assert float(cpu) < BUDGET_S, (
        f"{path.name} used {float(cpu):.1f}s of CPU ({elapsed:.1f}s wall); the budget is "
        f"{BUDGET_S}s")


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_notebook_committed_with_outputs(path: Path) -> None:
    """Committed notebooks read well on a code host: every code cell was executed, in order."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: execution counts {counts}; re-run `python tests/test_notebooks.py`")
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was saved with an error output: {errors[0]}"


def main() -> None:
    """Execute every notebook (or the ones named) in place, saving outputs."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        _kernel_env(Path(root))
        os.environ["JUPYTER_PATH"] = root
        for path in [Path(p) for p in sys.argv[1:]] or _paths():
            nb = nbformat.read(path, as_version=4)
            elapsed = _execute(nb)
            nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)",
                                         "language": "python", "name": "python3"}
            nbformat.write(nb, path)
            print(f"{path.name}: {elapsed:.1f}s")


if __name__ == "__main__":
    main()
