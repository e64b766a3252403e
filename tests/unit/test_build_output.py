"""--overwrite and --resume clear only what the builder wrote (issue 31, defect 4): a folder that holds
anything else is refused by name and keeps every file. No Ray: the refusal comes before any work."""

from pathlib import Path

import pytest

from preprocessing.builder import main
from preprocessing.errors import UsageError
from preprocessing.output import prepare_output, remove_stale
from preprocessing.shard_format import BuildManifest


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fake_build(out: Path) -> None:
    """What a finished build leaves (the names and layout; the contents do not matter here)."""
    BuildManifest(status="complete").write(out / "build_manifest.json")
    (out / "index.json").write_text('{"version": 2, "shards": []}')
    (out / "rejects.jsonl").write_text("")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    for part in ("part-00000", "part-00001"):
        (out / part).mkdir()
        for name in ("index.json", "part_stats.json", "rejects.jsonl", "shard.00000.mds.zstd"):
            (out / part / name).write_text("x")
    (out / ".tmp-part-00002-0123abcd").mkdir()  # a task killed mid-write
    (out / ".tmp-part-00002-0123abcd" / "shard.00000.mds.zstd").write_text("x")


def _build_args(tmp_path: Path, out: Path) -> list[str]:
    (tmp_path / "a.txt").write_text("One sentence here.\n\nAnother document.\n")
    return ["--input", str(tmp_path / "a.txt"), "--output", str(out), "--tokenizer", "unused", "--overwrite"]


def test_overwrite_refuses_a_user_folder_whose_names_look_like_a_build(tmp_path, capsys):
    """The hostile probe: part-2-notes.txt made the folder 'look built', and --overwrite deleted
    thesis.tex and photos/ with it."""
    out = tmp_path / "mine"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    (out / "thesis.tex").write_text("\\documentclass{article}")
    (out / "part-2-notes.txt").write_text("notes")
    before = _tree(out)
    assert main(_build_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"--output {out}: is not empty and holds no previous build (no build_manifest.json)" in err
    assert "nothing was deleted" in err
    assert _tree(out) == before
    (out / "index.json").write_text("{}")  # an index.json alone proves nothing either
    assert main(_build_args(tmp_path, out)) == 2
    assert (out / "thesis.tex").is_file()


def test_overwrite_refuses_a_build_mixed_with_foreign_files_naming_them(tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    _fake_build(out)
    (out / "thesis.tex").write_text("mine")
    (out / "part-00001" / "notes.txt").write_text("mine too")
    (out / "part-notes").mkdir()
    before = _tree(out)
    assert main(_build_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert "holds a previous build and also part-00001/notes.txt, part-notes/, thesis.tex" in err
    assert "which the builder did not write; --overwrite deleted nothing" in err
    assert _tree(out) == before and (out / "part-notes").is_dir()


def test_overwrite_clears_a_build_and_refuses_an_unreadable_manifest(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    _fake_build(out)
    assert prepare_output(out, overwrite=True, resume=False) is None
    assert list(out.iterdir()) == []
    _fake_build(out)
    (out / "build_manifest.json").write_text("[1, 2")
    with pytest.raises(UsageError, match="build_manifest.json: cannot read the build manifest"):
        prepare_output(out, overwrite=True, resume=False)
    assert (out / "part-00000" / "shard.00000.mds.zstd").is_file()


def test_resume_drops_only_the_builders_stale_part_folders(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    _fake_build(out)
    (out / "part-notes").mkdir()
    (out / "part-notes" / "n.txt").write_text("mine")
    remove_stale(out, keep={"part-00000"}, part_stats="part_stats.json")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["part-00000", "part-notes", "tokenizer"]
    assert (out / "part-notes" / "n.txt").read_text() == "mine"


def _fake_eval(out: Path) -> None:
    """What --eval_share adds: OUTPUT/eval, a shard folder of the builder's own."""
    held = out / "eval"
    held.mkdir()
    BuildManifest(status="complete", split="eval").write(held / "build_manifest.json")
    (held / "index.json").write_text('{"version": 2, "shards": []}')
    (held / "tokenizer").mkdir()
    (held / "tokenizer" / "tokenizer.json").write_text("{}")
    for part in ("part-00000", "part-00001"):
        (held / part).mkdir()
        for name in ("index.json", "shard.00000.mds.zstd"):
            (held / part / name).write_text("x")
    (held / ".tmp-part-00002-0123abcd").mkdir()


def test_overwrite_clears_a_build_with_a_held_out_split_but_not_what_is_put_in_it(tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    _fake_build(out)
    _fake_eval(out)
    assert prepare_output(out, overwrite=True, resume=False) is None
    assert list(out.iterdir()) == []
    _fake_build(out)
    _fake_eval(out)
    (out / "eval" / "notes.txt").write_text("mine")
    (out / "eval" / "part-00000" / "scores.csv").write_text("mine too")
    (out / "eval" / "eval").mkdir()  # only OUTPUT/eval is the builder's, not eval/eval
    before = _tree(out)
    assert main(_build_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert "also eval/eval/, eval/notes.txt, eval/part-00000/scores.csv, which the builder did not write" in err
    assert _tree(out) == before


def test_resume_drops_stale_held_out_parts(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    _fake_build(out)
    _fake_eval(out)
    (out / "eval" / "part-notes").mkdir()
    remove_stale(out, keep={"part-00000"}, part_stats="part_stats.json")
    assert sorted(p.name for p in (out / "eval").iterdir() if p.is_dir()) == ["part-00000", "part-notes", "tokenizer"]
