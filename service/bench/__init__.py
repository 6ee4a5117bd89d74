"""Benchmarks: a seeded workload, Slipstream and its peers on it, and a report."""
