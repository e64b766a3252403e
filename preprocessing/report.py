"""The build's account: per-part stats summed into the manifest's counts, package versions, and the
summary table printed at the end (the same numbers as build_manifest.json)."""

from __future__ import annotations

import platform
from collections import Counter
from importlib import metadata

from preprocessing.shard_format import BuildManifest, Counts

PACKAGES = (
    "tokencl",
    "tokenizers",
    "transformers",
    "mosaicml-streaming",
    "ray",
    "numpy",
    "pyarrow",
    "rjieba",
    "zstandard",
)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def aggregate(part_stats: list[dict], *, fmt: str) -> Counts:
    """Sum the parts' counters into the manifest's counts, the held-out split's (each part's
    "eval") into counts.eval; checks that every document is accounted for:
    documents_in == documents_written + sum(documents_skipped), held-out documents among the written."""
    total: Counter = Counter()
    for stats in part_stats:
        total.update(stats["counts"])
    skipped = {k[len("skipped_") :]: v for k, v in sorted(total.items()) if k.startswith("skipped_") and v}
    rejects = {
        k[len("rejects_") :]: v
        for k, v in sorted(total.items())
        if k.startswith("rejects_") and k != "rejects_not_logged" and v
    }
    counts = _made(total, fmt=fmt)
    counts.documents_in = total["documents_in"]
    counts.documents_written = total["documents_written"]
    counts.documents_skipped = skipped
    counts.documents_split = total["documents_split"]
    counts.input_bytes = total["input_bytes"]
    counts.non_utf8_replacements = total["non_utf8_replacements"]
    counts.long_line_pieces = total["long_line_pieces"]
    counts.problems_by_reason = rejects
    counts.problems_not_logged = total["rejects_not_logged"]
    if any("eval" in stats for stats in part_stats):
        held: Counter = Counter()
        for stats in part_stats:
            held.update(stats.get("eval", {}))
        counts.eval = _made(held, fmt=fmt)
        counts.eval.documents_in = counts.eval.documents_written = held["documents"]
    accounted = counts.documents_written + sum(skipped.values())
    assert counts.documents_in == accounted, (
        f"internal error: {counts.documents_in} documents in, {accounted} accounted for"
    )
    return counts


def _made(total: Counter, *, fmt: str) -> Counts:
    """The counts of what one split made: sentences, tokens, samples, shards."""
    counts = Counts(
        sentences=total["sentences"],
        tokens=total["tokens"],
        tokens_by_lang={"en": total["tokens_en"], "zh": total["tokens_zh"]},
        samples=total["samples"],
        tokens_in_samples=total["tokens_in_samples"],
        shards=total["shards"],
        bytes=total["bytes"],
    )
    if fmt == "nsp":
        counts.nsp_random_next = total["nsp_random_next"]
        counts.nsp_blocks_with_donors = total["nsp_blocks_with_donors"]
        counts.tokens_truncated = total["tokens_truncated"]
    else:
        counts.tokens_dropped_tail = total["tokens_dropped_tail"]
    return counts


def format_summary(manifest: BuildManifest) -> str:
    """A readable table of the manifest's counts (of a finished build)."""
    m, c, tok = manifest, manifest.counts, manifest.tokenizer
    assert c is not None and tok is not None, "format_summary needs a finished build's manifest"
    rows = [
        ("output", m.config["output"]),
        ("format", f"{m.format}, max_seq_len {m.max_seq_len}, seed {m.config['seed']}"),
        ("tokenizer", f"{tok.kind} ({tok.vocab_size} tokens)"),
        ("input", f"{c.input_bytes / 1e6:.1f} MB in {m.chunks} chunks ({m.chunks_resumed} already done)"),
        (
            "wall time",
            f"{m.wall_s:.1f} s  ({m.mb_per_s:.2f} MB/s, "
            f"{m.workers} workers, peak RSS/worker {m.peak_rss_mb_per_worker:.0f} MB)",
        ),
        ("documents in", f"{c.documents_in:,}"),
        (
            "documents written",
            f"{c.documents_written:,}"
            + (
                f"  (train {c.documents_written - c.eval.documents_written:,}, eval {c.eval.documents_written:,})"
                if c.eval
                else ""
            ),
        ),
    ]
    rows += [(f"  skipped: {k}", f"{v:,}") for k, v in c.documents_skipped.items()]
    rows += [
        ("sentences", f"{c.sentences:,}"),
        ("tokens", f"{c.tokens:,}  (en {c.tokens_by_lang['en']:,}, zh {c.tokens_by_lang['zh']:,})"),
        (
            "samples",
            f"{c.samples:,}" + (f"  ({c.nsp_random_next:,} with a random B)" if c.nsp_random_next is not None else ""),
        ),
    ]
    if c.tokens_truncated is not None:
        rows.append(("tokens truncated", f"{c.tokens_truncated:,}"))
    if c.tokens_dropped_tail is not None:
        rows.append(("tokens dropped (tails)", f"{c.tokens_dropped_tail:,}"))
    rows += [
        ("shards", f"{c.shards:,}  ({c.bytes / 1e6:.1f} MB, zstd)"),
        *_held_out_rows(c.eval),
        ("non-UTF-8 replaced", f"{c.non_utf8_replacements:,}"),
        ("problems logged", f"{sum(c.problems_by_reason.values()) - c.problems_not_logged:,}  (rejects.jsonl)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _held_out_rows(held: Counts | None) -> list[tuple[str, str]]:
    """The held-out folder's row (OUTPUT/eval); the sentences, tokens, samples and shards above are
    the training folder's."""
    if held is None:
        return []
    return [
        (
            "eval (OUTPUT/eval)",
            f"{held.documents_written:,} documents, {held.tokens:,} tokens, {held.samples:,} samples, "
            f"{held.shards:,} shards ({held.bytes / 1e6:.1f} MB)",
        )
    ]


def explain_no_samples(counts: Counts, *, fmt: str, max_seq_len: int) -> str:
    """Why a build wrote nothing, from its counts, and what would change that."""
    skipped = ", ".join(f"{k} {v:,}" for k, v in counts.documents_skipped.items()) or "none"
    why = (
        f"{counts.documents_in:,} documents read, {counts.documents_written:,} written "
        f"(skipped: {skipped}; rejects.jsonl lists each one)"
    )
    if counts.documents_in == 0:
        return why + "; the inputs hold no documents"
    if fmt == "packed" and counts.tokens_dropped_tail:
        return (
            why + f"; --format packed drops what is left of each chunk after its last full block of "
            f"{max_seq_len} tokens ({counts.tokens_dropped_tail:,} tokens here): give more text, a "
            "smaller --max_seq_len or a larger --chunk_mb"
        )
    return why + "; every document was skipped"
