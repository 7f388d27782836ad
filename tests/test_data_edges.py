"""The data path's edges (issue 35): a prepared dataset's manifest is checked, not trusted (every
count against the lengths files, every key of its type, before grain reads anything or the
trainer builds anything); every failure of `prepare` and of `--data FILE` names the file (and
line), and a failed cache build leaves nothing behind; SIGINT / SIGTERM stop a prepare's workers
with one line and the rerun resumes; a resumed prepare counts every document, and an input given
by another path to the same file is the same input."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from train.data import DatasetError, make_source, prepare
from train.data.format import load_manifest
from train.data.loader import PackedRows

ROOT = Path(__file__).resolve().parents[1]
SEQ, B = 16, 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """30 documents in shards of 7 (5 shards), byte-level."""
    tmp = tmp_path_factory.mktemp("edges")
    lines = [json.dumps({"text": chr(97 + i % 26) * (80 + (5 * i) % 60)}) for i in range(30)]
    (tmp / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare.prepare([str(tmp / "c.jsonl")], tmp / "ds", workers=1, docs_per_shard=7)
    return tmp / "ds"


def _edited(dataset, tmp_path, edit) -> Path:
    """A copy of `dataset` whose manifest.json `edit(d)` changed."""
    copy = tmp_path / "ds"
    copy.mkdir()
    for f in dataset.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    d = json.loads((copy / "manifest.json").read_text())
    edit(d)
    (copy / "manifest.json").write_text(json.dumps(d))
    return copy


def _shard_tokens(delta):
    def edit(d):  # the shard's count and the total together: only the lengths file disagrees
        d["shards"][1]["tokens"] += delta
        d["tokens"] += delta

    return edit


# ------------------------------------------------------------------ the manifest, checked


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _shard_tokens(500),  # was: an IndexError traceback in a grain thread
            r"manifest\.json: shards\[1\] \(shard-00001\.array_record\) records 7 documents and "
            r"(\d+) tokens, its lengths file shard-00001\.lengths\.npy holds 7 and (\d+) ",
        ),
        (
            _shard_tokens(-500),  # was: trained silently on wrong rows
            r"manifest\.json: shards\[1\] \(shard-00001\.array_record\) records 7 documents and "
            r"(\d+) tokens, its lengths file shard-00001\.lengths\.npy holds 7 and (\d+) ",
        ),
        (
            lambda d: d["shards"][2].update(documents=6),
            r"shards\[2\] \(shard-00002\.array_record\) records 6 documents and \d+ tokens, its "
            r"lengths file shard-00002\.lengths\.npy holds 7 and",
        ),
        (lambda d: d.update(tokens=d["tokens"] + 1), r"key 'tokens' is (\d+), its shards' sum"),
        (lambda d: d.update(documents=31), r"key 'documents' is 31, its shards' sum is 30"),
        (
            lambda d: d["skipped"].update(empty_documents=2),
            r"key 'skipped\.empty_documents' is 2, its shards' sum is 0",
        ),
    ],
)
def test_manifest_counts_are_checked_against_the_lengths_files(dataset, tmp_path, edit, match):
    """Each shard's documents and tokens are its lengths file's size and sum, and the totals the
    shards' sums: refused when the loader is made, before grain reads a row."""
    copy = _edited(dataset, tmp_path, edit)
    with pytest.raises(DatasetError, match=match) as e:
        PackedRows(copy, seq_len=SEQ, global_batch=B, seed=0)
    assert str(copy / "manifest.json") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DatasetError, match=match):  # unhashed too: the counts are always read
        load_manifest(copy)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.pop("shards"), r"no key 'shards'"),  # was: a KeyError (fixed in issue 34)
        (lambda d: d["shards"][0].pop("tokens"), r"no key 'shards\[0\]\.tokens'"),
        (
            lambda d: d["shards"][0].update(tokens="9"),
            r"key 'shards\[0\]\.tokens' is \"9\", expected an integer >= 0",
        ),
        (lambda d: d.update(documents=True), r"key 'documents' is true, expected an integer"),
        (lambda d: d.update(tokens=2.5), r"key 'tokens' is 2\.5, expected an integer >= 0"),
        (
            lambda d: d["shards"][3].update(documents=-1),
            r"key 'shards\[3\]\.documents' is -1, expected an integer >= 0",
        ),
        (
            lambda d: d.update(eod_id="x"),
            r"key 'eod_id' is \"x\", expected an integer >= 0 or null",
        ),
        (lambda d: d["tokenizer"].update(kind=3), r"key 'tokenizer\.kind' is 3, expected a string"),
        (lambda d: d.update(skipped=[]), r"skipped is not an object"),
        (lambda d: d.update(shards={}), r"key 'shards' is not a list"),
        (
            lambda d: d["shards"][0].update(file="../x"),
            r"shards\[0\] names '\.\./x', not a file in",
        ),
    ],
)
def test_a_missing_or_mistyped_key_is_one_line_naming_it(dataset, tmp_path, edit, match):
    copy = _edited(dataset, tmp_path, edit)
    with pytest.raises(DatasetError, match=match) as e:
        load_manifest(copy)
    assert str(e.value).startswith(str(copy / "manifest.json")) and "\n" not in str(e.value)


def test_the_trainer_refuses_an_edited_manifest_before_building(dataset, tmp_path, monkeypatch):
    """`--data DIR` with a shard's count raised: the one-line DatasetError (which the trainer
    prints as `error: ...`) comes from the data source, before the model is built or compiled."""
    from train import cli
    from train.step import train_step

    def refuse(*args, **kwargs):
        raise AssertionError("got as far as building the model")

    monkeypatch.setattr(train_step, "init_state", refuse)
    monkeypatch.setattr(train_step, "compile_step", refuse)
    copy = _edited(dataset, tmp_path, _shard_tokens(500))
    argv = ["--config", "configs/tiny.yaml", "seq_len=16", "batch_size=8", "--steps", "1"]
    with pytest.raises(DatasetError, match=r"manifest\.json: shards\[1\] .* holds 7 and"):
        cli.main([*argv, "--data", str(copy), "--out", str(tmp_path / "run")])


# ------------------------------------------------------------- prepare's errors name the file


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "name, data, match",
    [
        ("bin.dat", bytes(range(256)), r"bin\.dat: not UTF-8 at byte 128 \(0x80: invalid start"),
        ("l1.txt", b"x" * 128 + "caf\xe9!".encode("latin-1"), r"l1\.txt: not UTF-8 at byte 131"),
        (
            "l1.jsonl",
            b'{"text": "ok"}\n{"text": "caf' + b'\xe9"}\n',
            r"l1\.jsonl:2: not UTF-8 at byte 28 \(0xe9",
        ),
        (
            "s.jsonl",
            b'{"text": "ok"}\n\n{"text": "a\\ud800b"}\n',
            r"s\.jsonl:3: field 'text' holds a lone surrogate \('\\ud800' at character 1\)",
        ),
    ],
)
def test_undecodable_text_names_the_file_line_and_byte(tmp_path, capsys, name, data, match):
    """In-process and as the command: one `error:` line naming the file (and line), exit 1."""
    f = _write(tmp_path / name, data)
    with pytest.raises(prepare.PrepareError, match=match):
        prepare.prepare([f], tmp_path / "ds", workers=1)
    capsys.readouterr()
    assert prepare.main([f, "--out", str(tmp_path / "ds2"), "--workers", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: prepare: ") and re.search(match, err[-1]), err
    assert [x for x in err if not x.startswith("prepare: ")] == [err[-1]]


def test_a_directory_input_is_called_a_directory(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(prepare.PrepareError, match=r"prepare: .*d is a directory: give its files"):
        prepare.prepare([str(tmp_path / "d")], tmp_path / "ds", workers=1)


@pytest.mark.parametrize("after", ["scan", "_plan"])
def test_an_input_that_vanished_is_named(tmp_path, monkeypatch, after):
    """The file removed after it was listed: before it is hashed (after `scan`), or before a
    worker reads it (after `_plan`)."""
    f = _write(tmp_path / "a.txt", b"some text")
    real = getattr(prepare, after)

    def then_remove(*args, **kwargs):
        got = real(*args, **kwargs)
        os.remove(f)
        return got

    monkeypatch.setattr(prepare, after, then_remove)
    with pytest.raises(prepare.PrepareError, match=r"prepare: .*a\.txt: vanished \(listed, then"):
        prepare.prepare([f], tmp_path / "ds", workers=1)


@pytest.mark.parametrize(
    "name, data, match",
    [
        ("l1.txt", b"x" * 128 + b"\xe9", r"prepare: .*l1\.txt: not UTF-8 at byte 128"),
        ("s.jsonl", b'{"text": "\\udfff"}\n', r"prepare: .*s\.jsonl:1: field 'text' holds a lone"),
        ("b.jsonl", b'{"body": "x"}\n', r"b\.jsonl:1: no string field 'text' .* --field NAME"),
    ],
)
def test_a_failed_data_file_build_leaves_nothing_in_the_cache(
    tmp_path, monkeypatch, name, data, match
):
    """`--data FILE` prepares into a hidden directory of the cache: on failure it is removed."""
    monkeypatch.setenv("RELAYMOE_DATA_CACHE", str(tmp_path / "cache"))
    f = _write(tmp_path / name, data)
    with pytest.raises(ValueError, match=match):
        make_source([f], synthetic=False, seq_len=4, batch_size=2, seed=0, vocab_size=256)
    assert list((tmp_path / "cache").iterdir()) == []


# --------------------------------------------------------------- resume: counts and paths


def test_a_resumed_prepare_counts_every_document(tmp_path, capsys):
    files = [_write(tmp_path / f"{i}.txt", f"document {i}".encode()) for i in range(6)]
    out = tmp_path / "ds"
    prepare.prepare(files, out, workers=1, docs_per_shard=2)
    (out / "shard-00001.array_record").unlink()
    (out / "done" / "shard-00001.array_record.json").unlink()
    (out / "manifest.json").unlink()
    capsys.readouterr()
    prepare.prepare(files, out, workers=1, docs_per_shard=2)
    err = capsys.readouterr().err
    assert "resuming: 2 of 3 shards done" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("prepare: 3/3 shards, 6 documents, 66 tokens, "), last


def test_an_input_by_another_path_to_the_same_file_resumes(tmp_path, monkeypatch, capsys):
    """`./a.txt` for `a.txt`, or through a symlinked directory, is the same input (resolved path
    and content); the same path with other content is not."""
    (tmp_path / "in").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "in")
    for n in ("a", "b"):
        (tmp_path / "in" / f"{n}.txt").write_text(f"text of {n}")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ds"
    first = prepare.prepare(["in/a.txt", "in/b.txt"], out, workers=1, docs_per_shard=1)
    (out / "manifest.json").unlink()
    for again in (["./in/a.txt", "in/./b.txt"], ["link/a.txt", str(tmp_path / "in" / "b.txt")]):
        capsys.readouterr()
        m = prepare.prepare(again, out, workers=1, docs_per_shard=1)
        assert "resuming: 2 of 2 shards done" in capsys.readouterr().err
        assert m.shards == first.shards and [i.path for i in m.inputs] == again
    (tmp_path / "in" / "b.txt").write_text("other text")
    with pytest.raises(prepare.PrepareError, match="holds a prepare of other inputs"):
        prepare.prepare(["in/a.txt", "in/b.txt"], out, workers=1, docs_per_shard=1)
    (tmp_path / "in" / "b.txt").write_text("text of b")
    (tmp_path / "c.txt").write_text("text of b")  # the same content at another path
    with pytest.raises(prepare.PrepareError, match="holds a prepare of other inputs"):
        prepare.prepare(["in/a.txt", "c.txt"], out, workers=1, docs_per_shard=1)


# --------------------------------------------------------------- signals during prepare


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    """No process left in the process group `pgid` (the workers, the resource tracker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_workers_with_one_line_and_the_rerun_resumes(tmp_path, capsys, signum):
    """The command with two workers, signalled once the first shard is done: Ctrl-C as a
    terminal sends it (SIGINT to the process group), SIGTERM as a scheduler does (to the
    process). One line, exit 128 + signal, no traceback, no leaked semaphores, no process left;
    the rerun resumes and the dataset is whole."""
    n = 400
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(n)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "train.data.prepare", str(tmp_path / "c.jsonl"), "--out", str(out)]
    cmd += ["--workers", "2", "--docs-per-shard", "1"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("done/*.json")):  # the first shard is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 128 + signum, stderr
    err = stderr.strip().splitlines()
    name = signal.Signals(signum).name
    assert err[-1].startswith(f"prepare: stopped by {name} ("), stderr
    assert err[-1].endswith(f"finished in {out}); the same command resumes there"), stderr
    assert not [x for x in err[:-1] if not x.startswith("prepare: ")], stderr  # progress only
    for bad in ("Traceback", "resource_tracker", "leaked", "KeyboardInterrupt"):
        assert bad not in stderr, stderr
    assert _group_gone(proc.pid), "a worker outlived the prepare"
    assert not list(out.glob(".shard-*.tmp")) and not list(out.glob("done/.*.tmp"))
    done = len(list((out / "done").glob("*.json")))  # each whole: the rerun reads them
    assert 1 <= done < n, done
    capsys.readouterr()
    m = prepare.prepare([str(tmp_path / "c.jsonl")], out, workers=1, docs_per_shard=1)
    assert f"resuming: {done} of {n} shards done" in capsys.readouterr().err
    assert m.documents == n
    reader = PackedRows(out, seq_len=SEQ, global_batch=B, seed=0)
    whole = reader.corpus.read(0, reader.corpus.tokens).tokens
    want = b"".join(json.loads(x)["text"].encode() + b"\n" for x in lines)
    np.testing.assert_array_equal(whole, np.frombuffer(want, np.uint8))
