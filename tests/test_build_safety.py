"""Issue 15's builder probes as tests, on real Ray (loopback) and real files: the output inside the
input glob, and an input that breaks or vanishes mid-build."""
import gzip
import json
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
