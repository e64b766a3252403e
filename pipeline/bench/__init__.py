"""Benchmarks, one module each, run as `python -m pipeline.bench.<name>`; each prints one JSON object.
Tests assert behaviour; these measure."""
