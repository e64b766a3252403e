"""Issue 15's builder probes as tests, on real Ray (loopback) and real files: --resume after an
in-place edit, the output inside the input glob, a build stopped before its manifest, and an input
that breaks or vanishes mid-build."""
import gzip
import json
import os
import random
import shutil
import threading
import time

import pytest
from build_helpers import (REPO, english_docs, ray_on_loopback, shard_hashes,
                           small_corpus, write_bert_text)

from preprocessing.builder import main

pytestmark = pytest.mark.multiproc
BUILD_SHARDS = str(REPO / "preprocessing" / "build_shards.py")


@pytest.fixture(scope="module")
def ray_here():
    yield from ray_on_loopback()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def cli(corpus, inputs, out, *extra):
    """build_shards.py arguments: `inputs` with the corpus tokenizer, packed 32, no progress bar."""
    args = [a for spec in inputs for a in ("--input", spec)]
    return args + ["--output", str(out), "--tokenizer", str(corpus.tok_dir), "--format", "packed",
                   "--max_seq_len", "32", "--no_progress", *extra]


def test_resume_refuses_an_input_edited_in_place(ray_here, corpus, tmp_path, capsys):
    """Defect 5: resume compared path, language and size only, so a same-size edit mixed old and
    new text. Now the file's modification time, and a digest of the bytes each finished part was
    made from, are compared too."""
    src = tmp_path / "en.txt"
    src.write_bytes((corpus.dir / "en.txt").read_bytes())
    out = tmp_path / "out"
    args = cli(corpus, [f"en:{src}"], out, "--format", "nsp", "--max_seq_len", "48", "--chunk_mb", "0.004")
    assert main(args) == 0
    clean = shard_hashes(out)
    parts = sorted(out.glob("part-*"))
    assert len(parts) > 4
    for part in parts[-2:]:  # what a build killed before its last two chunks leaves
        shutil.rmtree(part)
    original, st = src.read_bytes(), src.stat()
    edited = original.replace(b"Doc1 sentence0", b"Dox1 sentence0", 1)  # in part-00000, same size
    assert edited != original and len(edited) == len(original)
    src.write_bytes(edited)
    assert main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {src} changed since the build in {out} started" in err and "--overwrite" in err
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # the edit no longer shows in size or time
    assert main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {src} changed since {out / 'part-00000'} was made from it" in err
    src.write_bytes(original)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert main(args + ["--resume"]) == 0
    assert shard_hashes(out) == clean


def test_overwrite_with_the_output_inside_the_input_glob(ray_here, corpus, tmp_path, capsys):
    """The glob used to match the build's own tokenizer/vocab.txt; --overwrite then deleted it
    and crashed after wiping the previous build. The output folder is now never an input."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(corpus.dir / "en.txt", data / "en.txt")
    args = cli(corpus, [f"en:{data}/**/*.txt"], data / "shards")
    assert main(args) == 0
    first = shard_hashes(data / "shards")
    capsys.readouterr()
    assert main(args + ["--overwrite"]) == 0
    manifest = json.loads((data / "shards" / "build_manifest.json").read_text())
    assert [f["path"] for f in manifest["inputs"]] == [str(data / "en.txt")]
    assert shard_hashes(data / "shards") == first
    assert f"skipped 1 path(s) inside --output {data / 'shards'}" in capsys.readouterr().err


def test_a_build_stopped_before_its_manifest_is_replaced_or_resumed(ray_here, corpus, tmp_path, capsys):
    """A kill between tokenizer/ and build_manifest.json left a folder that neither --resume nor
    --overwrite accepted."""
    out = tmp_path / "early"
    args = cli(corpus, [f"en:{corpus.dir / 'en.txt'}"], out)
    shutil.copytree(corpus.tok_dir, out / "tokenizer")
    assert main(args) == 2
    assert "pass --resume to finish the build in it or --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0
    built = shard_hashes(out)
    shutil.rmtree(out)
    shutil.copytree(corpus.tok_dir, out / "tokenizer")
    (out / "build_manifest.json.tmp").write_text('{"status": "runn')
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    assert "no chunk was finished, so the build starts over" in capsys.readouterr().err
    assert shard_hashes(out) == built


def test_an_input_that_breaks_or_vanishes_mid_build_is_named(ray_here, corpus, tmp_path, capsys):
    """Errors inside a chunk task used to surface as a RuntimeError traceback wrapping Ray's; a
    task's UsageError is now the CLI's exit 2, naming the file."""
    rng = random.Random(0)
    text = "".join(f"doc {i} {rng.random()} {rng.random()}\n\n" for i in range(40_000)).encode()
    packed = gzip.compress(text)
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(packed[:len(packed) * 9 // 10])  # the first MB (checked up front) is whole
    assert main(cli(corpus, [f"en:{broken}"], tmp_path / "gz")) == 2
    err = capsys.readouterr().err
    assert f"{broken} (from --input en:{broken}): the compressed stream ends early" in err
    assert "Traceback" not in err

    first = write_bert_text(tmp_path / "first.txt", english_docs(80, seed=5))
    second = write_bert_text(tmp_path / "second.txt", english_docs(5, seed=6))
    out = tmp_path / "vanish"

    def remove_second_once_a_part_is_done():
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "part-00000" / "part_stats.json").exists():
            time.sleep(0.005)
        second.unlink()

    watcher = threading.Thread(target=remove_second_once_a_part_is_done)
    watcher.start()
    try:  # one task at a time, in plan order: second.txt's chunk comes last
        rc = main(cli(corpus, [f"en:{first}", f"en:{second}"], out, "--chunk_mb", "0.004", "--num_workers", "1"))
    finally:
        watcher.join()
    assert rc == 2
    assert f"{second} (from --input en:{second}): disappeared during the build" in capsys.readouterr().err
