"""Raw English/Chinese corpora -> MDS shards for BERT pre-training (see preprocessing/builder.py).

    python preprocessing/build_shards.py --input en:corpus/*.txt --input zh:corpus/*.jsonl \
        --output shards/ --train_tokenizer wordpiece --vocab_size 30000 --format nsp --max_seq_len 128
"""

import sys
from pathlib import Path

# Run as a script, Python puts preprocessing/ itself first on sys.path, where our module names
# (text, inputs, config...) would shadow or be shadowed by top-level packages; the package is
# imported through the editable install instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from preprocessing.builder import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
