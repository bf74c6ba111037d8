"""Activation memory per rank of the example causal VAE under context parallelism.

`python -m benchmarks.vae_memory` runs `examples/causal_vae.py`'s model (float64, one
forward + backward) on 1 device and on P = 2, 4 gloo ranks with T sharded (`--dims 2 3 2,3`: T,
then H, as serving stacks shard decode, `spatial_plan`, then both on a `(P/2, 2)` mesh,
`time_height_plan`), and prints per P the largest rank's
activation memory against the single-device run and the bytes it handed to collectives,
side by side with the largest difference to the single-device results (forward, input and
parameter gradients).

Method: activation memory is the bytes autograd saves for the backward during the forward,
counted with `torch.autograd.graph.saved_tensors_hooks`, each distinct storage once (views
share one). At the end of the forward all of them are alive at once: that is the peak of a
training step's activations (parameters, gradients and the transient buffers of one op are
not included; they are the same on every rank or small). It counts the same thing on both
sides, on CPU, without allocator noise. Targets: rank peak <= (1/P) * 1.15 of the single
device (strict reading of "1/P + 15%"), and <= 1/P + 0.15 (loose reading).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from haloshard.testing import GlooWorld


def _example() -> Any:
    path = Path(__file__).resolve().parents[1] / "examples" / "causal_vae.py"
    spec = importlib.util.spec_from_file_location("haloshard_example_causal_vae", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=129)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--ch", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dims", nargs="+", default=["2"],
                        help="sharded dims to compare: 2 (T), 3 (H), 4 (W), 2,3 (T and H "
                             "on a (P/2, 2) mesh)")
    args = parser.parse_args()
    vae = _example()
    print(f"causal VAE (ch={args.ch}), input (1, 3, {args.frames}, {args.size}, {args.size}) "
          "float64, forward + backward; saved activations and bytes sent per rank")
    print("| sharded | P | single MiB | max rank MiB | rank / single | 1/P | (1/P)*1.15 "
          "| 1/P+0.15 | max MiB sent | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for given in args.dims:
        dims = tuple(int(d) for d in given.split(","))
        for p in args.ranks:
            with GlooWorld(p, timeout=600) as world:
                rows = world.run(vae.on_rank, args.frames, args.size, 0, args.ch,
                                 dims[0] if len(dims) == 1 else dims)
            single, peak = rows[0]["single MiB"], max(r["saved MiB"] for r in rows)
            diff = max(r[k] for r in rows for k in ("forward", "input grad", "param grads"))
            ratio, sent = peak / single, max(r["sent MiB"] for r in rows)
            name = "+".join("THW"[d - 2] for d in dims)
            print(f"| {name} | {p} | {single:.2f} | {peak:.2f} | {ratio:.3f} | "
                  f"{1 / p:.3f} | "
                  f"{1.15 / p:.3f}{' ok' if ratio <= 1.15 / p else ' MISS'} | "
                  f"{1 / p + 0.15:.3f}{' ok' if ratio <= 1 / p + 0.15 else ' MISS'} | "
                  f"{sent:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
