"""Trainer data (`train.data`): --data files prepared into the cache with a local HF
tokenizer.json and the byte-level default, prepared directories checked against the model, and
the loss-curve plot (`train.run.plot`). The byte-level determinism/cycling test is in
test_train.py."""

import json
import subprocess
import sys

import numpy as np
import pytest

from train.data import DatasetError, make_source, prepare, prepared
from train.data.tokenizers import byte_tokenize
from train.run import plot

TEXTS = [
    "the cat sat on the mat\nthe dog sat on the log\n",
    "a cat and a dog\nthe mat and the log and the cat\n",
]


def _tokenizer_json(path, specials, *, bos_template=False):
    """A WordLevel tokenizer.json trained on TEXTS with `specials` first in its vocabulary;
    with `bos_template` its post-processor prepends "<s>" (which packing must not add)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=specials))
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(path))
    return tok


@pytest.fixture
def files(tmp_path):
    out = []
    for i, t in enumerate(TEXTS):
        out.append(tmp_path / f"f{i}.txt")
        out[-1].write_text(t)
    return out


def _stream(d):
    """The whole token stream of a packed data source, with its segment ids."""
    whole = d.corpus.read(0, d.corpus.tokens)
    return whole.tokens, whole.segment_ids


@pytest.mark.parametrize(
    "specials, eos",
    [
        (["[UNK]", "<s>", "<|endoftext|>"], "<|endoftext|>"),
        (["[UNK]", "<s>", "</s>"], "</s>"),
        (["[UNK]", "<s>"], None),
    ],
)
def test_hf_tokenizer_packs_independent_tokenization(tmp_path, files, specials, eos):
    """--data files with --tokenizer: each file one document, tokenized without the
    post-processor's tokens and followed by the EOS the vocabulary has (none without one)."""
    tok = _tokenizer_json(tmp_path / "tokenizer.json", specials, bos_template=True)
    sep = [] if eos is None else [tok.token_to_id(eos)]
    per_file = [tok.encode(t, add_special_tokens=False).ids + sep for t in TEXTS]
    ids = [i for f in per_file for i in f]
    assert tok.token_to_id("<s>") not in ids  # no post-processor tokens
    kw = dict(synthetic=False, seq_len=4, batch_size=1, seed=1)
    d = make_source(
        [str(f) for f in files], vocab_size=64, tokenizer=tmp_path / "tokenizer.json", **kw
    )
    tokens, seg = _stream(d)
    np.testing.assert_array_equal(tokens, ids)
    np.testing.assert_array_equal(seg, np.repeat([1, 2], [len(f) for f in per_file]))
    logged = []
    again = make_source(
        files, vocab_size=64, tokenizer=str(tmp_path / "tokenizer.json"), log=logged.append, **kw
    )
    assert logged == []  # read from the cache, not prepared again
    for _ in range(d.num_rows + 3):  # into the second epoch
        a, b = next(d), next(again)
        np.testing.assert_array_equal(a.tokens, b.tokens)  # order fixed by the seed
        assert a.tokens.tobytes() in np.asarray(ids, np.int32).tobytes()


def test_data_errors(tmp_path, files):
    tok = _tokenizer_json(tmp_path / "tok.json", ["[UNK]", "</s>"])
    n = tok.get_vocab_size(with_added_tokens=True)
    kw = dict(synthetic=False, seq_len=4, batch_size=2, seed=0)
    with pytest.raises(FileNotFoundError, match=r"tokenizer file not found: .*missing\.json"):
        make_source(files, vocab_size=64, tokenizer=tmp_path / "missing.json", **kw)
    for i, junk in enumerate(["not json", "{}", '{"model": 3}']):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(junk)
        with pytest.raises(ValueError, match=rf"not a valid tokenizer\.json: .*bad{i}\.json"):
            make_source(files, vocab_size=64, tokenizer=bad, **kw)
    with pytest.raises(ValueError, match=rf"has {n} tokens, .*vocab_size={n - 1}"):
        make_source(files, vocab_size=n - 1, tokenizer=tmp_path / "tok.json", **kw)
    make_source(files, vocab_size=n, tokenizer=tmp_path / "tok.json", **kw)  # exactly fits
    with pytest.raises(ValueError, match=r"seq_len=10000 is longer than the whole corpus"):
        make_source(
            files, vocab_size=n, tokenizer=tmp_path / "tok.json", **{**kw, "seq_len": 10_000}
        )
    body = tmp_path / "b.jsonl"
    body.write_text('{"body": "some words"}\n')
    with pytest.raises(DatasetError, match=r"b\.jsonl:1: no string field 'text' .* --field NAME"):
        make_source([body], vocab_size=256, **kw)
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.txt"):
        make_source([tmp_path / "nope.txt"], vocab_size=256, **kw)
    # a prepared directory: its manifest against the model and --tokenizer
    prepare.prepare(
        [str(f) for f in files], tmp_path / "ds", tokenizer=tmp_path / "tok.json", workers=1
    )
    make_source([tmp_path / "ds"], vocab_size=n, **kw)
    with pytest.raises(
        DatasetError,
        match=rf"manifest\.json: prepared with .*tok\.json of {n} tokens, .* vocab_size={n - 1}",
    ):
        make_source([tmp_path / "ds"], vocab_size=n - 1, **kw)
    other = _tokenizer_json(tmp_path / "other.json", ["[UNK]", "<|endoftext|>", "x"])
    assert other.get_vocab_size() <= 64
    with pytest.raises(
        DatasetError,
        match=r"manifest\.json: prepared with tokenizer .*tok\.json, not --tokenizer .*other",
    ):
        make_source([tmp_path / "ds"], vocab_size=64, tokenizer=tmp_path / "other.json", **kw)
    with pytest.raises(DatasetError, match=r"is a prepared dataset: give it alone"):
        make_source([tmp_path / "ds", files[0]], vocab_size=64, **kw)


def test_byte_tokenizer_packs_files_joined_by_newline(files):
    d = make_source(files, synthetic=False, seq_len=8, batch_size=2, seed=0, vocab_size=256)
    raw = "".join(t + "\n" for t in TEXTS).encode()
    tokens, seg = _stream(d)
    np.testing.assert_array_equal(tokens, np.frombuffer(raw, np.uint8))
    np.testing.assert_array_equal(seg, np.repeat([1, 2], [len(t.encode()) + 1 for t in TEXTS]))
    np.testing.assert_array_equal(byte_tokenize("é"), [0xC3, 0xA9])
    with pytest.raises(
        ValueError,
        match=r"byte-level tokenizer of 256 tokens, more than .* vocab_size=255",
    ):
        make_source(files, synthetic=False, seq_len=8, batch_size=2, seed=0, vocab_size=255)


def test_default_data_does_not_import_tokenizers():
    code = (
        "import sys; from train.data import make_source; "
        "d = make_source(None, synthetic=False, seq_len=32, batch_size=2, seed=0, "
        "vocab_size=256); next(d); assert 'tokenizers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- train.run.plot ----

RUN_A = [{"step": s, "loss": 5.0 / s, "lm_loss": 4.0 / s} for s in range(1, 6)]
RUN_B = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 9)]


@pytest.fixture
def runs(tmp_path):
    """Run "a" as a run directory (with a torn last line and a record without "loss"), run "b"
    as a bare .jsonl file."""
    (tmp_path / "a").mkdir()
    lines = [json.dumps(r) for r in RUN_A] + [json.dumps({"step": 6}), '{"step": 7, "lo']
    (tmp_path / "a" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RUN_B))
    return {"a": tmp_path / "a", "b": tmp_path / "b.jsonl"}


def _want(recs, key):
    return ([r["step"] for r in recs if key in r], [r[key] for r in recs if key in r])


def test_curves_equal_records(runs):
    got = plot.curves(runs)
    assert list(got) == ["a", "b"]
    for label, recs in (("a", RUN_A), ("b", RUN_B)):
        np.testing.assert_array_equal(got[label][0], _want(recs, "loss")[0])
        np.testing.assert_array_equal(got[label][1], _want(recs, "loss")[1])
    lm = plot.curves({"a": runs["a"], "list": RUN_A[::-1]}, key="lm_loss")
    for label in lm:  # lists taken as is, sorted by step
        np.testing.assert_array_equal(np.stack(lm[label]), np.array(_want(RUN_A, "lm_loss")))


def test_plot_losses_writes_png_of_the_curves(runs, tmp_path):
    fig = plot.make_figure(runs, key="loss", title="t")
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["a", "b"]
    for ln, recs in zip(lines, (RUN_A, RUN_B)):
        np.testing.assert_array_equal(ln.get_xydata().T, np.array(_want(recs, "loss")))
    out = plot.plot_losses(runs, tmp_path / "sub" / "loss.png", title="t")
    assert out == tmp_path / "sub" / "loss.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_errors(runs, tmp_path):
    with pytest.raises(ValueError, match=r"run 'b' .* no records with 'step' and 'lm_loss'"):
        plot.curves(runs, key="lm_loss")
    with pytest.raises(ValueError, match="run 'empty'"):
        plot.plot_losses({"empty": []}, tmp_path / "x.png")
    with pytest.raises(FileNotFoundError, match=r"metrics file not found: .*nope"):
        plot.curves({"x": tmp_path / "nope"})
    assert not (tmp_path / "x.png").exists()


def test_plot_cli(runs, tmp_path, capsys):
    out = tmp_path / "cli.png"
    assert plot.main([str(out), str(runs["a"]), f"B={runs['b']}", "--title", "x"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.parse_run(str(runs["a"])) == ("a", runs["a"])
    assert plot.parse_run(str(runs["a"] / "metrics.jsonl"))[0] == "a"
    assert plot.parse_run(str(runs["b"]))[0] == "b"
    assert plot.main([str(out), str(runs["a"]), str(runs["a"])]) == 1
    assert "two runs are labelled 'a'" in capsys.readouterr().err
    assert plot.main([str(out), str(runs["b"]), "--key", "lm_loss"]) == 1
    assert "no records" in capsys.readouterr().err


def test_two_processes_preparing_the_same_files_keep_one_copy(tmp_path, monkeypatch, files):
    """Each process prepares into a directory of its own and renames it into place; the one
    that finishes second (here: another copy appears just before our rename) discards its own
    and reads the first one's."""
    import shutil

    data = prepared

    monkeypatch.setenv("RELAYMOE_DATA_CACHE", str(tmp_path / "cache"))
    real = prepare.prepare

    def another_process_finishes_first(inputs, out, **kw):
        manifest = real(inputs, out, **kw)
        shutil.copytree(out, out.parent / out.name.split(".")[1])  # its copy, renamed in place
        (out.parent / out.name.split(".")[1] / "theirs").write_text("")
        return manifest

    monkeypatch.setattr(prepare, "prepare", another_process_finishes_first)
    got = data.prepared_text(files, log=lambda line: None)
    assert (got / "theirs").exists() and (got / "manifest.json").is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [got.name]  # ours removed
    monkeypatch.setattr(prepare, "prepare", real)
    assert data.prepared_text(files, log=lambda line: None) == got  # read from the cache
