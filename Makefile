# Two commands do all the set-up on a fresh clone:
#   make demo   install, build shards from the embedded sample corpus, pre-train a tiny model, plot its
#               curves, export it, and print a summary (first/last losses and accuracy, a fill-mask)
#   make test   install, run the whole test suite (what CI runs)
# Also: make test-fast (the in-process tier, under 2 minutes), make lint (ruff, as CI runs it).
# People who manage their own environment: pip install -e ".[dev]" and run the same steps by hand.

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
DEMO    ?= demo
# CPU here, every GPU where there are some.
NGPU    := $(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

.PHONY: setup demo test test-fast lint clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e ".[dev]"
	touch $@

demo: setup
	$(MAKE) --no-print-directory _demo

# The demo's run: TACO on the sample corpus (60 documents, about 20k tokens; a tenth held out, evaluated
# every DEMO_EVAL steps) with a tiny model, sized so
# that the run visibly learns within a couple of minutes on 2 CPU cores (mlm_acc well above 0, tc_loss
# falling). A small WordPiece vocabulary (most English words become a few pieces) and a high learning
# rate let the 0.3M-parameter model get past the unigram plateau quickly; the trainer's defaults for real
# runs are untouched (deepspeed_configs/demo.json: fp32, micro-batch 16).
DEMO_VOCAB ?= 1500
DEMO_STEPS ?= 2000
DEMO_LR    ?= 3e-3
DEMO_WARMUP ?= 100
DEMO_EVAL  ?= 250
DEMO_FILL  ?= 长城是中国古代修建的大型军事防御工[MASK]。

_demo:
	PATH="$(abspath $(VENV))/bin:$$PATH" bash -c ' \
	  set -euo pipefail; \
	  if [ "$(NGPU)" -gt 0 ]; then LAUNCH="--num_gpus $(NGPU)"; else export DS_ACCELERATOR=cpu; LAUNCH="--num_gpus 2"; fi; \
	  python preprocessing/build_shards.py \
	      --input en:preprocessing/sample_corpus/en.txt --input zh:preprocessing/sample_corpus/zh.jsonl \
	      --output $(DEMO)/shards --train_tokenizer wordpiece --vocab_size $(DEMO_VOCAB) \
	      --format packed --max_seq_len 64 --eval_share 0.1 --num_workers 2 --overwrite --no_progress; \
	  rm -rf $(DEMO)/run $(DEMO)/export; \
	  deepspeed $$LAUNCH pipeline/train.py --ds_config deepspeed_configs/demo.json \
	      --objective taco --data $(DEMO)/shards --model_config tiny \
	      --max_steps $(DEMO_STEPS) --lr $(DEMO_LR) --warmup_steps $(DEMO_WARMUP) --log_every 50 \
	      --eval_every $(DEMO_EVAL) --save_every $(DEMO_STEPS) --save_dir $(DEMO)/run --export_dir $(DEMO)/export --seed 0; \
	  tokencl-plot-runs $(DEMO)/run --out $(DEMO)/run/curves.png \
	      --title "make demo: TACO, tiny model, sample corpus"; \
	  python -m pipeline.demo_summary --run $(DEMO)/run --shards $(DEMO)/shards --plot $(DEMO)/run/curves.png \
	      --export $(DEMO)/export --fill_mask "$(DEMO_FILL)"'

# pytest exits 5 when it collected nothing: an empty run is a failure, not a pass.
test: setup
	$(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The fast tier: the in-process tests of tests/unit (no subprocess, no spawn: tests/unit/conftest.py
# refuses one); the tests that start processes carry the multiproc marker and run in `make test`.
test-fast: setup
	$(PY) -m pytest tests/unit -m "not multiproc"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-demo:
	rm -rf $(DEMO)
