"""The builder benchmark's baseline: what a user would write without our builder, as a script.

    python preprocessing/bench/datasets_baseline.py TEXT_FILE TOKENIZER_DIR OUT_MDS CACHE_DIR MAX_SEQ_LEN

datasets `load_dataset("text")` + `map(num_proc=2)` with the same tokenizer, HF run_mlm.py's
group_texts packing (with [CLS] in front of each block), then a streaming MDSWriter loop. Prints one
JSON line with the sample count and the phase times.
"""

import json
import sys
import time

import numpy as np


def group_texts(batch, *, tok, L):
    """HF run_mlm.py's packing, with [CLS] in front of each block."""
    flat = [t for ids in batch["input_ids"] for t in ids + [tok.sep_token_id]]
    n = len(flat) // (L - 1) * (L - 1)
    return {"input_ids": [[tok.cls_token_id] + flat[i : i + L - 1] for i in range(0, n, L - 1)]}


def main(argv: list[str]) -> int:
    t0 = time.time()
    from datasets import load_dataset
    from streaming import MDSWriter
    from transformers import AutoTokenizer

    path, tok_dir, out, cache, L = argv[0], argv[1], argv[2], argv[3], int(argv[4])
    t_import = time.time() - t0
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ds = load_dataset("text", data_files=path, split="train", cache_dir=cache)
    ds = ds.filter(lambda b: [bool(t.strip()) for t in b["text"]], batched=True, num_proc=2)
    t_load = time.time() - t0
    ds = ds.map(
        lambda b: tok(b["text"], add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False),
        batched=True,
        num_proc=2,
        remove_columns=["text"],
    )
    ds = ds.map(group_texts, fn_kwargs={"tok": tok, "L": L}, batched=True, num_proc=2, remove_columns=ds.column_names)
    t_map = time.time() - t0
    columns = {"input_ids": "ndarray:uint16", "token_type_ids": "ndarray:uint8", "lang": "str"}
    zeros = np.zeros(L, dtype=np.uint8)
    with MDSWriter(out=out, columns=columns, compression="zstd", hashes=["xxh64"], size_limit="64mb") as w:
        for row in ds.with_format("numpy"):
            w.write({"input_ids": row["input_ids"].astype(np.uint16), "token_type_ids": zeros, "lang": "en"})
    print(
        json.dumps(
            {"samples": len(ds), "import_s": t_import, "load_s": t_load, "map_s": t_map, "total_s": time.time() - t0}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
