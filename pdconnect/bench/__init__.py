"""Benchmarks and real-engine test tooling: tiny local models, process launcher, measurements."""
