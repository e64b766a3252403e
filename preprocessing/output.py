"""The output folder: refuse what is not ours, clear a previous build for --overwrite, and decide
whether --resume may continue the build in it (same settings, inputs unchanged: each file's size
and modification time, and a digest of the bytes every finished part was made from).

OUTPUT is ours when it is empty, or holds a previous build: a build_manifest.json beside nothing but
what the builder writes (index.json, part-XXXXX/ folders of shard files, tokenizer/, rejects.jsonl,
their temporary forms, and eval/ holding the same kinds of things), or only what a build writes
before its manifest (tokenizer/, its temporary copy, the manifest's temporary file), which is what a
build killed while preparing its tokenizer leaves. Anything else is the user's: --overwrite then
refuses, naming it, and deletes nothing.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import time
from pathlib import Path

from preprocessing import cli
from preprocessing.errors import UsageError, note
from preprocessing.lock import LOCK_NAME
from preprocessing.shard_format import EVAL_DIR, INDEX, MANIFEST, REJECTS, TOKENIZER_DIR, BuildManifest

EARLY_ARTEFACTS = frozenset({TOKENIZER_DIR, TOKENIZER_DIR + ".tmp", MANIFEST + ".tmp"})
"""What a build writes before its first manifest."""
_BUILD_FILES = frozenset({MANIFEST, MANIFEST + ".tmp", INDEX, INDEX + ".tmp", REJECTS})
_BUILD_DIRS = frozenset({TOKENIZER_DIR, TOKENIZER_DIR + ".tmp"})
# A part folder (process.py: written as .tmp-part-XXXXX-<8 hex>, renamed to part-XXXXX) and what it holds.
_PART_DIR = re.compile(r"(\.tmp-)?part-\d{5}(?(1)-[0-9a-f]{8})")
_PART_FILE = re.compile(r"index\.json|part_stats\.json|rejects\.jsonl|shard\.\d{5}\.mds(\.zstd)?")


def check_output_path(out: Path) -> None:
    """Refuse an --output that is not a folder, before anything is read or written."""
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"--output {out}: exists and is not a directory; give the path of a folder "
            "(new, empty, or holding a previous build)"
        )
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--output {out}: {parent} is not a directory, so the folder cannot be created there")
            break


def make_output(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--output {out}: cannot create it ({err.strerror or err})") from err


def _entries(out: Path) -> list[Path]:
    return [child for child in out.iterdir() if child.name != LOCK_NAME]


def _clear(entries: list[Path]) -> None:
    for child in entries:
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def prepare_output(out: Path, *, overwrite: bool, resume: bool) -> BuildManifest | None:
    """Refuse a non-empty OUTPUT without --resume/--overwrite. Returns the previous manifest when
    resuming one, else None (after clearing OUTPUT for --overwrite). OUTPUT exists and this
    build holds its lock."""
    entries = _entries(out)
    if not entries:
        return None
    has_manifest = (out / MANIFEST).is_file()
    if not has_manifest and all(child.name in EARLY_ARTEFACTS for child in entries):
        if overwrite or resume:
            if resume:
                note(
                    f"--resume: {out} holds only {', '.join(sorted(c.name for c in entries))} of a build "
                    f"stopped before it wrote {MANIFEST}: no chunk was finished, so the build starts over"
                )
            _clear(entries)
            return None
    if overwrite:
        _check_only_a_build(out, entries, has_manifest=has_manifest)
        _clear(entries)
        return None
    if resume:
        if not has_manifest:
            raise UsageError(
                f"--resume: {out} has no {MANIFEST}, so it is not a build to resume; "
                "use another --output or --overwrite"
            )
        return BuildManifest.read(out / MANIFEST)
    raise UsageError(
        f"--output {out}: is not empty; pass --resume to finish the build in it or --overwrite to replace it"
    )


def _foreign(entries: list[Path], *, inside: str = "") -> list[str]:
    """The entries (and part-folder files) that the builder does not write, as paths relative to
    OUTPUT; in OUTPUT/eval (the held-out split, `inside` "eval/") the same kinds of entries."""
    out = []
    for child in entries:
        if child.is_symlink():
            out.append(inside + child.name)
        elif child.is_dir() and _PART_DIR.fullmatch(child.name):
            out += [
                f"{inside}{child.name}/{f.name}"
                for f in child.iterdir()
                if not (f.is_file() and _PART_FILE.fullmatch(f.name))
            ]
        elif child.is_dir() and child.name == EVAL_DIR and not inside:
            out += _foreign(list(child.iterdir()), inside=f"{EVAL_DIR}/")
        elif not (child.name in _BUILD_DIRS and child.is_dir()) and not (
            child.name in _BUILD_FILES and child.is_file()
        ):
            out.append(inside + child.name + ("/" if child.is_dir() else ""))
    return sorted(out)


def _check_only_a_build(out: Path, entries: list[Path], *, has_manifest: bool) -> None:
    """--overwrite clears OUTPUT only when its manifest shows a previous build and nothing else is in it;
    otherwise a UsageError naming what is not the builder's (nothing is deleted)."""
    if not has_manifest:
        raise UsageError(
            f"--output {out}: is not empty and holds no previous build (no {MANIFEST}); --overwrite only "
            f"replaces builds, so nothing was deleted: choose an empty or new folder"
        )
    BuildManifest.read(out / MANIFEST)  # an unreadable manifest proves nothing: UsageError naming it
    foreign = _foreign(entries)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise UsageError(
            f"--output {out}: holds a previous build and also {shown}, which the builder did not write; "
            f"--overwrite deleted nothing: move them out, or choose another --output"
        )


# ---- a full disk --------------------------------------------------------------------------------
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full_error(out: Path, err: OSError, *, input_bytes: int, part_stats: str) -> UsageError:
    """The one-line error for a build that ran out of space in OUTPUT: how much is free, how much more
    the rest of the build needs (estimated from the finished parts' shard bytes per input byte), and
    that --resume continues it (finished parts are kept; interrupted ones are redone)."""
    done_in = done_out = parts = 0
    for stats in out.glob(f"part-*/{part_stats}"):
        try:
            counts = json.loads(stats.read_text())["counts"]
            done_in, done_out, parts = done_in + counts["input_bytes"], done_out + counts["bytes"], parts + 1
        except (OSError, ValueError, KeyError):
            continue
    left = max(0, input_bytes - done_in)
    if done_in:
        need = (
            f"about {_size(left * done_out / done_in)} more for the {_size(left)} of input left (the {parts} "
            f"finished part(s) hold {_size(done_out)} of shards for {_size(done_in)} of input)"
        )
    else:
        need = f"up to about the input's {_size(input_bytes)} (no part finished yet)"
    free = shutil.disk_usage(out).free if out.exists() else 0
    where = f" writing {err.filename}" if err.filename else ""
    return UsageError(
        f"--output {out}: its file system is full ({err.strerror}{where}; {_size(free)} free): free {need}, "
        f"then rerun with --resume to continue the build (finished parts are kept)"
    )


def _size(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


# ---- resume -------------------------------------------------------------------------------------
def fingerprint(cfg, *, files: list, chunk_bytes: int, tokenizer_sha256: str, knobs: list[str]) -> dict:
    """Everything the samples depend on (not --num_workers): what --resume compares. `knobs`: the
    config's math knobs, by value; the inputs, their encodings and the chunk size as resolved;
    input_state (size and modification time per file) catches an input edited in place at the same size."""
    return {
        "inputs": [[f.path, f.lang, f.encoding] for f in files],
        "input_state": [[f.path, f.size, f.mtime_ns] for f in files],
        "chunk_bytes": chunk_bytes,
        "tokenizer_sha256": tokenizer_sha256,
        **{k: getattr(cfg, k) for k in knobs},
    }


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime_ns / 1e9)) + f".{mtime_ns % 10**9:09d}"


def check_resumable(previous: BuildManifest, *, fingerprint: dict, out: Path, config_cls: type) -> None:
    """Refuse --resume when the settings or the inputs differ from the interrupted build's, naming
    each changed setting or file. The knobs are compared as `cli.math_changes` compares a resumed
    run's (a knob the earlier build did not know yet ran with its default)."""
    before = previous.fingerprint
    if "input_state" not in before:
        raise UsageError(
            f"--resume: {out} was built by an older builder that did not record the state of "
            "its inputs, so an input changed since could not be detected; rebuild with --overwrite"
        )
    old = {path: (size, mtime) for path, size, mtime in before["input_state"]}
    for path, size, mtime in fingerprint["input_state"]:
        if path in old and old[path] != (size, mtime):
            size0, mtime0 = old[path]
            raise UsageError(
                f"--resume: {path} changed since the build in {out} started (size {size0:,} -> {size:,} bytes, "
                f"modified {_when(mtime0)} -> {_when(mtime)}); its finished parts hold the old text, so "
                f"rebuild with --overwrite (if only its time changed: touch -d @{mtime0 / 1e9:.9f} {path})"
            )
    knobs = cli.math_changes({"build": before}, {"build": fingerprint}, {"build": config_cls})
    changed = {name.split(".", 1)[1]: values for name, values in knobs.items()}
    facts = (set(before) | set(fingerprint)) - {f.name for f in cli.knob_fields(config_cls)} - {"input_state"}
    changed.update({k: (before.get(k), fingerprint.get(k)) for k in facts if before.get(k) != fingerprint.get(k)})
    if changed:
        differ = sorted(changed)
        raise UsageError(
            f"--resume: {out} was built with different {', '.join(differ)} "
            f"(before: {[changed[k][0] for k in differ]}, now: "
            f"{[changed[k][1] for k in differ]}); rerun with the same settings "
            "or use --overwrite"
        )


def verify_done_parts(out: Path, done: list, *, part_stats: str) -> None:
    """Re-hash the input bytes each finished part was made from (recorded by its task) and refuse
    --resume where they differ: an edit that kept the file's size and modification time."""
    from preprocessing.inputs import digest, reading

    cache: dict = {}
    for chunk in done:
        stats = json.loads((out / chunk.name / part_stats).read_text())
        source = stats.get("source")
        if not source:
            raise UsageError(
                f"--resume: {out / chunk.name} was written by an older builder that did not "
                "record a digest of its input; rebuild with --overwrite"
            )
        lo, hi = source["span"]
        with reading(chunk.file):
            now = digest(chunk.file.path, lo, hi, cache=cache)
        if now != source["xxh64"]:
            raise UsageError(
                f"--resume: {chunk.file.path} changed since {out / chunk.name} was made from it (its bytes "
                f"{lo:,}-{hi:,} differ, though the file's size and modification time do not); its finished "
                "parts hold the old text, so rebuild with --overwrite"
            )


def remove_stale(out: Path, *, keep: set[str], part_stats: str) -> None:
    """Drop temporary folders of interrupted tasks and parts that are not in this plan, in OUTPUT
    and OUTPUT/eval. (An interrupted chunk's finished held-out part is replaced when it is redone.)"""
    for child in out.iterdir():
        # Only the builder's own part folders (by their exact name pattern); a user's part-notes/ stays.
        if not (child.is_dir() and not child.is_symlink() and _PART_DIR.fullmatch(child.name)):
            continue
        if child.name.startswith(".tmp-") or child.name not in keep or not (child / part_stats).is_file():
            shutil.rmtree(child, ignore_errors=True)
    held_out = out / EVAL_DIR
    if held_out.is_dir() and not held_out.is_symlink():
        for child in held_out.iterdir():
            if child.is_dir() and not child.is_symlink() and _PART_DIR.fullmatch(child.name):
                if child.name.startswith(".tmp-") or child.name not in keep:
                    shutil.rmtree(child, ignore_errors=True)


def concat_rejects(out: Path, part_names: list[str], *, part_rejects: str) -> None:
    with open(out / REJECTS, "w", encoding="utf-8") as dst:
        for name in part_names:
            src = out / name / part_rejects
            if src.is_file():
                with open(src, encoding="utf-8") as f:
                    shutil.copyfileobj(f, dst)
