"""Measurement helpers shared by the benchmark script and the tests (memory, FLOPs)."""
