"""Text encodings of the inputs: which one each file is read in (--encoding), a per-file check that
a file is plausibly in it, and decoding that counts what it cannot decode.

UTF-8 is the default. Other encodings in which b"\\n" is only ever a newline (GBK, GB18030, Big5,
Shift_JIS, EUC-KR, Latin-1, cp1252...) are decoded line by line, so their files are still cut into
byte ranges. UTF-16/32 and the stateful encodings (ISO-2022, HZ, UTF-7) are transcoded to UTF-8 as
one stream, one chunk per file. A file whose first MB has a UTF-16/32 byte-order mark, many NUL
bytes, or more than 1% undecodable characters is refused, naming it and the flag that reads it:
decoding it anyway would fill the shards with garbage that no later step notices.
"""

from __future__ import annotations

import codecs
import fnmatch
import io
import os
from typing import BinaryIO

from preprocessing.errors import UsageError

DEFAULT = "utf-8"
SNIFF_BYTES = 1 << 20
MAX_BAD_SHARE = 0.01
MIN_BAD = 16
"""A sample is refused when at least MIN_BAD and MAX_BAD_SHARE of its characters cannot be decoded:
a few broken bytes are counted and logged per line (non_utf8_replaced); a wrong encoding is not."""

_MARK = "tokencl.mark"
_MARK_CHAR = "\udcff"  # a lone surrogate: no decoder produces one, so each one is a decoding error
codecs.register_error(_MARK, lambda err: (_MARK_CHAR, err.end))
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),  # before UTF-16 LE's FF FE
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_GUESSES = ("gb18030", "big5", "shift_jis", "euc_kr", "cp1252")


def canonical(name: str) -> str:
    """Python's name of an encoding ('UTF8' -> 'utf-8'); 'utf-8-sig' is 'utf-8' (the reader drops
    a UTF-8 byte-order mark anyway). Raises LookupError for an unknown name."""
    real = codecs.lookup(name).name
    return DEFAULT if real == "utf-8-sig" else real


def parse_rules(values: list[str]) -> list[tuple[str | None, str]]:
    """--encoding values, 'ENC' (every text/JSONL input) or 'GLOB=ENC' (inputs whose path or file
    name matches GLOB), into (pattern or None, encoding); later rules win."""
    rules = []
    for value in values:
        pattern, sep, name = value.rpartition("=")
        try:
            rules.append((pattern if sep else None, canonical(name.strip())))
        except LookupError:
            raise UsageError(
                f"--encoding {value}: unknown encoding {name.strip()!r}; use a Python codec "
                "name such as utf-8, utf-16, gbk, gb18030, big5, shift_jis or latin-1"
            ) from None
    return rules


def encoding_for(path: str, rules: list[tuple[str | None, str]]) -> str:
    encoding = DEFAULT
    for pattern, name in rules:
        if pattern is None or fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(os.path.basename(path), pattern):
            encoding = name
    return encoding


def is_stream_encoding(encoding: str) -> bool:
    """True when a byte range cannot be cut at b"\\n": the file is transcoded whole."""
    return "\n".encode(encoding) != b"\n" or encoding in ("hz", "utf-7") or encoding.startswith("iso2022")


def decode(data: bytes, encoding: str) -> tuple[str, int]:
    """(text, undecodable sequences, each now U+FFFD)."""
    try:
        return data.decode(encoding), 0
    except UnicodeDecodeError:
        text = data.decode(encoding, errors=_MARK)
        bad = text.count(_MARK_CHAR)
        return text.replace(_MARK_CHAR, "\ufffd"), bad


def check_sample(head: bytes, *, encoding: str, where: str) -> None:
    """Raise UsageError naming `where` (a file) when `head`, its first bytes, cannot be text in
    `encoding`, with the --encoding value that would read it when it can be told."""
    if not is_stream_encoding(encoding):
        for bom, name in _BOMS:
            if head.startswith(bom):
                raise UsageError(
                    f"{where}: starts with a {name.upper()} byte-order mark, so it is not "
                    f"{encoding} text; pass --encoding '{where}={name}' to read it "
                    "(or convert it to UTF-8)"
                )
        nul = head.count(0)
        if nul >= MIN_BAD and nul >= len(head) / 20:
            guess = "utf-16-le" if head[1::2].count(0) > head[0::2].count(0) else "utf-16-be"
            raise UsageError(
                f"{where}: {nul:,} of its first {len(head):,} bytes are NUL, as in UTF-16 or "
                f"UTF-32 text, so it is not {encoding} text; pass --encoding '{where}={guess}' "
                "(or its real encoding) to read it, or convert it to UTF-8"
            )
    try:
        text = codecs.getincrementaldecoder(encoding)(errors=_MARK).decode(head, final=False)
    except UnicodeError as err:  # 'utf-16' without a byte-order mark, for one
        raise UsageError(
            f"{where}: cannot be read as {encoding} ({err}); name the byte order, e.g. "
            f"--encoding '{where}={encoding}-le'"
        ) from None
    bad = text.count(_MARK_CHAR)
    if bad >= MIN_BAD and bad >= MAX_BAD_SHARE * len(text):
        guess = next((g for g in _GUESSES if g != encoding and _decodes(head, g)), None)
        hint = f" (it decodes cleanly as {guess})" if guess else ""
        raise UsageError(
            f"{where}: {bad:,} of its first {len(text):,} characters are not valid {encoding} "
            f"({100 * bad / max(len(text), 1):.1f}%), so it is in another encoding{hint}; pass "
            f"--encoding '{where}={guess or 'ENCODING'}' naming its encoding to read it, or "
            "convert it to UTF-8"
        )


def _decodes(head: bytes, encoding: str) -> bool:
    try:
        codecs.getincrementaldecoder(encoding)().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


class Utf8Transcoder(io.RawIOBase):
    """UTF-8 bytes of a binary stream in a stream encoding (UTF-16...). Undecodable sequences come
    out as the byte 0xFF, which is never UTF-8, so the reader counts and logs them per line as it
    does for broken UTF-8."""

    def __init__(self, raw: BinaryIO, encoding: str):
        self._raw = raw
        self._decoder = codecs.getincrementaldecoder(encoding)(errors=_MARK)
        self._buf = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._buf):
            data = self._raw.read(1 << 20)
            text = self._decoder.decode(data, final=not data)
            if not data and not text:
                return 0
            self._buf, self._pos = text.encode("utf-8", errors="surrogateescape"), 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()
