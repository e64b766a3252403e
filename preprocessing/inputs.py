"""Input specs (`[en:|zh:]PATH_OR_GLOB`), file formats, and the chunk plan.

A chunk is the unit of work of one Ray task and of determinism: its identity (file, start, end)
depends only on the inputs and the chunk size, never on the number of workers. Text and JSONL
files are cut into byte ranges that the reader later aligns to document boundaries; Parquet and
`datasets` Arrow files are cut into row ranges; compressed files cannot seek and are one chunk each.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from preprocessing.errors import UsageError

LANGS = ("en", "zh")
TEXT_SUFFIXES = {".txt", ".text", ".tok", ".raw"}
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}


@dataclass(frozen=True)
class InputFile:
    """One file to read. kind: 'text' (BERT format), 'jsonl', 'parquet' or 'arrow' (a file of a
    `datasets` save_to_disk folder); compression: None, 'gz' or 'zst'."""
    path: str
    lang: str | None
    kind: str
    compression: str | None
    size: int
    spec: str


@dataclass(frozen=True)
class Chunk:
    """A byte range [start, end) of a text/JSONL file, or a row range of a Parquet/Arrow file.
    nbytes approximates the input bytes it covers (progress bar, MB/s)."""
    index: int
    file: InputFile
    start: int
    end: int
    nbytes: int

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"

    def describe(self) -> str:
        unit = "rows" if self.file.kind in ("parquet", "arrow") else "bytes"
        return f"{self.name} ({self.file.path}, {unit} {self.start}-{self.end})"


def parse_input_spec(spec: str) -> tuple[str | None, str]:
    """'zh:corpora/*.jsonl' -> ('zh', 'corpora/*.jsonl'); 'a.txt' -> (None, 'a.txt')."""
    head, sep, rest = spec.partition(":")
    if sep and head in LANGS:
        return head, rest
    if sep and head.isalpha() and len(head) <= 3 and "/" not in head and not os.path.exists(spec):
        raise UsageError(f"--input {spec}: unknown language prefix '{head}:'; use en: or zh: "
                         "(or no prefix to detect the language per document)")
    return None, spec


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _hf_arrow_files(folder: Path, spec: str) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in order (every split of a DatasetDict), as
    `datasets`' public API lists them (load_from_disk memory-maps them; no row is read)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder), keep_in_memory=False)
    except Exception as err:  # datasets raises FileNotFoundError/ValueError/... depending on the cause
        raise UsageError(f"--input {spec}: cannot open the datasets folder {folder} ({err})") from err
    caches = loaded.cache_files  # {split: [...]} for a DatasetDict, in dataset_dict.json's order
    entries = [e for split in caches.values() for e in split] if isinstance(caches, dict) else caches
    # datasets names them by absolute path; keep the folder as the user spelled it (manifest, rejects)
    return [folder / os.path.relpath(entry["filename"], os.path.abspath(folder)) for entry in entries]


def classify(path: Path) -> tuple[str, str | None]:
    """(kind, compression) from the file name; unknown suffixes are read as BERT-format text."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in PARQUET_SUFFIXES:
        if compression:
            raise UsageError(f"{path}: Parquet files carry their own compression; "
                             f"decompress {path.name} first")
        return "parquet", None
    if last in JSONL_SUFFIXES:
        return "jsonl", compression
    return "text", compression


def resolve_inputs(specs: list[str]) -> list[InputFile]:
    """Expand every --input spec into files, in order (globs sorted). Raises ValueError naming the
    spec for a missing path, an empty glob, a plain directory, or a file listed twice."""
    files: list[InputFile] = []
    seen: dict[str, str] = {}
    for spec in specs:
        lang, pattern = parse_input_spec(spec)
        pattern = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise UsageError(f"--input {spec}: the glob {pattern!r} matched no files")
        else:
            if not os.path.exists(pattern):
                raise UsageError(f"--input {spec}: no such file or directory: {pattern}")
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if path.is_dir():
                if not _is_hf_dataset_dir(path):
                    raise UsageError(
                        f"--input {spec}: {path} is a directory but not a datasets save_to_disk "
                        "folder; pass a glob such as DIR/*.txt")
                pieces = [(p, "arrow", None) for p in _hf_arrow_files(path, spec)]
            else:
                pieces = [(path, *classify(path))]
            for p, kind, compression in pieces:
                key = str(p.resolve())
                if key in seen:
                    raise UsageError(f"--input {spec}: {p} is already read by --input {seen[key]}")
                seen[key] = spec
                files.append(InputFile(path=str(p), lang=lang, kind=kind, compression=compression,
                                       size=p.stat().st_size, spec=spec))
    return files


def _row_counts(file: InputFile, text_field: str) -> list[int]:
    """Rows per row group (Parquet) or per record batch (Arrow). Checks the text column exists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if file.kind == "parquet":
        meta = pq.ParquetFile(file.path)
        names = meta.schema_arrow.names
        counts = [meta.metadata.row_group(i).num_rows for i in range(meta.num_row_groups)]
    else:
        with pa.memory_map(file.path) as source:
            reader = pa.ipc.open_stream(source)
            names = reader.schema.names
            counts = [batch.num_rows for batch in reader]
    if text_field not in names:
        raise UsageError(f"--text_field {text_field}: no such column in {file.path} "
                         f"(from --input {file.spec}); its columns are {names}")
    return counts


def plan_chunks(files: list[InputFile], *, chunk_bytes: int, text_field: str) -> list[Chunk]:
    """Cut every file into chunks of about `chunk_bytes` input bytes, in input order."""
    chunks: list[Chunk] = []

    def add(file: InputFile, start: int, end: int, nbytes: int) -> None:
        chunks.append(Chunk(index=len(chunks), file=file, start=start, end=end, nbytes=nbytes))

    for file in files:
        if file.kind in ("parquet", "arrow"):
            rows = sum(_row_counts(file, text_field))
            if rows == 0:
                continue
            per_chunk = max(1, int(rows * chunk_bytes / max(file.size, 1)))
            for start in range(0, rows, per_chunk):
                end = min(rows, start + per_chunk)
                add(file, start, end, file.size * (end - start) // rows)
        elif file.compression:
            if file.size:
                add(file, 0, file.size, file.size)
        else:
            for start in range(0, file.size, chunk_bytes):
                end = min(file.size, start + chunk_bytes)
                add(file, start, end, end - start)
    return chunks


def auto_chunk_bytes(total_bytes: int) -> int:
    """About 64 chunks for small corpora, at most 64 MB each for large ones (so shards approach
    the 64 MB size limit), and never under 1 MB. Depends only on the input size."""
    mb = 1 << 20
    return int(min(64 * mb, max(1 * mb, total_bytes // 64)))
