"""Evaluation of trained encoders: representation analysis (representation) and downstream fine-tuning
(downstream), with the `--model [LABEL=]DIR` arguments and device choice they share (models)."""
