"""What pre-flight's shard verification costs: hashing every local shard file (xxh64) against index.json.

Writes a synthetic packed build of about --mb MB of token shards (the builder's own MDS writer, random
ids, so zstd barely compresses them: the worst case per sample), then times `inspect_data` on it with
and without file verification, from the page cache (repeated rounds, median). Disk or network reads come
on top on a cold cache. Prints one JSON object.

    python -m pipeline.bench.shards [--mb 512] [--rounds 3]
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from preprocessing import cli


def write_build(out: Path, *, mb: float, seq_len: int = 128, vocab_size: int = 30522) -> int:
    """A packed MDS folder of about `mb` MB of samples; returns the bytes of its shard files."""
    from preprocessing.mds import LocalMDSWriter, merge_local_indexes
    from preprocessing.shard_format import columns_for, id_dtype_for

    rng = np.random.default_rng(0)
    dtype = id_dtype_for(vocab_size)
    per_sample = seq_len * (np.dtype(dtype).itemsize + 2) + 40
    part = out / "part-00000"
    with LocalMDSWriter(out=str(part), columns=columns_for(fmt="packed", vocab_size=vocab_size)) as writer:
        for _ in range(int(mb * 1e6 / per_sample)):
            writer.write(
                {
                    "input_ids": rng.integers(5, vocab_size, seq_len).astype(dtype),
                    "token_type_ids": np.zeros(seq_len, np.uint8),
                    "word_starts": rng.integers(0, 2, seq_len).astype(np.uint8),
                    "lang": "en",
                }
            )
    merge_local_indexes(str(out), ["part-00000"])
    return sum(f.stat().st_size for f in part.glob("shard.*"))


def main(argv: list[str] | None = None) -> dict:
    p = cli.bench_parser(__doc__.splitlines()[0], work_dir="where the build goes")
    p.add_argument("--mb", type=float, default=512, help="MB of samples to write")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from pipeline.data.shards import inspect_data

    work = cli.bench_work_dir(args.work_dir, prefix="bench-shards-")
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    size = write_build(data, mb=args.mb)

    def timed(verify: bool) -> float:
        t = time.perf_counter()
        info = inspect_data([str(data)], cache_root=str(work / "cache"), verify_files=verify)
        assert info.verified_bytes == (size if verify else 0)
        return time.perf_counter() - t

    timed(True)  # warm the page cache
    with_hash = statistics.median(timed(True) for _ in range(args.rounds))
    without = statistics.median(timed(False) for _ in range(args.rounds))
    report = {
        "shard_bytes": size,
        "inspect_s_with_hashes": round(with_hash, 4),
        "inspect_s_without": round(without, 4),
        "hash_s_per_gb": round((with_hash - without) / (size / 1e9), 3),
        "hash_gb_per_s": round(size / 1e9 / max(with_hash - without, 1e-9), 2),
        "note": "page cache warm; reading a cold disk or network file system adds its own GB/s",
    }
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
