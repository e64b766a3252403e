"""Pre-flight: is the job's tokenizer the one its shards were built with?

Sizes alone cannot tell: a tokenizer of the same size with other ids trains without an error, and
the exported model then ships a tokenizer its training text was not written in. So every tokenizer
the job uses (--tokenizer, or DATA/tokenizer by default, and --init_from's own tokenizer when that
folder has one) is compared, by vocabulary fingerprint (preprocessing.shard_format.Vocabulary), with
the identity of the shards' vocabulary:
- the fingerprint build_manifest.json records (builds since fingerprints were recorded);
- for an older manifest: the fingerprint of DATA/tokenizer, when its tokenizer.json is the file the
  manifest's sha256 names (that folder is the build's own tokenizer); a folder without a manifest
  is taken as the build's;
- otherwise nothing can be compared (an older manifest and a missing or replaced DATA/tokenizer): a
  warning says so, and only the vocabulary sizes are checked.
A mismatch is a UsageError naming both sides; --allow_tokenizer_mismatch turns it into a warning.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.data.shards import DataInfo, SourceInfo
from pipeline.training import log
from preprocessing.errors import UsageError
from preprocessing.shard_format import (
    MANIFEST,
    TOKENIZER_DIR,
    Vocabulary,
    has_tokenizer,
    read_vocabulary,
    vocabulary_differences,
)


@dataclass
class DataIdentity:
    """The shards' vocabulary: its fingerprint, where that came from, and the shards' own tokenizer
    folder (read now, to name the ids that differ) when there is one."""

    fingerprint: str
    origin: str
    folder: Optional[Vocabulary]


def _source_identity(source: SourceInfo) -> tuple[Optional[DataIdentity], Optional[str]]:
    """(the identity of one source's vocabulary, or None and why it cannot be known)."""
    tok_dir = Path(source.local) / TOKENIZER_DIR
    folder = read_vocabulary(tok_dir) if has_tokenizer(tok_dir) else None
    manifest = source.manifest
    shown = f"{source.path}/{TOKENIZER_DIR}"
    if manifest is not None and manifest.vocab_fingerprint:
        return DataIdentity(manifest.vocab_fingerprint, f"{source.path}/{MANIFEST}", folder), None
    if folder is None:
        return None, f"{source.path} has neither a vocabulary fingerprint in {MANIFEST} nor a {TOKENIZER_DIR}/ folder"
    if manifest is None:
        return DataIdentity(folder.fingerprint, f"{shown} (no {MANIFEST}: taken as the build's)", folder), None
    recorded = manifest.tokenizer.sha256 if manifest.tokenizer else None
    json_file = tok_dir / "tokenizer.json"
    now = hashlib.sha256(json_file.read_bytes()).hexdigest() if json_file.is_file() else None
    if recorded and now == recorded:
        origin = f"{shown} (its tokenizer.json is the one {MANIFEST} names; that manifest predates fingerprints)"
        return DataIdentity(folder.fingerprint, origin, folder), None
    return None, (
        f"{source.path}/{MANIFEST} predates vocabulary fingerprints and {shown}/tokenizer.json is not the file it "
        f"names (sha256 {recorded} there, {now} here)"
    )


def check_tokenizer_identity(
    data: DataInfo, *, tokenizer_dir: str, tokenizer_flag: Optional[str], init_from: Optional[str], allow: bool
) -> None:
    """Raise UsageError (a warning with `allow`) when a tokenizer of the job is not the shards'.

    `tokenizer_dir` is the tokenizer the job loads; `tokenizer_flag` is --tokenizer as given (None when
    the job defaulted to DATA/tokenizer or --init_from's folder); `init_from` is --init_from.
    """
    identities = _known_identities(data)
    problems = _source_mismatches(identities)
    if identities:
        problems += _tokenizer_mismatches(
            *identities[0], tokenizer_dir=tokenizer_dir, tokenizer_flag=tokenizer_flag, init_from=init_from
        )
    if not problems:
        return
    text = "; ".join(problems)
    if allow:
        log.warning(
            f"--allow_tokenizer_mismatch: {text}. Training anyway: the shards' token ids are read as this "
            f"tokenizer's tokens, so the model learns, and exports with this tokenizer, a vocabulary its "
            f"training text was not written in"
        )
        return
    own = f" (the shards' own is {data.tokenizer_dir})" if data.tokenizer_dir else ""
    raise UsageError(
        f"tokenizer mismatch: {text}. Train with the shards' tokenizer{own}, rebuild the shards with this one, or "
        f"pass --allow_tokenizer_mismatch to train anyway"
    )


def _known_identities(data: DataInfo) -> list[tuple[SourceInfo, DataIdentity]]:
    """Each source whose vocabulary's identity is known, with it; a warning for every other source."""
    identities: list[tuple[SourceInfo, DataIdentity]] = []
    for source in data.sources:
        identity, unknown = _source_identity(source)
        if identity is None:
            log.warning(
                f"tokenizer identity: {unknown}; only vocabulary sizes are compared (rebuild the shards to "
                f"record a fingerprint)"
            )
        else:
            identities.append((source, identity))
    return identities


def _source_mismatches(identities: list[tuple[SourceInfo, DataIdentity]]) -> list[str]:
    """One problem for every source tokenized otherwise than the first."""
    problems = []
    for source, identity in identities[1:]:
        first_source, first = identities[0]
        if identity.fingerprint != first.fingerprint:
            problems.append(
                f"--data {source.path} and --data {first_source.path} were tokenized with different tokenizers "
                f"({identity.origin} vs {first.origin}); use one tokenizer for all"
            )
    return problems


def _tokenizer_mismatches(
    source: SourceInfo,
    identity: DataIdentity,
    *,
    tokenizer_dir: str,
    tokenizer_flag: Optional[str],
    init_from: Optional[str],
) -> list[str]:
    """One problem for each of the job's tokenizers (the one it loads, and --init_from's own when that is
    another folder) that is not `source`'s, naming the ids that differ where both folders are at hand."""
    problems = []
    sides = [
        (
            f"--tokenizer {tokenizer_flag}" if tokenizer_flag else f"the job's tokenizer {tokenizer_dir}",
            tokenizer_dir,
        )
    ]
    if init_from and has_tokenizer(init_from) and Path(init_from).resolve() != Path(tokenizer_dir).resolve():
        sides.append((f"--init_from {init_from}'s tokenizer", init_from))
    for label, folder in sides:
        mine = read_vocabulary(folder)
        if mine.fingerprint == identity.fingerprint:
            continue
        if identity.folder is not None and identity.folder.fingerprint != mine.fingerprint:
            where = f"{source.path}/{TOKENIZER_DIR} vs {folder}"
            diffs = "; ".join(vocabulary_differences(identity.folder, mine))
        else:
            where, diffs = "fingerprints", f"{identity.fingerprint[:20]}... vs {mine.fingerprint[:20]}..."
        problems.append(
            f"{label} is not the tokenizer the shards were built with ({identity.origin}); {where}: {diffs}"
        )
    return problems
