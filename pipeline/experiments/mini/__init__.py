"""The miniature reproduction of TaCL and TACO on CPU: a small BERT pre-trained from scratch on real
English and Chinese text, TACO and TaCL arms against MLM alone, held-out MLM scores, the representation
analysis, and fine-tuning on real downstream tasks with several seeds; OUT/README.md holds the tables,
figures and one verdict per claim. A re-run with the same settings keeps the stages already done.

    python -m pipeline.experiments.mini --out OUT --corpora ../shared/corpora
        --tasks sst2=DIR,mrpc=DIR,ner=DIR,chnsenti=DIR      (the full run: 70-90 minutes on 2 cores)
    python -m pipeline.experiments.mini --out OUT --quick --corpora ... --tasks ...   (minutes)
    python -m pipeline.experiments.mini --out OUT --start_only --start_steps N --curve ...  (the start alone)

pipeline/experiments/mini/README.md says what each stage runs and what the committed runs found.
"""
