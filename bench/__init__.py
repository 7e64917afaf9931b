"""Benchmarks: each file runs on its own (`python bench/NAME.py`); see bench/README.md."""
