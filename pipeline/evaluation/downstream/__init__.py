"""Downstream evaluation (pipeline/finetune.py): task files (tasks), official metrics (scoring), the
fine-tuning runs and their tables (finetuning)."""
