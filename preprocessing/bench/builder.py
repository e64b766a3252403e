"""Shard-builder benchmark on real corpora; prints one JSON object.

For English and Chinese separately, on the same cores:
  (a) raw fast-tokenizer `encode_batch` over the corpus lines (all threads): the speed limit;
  (b) our builder end to end (`python preprocessing/build_shards.py`, 2 workers);
  (c) what a user would write instead (preprocessing/bench/datasets_baseline.py): datasets
      `load_dataset("text")` + `map(num_proc=2)` with the same tokenizer, HF's group_texts packing,
      then an MDSWriter loop;
  (d) our builder with 1 and with 2 workers;
plus peak RSS per builder worker on a quarter of the corpus and on all of it (does it grow?).

    python -m preprocessing.bench.builder                # ../shared/corpora, full files
    python -m preprocessing.bench.builder --quick        # ~2 MB per language, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from preprocessing import cli
from preprocessing.config import BuildConfig
from preprocessing.shard_format import MANIFEST, BuildManifest

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parents[1]
CORPORA = {
    "en": ["en/enwiki_wikiextractor.txt"],
    "zh": ["zh/court_judgments.txt", "zh/four_classic_novels.txt", "zh/thucnews_cnews.txt"],
}


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1 here
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def prepare_corpus(lang: str, *, corpora: Path, work: Path, limit_bytes: int | None, repeat: int = 1) -> Path:
    """One BERT-format file per language (the corpus files concatenated `repeat` times, which
    stands in for a larger corpus so fixed start-up costs amortise; optionally cut at a document
    boundary after limit_bytes)."""
    out = work / f"{lang}.txt"
    written = 0
    with open(out, "wb") as dst:
        for name in CORPORA[lang] * repeat:
            with open(corpora / name, "rb") as src:
                for line in src:
                    dst.write(line)
                    written += len(line)
                    if limit_bytes and written >= limit_bytes and not line.strip():
                        return out
            dst.write(b"\n")
    return out


def prefix_file(path: Path, fraction: float) -> Path:
    """The first `fraction` of a BERT-format file, cut at a document boundary."""
    out = path.with_name(path.stem + f"_{int(fraction * 100)}pct.txt")
    limit = int(path.stat().st_size * fraction)
    with open(path, "rb") as src, open(out, "wb") as dst:
        n = 0
        for line in src:
            dst.write(line)
            n += len(line)
            if n >= limit and not line.strip():
                break
    return out


def raw_tokenizer(path: Path, tok_dir: Path) -> dict:
    """(a): encode_batch over the file's non-blank lines, text already in memory, every thread."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    data = path.read_bytes()
    lines = [ln for ln in data.decode("utf-8", errors="replace").split("\n") if ln.strip()]
    out = {"mb": len(data) / 1e6}
    for name in ("encode_batch", "encode_batch_fast"):
        fn = getattr(tok, name)
        t = time.time()
        tokens = 0
        for i in range(0, len(lines), 2000):
            tokens += sum(len(e.ids) for e in fn(lines[i : i + 2000], add_special_tokens=False))
        wall = time.time() - t
        out[name] = {"wall_s": round(wall, 3), "mb_per_s": round(len(data) / 1e6 / wall, 3), "tokens": tokens}
    return out


def builder(path: Path, *, tok_dir: Path, out: Path, workers: int, lang: str, fmt: str, max_seq_len: int) -> dict:
    """(b)/(d): the command a user runs, timed from outside; plus what the manifest says."""
    cmd = [
        sys.executable,
        str(REPO / "preprocessing" / "build_shards.py"),
        "--input",
        f"{lang}:{path}",
        "--output",
        str(out),
        "--tokenizer",
        str(tok_dir),
        "--format",
        fmt,
        "--max_seq_len",
        str(max_seq_len),
        "--num_workers",
        str(workers),
        "--no_progress",
    ]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    wall = time.time() - t
    if proc.returncode:
        raise RuntimeError(f"builder failed: {proc.stderr[-3000:]}")
    m = BuildManifest.read(out / MANIFEST)
    parts = [json.loads(p.read_text()) for p in out.glob("part-*/part_stats.json")]
    peak_by_worker: dict = {}
    for p in parts:
        key = f"{p['host']}:{p['pid']}"
        peak_by_worker[key] = max(peak_by_worker.get(key, 0), p["peak_rss_mb"])
    task_s = sum(p["wall_s"] for p in parts)
    mb = m.counts.input_bytes / 1e6
    return {
        "workers": workers,
        "command_wall_s": round(wall, 3),
        "command_mb_per_s": round(mb / wall, 3),
        "manifest_wall_s": m.wall_s,
        "manifest_mb_per_s": m.mb_per_s,
        "chunks": m.chunks,
        # Throughput once the workers run: input over the time the tasks took, per worker.
        "steady_mb_per_s": round(mb / task_s * workers, 3) if task_s else None,
        "fixed_cost_s": round(wall - task_s / workers, 3),
        "peak_rss_mb_per_worker": peak_by_worker,
        "samples": m.counts.samples,
        "tokens": m.counts.tokens,
    }


def datasets_baseline(path: Path, *, tok_dir: Path, work: Path, max_seq_len: int) -> dict:
    """(c): datasets_baseline.py, run as a user would run their script, timed from outside."""
    out, cache = work / "baseline_mds", work / "baseline_cache"
    cmd = [
        sys.executable,
        str(_HERE / "datasets_baseline.py"),
        str(path),
        str(tok_dir),
        str(out),
        str(cache),
        str(max_seq_len),
    ]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), "TOKENIZERS_PARALLELISM": "false"})
    wall = time.time() - t
    if proc.returncode:
        raise RuntimeError(f"baseline failed: {proc.stderr[-3000:]}")
    inner = json.loads(proc.stdout.strip().splitlines()[-1])
    mb = path.stat().st_size / 1e6
    return {
        "command_wall_s": round(wall, 3),
        "command_mb_per_s": round(mb / wall, 3),
        "phases_s": {k: round(v, 3) for k, v in inner.items() if k.endswith("_s")},
        "samples": inner["samples"],
    }


def train_tokenizer(corpora: list[Path], *, out: Path, sample_mb: float) -> Path:
    """A joint EN+ZH WordPiece vocabulary (30522) trained by the builder's own trainer."""
    from preprocessing.inputs import plan_chunks, resolve_inputs
    from preprocessing.tokenization import save_trained, training_texts
    from preprocessing.tokenization import train_tokenizer as train

    chunks = plan_chunks(resolve_inputs([str(p) for p in corpora]), chunk_bytes=1 << 20, text_field="text")
    tok = train(
        "wordpiece",
        texts=training_texts(chunks, text_field="text", budget_bytes=int(sample_mb * 1e6)),
        vocab_size=30522,
    )
    save_trained(tok, out, kind="wordpiece", lowercase=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not args.corpora.is_dir():
        print(f"preprocessing.bench.builder: error: --corpora {args.corpora}: not a directory", file=sys.stderr)
        return 2
    work = cli.bench_work_dir(args.work_dir, prefix="build_bench_")
    work.mkdir(parents=True, exist_ok=True)
    limit = 2_000_000 if args.quick else None
    langs = args.langs.split(",")
    files = {
        lang: prepare_corpus(lang, corpora=args.corpora, work=work, limit_bytes=limit, repeat=args.repeat)
        for lang in langs
    }
    tok_dir = args.tokenizer or train_tokenizer(
        list(files.values()), out=work / "tokenizer", sample_mb=2 if args.quick else 16
    )
    report = {
        "quick": args.quick,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "tokenizer": str(tok_dir),
        "format": args.format,
        "max_seq_len": args.max_seq_len,
        "langs": {},
    }
    for lang, path in files.items():
        report["langs"][lang] = measure_language(lang, path, tok_dir=tok_dir, work=work, args=args)
    report["load_avg_at_end"] = os.getloadavg()
    report["work_dir"] = str(work)
    cli.emit_json(report, args.out)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = cli.bench_parser(
        __doc__.split("\n")[0],
        smoke="~2 MB per language: a smoke run",
        work_dir="where corpora, tokenizer and builds go",
        out=True,
    )
    p.add_argument("--corpora", type=Path, default=REPO.parent / "shared" / "corpora")
    p.add_argument("--langs", default="en,zh")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: train a joint WordPiece here")
    p.add_argument("--format", default="packed", choices=("packed", "nsp"))
    p.add_argument("--max_seq_len", type=int, default=BuildConfig.max_seq_len)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="concatenate each language's corpus N times: a larger input, where Ray's and the "
        "workers' start-up seconds amortise as they do on real corpora",
    )
    return p.parse_args(argv)


def measure_language(lang: str, path: Path, *, tok_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    """(a) to (d) and the peak RSS per worker on one language's corpus `path`, with the ratios."""
    r: dict = {"corpus_mb": round(path.stat().st_size / 1e6, 3)}
    r["a_raw_tokenizer"] = raw_tokenizer(path, tok_dir)
    kw = dict(lang=lang, fmt=args.format, max_seq_len=args.max_seq_len)
    r["d_builder_1_worker"] = builder(path, tok_dir=tok_dir, out=work / f"{lang}_w1", workers=1, **kw)
    r["b_builder"] = r["d_builder_2_workers"] = builder(path, tok_dir=tok_dir, out=work / f"{lang}_w2", workers=2, **kw)
    small = prefix_file(path, 0.25)
    r["rss_quarter_corpus"] = builder(small, tok_dir=tok_dir, out=work / f"{lang}_q", workers=2, **kw)[
        "peak_rss_mb_per_worker"
    ]
    r["c_datasets_map_mdswriter"] = datasets_baseline(
        path, tok_dir=tok_dir, work=work / lang, max_seq_len=args.max_seq_len
    )
    r["ratios"] = _ratios(r)
    return r


def _ratios(r: dict) -> dict:
    """One language's figures against the targets."""
    raw = r["a_raw_tokenizer"]["encode_batch"]["mb_per_s"]
    b, d1 = r["b_builder"], r["d_builder_1_worker"]
    peak_full = max(b["peak_rss_mb_per_worker"].values())
    peak_small = max(r["rss_quarter_corpus"].values())
    return {
        "builder_vs_raw (target >= 0.7)": round(b["command_mb_per_s"] / raw, 3),
        "builder_steady_vs_raw": round(b["steady_mb_per_s"] / raw, 3),
        "builder_vs_datasets (target >= 2)": round(
            b["command_mb_per_s"] / r["c_datasets_map_mdswriter"]["command_mb_per_s"], 3
        ),
        "2_vs_1_workers (target >= 1.7)": round(b["command_mb_per_s"] / d1["command_mb_per_s"], 3),
        "2_vs_1_workers_steady": round(b["steady_mb_per_s"] / d1["steady_mb_per_s"], 3),
        "peak_rss_mb_per_worker (target < 1500)": peak_full,
        "peak_rss_growth_mb_quarter_to_full (target ~0)": round(peak_full - peak_small, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
