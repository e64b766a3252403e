"""The shard builder's driver: plan the chunks, lock and prepare the output folder, prepare the
tokenizer, run one Ray task per chunk (at most --num_workers, and at most the CPUs Ray sees, at a
time), merge the parts' indexes, write the manifest. A build that writes no sample fails (exit 2).

Without --ray_address, Ray is started on this machine with no dashboard process (so no request to
cloud metadata endpoints) and a reaper that stops its processes when the builder ends, even by
`kill -9` (see local_ray.py for both, and for the manual clean-up).

OUTPUT/ after a build is what preprocessing/shard_format.py describes (index.json, part-XXXXX/,
tokenizer/, build_manifest.json, rejects.jsonl, and eval/ with --eval_share); each part-XXXXX/ also
keeps its own index.json, part_stats.json and rejects.jsonl (what --resume reuses), and
`.build.lock` exists only while a build runs (its pid, host and start; see lock.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from preprocessing import cli
from preprocessing.config import BuildConfig, describe_json, math_knobs, parse_args
from preprocessing.errors import UsageError, note
from preprocessing.heldout import EVAL, held_out_rule
from preprocessing.inputs import Chunk, InputFile, auto_chunk_bytes, plan_chunks, resolve_inputs
from preprocessing.lock import output_lock
from preprocessing.mds import merge_local_indexes
from preprocessing.output import (
    DISK_FULL,
    check_output_path,
    check_resumable,
    concat_rejects,
    disk_full_error,
    fingerprint,
    make_output,
    prepare_output,
    remove_stale,
    verify_done_parts,
)
from preprocessing.process import PART_REJECTS, PART_STATS, TaskSpec, process_chunk
from preprocessing.report import aggregate, explain_no_samples, format_summary, versions
from preprocessing.shard_format import (
    EVAL_DIR,
    INDEX,
    MANIFEST,
    REJECTS,
    TOKENIZER_DIR,
    BuildManifest,
    MdsSettings,
    columns_for,
)
from preprocessing.tokenization import TokenizerInfo, prepare_tokenizer, training_texts

MB = 1 << 20
# Credentials and endpoints the workers need to upload to --remote; Ray workers on other nodes do
# not inherit the driver's environment, so these travel with the tasks.
FORWARDED_ENV_PREFIXES = ("AWS_", "S3_", "GOOGLE_", "GCS_", "AZURE_", "OCI_", "DATABRICKS_")


def build_shards(cfg: BuildConfig) -> BuildManifest:
    """Build OUTPUT from cfg; return the manifest (also written to OUTPUT/build_manifest.json).
    Raises UsageError (a ValueError) for bad inputs, flags or tokenizer, before any chunk is
    processed."""
    cfg.validate()
    t0 = time.time()
    out = Path(cfg.output)
    check_output_path(out)
    files = resolve_inputs(cfg.inputs, encoding_rules=cfg.encoding_rules(), exclude=out)
    total_bytes = sum(f.size for f in files)
    chunk_bytes = int(cfg.chunk_mb * MB) if cfg.chunk_mb else auto_chunk_bytes(total_bytes)
    chunks = plan_chunks(files, chunk_bytes=max(1, chunk_bytes), text_field=cfg.text_field)
    if not chunks:
        raise UsageError(f"--input {' '.join(cfg.inputs)}: every matched file is empty")
    make_output(out)
    try:
        with output_lock(out):
            previous = prepare_output(out, overwrite=cfg.overwrite, resume=cfg.resume)
            with _ray_session(cfg) as ray:
                workers = _worker_slots(ray, cfg)
                _warm_up(ray, workers=workers, cfg=cfg)
                manifest = _build(
                    ray,
                    cfg,
                    out=out,
                    files=files,
                    chunks=chunks,
                    chunk_bytes=chunk_bytes,
                    previous=previous,
                    workers=workers,
                    t0=t0,
                )
    except OSError as err:  # from this process or, re-raised by _run_chunks, from a chunk task
        if err.errno not in DISK_FULL:
            raise
        raise disk_full_error(out, err, input_bytes=total_bytes, part_stats=PART_STATS) from err
    return manifest


def _worker_slots(ray, cfg: BuildConfig) -> int:
    """--num_workers, capped at the CPUs Ray sees: more tasks than cores only compete for them."""
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    if cfg.num_workers and cfg.num_workers > cpus:
        note(f"--num_workers {cfg.num_workers}: Ray sees {cpus} CPUs, so {cpus} chunk tasks run at a time")
        return cpus
    return cfg.num_workers or cpus


def _build(
    ray,
    cfg: BuildConfig,
    *,
    out: Path,
    files: list[InputFile],
    chunks: list[Chunk],
    chunk_bytes: int,
    previous: BuildManifest | None,
    workers: int,
    t0: float,
) -> BuildManifest:
    held_out = held_out_rule(seed=cfg.seed, share=cfg.eval_share)
    tok = _tokenizer(cfg, out=out, chunks=chunks, held_out=held_out)
    fp = fingerprint(cfg, files=files, chunk_bytes=chunk_bytes, tokenizer_sha256=tok.sha256, knobs=math_knobs())
    done = _resumable(previous, fingerprint=fp, out=out, chunks=chunks, held_out=held_out is not None)
    manifest = BuildManifest(
        status="running",
        config=_resolved_config(cfg, chunk_bytes),
        fingerprint=fp,
        tokenizer=tok.record(),
        versions=versions(),
        inputs=[asdict(f) for f in files],
    )
    _write_running(manifest, out=out, held_out=held_out is not None)
    done_names = {c.name for c in done}
    todo = [c for c in chunks if c.name not in done_names]
    remove_stale(out, keep={c.name for c in chunks}, part_stats=PART_STATS)
    tokenizer_json = (out / TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8")
    spec = _task_spec(cfg, out=out, tok=tok)
    new_stats = _run_chunks(ray, todo, plan=chunks, spec=spec, tokenizer_json=tokenizer_json, cfg=cfg, workers=workers)
    part_stats = sorted(
        [json.loads((out / c.name / PART_STATS).read_text()) for c in done] + new_stats, key=lambda s: s["index"]
    )
    concat_rejects(out, [c.name for c in chunks], part_rejects=PART_REJECTS)
    wall = time.time() - t0
    counts = aggregate(part_stats, fmt=cfg.format)
    manifest = dataclasses.replace(
        manifest,
        status="complete" if counts.samples else "empty",
        counts=counts,
        columns=columns_for(fmt=cfg.format, vocab_size=tok.vocab_size),
        worker_slots=workers,
        mds=MdsSettings(),
        chunks=len(chunks),
        chunks_resumed=len(done),
        workers=len({(s["host"], s["pid"]) for s in new_stats}),
        peak_rss_mb_per_worker=max([s["peak_rss_mb"] for s in new_stats], default=0.0),
        wall_s=round(wall, 3),
        mb_per_s=round(counts.input_bytes / 1e6 / max(wall, 1e-9), 3),
    )
    _finish(ray, cfg, out=out, manifest=manifest, part_names=[c.name for c in chunks])
    if not counts.samples:
        raise UsageError(
            f"--output {out}: the build wrote no samples: "
            + explain_no_samples(counts, fmt=cfg.format, max_seq_len=cfg.max_seq_len)
        )
    return manifest


def _tokenizer(cfg: BuildConfig, *, out: Path, chunks: list[Chunk], held_out) -> TokenizerInfo:
    """OUTPUT/tokenizer: --tokenizer's, or one trained on a sample of the inputs' documents (the
    held-out ones left out)."""
    texts = None
    if cfg.train_tokenizer:
        budget = int(cfg.tokenizer_train_mb * MB)

        def texts():  # the trainer reads the sample twice
            return training_texts(chunks, text_field=cfg.text_field, budget_bytes=budget, held_out=held_out)

    return prepare_tokenizer(
        tokenizer=cfg.tokenizer,
        train=cfg.train_tokenizer,
        vocab_size=cfg.vocab_size,
        lowercase=cfg.lowercase,
        out_dir=out / TOKENIZER_DIR,
        texts=texts,
        sp_model_type=cfg.sp_model_type,
    )


def _write_running(manifest: BuildManifest, *, out: Path, held_out: bool) -> None:
    """The manifest of a build under way (status running), in OUTPUT and, with --eval_share, in
    OUTPUT/eval: neither folder reads as finished until the build ends."""
    manifest.write(out / MANIFEST)
    if held_out:
        (out / EVAL_DIR).mkdir(exist_ok=True)
        dataclasses.replace(manifest, split=EVAL).write(out / EVAL_DIR / MANIFEST)


def _task_spec(cfg: BuildConfig, *, out: Path, tok: TokenizerInfo) -> TaskSpec:
    return TaskSpec(
        output=str(out),
        remote=cfg.remote,
        fmt=cfg.format,
        max_seq_len=cfg.max_seq_len,
        short_seq_prob=cfg.short_seq_prob,
        random_next_prob=cfg.random_next_prob,
        seed=cfg.seed,
        text_field=cfg.text_field,
        block_chars=int(cfg.block_mb * 1e6),
        tokenizer_sha256=tok.sha256,
        cls_id=tok.cls_id,
        sep_id=tok.sep_id,
        vocab_size=tok.vocab_size,
        eval_share=cfg.eval_share,
    )


def _resumable(
    previous: BuildManifest | None, *, fingerprint: dict, out: Path, chunks: list[Chunk], held_out: bool
) -> list[Chunk]:
    """The chunks an interrupted build finished, once --resume is found to continue it (same
    settings, inputs unchanged); none for a new build."""
    if previous is None:
        return []
    check_resumable(previous, fingerprint=fingerprint, out=out, config_cls=BuildConfig)
    done = [c for c in chunks if _is_done(out, c, held_out=held_out)]
    verify_done_parts(out, done, part_stats=PART_STATS)
    return done


def _is_done(out: Path, chunk: Chunk, *, held_out: bool) -> bool:
    """A chunk is finished when its part folder holds part_stats.json (renamed into place last),
    and, with --eval_share, its held-out part is there too."""
    if not (out / chunk.name / PART_STATS).is_file():
        return False
    return not held_out or (out / EVAL_DIR / chunk.name / INDEX).is_file()


def _finish(ray, cfg: BuildConfig, *, out: Path, manifest: BuildManifest, part_names: list[str]) -> None:
    """The finished build's manifest and merged index; with --eval_share, OUTPUT/eval's too (its
    own counts, and a copy of the tokenizer, so that it is a shard folder of its own)."""
    manifest.write(out / MANIFEST)
    extra = [MANIFEST, REJECTS] + sorted(str(p.relative_to(out)) for p in (out / TOKENIZER_DIR).iterdir())
    _finish_index(ray, folder=out, remote=cfg.remote, part_names=part_names, extra=extra, cfg=cfg)
    held = manifest.counts.eval if manifest.counts else None
    if held is None:
        return
    folder = out / EVAL_DIR
    shutil.copytree(out / TOKENIZER_DIR, folder / TOKENIZER_DIR, dirs_exist_ok=True)
    record = dataclasses.replace(manifest.tokenizer, path=str(folder / TOKENIZER_DIR))
    status = "complete" if held.samples else "empty"
    dataclasses.replace(manifest, split=EVAL, status=status, counts=held, tokenizer=record).write(folder / MANIFEST)
    extra = [MANIFEST] + sorted(str(p.relative_to(folder)) for p in (folder / TOKENIZER_DIR).iterdir())
    remote = f"{cfg.remote.rstrip('/')}/{EVAL_DIR}" if cfg.remote else None
    _finish_index(ray, folder=folder, remote=remote, part_names=part_names, extra=extra, cfg=cfg)
    if not held.samples:
        note(
            f"--eval_share {cfg.eval_share}: no held-out sample was written ({held.documents_written:,} "
            f"held-out document(s)), so {folder} holds none; raise --eval_share"
        )


def _resolved_config(cfg: BuildConfig, chunk_bytes: int) -> dict:
    resolved = cfg.to_dict()
    resolved["chunk_bytes"] = chunk_bytes
    return resolved


# ---- Ray ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _ray_session(cfg: BuildConfig) -> Iterator:
    """Reuse an initialised Ray; else join --ray_address, or start one on this machine (local_ray)."""
    import ray

    from preprocessing.local_ray import available_cpus, local_ray

    if ray.is_initialized():
        yield ray
        return
    kwargs = dict(logging_level=logging.WARNING, log_to_driver=True)
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, include_dashboard=False, **kwargs)
        try:
            yield ray
        finally:
            ray.shutdown()
        return
    cpus = available_cpus()
    with local_ray(num_cpus=min(cfg.num_workers or cpus, cpus), **kwargs) as ray:
        yield ray


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


def _run_chunks(
    ray, todo: list[Chunk], *, plan: list[Chunk], spec: TaskSpec, tokenizer_json: str, cfg: BuildConfig, workers: int
) -> list[dict]:
    """Run process_chunk on every chunk, at most --num_workers at a time; stats in any order."""
    from tqdm import tqdm

    if not todo:
        return []
    task = ray.remote(num_cpus=1)(process_chunk).options(**_task_options(cfg))
    tok_ref = ray.put(tokenizer_json)
    plan_ref = ray.put(plan)
    queue = iter(todo)
    pending: dict = {}
    results: list[dict] = []

    def submit() -> None:
        chunk = next(queue, None)
        if chunk is not None:
            pending[task.remote(chunk, spec=spec, tokenizer_json=tok_ref, plan=plan_ref)] = chunk

    for _ in range(workers):
        submit()
    with tqdm(
        total=sum(c.nbytes for c in todo),
        unit="B",
        unit_scale=True,
        desc="build_shards",
        disable=not cfg.progress,
        mininterval=1.0,
        file=sys.stderr,
    ) as bar:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            chunk = pending.pop(ready[0])
            try:
                results.append(ray.get(ready[0]))
            except Exception as err:
                for ref in pending:
                    ray.cancel(ref)
                cause = getattr(err, "cause", err)  # a RayTaskError carries the task's own exception
                if isinstance(cause, UsageError):  # bad input, named by the task: no traceback
                    raise UsageError(f"{cause} [{chunk.name}; finished parts are kept]") from None
                if isinstance(cause, OSError) and cause.errno in DISK_FULL:  # build_shards says what to free
                    raise cause from None
                raise RuntimeError(
                    f"{chunk.describe()} failed; finished parts are kept, rerun with --resume to continue: {err}"
                ) from err
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
    (out / INDEX).unlink(missing_ok=True)
    local = [str(out / name / INDEX) for name in part_names]
    urls = [(path, f"{remote.rstrip('/')}/{name}/{INDEX}") for path, name in zip(local, part_names)]
    merge_index(urls, (output, remote), keep_local=True)
    uploader = CloudUploader.get((output, remote), exist_ok=True, keep_local=True)
    for name in extra_files:
        uploader.upload_file(name)
    return len(json.loads((out / INDEX).read_text())["shards"])


def _finish_index(ray, *, folder: Path, remote: str | None, part_names: list[str], extra: list[str], cfg) -> None:
    """FOLDER/index.json over its part folders (OUTPUT's, or OUTPUT/eval's). Local output: merged
    here, without streaming. Remote output: by merge_part_indexes in a Ray worker on this node,
    which has already paid the seconds it takes to import streaming (for the uploader); the driver
    has not. It uploads `extra` (paths relative to FOLDER) too."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not remote:
        merge_local_indexes(str(folder), part_names)
        return
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(num_cpus=0)(merge_part_indexes).options(scheduling_strategy=here, **_task_options(cfg))
    ray.get(task.remote(str(folder), remote=remote, part_names=part_names, extra_files=extra))


# ---- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`python preprocessing/build_shards.py ...`: 0 on success, 2 on bad input or flags."""

    def run() -> int:
        cfg = parse_args(argv)
        if cfg.print_config:
            print(describe_json(cfg))
            return 0
        print(format_summary(build_shards(cfg)))
        return 0

    return cli.run(run, prog="build_shards.py")
