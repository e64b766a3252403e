"""The shard builder's driver: plan the chunks, prepare the output folder and the tokenizer, run one
Ray task per chunk (bounded by --num_workers), merge the parts' indexes, write the manifest.

OUTPUT/ after a build:
  index.json            merged MDS index over every part-XXXXX/ (what StreamingDataset reads)
  part-XXXXX/           one chunk's shards + its index.json, part_stats.json, rejects.jsonl
  tokenizer/            the HF tokenizer folder the samples were made with
  build_manifest.json   resolved config, tokenizer hash, versions, counts, wall time, MB/s
  rejects.jsonl         every skipped line/document with file and line (or row) and reason
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from preprocessing.config import OUTPUT_KEYS, BuildConfig, parse_args
from preprocessing.errors import UsageError
from preprocessing.inputs import Chunk, InputFile, auto_chunk_bytes, plan_chunks, resolve_inputs
from preprocessing.mds import COMPRESSION, HASHES, SIZE_LIMIT, columns_for, merge_local_indexes
from preprocessing.process import PART_REJECTS, PART_STATS, TaskSpec, process_chunk
from preprocessing.report import aggregate, format_summary, versions
from preprocessing.tokenization import TokenizerInfo, prepare_tokenizer, training_texts

MB = 1 << 20
MANIFEST = "build_manifest.json"
REJECTS = "rejects.jsonl"
# Credentials and endpoints the workers need to upload to --remote; Ray workers on other nodes do
# not inherit the driver's environment, so these travel with the tasks.
FORWARDED_ENV_PREFIXES = ("AWS_", "S3_", "GOOGLE_", "GCS_", "AZURE_", "OCI_", "DATABRICKS_")


def build_shards(cfg: BuildConfig) -> dict:
    """Build OUTPUT from cfg; return the manifest (also written to OUTPUT/build_manifest.json).
    Raises UsageError (a ValueError) for bad inputs, flags or tokenizer, before any chunk is
    processed."""
    cfg.validate()
    t0 = time.time()
    files = resolve_inputs(cfg.inputs)
    total_bytes = sum(f.size for f in files)
    chunk_bytes = int(cfg.chunk_mb * MB) if cfg.chunk_mb else auto_chunk_bytes(total_bytes)
    chunks = plan_chunks(files, chunk_bytes=max(1, chunk_bytes), text_field=cfg.text_field)
    if not chunks:
        raise UsageError(f"--input {' '.join(cfg.inputs)}: every matched file is empty")
    out = Path(cfg.output)
    previous = _prepare_output(out, cfg)
    with _ray_session(cfg) as ray:
        workers = cfg.num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        _warm_up(ray, workers=workers, cfg=cfg)
        manifest = _build(ray, cfg, out=out, files=files, chunks=chunks, chunk_bytes=chunk_bytes,
                          previous=previous, workers=workers, t0=t0)
    return manifest


def _build(ray, cfg: BuildConfig, *, out: Path, files: list[InputFile], chunks: list[Chunk], chunk_bytes: int,
           previous: dict | None, workers: int, t0: float) -> dict:
    texts = None
    if cfg.train_tokenizer:
        def texts():  # the trainer reads the sample twice
            return training_texts(chunks, text_field=cfg.text_field,
                                  budget_bytes=int(cfg.tokenizer_train_mb * MB))
    tok = prepare_tokenizer(tokenizer=cfg.tokenizer, train=cfg.train_tokenizer,
                            vocab_size=cfg.vocab_size, lowercase=cfg.lowercase,
                            out_dir=out / "tokenizer", texts=texts, sp_model_type=cfg.sp_model_type)
    fingerprint = _fingerprint(cfg, files=files, chunk_bytes=chunk_bytes, tok=tok)
    if previous is not None:
        _check_resumable(previous, fingerprint=fingerprint, out=out)
    manifest = {"status": "running", "config": _resolved_config(cfg, chunk_bytes),
                "fingerprint": fingerprint, "tokenizer": tok.manifest(), "versions": versions(),
                "inputs": [asdict(f) for f in files]}
    _write_json(out / MANIFEST, manifest)

    done = [c for c in chunks if (out / c.name / PART_STATS).is_file()] if previous else []
    done_names = {c.name for c in done}
    todo = [c for c in chunks if c.name not in done_names]
    _remove_stale(out, keep={c.name for c in chunks})
    spec = TaskSpec(output=str(out), remote=cfg.remote, fmt=cfg.format, max_seq_len=cfg.max_seq_len,
                    short_seq_prob=cfg.short_seq_prob, random_next_prob=cfg.random_next_prob,
                    seed=cfg.seed, text_field=cfg.text_field, block_chars=int(cfg.block_mb * 1e6),
                    tokenizer_sha256=tok.sha256, cls_id=tok.cls_id, sep_id=tok.sep_id,
                    vocab_size=tok.vocab_size)
    tokenizer_json = (out / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8")

    new_stats = _run_chunks(ray, todo, spec=spec, tokenizer_json=tokenizer_json, cfg=cfg, workers=workers)
    part_stats = sorted([json.loads((out / c.name / PART_STATS).read_text()) for c in done]
                        + new_stats, key=lambda s: s["index"])
    _concat_rejects(out, [c.name for c in chunks])
    wall = time.time() - t0
    counts = aggregate(part_stats, fmt=cfg.format)
    used = {(s["host"], s["pid"]) for s in new_stats}
    manifest.update({
        "status": "complete", "counts": counts, "columns": columns_for(fmt=cfg.format, vocab_size=tok.vocab_size),
        "mds": {"compression": COMPRESSION, "hashes": HASHES, "size_limit": SIZE_LIMIT},
        "chunks": len(chunks), "chunks_resumed": len(done), "workers": len(used),
        "peak_rss_mb_per_worker": max([s["peak_rss_mb"] for s in new_stats], default=0.0),
        "wall_s": round(wall, 3), "mb_per_s": round(counts["input_bytes"] / 1e6 / max(wall, 1e-9), 3),
    })
    _write_json(out / MANIFEST, manifest)
    _finish_index(ray, out=out, cfg=cfg, part_names=[c.name for c in chunks])
    return manifest


# ---- output folder ------------------------------------------------------------------------------
def _prepare_output(out: Path, cfg: BuildConfig) -> dict | None:
    """Refuse a non-empty OUTPUT without --resume/--overwrite. Returns the previous manifest when
    resuming one, else None (after clearing OUTPUT for --overwrite)."""
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return None
    if not out.is_dir():
        raise UsageError(f"--output {out}: exists and is not a directory")
    has_manifest = (out / MANIFEST).is_file()
    if cfg.overwrite:
        looks_built = has_manifest or (out / "index.json").exists() or any(out.glob("part-*"))
        if not looks_built:
            raise UsageError(f"--output {out}: is not empty and holds no previous build; "
                             "--overwrite only replaces builds (remove the folder yourself)")
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        return None
    if cfg.resume:
        if not has_manifest:
            raise UsageError(f"--resume: {out} has no {MANIFEST}, so it is not a build to resume; "
                             "use another --output or --overwrite")
        return json.loads((out / MANIFEST).read_text())
    raise UsageError(f"--output {out}: is not empty; pass --resume to finish the build in it or "
                     "--overwrite to replace it")


def _fingerprint(cfg: BuildConfig, *, files: list[InputFile], chunk_bytes: int, tok: TokenizerInfo) -> dict:
    """Everything the samples depend on (not --num_workers): what --resume compares."""
    return {"inputs": [[f.path, f.lang, f.size] for f in files], "chunk_bytes": chunk_bytes,
            "tokenizer": cfg.tokenizer, "tokenizer_sha256": tok.sha256, **{k: getattr(cfg, k) for k in OUTPUT_KEYS}}


def _check_resumable(previous: dict, *, fingerprint: dict, out: Path) -> None:
    before = previous.get("fingerprint", {})
    differ = sorted(k for k in set(before) | set(fingerprint) if before.get(k) != fingerprint.get(k))
    if differ:
        raise UsageError(f"--resume: {out} was built with different {', '.join(differ)} "
                         f"(before: {[before.get(k) for k in differ]}, now: "
                         f"{[fingerprint.get(k) for k in differ]}); rerun with the same settings "
                         "or use --overwrite")


def _resolved_config(cfg: BuildConfig, chunk_bytes: int) -> dict:
    resolved = cfg.to_dict()
    resolved["chunk_bytes"] = chunk_bytes
    return resolved


def _remove_stale(out: Path, *, keep: set[str]) -> None:
    """Drop temporary folders of interrupted tasks and parts that are not in this plan."""
    for child in out.iterdir():
        if child.name.startswith(".tmp-part-") or (child.name.startswith("part-") and child.name not in keep):
            shutil.rmtree(child, ignore_errors=True)
        elif child.name.startswith("part-") and not (child / PART_STATS).is_file():
            shutil.rmtree(child, ignore_errors=True)


def _concat_rejects(out: Path, part_names: list[str]) -> None:
    with open(out / REJECTS, "w", encoding="utf-8") as dst:
        for name in part_names:
            src = out / name / PART_REJECTS
            if src.is_file():
                with open(src, encoding="utf-8") as f:
                    shutil.copyfileobj(f, dst)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False))
    tmp.replace(path)


# ---- Ray ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _ray_session(cfg: BuildConfig) -> Iterator:
    """Reuse an initialised Ray; else join --ray_address, or start one on this machine."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, **kwargs)
    else:
        ray.init(address="local", num_cpus=cfg.num_workers or os.cpu_count(), **kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


def _task_options(cfg: BuildConfig) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    return {"runtime_env": {"env_vars": env}} if cfg.remote and env else {}


def warm_worker(remote: bool) -> int:
    """Import what chunk tasks need: the tokenizer and segmenter libraries, and streaming (seconds:
    torch, transformers...) only when its uploader is needed."""
    if remote:
        from preprocessing.mds import make_fast_writer_class

        make_fast_writer_class()
    import rjieba  # noqa: F401  (loads its dictionary)
    import tokenizers  # noqa: F401
    import xxhash  # noqa: F401
    import zstd  # noqa: F401
    return os.getpid()


def _warm_up(ray, *, workers: int, cfg: BuildConfig) -> None:
    """Start the workers' imports now, while the driver prepares the tokenizer; not awaited."""
    task = ray.remote(num_cpus=1)(warm_worker).options(**_task_options(cfg))
    for _ in range(workers):
        task.remote(bool(cfg.remote))


def _run_chunks(ray, todo: list[Chunk], *, spec: TaskSpec, tokenizer_json: str, cfg: BuildConfig,
                workers: int) -> list[dict]:
    """Run process_chunk on every chunk, at most --num_workers at a time; stats in any order."""
    from tqdm import tqdm

    if not todo:
        return []
    task = ray.remote(num_cpus=1)(process_chunk).options(**_task_options(cfg))
    tok_ref = ray.put(tokenizer_json)
    queue = iter(todo)
    pending: dict = {}
    results: list[dict] = []

    def submit() -> None:
        chunk = next(queue, None)
        if chunk is not None:
            pending[task.remote(chunk, spec=spec, tokenizer_json=tok_ref)] = chunk

    for _ in range(workers):
        submit()
    with tqdm(total=sum(c.nbytes for c in todo), unit="B", unit_scale=True, desc="build_shards",
              disable=not cfg.progress, mininterval=1.0, file=sys.stderr) as bar:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            chunk = pending.pop(ready[0])
            try:
                results.append(ray.get(ready[0]))
            except Exception as err:
                for ref in pending:
                    ray.cancel(ref)
                raise RuntimeError(f"{chunk.describe()} failed; finished parts are kept, rerun with "
                                   f"--resume to continue: {err}") from err
            bar.update(chunk.nbytes)
            submit()
    return results


def merge_part_indexes(output: str, *, remote: str, part_names: list[str], extra_files: list[str]) -> int:
    """OUTPUT/index.json over the parts (streaming's merge_index), uploaded to `remote` with
    `extra_files`. Returns the number of shards indexed."""
    from streaming.base.storage.upload import CloudUploader
    from streaming.base.util import merge_index

    logging.getLogger().setLevel(logging.ERROR)  # merge_index warns about its temporary folder
    out = Path(output)
    (out / "index.json").unlink(missing_ok=True)
    local = [str(out / name / "index.json") for name in part_names]
    urls = [(path, f"{remote.rstrip('/')}/{name}/index.json") for path, name in zip(local, part_names)]
    merge_index(urls, (output, remote), keep_local=True)
    uploader = CloudUploader.get((output, remote), exist_ok=True, keep_local=True)
    for name in extra_files:
        uploader.upload_file(name)
    return len(json.loads((out / "index.json").read_text())["shards"])


def _finish_index(ray, *, out: Path, cfg: BuildConfig, part_names: list[str]) -> None:
    """The root index.json. Local output: merged here, without streaming. Remote output: by
    merge_part_indexes in a Ray worker on this node, which has already paid the seconds it takes
    to import streaming (for the uploader); the driver has not."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not cfg.remote:
        merge_local_indexes(str(out), part_names)
        return

    extra = [MANIFEST, REJECTS] + sorted(str(p.relative_to(out)) for p in (out / "tokenizer").iterdir())
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(num_cpus=0)(merge_part_indexes).options(scheduling_strategy=here, **_task_options(cfg))
    ray.get(task.remote(str(out), remote=cfg.remote, part_names=part_names, extra_files=extra))


# ---- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`python preprocessing/build_shards.py ...`: 0 on success, 2 on bad input or flags."""
    try:
        cfg = parse_args(argv)
        manifest = build_shards(cfg)
    except UsageError as err:
        print(f"build_shards.py: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(manifest))
    return 0
