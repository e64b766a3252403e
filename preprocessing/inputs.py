"""Input specs (`[en:|zh:]PATH_OR_GLOB`), file formats, and the chunk plan.

A chunk is the unit of work of one Ray task and of determinism: its identity (file, start, end)
depends only on the inputs and the chunk size, never on the number of workers. Text and JSONL
files are cut into byte ranges that the reader later aligns to document boundaries; Parquet and
`datasets` Arrow files are cut into row ranges; compressed files cannot seek and are one chunk each,
as are files in a stream encoding such as UTF-16 (see charsets.py).

Every input must be a regular file (a FIFO or a device cannot be read twice, by byte ranges), and
its state when planned (size, mtime) is recorded: a chunk task refuses a file that changed since, and
`--resume` refuses one that changed since the build started.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from preprocessing import charsets
from preprocessing.errors import UsageError, note

LANGS = ("en", "zh")
TEXT_SUFFIXES = {".txt", ".text", ".tok", ".raw"}
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
MAGIC = {"gz": b"\x1f\x8b", "zst": b"\x28\xb5\x2f\xfd"}


@dataclass(frozen=True)
class InputFile:
    """One file to read. kind: 'text' (BERT format), 'jsonl', 'parquet' or 'arrow' (a file of a
    `datasets` save_to_disk folder); compression: None, 'gz' or 'zst'; encoding: of a text/JSONL
    file; size and mtime_ns: its state when the build planned it."""

    path: str
    lang: str | None
    kind: str
    compression: str | None
    size: int
    spec: str
    mtime_ns: int = 0
    encoding: str = charsets.DEFAULT

    @property
    def byte_ranges(self) -> bool:
        """True when chunks are byte ranges of the file (plain text or JSONL in a line encoding)."""
        return (
            self.kind in ("text", "jsonl") and not self.compression and not charsets.is_stream_encoding(self.encoding)
        )

    def where(self) -> str:
        return f"{self.path} (from --input {self.spec})"


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
        raise UsageError(
            f"--input {spec}: unknown language prefix '{head}:'; use en: or zh: "
            "(or no prefix to detect the language per document)"
        )
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
            raise UsageError(f"{path}: Parquet files carry their own compression; decompress {path.name} first")
        return "parquet", None
    if last in JSONL_SUFFIXES:
        return "jsonl", compression
    return "text", compression


def resolve_inputs(
    specs: list[str], *, encoding_rules: list[tuple[str | None, str]] = (), exclude: str | Path | None = None
) -> list[InputFile]:
    """Expand every --input spec into files, in order (globs sorted). Raises UsageError naming the
    spec for a missing path, an empty glob, a plain directory, a file listed twice, a broken
    symbolic link, something that is not a regular file, a .gz/.zst that is not one, or text that
    is not in its encoding (encoding_rules, from --encoding). Paths inside `exclude` (the output
    folder) are the build's own files: a glob skips them with a note, an explicit path is refused."""
    files: list[InputFile] = []
    seen: dict[str, str] = {}
    inside = _inside(exclude)
    for spec in specs:
        lang, pattern = parse_input_spec(spec)
        for match in _matches(spec, pattern=os.path.expanduser(pattern), inside=inside, exclude=exclude):
            for p, kind, compression in _pieces(Path(match), spec=spec):
                key = str(p.resolve())
                if key in seen:
                    raise UsageError(f"--input {spec}: {p} is already read by --input {seen[key]}")
                seen[key] = spec
                files.append(
                    _input_file(
                        p, kind=kind, compression=compression, lang=lang, spec=spec, encoding_rules=encoding_rules
                    )
                )
    return files


def _matches(spec: str, *, pattern: str, inside, exclude: str | Path | None) -> list[str]:
    """The paths one spec's pattern names: a glob's matches, sorted, less those inside `exclude` (with a
    note); or the one explicit path, which must exist and lie outside `exclude`."""
    if glob.has_magic(pattern):
        matches = sorted(glob.glob(pattern, recursive=True))
        own = [m for m in matches if inside(m)]
        matches = [m for m in matches if not inside(m)]
        if own:
            note(f"--input {spec}: skipped {len(own)} path(s) inside --output {exclude} (the build's own files)")
        if not matches:
            extra = f" outside --output {exclude}" if own else ""
            raise UsageError(f"--input {spec}: the glob {pattern!r} matched no files{extra}")
        return matches
    if not os.path.lexists(pattern):
        raise UsageError(f"--input {spec}: no such file or directory: {pattern}")
    if inside(pattern):
        raise UsageError(
            f"--input {spec}: is inside --output {exclude}; a build cannot read its own output: choose another --output"
        )
    return [pattern]


def _pieces(path: Path, *, spec: str) -> list[tuple[Path, str, str | None]]:
    """(file, kind, compression) for one matched path: itself, or the Arrow files of a `datasets`
    save_to_disk folder. Refuses a broken symbolic link and any other directory."""
    if path.is_symlink() and not path.exists():
        raise UsageError(f"--input {spec}: {path} is a broken symbolic link (to {os.readlink(path)}); fix or remove it")
    if path.is_dir():
        if not _is_hf_dataset_dir(path):
            raise UsageError(
                f"--input {spec}: {path} is a directory but not a datasets save_to_disk "
                "folder; pass a glob such as DIR/*.txt"
            )
        return [(p, "arrow", None) for p in _hf_arrow_files(path, spec)]
    return [(path, *classify(path))]


def _input_file(
    p: Path, *, kind: str, compression: str | None, lang: str | None, spec: str, encoding_rules
) -> InputFile:
    """The InputFile for a regular file with its state now; a text/JSONL file's encoding from
    `encoding_rules`, and a non-empty one's content checked."""
    st = _regular_file_stat(p, spec)
    encoding = charsets.encoding_for(str(p), list(encoding_rules)) if kind in ("text", "jsonl") else charsets.DEFAULT
    file = InputFile(
        path=str(p),
        lang=lang,
        kind=kind,
        compression=compression,
        size=st.st_size,
        spec=spec,
        mtime_ns=st.st_mtime_ns,
        encoding=encoding,
    )
    if kind in ("text", "jsonl") and file.size:
        _check_content(file)
    return file


def _inside(folder: str | Path | None):
    """A test: is a path (after symbolic links) inside `folder`, or `folder` itself?"""
    if folder is None:
        return lambda path: False
    root = Path(folder).resolve()

    def test(path: str) -> bool:
        resolved = Path(path).resolve()
        return resolved == root or root in resolved.parents

    return test


_FILE_TYPES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _regular_file_stat(path: Path, spec: str) -> os.stat_result:
    try:
        st = path.stat()
    except OSError as err:
        raise UsageError(f"--input {spec}: cannot read {path} ({err.strerror or err})") from err
    if not stat.S_ISREG(st.st_mode):
        what = next((name for test, name in _FILE_TYPES if test(st.st_mode)), "not a regular file")
        raise UsageError(
            f"--input {spec}: {path} is {what}; the builder reads each input more than once "
            "and by byte ranges, so it needs a regular file: save the stream to a file first"
        )
    return st


def _check_content(file: InputFile) -> None:
    """A compressed file starts with its format's magic bytes; the first MB of text is plausibly in
    the file's encoding (charsets.check_sample). Reads at most that MB."""
    where = file.where()
    if file.compression:
        with reading(file), open(file.path, "rb") as f:
            magic = f.read(len(MAGIC[file.compression]))
        if magic != MAGIC[file.compression]:
            name = {"gz": "gzip", "zst": "zstd"}[file.compression]
            raise UsageError(
                f"{where}: is named like a {name} file but is not {name} data (it starts with "
                f"{magic!r}); rename it to what it is, or compress it with {name}"
            )
    with reading(file), open_source(file, transcode=False) as f:
        head = f.read(charsets.SNIFF_BYTES)
    charsets.check_sample(head, encoding=file.encoding, where=file.path)


@contextlib.contextmanager
def reading(file: InputFile) -> Iterator[None]:
    """Turn the OS and decompressor errors of reading `file` into a UsageError naming it."""
    import zstandard

    where = file.where()
    try:
        yield
    except FileNotFoundError as err:
        raise UsageError(
            f"{where}: disappeared during the build; put it back unchanged and rerun with "
            "--resume, or rebuild without it"
        ) from err
    except EOFError as err:
        raise UsageError(
            f"{where}: the compressed stream ends early, so the file is truncated ({err}); "
            "download or compress it again, or leave it out"
        ) from err
    except (gzip.BadGzipFile, zlib.error, zstandard.ZstdError) as err:
        raise UsageError(
            f"{where}: is not valid {file.compression} data ({err}); download or compress it again, or leave it out"
        ) from err
    except OSError as err:
        raise UsageError(f"{where}: cannot be read ({err.strerror or err})") from err


def open_source(file: InputFile, *, transcode: bool = True) -> BinaryIO:
    """The file's bytes, decompressed, and (unless told not to) transcoded to UTF-8 for a stream
    encoding."""
    if file.compression == "gz":
        raw: BinaryIO = gzip.open(file.path, "rb")
    elif file.compression == "zst":
        raw = io.BufferedReader(_ZstdStream(open(file.path, "rb")), buffer_size=1 << 20)
    else:
        raw = open(file.path, "rb")
    if transcode and charsets.is_stream_encoding(file.encoding):
        raw = io.BufferedReader(charsets.Utf8Transcoder(raw, file.encoding), buffer_size=1 << 20)
    return raw


class _ZstdStream(io.RawIOBase):
    """Decompressed zstd frames, one after the other; EOFError when the data ends inside a frame
    (zstandard's stream_reader returns a truncated file's first part as if it were all of it)."""

    def __init__(self, raw: BinaryIO):
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._buf):
            data = self._raw.read(1 << 20)
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd data ends inside a frame")
                return 0
            out = []
            while data:
                out.append(self._obj.decompress(data))
                self._in_frame = True
                if self._obj.eof:  # a frame ended; what follows is the next one
                    data, self._obj, self._in_frame = self._obj.unused_data, self._dctx.decompressobj(), False
                else:
                    data = b""
            self._buf, self._pos = b"".join(out), 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def check_unchanged(file: InputFile) -> None:
    """Raise UsageError when `file` is not as the build planned it (size, modification time)."""
    with reading(file):
        st = os.stat(file.path)
    if (st.st_size, st.st_mtime_ns) != (file.size, file.mtime_ns):
        raise UsageError(
            f"{file.where()}: changed during the build (size {file.size:,} -> {st.st_size:,} "
            "bytes, or its modification time); rebuild once it stays unchanged"
        )


def digest(path: str, lo: int, hi: int, *, cache: dict | None = None) -> str:
    """xxh64 of bytes [lo, hi) of a file. `cache`, a dict the caller keeps for one pass (the
    chunks of a Parquet file all cover the whole file), saves hashing a range twice; nothing is
    kept across calls otherwise: a file edited with its time restored must hash anew."""
    import xxhash

    if cache is not None and (path, lo, hi) in cache:
        return cache[path, lo, hi]
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        f.seek(lo)
        remaining = hi - lo
        while remaining > 0:
            data = f.read(min(8 << 20, remaining))
            if not data:
                break
            h.update(data)
            remaining -= len(data)
    if cache is not None:
        cache[path, lo, hi] = h.hexdigest()
    return h.hexdigest()


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
        raise UsageError(
            f"--text_field {text_field}: no such column in {file.path} "
            f"(from --input {file.spec}); its columns are {names}"
        )
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
        elif not file.byte_ranges:
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
