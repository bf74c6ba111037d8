"""Run a script as `__main__`, then leave the process without interpreter finalization.

    torchrun --standalone --nproc-per-node 2 tests/exit_after.py examples/quickstart.py

What the tests need from a torchrun'd example is its output and its status; this runs the
example unchanged and exits with its status through `os._exit`, skipping the one step that
races on torch 2.13: interpreter finalization. DTensor's caches (the mesh's topology, the
redistribute planner) hold the device mesh and so its gloo process group past
`destroy_process_group`, so the group's worker threads live on; a worker that drops the last
reference to a collective's tensor (the final barrier's, measured from a core dump: the
`AsyncBarrierWork` destructor in `ProcessGroupGloo::runLoop`) after finalization began takes
the GIL, CPython 3.11 ends that thread with `pthread_exit`, and its forced unwind through a
`noexcept` destructor aborts the process ("terminate called without an active exception").
A loaded 2-core machine hit it in about 1 run in 5.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            status = stop.code or 0
        else:  # as the interpreter does: the message on stderr, status 1
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException:  # the example failed: its traceback, and a failing status
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
