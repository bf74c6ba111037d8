"""Benchmarks: ratios measured side by side in one run on gloo CPU ranks."""

import os

# glibc hands large buffers back to the kernel on every free and faults them in again on the
# next allocation. On a small VM those page faults (and the kernel time around them) come in
# bursts that stall a rank for tens of milliseconds and swamp the millisecond ratios being
# measured. The gloo ranks inherit these settings: freed memory stays in the process, as a
# GPU caching allocator would keep it. They only make timings steadier; every contender runs
# under the same allocator.
# (32 MiB is the largest mmap threshold glibc accepts; larger values are ignored.)
STEADY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 25), "MALLOC_TRIM_THRESHOLD_": str(1 << 33)}


def steady_allocator() -> None:
    """Keep freed memory in the benchmark's worker processes (set before they start)."""
    for key, value in STEADY_ALLOCATOR.items():
        os.environ.setdefault(key, value)
