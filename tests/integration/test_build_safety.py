"""Issue 15's builder probes as tests, on real Ray (loopback) and real files: two builds into one
--output, --resume after an in-place edit, the output inside the input glob, a build stopped before
its manifest, a build that writes nothing, an input that breaks or vanishes mid-build, NSP's random
B, the worker cap, Ray's processes after a kill -9 of the builder, and no network request."""

import gzip
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from preprocessing.builder import build_shards, main
from tests.support.builder import (
    REPO,
    config,
    english_docs,
    kill_tree,
    ray_on_loopback,
    read_samples,
    shard_hashes,
    small_corpus,
    squash,
    write_bert_text,
)

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
    return args + [
        "--output",
        str(out),
        "--tokenizer",
        str(corpus.tok_dir),
        "--format",
        "packed",
        "--max_seq_len",
        "32",
        "--no_progress",
        *extra,
    ]


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


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 160 kB tmpfs: a real file system that fills up (mounting needs root or CAP_SYS_ADMIN; the
    test is skipped where that is refused). Yields (mount point, a function that resizes it)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield mnt, lambda size: subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_is_one_line_naming_the_output_and_the_build_resumes(
    ray_here, corpus, tmp_path, small_tmpfs, capsys
):
    """Issue 31: ENOSPC while a chunk task wrote its shards ended the build with a RuntimeError
    traceback. Now: exit 2, one line naming the output folder and what to free; after freeing space,
    --resume finishes it with the shards a build that never ran out of space makes."""
    mnt, resize = small_tmpfs
    src = tmp_path / "en.txt"
    src.write_text((corpus.dir / "en.txt").read_text(encoding="utf-8") * 20, encoding="utf-8")
    out = mnt / "out"
    args = cli(corpus, [f"en:{src}"], out, "--chunk_mb", "0.05")
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("build_shards.py: error:")]
    assert len(err) == 1, err
    assert f"--output {out}: its file system is full (No space left on device" in err[0]
    assert re.search(r"free about [\d.]+ [kM]B more for the [\d.]+ [kM]B of input left", err[0]), err[0]
    assert err[0].endswith("then rerun with --resume to continue the build (finished parts are kept)")
    assert json.loads((out / "build_manifest.json").read_text())["status"] == "running"
    resize("16m")
    assert main(args + ["--resume"]) == 0
    assert main(cli(corpus, [f"en:{src}"], tmp_path / "clean", "--chunk_mb", "0.05")) == 0
    assert shard_hashes(out) == shard_hashes(tmp_path / "clean")


def test_a_build_that_writes_no_sample_exits_2_saying_why(ray_here, corpus, tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("A short document.\n\nAnother one.\n")
    out = tmp_path / "none"
    assert main(cli(corpus, [f"en:{tiny}"], out, "--max_seq_len", "512")) == 2
    err = capsys.readouterr().err
    assert (
        f"--output {out}: the build wrote no samples: 2 documents read, 0 written (skipped: packed_tail 2; "
        "rejects.jsonl lists each one); --format packed drops"
    ) in err
    assert json.loads((out / "build_manifest.json").read_text())["status"] == "empty"
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b"\x01\x02\n\n\x07\n")
    assert main(cli(corpus, [f"en:{blank}"], tmp_path / "none2", "--format", "nsp")) == 2
    assert "2 documents read, 0 written (skipped: empty 2;" in capsys.readouterr().err


def test_an_input_that_breaks_or_vanishes_mid_build_is_named(ray_here, corpus, tmp_path, capsys):
    """Errors inside a chunk task used to surface as a RuntimeError traceback wrapping Ray's; a
    task's UsageError is now the CLI's exit 2, naming the file."""
    rng = random.Random(0)
    text = "".join(f"doc {i} {rng.random()} {rng.random()}\n\n" for i in range(40_000)).encode()
    packed = gzip.compress(text)
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(packed[: len(packed) * 9 // 10])  # the first MB (checked up front) is whole
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


def test_random_b_never_comes_from_as_document_with_small_chunks(ray_here, corpus, tmp_path):
    """With chunks of about one document, every 'random' B used to be A's own text. B now comes
    from another document, from the next chunks' documents when the block has no other, and the
    samples are still the same for 1 and 3 workers."""
    runs = {}
    for n in (1, 3):
        cfg = config(
            corpus,
            tmp_path / f"w{n}",
            inputs=[f"en:{corpus.dir / 'en.txt'}"],
            format="nsp",
            max_seq_len=64,
            chunk_mb=0.0005,
            num_workers=n,
            seed=3,
        )
        runs[n] = (build_shards(cfg), shard_hashes(tmp_path / f"w{n}"))
    assert runs[1][1] == runs[3][1]
    docs = [squash("".join(lines)) for lines in corpus.en]
    cls, sep = corpus.hf.cls_token_id, corpus.hf.sep_token_id
    checked = 0
    for s in read_samples(tmp_path / "w1"):
        ids = s["input_ids"].tolist()
        mid = ids.index(sep)
        a, b = squash(corpus.hf.decode(ids[1:mid])), squash(corpus.hf.decode(ids[mid + 1 : -1]))
        homes_a = {i for i, d in enumerate(docs) if a in d}
        homes_b = {i for i, d in enumerate(docs) if b in d}
        assert ids[0] == cls and homes_a and homes_b
        if s["nsp_label"] == 1 and len(b) >= 30:  # long enough not to occur in two documents by chance
            assert not homes_a & homes_b, (a, b)
            checked += 1
    assert checked > 40, checked
    counts = runs[1][0].counts
    assert counts.nsp_blocks_with_donors > 20 and counts.nsp_random_next > 60


def test_num_workers_is_capped_at_the_cpus_ray_sees(ray_here, corpus, tmp_path, capsys):
    m = build_shards(config(corpus, tmp_path / "many", num_workers=1000))
    assert m.worker_slots == 2 and m.workers <= 2
    assert "--num_workers 1000: Ray sees 2 CPUs, so 2 chunk tasks run at a time" in capsys.readouterr().err


def _ray_processes(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def test_two_builds_into_one_output_and_a_kill_9(ray_here, corpus, tmp_path, capsys):
    """Defect 2 and the orphans: while a build runs (a real one, in a subprocess), a second build
    into its --output exits 2 naming its pid and host. Killing only the first build's driver with
    SIGKILL leaves none of its Ray processes behind (its dashboard and runtime-env agents used to
    linger for a minute), and a --resume takes over the lock the dead build left."""
    import psutil

    big = write_bert_text(tmp_path / "big.txt", english_docs(500, seed=3))
    out = tmp_path / "out"
    args = cli(
        corpus,
        [f"en:{big}"],
        out,
        "--format",
        "nsp",
        "--max_seq_len",
        "48",
        "--chunk_mb",
        "0.002",
        "--num_workers",
        "1",
    )
    proc = subprocess.Popen(
        [sys.executable, BUILD_SHARDS, *args], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    tree = []
    try:
        deadline = time.time() + 120
        while not (out / "build_manifest.json").exists():  # it has started Ray and its tokenizer
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "the first build never got going"
            time.sleep(0.02)
        assert main(args + ["--resume"]) == 2  # it used to join in, and both exited 0
        err = capsys.readouterr().err
        assert f"another build is writing into it: pid {proc.pid} on host {socket.gethostname()}" in err
        assert json.loads((out / ".build.lock").read_text())["pid"] == proc.pid
        while len(list(out.glob("part-*/part_stats.json"))) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline + 120, "the first build never got going"
            time.sleep(0.02)
        tree = _ray_processes(proc.pid)
        names = {p.name() for p in tree}
        assert any("gcs_server" in n for n in names) and len(tree) >= 5, names
        agents = [p for p in tree if "Agent" in " ".join(p.cmdline())]
        assert agents, [p.cmdline()[:2] for p in tree]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, left = psutil.wait_procs(tree, timeout=20)
        assert not left, [(p.pid, " ".join(p.cmdline())[:80]) for p in left]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    finished = len(list(out.glob("part-*/part_stats.json")))
    assert main(args + ["--resume"]) == 0
    assert f"taking over the lock left by pid {proc.pid} on host {socket.gethostname()}" in capsys.readouterr().err
    manifest = json.loads((out / "build_manifest.json").read_text())
    assert manifest["status"] == "complete" and finished <= manifest["chunks_resumed"] < manifest["chunks"]
    assert not (out / ".build.lock").exists()


_ADDRESS = re.compile(r'sin_addr=inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "0.0.0.0", "::") or address.startswith("::ffff:127.")


def test_a_local_build_makes_no_network_request(corpus, tmp_path):
    """Every local build's ray.init used to connect to 169.254.169.254 and look up
    metadata.google.internal (Ray's usage-stats dashboard module, even with
    RAY_USAGE_STATS_ENABLED=0). Checked with strace on every process of the build: every connect()
    goes to a Unix socket or to loopback. Also --num_workers 1000 starts only the CPUs' worth."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("needs strace (apt-get install strace) to record the build's connect() calls")
    if subprocess.run([strace, "-f", "-qq", "-o", os.devnull, "true"]).returncode != 0:
        pytest.skip("strace cannot trace here (ptrace not permitted)")
    trace, out = tmp_path / "connect.trace", tmp_path / "out"
    proc = subprocess.run(
        [
            strace,
            "-f",
            "--seccomp-bpf",
            "-qq",
            "-e",
            "trace=connect",
            "-o",
            str(trace),
            sys.executable,
            BUILD_SHARDS,
            *cli(corpus, [f"en:{corpus.dir / 'en.txt'}"], out, "--chunk_mb", "0.004", "--num_workers", "1000"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [line for line in trace.read_text().splitlines() if "connect(" in line]
    addresses = [a or b for line in calls for a, b in _ADDRESS.findall(line)]
    assert any(_loopback(a) for a in addresses), "the trace saw none of Ray's own loopback traffic"
    outside = [line for line in calls if any(not _loopback(a or b) for a, b in _ADDRESS.findall(line))]
    assert not outside, outside[:10]
    cpus = len(os.sched_getaffinity(0))
    manifest = json.loads((out / "build_manifest.json").read_text())
    assert manifest["chunks"] > cpus and manifest["workers"] <= cpus and manifest["worker_slots"] == cpus
    assert f"--num_workers 1000: Ray sees {cpus} CPUs, so {cpus} chunk tasks run at a time" in proc.stderr
