"""Streaming readers: one chunk of one input file -> raw documents, with bad input counted.

Memory stays bounded by the chunk's own documents: files are read line by line with a cap on the
line length (a line longer than MAX_LINE_BYTES is cut into pieces at a space or a character
boundary), never whole. A chunk owns the documents that start inside its byte range: both of its
ends are moved forward to the next document boundary, a blank line (`\\n\\n`; `\\n` for JSONL),
so neighbouring chunks agree on who reads what.

Lines are decoded in the file's encoding (charsets.py); a UTF-8 byte-order mark at the start of a
file is dropped (a JSON parser would refuse the first record for it). An input that vanishes, or
compressed data that is truncated or corrupt, is a UsageError naming the file (inputs.reading).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from preprocessing import charsets
from preprocessing.inputs import Chunk, open_source, reading

MAX_LINE_BYTES = 1 << 20
"""Text lines are handed on in pieces of at most this many bytes."""
MAX_DOC_PART_BYTES = 4 << 20
"""A longer text-format document is handed on in parts of about this size (same document)."""
MAX_JSON_LINE_BYTES = 64 << 20
"""A JSONL line must be parsed whole; longer lines are skipped, counted and logged."""
MAX_LOGGED_REJECTS = 1000
"""Per reason and chunk, rejects.jsonl lists this many; the counts always cover all of them."""

_BOUNDARY = {"text": re.compile(rb"\n\r?\n"), "jsonl": re.compile(rb"\n")}
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass
class RawDocument:
    """A document's lines as decoded text, and where it starts: `line` is 1-based and relative to
    the chunk's first line (text, JSONL) or the row index in the file (Parquet, Arrow). A very
    long document comes in parts: `part` counts them from 0, `last` marks the final one."""

    lines: list[str]
    line: int
    part: int = 0
    last: bool = True


@dataclass
class ChunkReader:
    """Iterate `documents()`; afterwards `counts` holds documents_in, skipped_* reasons,
    non_utf8_replacements and long_line_pieces, `rejects` the logged problems, and `span` the
    bytes [lo, hi) of the file the documents depend on (the whole file unless it is read by byte
    ranges; then the chunk's range as aligned, with the bytes the alignment looked at)."""

    chunk: Chunk
    text_field: str = "text"
    counts: Counter = field(default_factory=Counter)
    rejects: list[dict] = field(default_factory=list)
    span: tuple[int, int] | None = None
    _first_line: int | None = None
    _aligned_start: int = 0

    @property
    def first_document_at(self) -> int:
        """Byte offset of the chunk's first document start, once documents() has begun (at or past
        the chunk's end when it has none: a long document of an earlier chunk covers it)."""
        return self._aligned_start

    # ---- bookkeeping ------------------------------------------------------------------------
    def location(self, relative_line: int) -> dict:
        """{'file', 'line'} or {'file', 'row'}: absolute position of a relative line/row."""
        if self.chunk.file.kind in ("parquet", "arrow"):
            return {"file": self.chunk.file.path, "row": relative_line}
        if self._first_line is None:
            self._first_line = _count_newlines(self.chunk.file.path, self._aligned_start)
        return {"file": self.chunk.file.path, "line": self._first_line + relative_line}

    def reject(self, reason: str, relative_line: int, **extra) -> None:
        """Count a problem; log it with its file and line unless this reason is already logged
        MAX_LOGGED_REJECTS times in this chunk."""
        self.counts[f"rejects_{reason}"] += 1
        if self.counts[f"rejects_{reason}"] <= MAX_LOGGED_REJECTS:
            self.rejects.append({"reason": reason, **self.location(relative_line), **extra})
        else:
            self.counts["rejects_not_logged"] += 1

    def skip(self, reason: str, relative_line: int, **extra) -> None:
        """A document that will not be written: counted under documents_skipped[reason]."""
        self.counts[f"skipped_{reason}"] += 1
        self.reject(reason, relative_line, **extra)

    def decode(self, data: bytes, relative_line: int) -> str:
        """Decode in the file's encoding; undecodable bytes become U+FFFD, are counted and the line
        is logged."""
        encoding = self.chunk.file.encoding
        # A stream encoding reaches us already transcoded to UTF-8 (inputs.open_source).
        line_encoding = charsets.DEFAULT if charsets.is_stream_encoding(encoding) else encoding
        text, replaced = charsets.decode(data, line_encoding)
        if replaced:
            self.counts["non_utf8_replacements"] += replaced
            if encoding == charsets.DEFAULT:
                self.reject("non_utf8_replaced", relative_line, replaced=replaced)
            else:
                self.reject("undecodable_replaced", relative_line, replaced=replaced, encoding=encoding)
        return text

    # ---- documents ----------------------------------------------------------------------------
    def documents(self) -> Iterator[RawDocument]:
        kind = self.chunk.file.kind
        if kind == "text":
            yield from self._text_documents()
        elif kind == "jsonl":
            yield from self._jsonl_documents()
        else:
            yield from self._table_documents()

    def _lines(self) -> Iterator[tuple[bytes, int, bool]]:
        """(bytes, relative line number, line_complete) for the chunk's lines; long lines come in
        several pieces, all but the last with line_complete=False. Trailing newlines stripped."""
        file = self.chunk.file
        boundary = _BOUNDARY[file.kind]
        utf8 = file.encoding == charsets.DEFAULT or charsets.is_stream_encoding(file.encoding)
        with reading(file), open_source(file) as f:
            if not file.byte_ranges:
                start, end = 0, float("inf")
                self.span = (0, file.size)
            else:
                start = _align(f, self.chunk.start, boundary=boundary)
                end = _align(f, self.chunk.end, boundary=boundary) if self.chunk.end < file.size else file.size
                self.span = (max(0, self.chunk.start - 3), max(start, end))  # see _align's look-back
                f.seek(start)
            self._aligned_start = start
            pos, line_no, carry, at_line_start = start, 0, b"", True
            while not (at_line_start and pos >= end):
                limit = MAX_LINE_BYTES - len(carry)
                data = f.readline(limit)
                piece, carry = carry + data, b""
                if not piece:
                    break
                if pos == 0 and piece.startswith(_UTF8_BOM):
                    piece, pos = piece[len(_UTF8_BOM) :], len(_UTF8_BOM)
                if piece.endswith(b"\n") or len(data) < limit:  # a whole line, or the last one
                    pos += len(piece)
                    line_no += 1
                    at_line_start = True
                    yield piece.rstrip(b"\r\n"), line_no, True
                else:
                    cut = _safe_cut(piece, utf8=utf8)
                    carry = piece[cut:]
                    pos += cut
                    at_line_start = False
                    self.counts["long_line_pieces"] += 1
                    yield piece[:cut], line_no + 1, False

    def _text_documents(self) -> Iterator[RawDocument]:
        lines: list[str] = []
        first, part, size, line_blank = 0, 0, 0, True
        for data, line_no, complete in self._lines():
            if data.strip():
                if not lines and part == 0:
                    first = line_no
                    self.counts["documents_in"] += 1
                lines.append(self.decode(data, line_no))
                size += len(data)
                line_blank = False
                if size >= MAX_DOC_PART_BYTES:  # hand a giant document on in parts
                    yield RawDocument(lines, first, part=part, last=False)
                    lines, size, part = [], 0, part + 1
            if complete:
                if line_blank and (lines or part):  # a blank line ends the document
                    yield RawDocument(lines, first, part=part, last=True)
                    lines, size, part = [], 0, 0
                line_blank = True
        if lines or part:
            yield RawDocument(lines, first, part=part, last=True)

    def _jsonl_documents(self) -> Iterator[RawDocument]:
        parts: list[bytes] = []
        size = 0
        too_long = False
        for data, line_no, complete in self._lines():
            if not too_long:
                parts.append(data)
                size += len(data)
                too_long = size > MAX_JSON_LINE_BYTES
            if not complete:
                continue
            data, parts, size = b"".join(parts), [], 0
            if too_long:
                too_long = False
                self.counts["documents_in"] += 1
                self.skip("line_too_long", line_no, limit_bytes=MAX_JSON_LINE_BYTES)
                continue
            if not data.strip():
                continue  # blank lines separate nothing in JSONL; not a document
            self.counts["documents_in"] += 1
            text = self.decode(data, line_no)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                self.skip("malformed_json", line_no, error=str(err)[:200])
                continue
            value = self._field(obj, line_no)
            if value is not None:
                yield RawDocument(value.split("\n"), line_no)

    def _field(self, obj: object, where: int) -> str | None:
        """The text field of a JSON object / table row, or None after counting why not."""
        if not isinstance(obj, dict):
            self.skip("malformed_json", where, error=f"expected a JSON object, got {type(obj).__name__}")
            return None
        value = obj.get(self.text_field)
        if value is None:
            self.skip("missing_field", where, field=self.text_field)
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return "\n".join(value)
        if not isinstance(value, str):
            self.skip("bad_field_type", where, field=self.text_field, type=type(value).__name__)
            return None
        return value

    def _table_documents(self) -> Iterator[RawDocument]:
        self.span = (0, self.chunk.file.size)
        with reading(self.chunk.file):
            yield from self._table_rows()

    def _table_rows(self) -> Iterator[RawDocument]:
        for row, value in _table_rows(self.chunk, self.text_field):
            self.counts["documents_in"] += 1
            if value is None:
                self.skip("missing_field", row, field=self.text_field)
                continue
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                value = "\n".join(value)
            if not isinstance(value, str):
                self.skip("bad_field_type", row, field=self.text_field, type=type(value).__name__)
                continue
            yield RawDocument(value.split("\n"), row)


def _table_rows(chunk: Chunk, text_field: str) -> Iterator[tuple[int, object]]:
    """(row index, value) for rows [start, end) of a Parquet or Arrow (IPC stream) file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if chunk.file.kind == "parquet":
        pf = pq.ParquetFile(chunk.file.path)
        groups, first, offset = [], None, 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if offset + n > chunk.start and offset < chunk.end:
                groups.append(g)
                first = offset if first is None else first
            offset += n
        batches = pf.iter_batches(batch_size=1024, row_groups=groups, columns=[text_field]) if groups else []
        row = first or 0
    else:
        source = pa.memory_map(chunk.file.path)
        batches = pa.ipc.open_stream(source)
        row = 0
    for batch in batches:
        n = batch.num_rows
        if row + n > chunk.start and row < chunk.end:
            lo, hi = max(chunk.start - row, 0), min(chunk.end - row, n)
            values = batch.column(batch.schema.get_field_index(text_field)).slice(lo, hi - lo).to_pylist()
            for i, value in enumerate(values):
                yield row + lo + i, value
        row += n
        if row >= chunk.end:
            break


def _align(f: BinaryIO, offset: int, *, boundary: re.Pattern, block: int = 1 << 20) -> int:
    """The first document start at or after `offset`: just past the next boundary match that ends
    at or after `offset` (0 stays 0; end of file if none). Scans in blocks, O(1) memory."""
    if offset <= 0:
        return 0
    back = 3  # a boundary may straddle `offset`: "\n" at offset-2, "\r\n" at offset-1...
    pos = max(0, offset - back)
    f.seek(pos)
    tail = b""
    while True:
        data = f.read(block)
        if not data:
            return pos + len(tail)
        buf = tail + data
        base = pos - len(tail)
        for m in boundary.finditer(buf):
            if base + m.end() >= offset:
                return base + m.end()
        pos += len(data)
        tail = buf[-back:]


def _safe_cut(piece: bytes, *, utf8: bool = True) -> int:
    """Where to cut an over-long line piece: after the last space or Chinese full stop in its
    second half, else at a UTF-8 character boundary. In another encoding only a space or tab is
    a safe cut (a cut elsewhere may split a character, which then counts as undecodable)."""
    half = len(piece) // 2
    for sep in (b"\xe3\x80\x82", b" ", b"\t") if utf8 else (b" ", b"\t"):  # 。 first: Chinese rarely has spaces
        i = piece.rfind(sep, half)
        if i > 0:
            return i + len(sep)
    cut = len(piece)
    if not utf8:
        return cut
    while cut > 0 and (piece[cut - 1] & 0xC0) == 0x80:
        cut -= 1  # step back over continuation bytes...
    if cut > 0 and piece[cut - 1] >= 0xC0:
        cut -= 1  # ...and the lead byte of the character they belong to
    return cut or len(piece)


def _count_newlines(path: str, end: int, *, block: int = 8 << 20) -> int:
    """Number of lines before byte `end` (so the line starting at `end` is this + 1)."""
    n = 0
    with open(path, "rb") as f:
        remaining = end
        while remaining > 0:
            data = f.read(min(block, remaining))
            if not data:
                break
            n += data.count(b"\n")
            remaining -= len(data)
    return n
