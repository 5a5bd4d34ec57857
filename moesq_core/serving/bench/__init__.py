"""Benchmarks: kernel-level sweeps against vendor baselines (kernel_bench, harness)."""
