"""Command-line errors: exit code 2 with a message naming the path, flag or value (no Ray needed:
everything here fails before any work starts)."""

import re
import subprocess
import sys

import pytest

from preprocessing.builder import main
from tests.support.builder import REPO


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("One sentence here.\n\nAnother document.\n")
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--input", "en:{tmp}/missing.txt"], "--input en:{tmp}/missing.txt: no such file or directory"),
        (["--input", "zh:{tmp}/*.jsonl"], "the glob '{tmp}/*.jsonl' matched no files"),
        (["--input", "de:{tmp}/a.txt"], "unknown language prefix 'de:'"),
        (["--input", "{tmp}/a.txt", "--train_tokenizer", "wordpiece"], "give exactly one of --tokenizer"),
        (["--input", "{tmp}/a.txt", "--max_seq_len", "4"], "--max_seq_len 4: must be between 5"),
        (["--input", "{tmp}/a.txt", "--num_workers", "0"], "--num_workers 0: must be at least 1"),
        (["--input", "{tmp}/a.txt", "--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["--input", "{tmp}/a.txt", "--short_seq_prob", "1.5"], "--short_seq_prob 1.5: must be between 0 and 1"),
        (["--input", "{tmp}/a.txt", "--eval_share", "1"], "--eval_share 1.0: must be at least 0 and below 1"),
        (["--input", "{tmp}/a.txt", "--eval_share", "-0.1"], "--eval_share -0.1: must be at least 0 and below 1"),
    ],
)
def test_bad_flags_exit_2_naming_them(tmp_path, text_file, capsys, extra, message):
    args = [a.format(tmp=tmp_path) for a in extra] + ["--output", str(tmp_path / "out")]
    if "--train_tokenizer" in extra:
        args += ["--tokenizer", str(tmp_path)]
    else:
        args += ["--tokenizer", str(tmp_path / "tok")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err
    assert not (tmp_path / "out" / "build_manifest.json").exists()


def test_malformed_flags_are_argparse_errors(tmp_path, text_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--input", str(text_file), "--output", str(tmp_path / "o"), "--tokenizer", "x", "--format", "mlm"])
    assert exc.value.code == 2 and "--format: invalid choice: 'mlm'" in capsys.readouterr().err


@pytest.mark.multiproc
def test_unloadable_tokenizer_and_missing_column(tmp_path, text_file, capsys):
    assert (
        main(["--input", str(text_file), "--output", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "none")]) == 2
    )
    assert f"--tokenizer {tmp_path / 'none'}: cannot load a tokenizer" in capsys.readouterr().err
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "t.parquet")
    assert main(["--input", str(tmp_path / "t.parquet"), "--output", str(tmp_path / "p"), "--tokenizer", "x"]) == 2
    assert "--text_field text: no such column" in capsys.readouterr().err


@pytest.mark.multiproc
def test_script_entry_point_exits_2(tmp_path):
    """`python preprocessing/build_shards.py` works without the repo root on sys.path."""
    missing = tmp_path / "nothing_here.txt"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "preprocessing" / "build_shards.py"),
            "--input",
            f"en:{missing}",
            "--output",
            str(tmp_path / "out"),
            "--tokenizer",
            "x",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"no such file or directory: {missing}" in proc.stderr


def test_output_that_is_a_file_or_under_a_file_exits_2(tmp_path, text_file, capsys):
    target = tmp_path / "taken"
    target.write_text("not a folder")
    for out, message in (
        (target, f"--output {target}: exists and is not a directory"),
        (target / "sub", f"--output {target / 'sub'}: {target} is not a directory"),
    ):
        assert main(["--input", str(text_file), "--output", str(out), "--tokenizer", "x"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert target.read_text() == "not a folder"


def test_unknown_encoding_exits_2(tmp_path, text_file, capsys):
    assert (
        main(
            [
                "--input",
                str(text_file),
                "--output",
                str(tmp_path / "o"),
                "--tokenizer",
                "x",
                "--encoding",
                "*.txt=klingon",
            ]
        )
        == 2
    )
    assert "--encoding *.txt=klingon: unknown encoding 'klingon'" in capsys.readouterr().err


# ---- the output folder's lock ------------------------------------------------------------------
@pytest.mark.multiproc
def test_a_locked_output_exits_2_naming_the_holder(tmp_path, text_file, capsys):
    """Another process holds OUTPUT's lock (as a running build does, from before its Ray starts to
    its end): a second build exits 2 naming that pid and host, and touches nothing."""
    import os
    import socket

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from preprocessing.lock import OutputLock; "
            "OutputLock(pathlib.Path(sys.argv[1])).acquire(); print('held', flush=True); "
            "sys.stdin.read()",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert main(["--input", str(text_file), "--output", str(out), "--tokenizer", "x"]) == 2
        err = capsys.readouterr().err
        assert f"another build is writing into it: pid {holder.pid} on host {socket.gethostname()}" in err
        assert [p.name for p in out.iterdir()] == [".build.lock"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # It ended without releasing its lock, as a killed build does: the file stays, the flock went
    # with the process, and the next build takes it over.
    assert (out / ".build.lock").exists()
    from preprocessing.lock import OutputLock

    lock = OutputLock(out)
    lock.acquire()
    assert f"taking over the lock left by pid {holder.pid}" in capsys.readouterr().err
    lock.release()


@pytest.mark.multiproc
def test_a_stale_lock_is_taken_over_and_a_foreign_one_refused(tmp_path, capsys):
    import json
    import os
    import socket

    from preprocessing.errors import UsageError
    from preprocessing.lock import OutputLock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = tmp_path / ".build.lock"
    record.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "yesterday"}))
    lock = OutputLock(tmp_path)
    lock.acquire()
    err = capsys.readouterr().err
    assert f"taking over the lock left by pid {dead.pid} on host {socket.gethostname()} (started yesterday)" in err
    assert json.loads(record.read_text())["pid"] == os.getpid()
    lock.release()
    assert not record.exists()
    record.write_text(json.dumps({"pid": 4242, "host": "node-elsewhere", "started": "today"}))
    with pytest.raises(
        UsageError,
        match=r"left by pid 4242 on host node-elsewhere .* cannot check; if no build "
        r"is running there, delete .*\.build\.lock",
    ):
        OutputLock(tmp_path).acquire()


# ---- one declaration per knob: flags, --config, --print_config, the resume check ---------------
def test_config_file_then_flags_and_print_config_replays(tmp_path, text_file, capsys):
    """Defaults, then the file's `build` section, then the flags typed; --print_config prints what a
    --config file replays, and writes nothing."""
    import json

    from preprocessing.config import BuildConfig, parse_args

    path = tmp_path / "build.yaml"
    path.write_text(
        f"build:\n  inputs: ['en:{text_file}']\n  output: {tmp_path / 'out'}\n  tokenizer: tok\n"
        "  max_seq_len: 64\n  short_seq_prob: 0\n  seed: 7\n"
    )
    cfg = parse_args(["--config", str(path), "--seed", "8", "--no_progress"])
    assert (cfg.max_seq_len, cfg.seed, cfg.short_seq_prob, cfg.progress) == (64, 8, 0.0, False)
    assert cfg.format == BuildConfig.__dataclass_fields__["format"].default == "nsp"
    assert main(["--config", str(path), "--seed", "8", "--no_progress", "--print_config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"build": cfg.to_dict()} and printed["build"]["vocab_size"] == 30522
    (tmp_path / "printed.json").write_text(json.dumps(printed))
    assert parse_args(["--config", str(tmp_path / "printed.json")]).to_dict() == cfg.to_dict()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ({"build": {"max_seq_lenn": 64}}, "unknown key build.max_seq_lenn; the keys of build are"),
        ({"build": {"max_seq_len": "long"}}, 'build.max_seq_len is "long" (str); expected an integer'),
        ({"build": {"format": "mlm"}}, "build.format is 'mlm'; expected one of nsp, packed"),
        ({"samples": {"seed": 1}}, "unknown key 'samples'; expected sections ['build']"),
    ],
)
def test_config_file_mistakes_exit_2_naming_the_key(tmp_path, text_file, capsys, content, message):
    import json

    path = tmp_path / "c.json"
    path.write_text(json.dumps(content))
    assert (
        main(["--config", str(path), "--input", str(text_file), "--output", str(tmp_path / "o"), "--tokenizer", "x"])
        == 2
    )
    assert f"--config {path}: {message}" in capsys.readouterr().err


def test_input_and_output_are_required_from_flags_or_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--tokenizer", "x"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "the following arguments are required: --input, --output" in err


def test_the_resume_check_is_the_math_knobs(tmp_path):
    """--resume compares the knobs marked math (what OUTPUT_KEYS listed, and --tokenizer); a knob the
    earlier build did not record ran with its default; the others may change."""
    from preprocessing.config import BuildConfig, math_knobs
    from preprocessing.errors import UsageError
    from preprocessing.output import check_resumable, fingerprint
    from preprocessing.shard_format import BuildManifest

    assert set(math_knobs()) >= {
        "format", "max_seq_len", "short_seq_prob", "random_next_prob", "seed", "text_field", "block_mb", "remote",
        "train_tokenizer", "sp_model_type", "vocab_size", "lowercase", "tokenizer_train_mb", "tokenizer",
    }  # fmt: skip
    assert not {"inputs", "output", "num_workers", "ray_address", "resume", "overwrite", "progress"} & set(math_knobs())

    def fp(cfg):
        return fingerprint(cfg, files=[], chunk_bytes=1 << 20, tokenizer_sha256="ab", knobs=math_knobs())

    base = BuildConfig(inputs=["a.txt"], output="o", tokenizer="t")
    saved = {k: v for k, v in fp(base).items() if k != "block_mb"}  # a build from before --block_mb existed
    previous = BuildManifest(fingerprint=saved)
    check_resumable(previous, fingerprint=fp(base), out=tmp_path, config_cls=BuildConfig)
    check_resumable(
        previous, fingerprint=fp(BuildConfig(inputs=["b.txt"], output="o", tokenizer="t", num_workers=3)),
        out=tmp_path, config_cls=BuildConfig,
    )  # fmt: skip
    for changed, message in (
        (dict(max_seq_len=64), "different max_seq_len (before: [128], now: [64])"),
        (dict(block_mb=2.0), "different block_mb (before: [4.0], now: [2.0])"),
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            cfg = BuildConfig(inputs=["a.txt"], output="o", tokenizer="t", **changed)
            check_resumable(previous, fingerprint=fp(cfg), out=tmp_path, config_cls=BuildConfig)
    with pytest.raises(UsageError, match=re.escape("different chunk_bytes (before: [1048576], now: [1])")):
        check_resumable(previous, fingerprint={**fp(base), "chunk_bytes": 1}, out=tmp_path, config_cls=BuildConfig)
