"""The README's quickstart runs as written: `torchrun` on 2 gloo ranks, checked on one device.

`examples/quickstart.py` is the file the README shows; this runs the README's own command
line (with this interpreter's torchrun) and requires every rank to report its match. Each
rank runs the example through `tests/exit_after.py`, which leaves without interpreter
finalization: torch 2.13's gloo workers outlive `destroy_process_group` once DTensor has
cached the mesh, and can abort a rank at exit after its work is done (that file says why).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXIT_AFTER = str(Path(__file__).resolve().parent / "exit_after.py")


def _readme_command() -> list[str]:
    """The quickstart's torchrun line, exactly as the README gives it."""
    lines = re.findall(r"^torchrun .*examples/quickstart\.py$",
                       (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    assert len(lines) == 1, f"expected one torchrun line for the quickstart, found {lines}"
    return lines[0].split()


@pytest.mark.gloo
def test_quickstart_runs_as_written() -> None:
    command = _readme_command()
    assert "--standalone" in command, "a fixed rendezvous port would clash with other runs"
    world = int(command[command.index("--nproc-per-node") + 1])
    # torchrun as a module of this interpreter, so the ranks import the haloshard under test
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:-1],
                           EXIT_AFTER, command[-1]],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    matched = re.findall(r"^rank (\d+): frames \d+ of 17; output, input grad and 6 param grads "
                         r"match one device", done.stdout, flags=re.MULTILINE)
    assert sorted(int(r) for r in matched) == list(range(world)), out[-4000:]


@pytest.mark.gloo
def test_parallelize_example_checks_its_plan_then_runs() -> None:
    """`examples/parallelize.py`, which the README's "Parallelize your model" shows: its plan
    passes `verify_plan` on 4 simulated ranks (every module's output and input gradient, and
    the parameter gradients, against one device), then the plan runs on 2 gloo ranks."""
    script = "examples/parallelize.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False, env=env)
    assert done.returncode == 0 and done.stdout.startswith("plan ok"), (
        done.stdout + done.stderr)[-4000:]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", EXIT_AFTER, script], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False, env=env)
    ranks = re.findall(r"rank (\d+): output frames 5 of 10", done.stdout)
    assert done.returncode == 0 and sorted(ranks) == ["0", "1"], (
        done.stdout + done.stderr)[-4000:]


@pytest.mark.parametrize(("section", "script"), [("Quickstart", "examples/quickstart.py"),
                                                 ("Parallelize your model",
                                                  "examples/parallelize.py")])
def test_readme_shows_the_example_as_it_is(section: str, script: str) -> None:
    """Every code line the README shows for a section is a line of the file the tests run
    (comment-only lines aside), so the README cannot drift from code that runs."""
    readme = (ROOT / "README.md").read_text()
    body = readme.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = body.split("```python\n", 1)[1].split("```", 1)[0]
    source = {line.strip() for line in (ROOT / script).read_text().splitlines()}
    shown = [line.strip() for line in block.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    missing = [line for line in shown if line not in source]
    assert shown and not missing, f"README's {section} shows lines not in {script}: {missing}"



@pytest.mark.parametrize(("body", "status"), [("print('ran')", 0), ("raise SystemExit(3)", 3),
                                              ("raise ValueError('bad')", 1),
                                              ("raise SystemExit('stopped')", 1)])
def test_exit_after_keeps_the_scripts_status(tmp_path: Path, body: str, status: int) -> None:
    """`tests/exit_after.py` skips finalization only: the script's output and status (a
    failure's traceback and a failing status) come through."""
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nassert __name__ == '__main__'\n{body}\n")
    done = subprocess.run([sys.executable, EXIT_AFTER, str(script)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == status, done.stdout + done.stderr
    assert ("ValueError: bad" in done.stderr) == ("ValueError" in body)
    assert ("stopped" in done.stderr) == ("stopped" in body)
    assert ("ran" in done.stdout) == (status == 0)
