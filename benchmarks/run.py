"""`python -m benchmarks.run`: every benchmark, one after the other, in one run.

1. the exchange alone per transport over a local `F.pad`, and bytes sent over halo bytes
   (`benchmarks.exchange`);
2. one halo conv3d step over the same conv without communication, the naive all-gather for
   contrast, and compiled over eager (`benchmarks.step --compile`).
"""

from __future__ import annotations

import argparse

from benchmarks import exchange, step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=3, help="step iterations (exchange: 20)")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    exchange.main(["--iters", "20"])
    print()
    step.main(["--iters", str(args.iters), *([] if args.no_compile else ["--compile"])])


if __name__ == "__main__":
    main()
