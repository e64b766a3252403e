"""The builder's benchmark (`python -m preprocessing.bench.builder`) and the script it races
(datasets_baseline.py)."""
