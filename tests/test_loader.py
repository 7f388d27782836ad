"""The packed-row loader of a prepared dataset (`train/data/loader.py`), against a reference built
here from the documents tokenized independently: each row is the corpus stream cut into rows and
visited in grain's permutation, with segment ids and positions that match the
documents in it; an epoch visits every row of its grid once; a process reads only its rows (and
only the records under them); a restored state continues exactly; bad datasets are refused
naming the file."""

import json

import numpy as np
import pytest

from train.data import prepare
from train.data.format import DatasetError, load_manifest
from train.data.loader import PackedRows, row_ranges
from train.data.tokenizers import byte_tokenize

SEQ, B = 16, 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """40 documents of 1..40 bytes ("a" * n, "b" * n, ...), prepared byte-level in shards of 7
    (rows cross shards); (its directory, each document's tokens with its end-of-document)."""
    tmp = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"text": chr(97 + i % 26) * (1 + (7 * i) % 40)}) for i in range(40)]
    (tmp / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare.prepare([str(tmp / "c.jsonl")], tmp / "ds", workers=1, docs_per_shard=7)
    docs = [np.append(byte_tokenize(json.loads(x)["text"]), np.int32(10)) for x in lines]
    return tmp / "ds", docs


def _expected(docs, seed: int, sample: int):
    """Global sample `sample` from the module docstring's definition: (tokens, segment ids,
    positions), numpy only apart from grain's permutation."""
    import grain

    stream = np.concatenate(docs)
    doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    starts = np.cumsum([0] + [len(d) for d in docs])[:-1]
    n = len(stream) // SEQ
    salt = int(np.random.Generator(np.random.PCG64([seed, 0x5EED])).integers(2**31))
    row = grain.MapDataset.range(n).shuffle(seed=salt).repeat()[sample]
    at = row * SEQ + np.arange(SEQ)
    d = doc_of[at]
    seg = 1 + np.concatenate([[0], np.cumsum(d[1:] != d[:-1])])
    pos = at - np.maximum(starts[d], at[0])
    return stream[at], seg, pos


def test_rows_are_the_corpus_cut_and_shuffled_with_document_segments(dataset):
    """Three epochs of batches, every row against the reference; each epoch visits each row of
    its grid once; a row holding several documents gives each its own segment."""
    directory, docs = dataset
    loader = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=1)
    n = loader.num_rows
    assert n == sum(map(len, docs)) // SEQ == 53
    steps = 3 * n // B + 1
    batches = [next(loader) for _ in range(steps)]
    for s, b in enumerate(batches):
        assert b.tokens.dtype == b.segment_ids.dtype == b.positions.dtype == np.int32
        for r in range(B):
            want = _expected(docs, 1, s * B + r)
            for got, w in zip((b.tokens[r], b.segment_ids[r], b.positions[r]), want):
                np.testing.assert_array_equal(got, w)
    rows = np.concatenate([b.tokens for b in batches])
    grid = np.concatenate(docs)[: n * SEQ].reshape(n, SEQ)
    for e in range(3):  # each epoch: every row once
        epoch = rows[e * n : (e + 1) * n]
        assert sorted(r.tobytes() for r in epoch) == sorted(r.tobytes() for r in grid)
    assert loader.unused_tokens == sum(map(len, docs)) - n * SEQ == 12
    assert max(b.segment_ids.max() for b in batches) >= 3  # rows do hold several documents
    assert not np.array_equal(rows[:n], rows[n : 2 * n])  # another permutation each epoch


def test_a_process_reads_only_its_rows(dataset):
    """Rows {1, 3} of each batch are exactly those rows of the whole batch, and reading them
    fetches only the records under them (counted at the ArrayRecord source)."""
    directory, docs = dataset
    whole = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=2, threads=0)
    part = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=2, rows=[1, 3], threads=0)
    fetched = []

    record = part.corpus.record
    part.corpus.record = lambda i: fetched.append(i) or record(i)  # each document read
    stream_docs = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    want_records = set()
    for s in range(6):
        w, p = next(whole), next(part)
        np.testing.assert_array_equal(p.tokens, w.tokens[[1, 3]])
        np.testing.assert_array_equal(p.segment_ids, w.segment_ids[[1, 3]])
        for r in (1, 3):
            sample = s * B + r
            start = int(part._order[sample]) * SEQ
            want_records.update(stream_docs[start : start + SEQ].tolist())
    assert set(fetched) == want_records
    with pytest.raises(DatasetError, match=r"rows \[4\]: expected distinct rows of a batch of 4"):
        PackedRows(directory, seq_len=SEQ, global_batch=B, seed=2, rows=[4])
    assert row_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_a_restored_state_continues_exactly(dataset):
    directory, _ = dataset
    run = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=4)
    for _ in range(6):
        next(run)
    state = json.loads(json.dumps(run.state()))  # as a checkpoint stores it
    assert state == {"next_index": 6} and run.position() == 6
    want = [next(run) for _ in range(20)]  # past the first epoch (13 batches)
    resumed = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=4, rows=[2, 0])
    resumed.restore(state)
    for w in want:
        got = next(resumed)
        for a, b in zip(got, w):
            np.testing.assert_array_equal(a, b[[2, 0]])
    with pytest.raises(DatasetError, match="does not fit this loader"):
        resumed.restore({"position": 3})


def _copy(directory, tmp_path):
    copy = tmp_path / "ds"
    copy.mkdir()
    for f in directory.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    return copy


def test_bad_datasets_name_the_file(dataset, tmp_path):
    directory, _ = dataset
    with pytest.raises(DatasetError, match=r"no manifest\.json"):
        load_manifest(tmp_path)
    copy = _copy(directory, tmp_path)
    shard = copy / "shard-00002.array_record"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[-30] ^= 0xFF  # the same size, one byte of the shard's footer changed
    shard.write_bytes(bytes(flipped))
    with pytest.raises(DatasetError, match=r"shard-00002\.array_record: its sha256 differs"):
        PackedRows(copy, seq_len=SEQ, global_batch=B, seed=0)
    flipped[len(good) // 2] ^= 0xFF  # and one in a record's chunk: riegeli's hash fails it
    shard.write_bytes(bytes(flipped))
    unchecked = PackedRows(copy, seq_len=SEQ, global_batch=B, seed=0, verify_hashes=False)
    with pytest.raises(DatasetError, match=r"shard-00002\.array_record: corrupt \("):
        for _ in range(unchecked.num_rows):  # an epoch reads every shard
            next(unchecked)
    shard.write_bytes(good[:-5])
    with pytest.raises(
        DatasetError, match=r"shard-00002.array_record: \d+ bytes, the manifest records"
    ):
        load_manifest(copy)
    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard-00002\.array_record: missing"):
        load_manifest(copy)
    shard.write_bytes(good)
    lengths = copy / "shard-00001.lengths.npy"
    lengths.write_bytes(lengths.read_bytes()[:-4])
    with pytest.raises(DatasetError, match=r"shard-00001\.lengths\.npy: \d+ bytes, the manifest"):
        load_manifest(copy)
    with pytest.raises(DatasetError, match=r"seq_len=861 is longer than the whole corpus \(860"):
        PackedRows(directory, seq_len=861, global_batch=B, seed=0)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format": "relaymoe-tokens-v1"}))
    with pytest.raises(DatasetError, match=r"manifest\.json: format 'relaymoe-tokens-v1', this"):
        load_manifest(copy)
    (copy / "manifest.json").write_text("{")
    with pytest.raises(DatasetError, match=r"manifest\.json: not valid JSON"):
        load_manifest(copy)


def test_the_manifest_is_one_record_read_back_as_written(dataset, tmp_path):
    """`load_manifest` reads manifest.json into the `Manifest` record that writes it back byte
    for byte; a manifest of the right format missing a field is one line naming the file."""
    directory, _ = dataset
    manifest = load_manifest(directory, verify_hashes=True)
    assert manifest.shards[0].file == "shard-00000.array_record"
    assert manifest.documents == 40 and manifest.tokenizer.kind == "bytes"
    copy = _copy(directory, tmp_path)
    manifest.write(copy)
    assert (copy / "manifest.json").read_bytes() == (directory / "manifest.json").read_bytes()
    d = json.loads((copy / "manifest.json").read_text())
    del d["shards"][0]["lengths_sha256"]
    (copy / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(DatasetError, match=r"manifest\.json: not a relaymoe-tokens-v2 manifest"):
        load_manifest(copy)
