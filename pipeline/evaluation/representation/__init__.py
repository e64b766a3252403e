"""Representation analysis (pipeline/analyze.py): similarity metrics (metrics), the token sequences
they run on (inputs), the run over models and checkpoints and its report (report), figures (plots)."""
