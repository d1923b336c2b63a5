"""Benchmarks. Each module is a command (`python -m bench.NAME`); results go to bench/results/."""
