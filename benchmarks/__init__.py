"""Benchmarks: ratios measured side by side in one run on gloo CPU ranks."""
