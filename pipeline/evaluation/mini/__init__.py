"""The miniature reproduction of TaCL and TACO (pipeline/reproduce_mini.py): a small BERT pre-trained
from scratch on real English and Chinese text, TaCL and TACO arms against MLM alone, representation
analysis, and fine-tuning on real downstream tasks, on 2 CPU cores."""
