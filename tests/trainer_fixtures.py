"""Helpers for the trainer tests: tiny shard folders, the launcher command, metrics readers.

Shards come from the real builder (preprocessing/build_shards.py) when it is present; otherwise
they are written here with streaming's MDSWriter following CONTRACTS.md's schema exactly (the same
columns, encodings, sub-folder layout, tokenizer/ and build_manifest.json).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

_NOUNS = "cat dog bird fish horse cow sheep lion tiger bear wolf fox mouse rabbit deer".split()
_VERBS = "sees chases likes finds follows hears watches meets helps feeds".split()
_ADJ = "big small red blue old young quick slow happy sad".split()
_PLACES = "park river forest garden field house city market".split()


def _sentence(rng: random.Random) -> str:
    # A small grammar: enough structure for a tiny model to overfit within a few dozen steps.
    return (f"the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} "
            f"in the {rng.choice(_PLACES)} .")


def corpus(num_docs: int, *, seed: int = 0, sentences: tuple[int, int] = (3, 6)) -> list[list[str]]:
    rng = random.Random(seed)
    return [[_sentence(rng) for _ in range(rng.randint(*sentences))] for _ in range(num_docs)]


def write_tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = ["the", "in", ".", *_NOUNS, *_VERBS, *_ADJ, *_PLACES, "##s", "##ed", "a", "b", "c"]
    (folder / "vocab.txt").write_text("\n".join([*SPECIALS, *dict.fromkeys(words)]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def _encode(tok, text: str) -> tuple[list[int], list[int]]:
    enc = tok(text, add_special_tokens=False)
    ids = enc["input_ids"]
    words = enc.word_ids()
    starts = [1 if i == 0 or words[i] != words[i - 1] else 0 for i in range(len(ids))]
    return ids, starts


def write_shards_mds(out: Path, *, fmt: str, max_seq_len: int, num_docs: int = 40, seed: int = 0,
                     tokenizer_dir: Optional[Path] = None, parts: int = 2, lang: str = "en") -> Path:
    """A shard folder in the builder's layout, written with MDSWriter (the fallback builder)."""
    import numpy as np
    from streaming import MDSWriter
    from streaming.base.util import merge_index

    # The tokenizer goes in after merge_index, which would take its JSON files for shard indexes.
    if tokenizer_dir is None:
        tokenizer_dir = out.parent / f"{out.name}_tok"
        write_tokenizer(tokenizer_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls, sep = tok.cls_token_id, tok.sep_token_id
    rng = random.Random(seed)
    docs = [[_encode(tok, s) for s in doc] for doc in corpus(num_docs, seed=seed)]
    samples: list[dict] = []
    if fmt == "packed":
        stream_ids, stream_ws = [], []
        for doc in docs:
            for ids, ws in doc:
                stream_ids += ids
                stream_ws += ws
            stream_ids.append(sep)
            stream_ws.append(1)
        block = max_seq_len - 1
        for start in range(0, len(stream_ids) - block + 1, block):
            ids = [cls] + stream_ids[start:start + block]
            ws = [1] + stream_ws[start:start + block]
            samples.append({"input_ids": ids, "token_type_ids": [0] * len(ids), "word_starts": ws})
    else:
        for d, doc in enumerate(docs):
            for i in range(len(doc) - 1):
                a = doc[i]
                label = rng.random() < 0.5
                if label:
                    other = docs[(d + rng.randint(1, len(docs) - 1)) % len(docs)]
                    b = other[rng.randrange(len(other))]
                else:
                    b = doc[i + 1]
                budget = max_seq_len - 3
                a_ids, a_ws = a[0][: budget // 2], a[1][: budget // 2]
                b_ids, b_ws = b[0][: budget - len(a_ids)], b[1][: budget - len(a_ids)]
                ids = [cls, *a_ids, sep, *b_ids, sep]
                ws = [1, *a_ws, 1, *b_ws, 1]
                tt = [0] * (len(a_ids) + 2) + [1] * (len(b_ids) + 1)
                samples.append({"input_ids": ids, "token_type_ids": tt, "word_starts": ws, "nsp_label": int(label)})
    columns = {"input_ids": "ndarray:uint16", "token_type_ids": "ndarray:uint8", "word_starts": "ndarray:uint8",
               "lang": "str"}
    if fmt == "nsp":
        columns["nsp_label"] = "int"
    per_part = -(-len(samples) // parts)
    for p in range(parts):
        with MDSWriter(out=str(out / f"part-{p:05d}"), columns=columns, size_limit=1 << 12) as w:
            for s in samples[p * per_part:(p + 1) * per_part]:
                row = {"input_ids": np.asarray(s["input_ids"], np.uint16),
                       "token_type_ids": np.asarray(s["token_type_ids"], np.uint8),
                       "word_starts": np.asarray(s["word_starts"], np.uint8), "lang": lang}
                if fmt == "nsp":
                    row["nsp_label"] = s["nsp_label"]
                w.write(row)
    merge_index(str(out), keep_local=True)
    tok.save_pretrained(out / "tokenizer")
    manifest = {"config": {"format": fmt, "max_seq_len": max_seq_len, "seed": seed},
                "tokenizer": {"path": str(out / "tokenizer"), "sha256": "", "vocab_size": len(tok), "kind": "wordpiece"},
                "versions": {}, "counts": {"samples": len(samples), "documents_in": num_docs}}
    (out / "build_manifest.json").write_text(json.dumps(manifest))
    return out


def builder_available() -> bool:
    return (REPO / "preprocessing" / "build_shards.py").is_file()


def write_text_corpus(path: Path, *, num_docs: int, seed: int) -> Path:
    """The same corpus as text: one sentence per line, documents separated by blank lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join("\n".join(doc) for doc in corpus(num_docs, seed=seed)) + "\n")
    return path


def build_shards(out: Path, *, fmt: str, max_seq_len: int, num_docs: int = 40, seed: int = 0,
                 tokenizer_dir: Optional[Path] = None) -> Path:
    """Shards from our builder's CLI when it exists, else the MDSWriter fallback above."""
    if not builder_available():
        return write_shards_mds(out, fmt=fmt, max_seq_len=max_seq_len, num_docs=num_docs, seed=seed,
                                tokenizer_dir=tokenizer_dir)
    text = write_text_corpus(out.parent / f"{out.name}_corpus" / "en.txt", num_docs=num_docs, seed=seed)
    tok_dir = tokenizer_dir
    if tok_dir is None:
        tok_dir = out.parent / f"{out.name}_tok"
        write_tokenizer(tok_dir)
    cmd = [sys.executable, str(REPO / "preprocessing" / "build_shards.py"), "--input", f"en:{text}",
           "--output", str(out), "--tokenizer", str(tok_dir), "--format", fmt, "--max_seq_len", str(max_seq_len),
           "--num_workers", "1", "--seed", str(seed), "--overwrite"]
    subprocess.run(cmd, check=True, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    return out


# ---------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------


def launch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def write_ds_config(path: Path, *, micro: int = 4, accum: int = 1, bf16: bool = True, **extra) -> Path:
    cfg = json.loads((REPO / "deepspeed_configs" / "zero2.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = accum
    cfg["bf16"] = {"enabled": bf16}
    if not bf16:
        cfg.pop("data_types", None)
    cfg.update(extra)
    path.write_text(json.dumps(cfg))
    return path


def train_args(*, ds_config: Path, objective: str, data: Sequence[Path], save_dir: Path, max_steps: int,
               model_config: str = "tiny", extra: Sequence[str] = ()) -> list[str]:
    args = ["--ds_config", str(ds_config), "--objective", objective]
    for d in data:
        args += ["--data", str(d)]
    if not any(a == "--init_from" for a in extra):
        args += ["--model_config", model_config]
    return args + ["--max_steps", str(max_steps), "--save_dir", str(save_dir), "--log_every", "1", "--seed", "0",
                   "--num_workers", "1", "--warmup_steps", "0", *extra]


def deepspeed_cmd(port: int, args: Sequence[str], *, num_gpus: int = 2) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus), "--master_port",
            str(port), str(REPO / "pipeline" / "train.py"), *args]


def run_deepspeed(port: int, args: Sequence[str], *, timeout: float = 400, num_gpus: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(deepspeed_cmd(port, args, num_gpus=num_gpus), cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_trace(save_dir: Path) -> dict[int, list[list[int]]]:
    lines = (save_dir / "sample_trace.jsonl").read_text().splitlines()
    return {r["step"]: r["sample_ids"] for r in map(json.loads, lines)}


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
