"""Benchmark scripts built on `zoo_core.bench` (run them from the repo root; see README.md)."""
