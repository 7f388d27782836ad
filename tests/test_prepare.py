"""`relaymoe-train prepare` (train/data/prepare.py): a corpus tokenized once into ArrayRecord
shards, read back through grain against the trainer's own tokenization of each document; the
manifest; an interrupted prepare resumed without redoing finished shards; bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.data import prepare
from train.data import tokenizers as data_mod
from train.data.format import sha256_file
from train.data.tokenizers import BYTE_EOD, byte_tokenize

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["the cat sat on the mat", "", "a dog and a log\n", "über café ☕", "the end"]


@pytest.fixture
def corpus(tmp_path):
    """Two text files (one empty) and a JSONL file with a blank line and an empty text: the
    documents in input order are DOCS[0], DOCS[2:]."""
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "b.txt").write_text(DOCS[1], encoding="utf-8")
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[2:])]
    lines.insert(1, "")  # a blank line
    lines.append(json.dumps({"text": ""}))  # an empty document
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp_path, [str(tmp_path / n) for n in ("a.txt", "b.txt", "c.jsonl")]


def read_back(out):
    """Every record of every shard in manifest order, through grain's ArrayRecord source."""
    import grain.python as grain

    m = json.loads((Path(out) / "manifest.json").read_text())
    src = grain.ArrayRecordDataSource([str(Path(out) / s["file"]) for s in m["shards"]])
    return m, [np.frombuffer(src[i], "<i4") for i in range(len(src))]


def test_byte_level_prepare_reads_back_document_by_document(corpus):
    tmp, inputs = corpus
    out = tmp / "ds"
    m = prepare.prepare(inputs, out, workers=2, docs_per_shard=2)
    m, records = read_back(out)
    texts = [d for d in DOCS if d]
    want = [np.append(byte_tokenize(t), BYTE_EOD) for t in texts]
    assert len(records) == len(want) == m["documents"]
    for got, w in zip(records, want):
        np.testing.assert_array_equal(got, w)
    assert m["tokens"] == sum(len(w) for w in want)
    assert m["skipped"] == {"empty_documents": 2, "blank_lines": 1}
    assert (m["vocab_size"], m["eod_id"], m["tokenizer"]["kind"]) == (256, 10, "bytes")
    assert len(m["shards"]) == 3  # 6 documents scanned (2 empty), 2 per shard
    for s in m["shards"]:
        assert s["sha256"] == sha256_file(out / s["file"])
        assert s["bytes"] == (out / s["file"]).stat().st_size
        assert s["lengths_sha256"] == sha256_file(out / s["lengths_file"])
    lengths = np.concatenate([np.load(out / s["lengths_file"]) for s in m["shards"]])
    np.testing.assert_array_equal(lengths, [len(w) for w in want])  # the loader's index
    assert [i["path"] for i in m["inputs"]] == inputs


def test_hf_tokenizer_json(corpus):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp, inputs = corpus
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp / "tokenizer.json"))
    m, records = (
        prepare.prepare(inputs, tmp / "ds", tokenizer=tmp / "tokenizer.json", workers=1),
        read_back(tmp / "ds")[1],
    )
    eod = tok.token_to_id("</s>")
    want = [[*tok.encode(d, add_special_tokens=False).ids, eod] for d in DOCS if d]
    assert [r.tolist() for r in records] == want
    assert m.eod_id == eod == data_mod.eos_id(tok)
    assert m.tokenizer.sha256 == sha256_file(tmp / "tokenizer.json")
    assert m.vocab_size == tok.get_vocab_size(with_added_tokens=True)


def test_an_interrupted_prepare_resumes_without_redoing_finished_shards(corpus, capsys):
    tmp, inputs = corpus
    out = tmp / "ds"
    prepare.prepare(inputs, out, workers=1, docs_per_shard=2)
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    # as if stopped while writing shard 1: its file and its done marker are not there
    (out / "shard-00001.array_record").unlink()
    (out / "done" / "shard-00001.array_record.json").unlink()
    (out / "manifest.json").unlink()
    capsys.readouterr()
    m = prepare.prepare(inputs, out, workers=1, docs_per_shard=2)
    assert "resuming: 2 of 3 shards done" in capsys.readouterr().err
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert after["shard-00000.array_record"] == first["shard-00000.array_record"]
    assert after["shard-00002.array_record"] == first["shard-00002.array_record"]
    assert m.documents == 4 and len(read_back(out)[1]) == 4
    with pytest.raises(prepare.PrepareError, match="holds a prepare of other inputs"):
        prepare.prepare(inputs[:1], out, workers=1, docs_per_shard=2)


@pytest.mark.parametrize(
    "content,match",
    [
        (
            '{"text": "ok"}\n{"body": "x"}\n',
            r"c\.jsonl:2: no string field 'text' \(keys: \['body'\]\)",
        ),
        ('{"text": "ok"}\nnot json\n', r"c\.jsonl:2: not a JSON line"),
        ('{"text": 3}\n', r"c\.jsonl:1: no string field 'text'"),
    ],
)
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, content, match):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(prepare.PrepareError, match=match):
        prepare.prepare([str(tmp_path / "c.jsonl")], tmp_path / "ds", workers=1)


def test_cli_one_line_errors_and_the_trainer_subcommand(tmp_path):
    """`python -m train.data.prepare` and `python -m train prepare`: a summary line when done, one
    `error:` line and exit status 1 for bad input (missing file, a glob matching nothing, an empty
    corpus: after the progress lines of what it read), argparse's exit 2 for bad numbers."""
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "empty.txt").write_text("")

    def run(*args, module="train.data.prepare"):
        cmd = [sys.executable, "-m", *module.split(), *map(str, args)]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    ok = run(tmp_path / "a.txt", "--out", tmp_path / "ds", module="train prepare")
    assert ok.returncode == 0, ok.stderr
    assert "prepared 1 documents, 10 tokens in 1 shards" in ok.stdout
    for args, msg in [
        ((tmp_path / "nope.txt",), f"error: prepare: input not found: {tmp_path / 'nope.txt'}"),
        ((tmp_path / "*.md",), "error: prepare: no file matches"),
        ((tmp_path / "empty.txt",), "is empty (empty corpus)"),
    ]:
        r = run(*args, "--out", tmp_path / "bad")
        assert r.returncode == 1 and msg in r.stderr, r.stderr
        errors = [line for line in r.stderr.splitlines() if not line.startswith("prepare: ")]
        assert errors == [r.stderr.strip().splitlines()[-1]], r.stderr  # one line, the last
    r = run(tmp_path / "a.txt", "--out", tmp_path / "x", "--workers", "0")
    assert r.returncode == 2 and "--workers 0: expected an integer >= 1" in r.stderr
