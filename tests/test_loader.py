"""The packed-row loader of a prepared dataset (`train/loader.py`): every row is documents of the
corpus back to back with segment ids and positions that match them (checked against the
documents themselves), each document piece comes from the corpus in order, the rows do not depend
on the number of processes reading them, a restored state continues exactly, and bad datasets
are refused naming the file."""

import json

import numpy as np
import pytest

from train import prepare
from train.data import byte_tokenize
from train.loader import DatasetError, PackedRows, load_manifest

SEQ, B = 16, 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """40 documents of 1..40 bytes ("a" * n, "b" * n, ...), prepared byte-level; (its
    directory, the texts in document order)."""
    tmp = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"text": chr(97 + i % 26) * (1 + (7 * i) % 40)}) for i in range(40)]
    (tmp / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare.prepare([str(tmp / "c.jsonl")], tmp / "ds", workers=1, docs_per_shard=7)
    return tmp / "ds", [json.loads(line)["text"] for line in lines]


def _pieces(batch):
    """Each row cut at its segment ids into (segment, tokens) pieces, padding left out."""
    out = []
    for tok, seg, pos in zip(batch.tokens, batch.segment_ids, batch.positions):
        for s in sorted(set(seg.tolist()) - {0}):
            sel = np.flatnonzero(seg == s)
            assert (np.diff(sel) == 1).all()  # a segment is contiguous
            np.testing.assert_array_equal(pos[sel], np.arange(len(sel)))  # positions restart
            out.append(tok[sel])
        assert (tok[seg == 0] == 0).all()  # padding is 0
    return out


def test_each_row_is_its_stream_of_shuffled_documents_packed(dataset):
    """Row r of consecutive batches is the documents at positions r, r + B, r + 2B, ... of the
    shuffled corpus (grain's permutation, reshuffled each epoch), their tokens (the text's bytes
    and the end-of-document token, tokenized here independently) back to back, split across rows
    where they do not fit; segment ids and positions mark each piece."""
    import grain

    directory, texts = dataset
    docs = [np.append(byte_tokenize(t), prepare.BYTE_EOD) for t in texts]
    rows = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=1)
    steps = 40  # about 3 epochs of the 40 documents (860 tokens) over 4 rows
    batches = [next(rows) for _ in range(steps)]
    order = grain.MapDataset.range(len(docs)).shuffle(seed=1).repeat()
    for r in range(B):
        stream = np.concatenate([docs[order[r + B * i]] for i in range(60)])
        got = np.concatenate([b.tokens[r] for b in batches])
        np.testing.assert_array_equal(got, stream[: steps * SEQ])
    for b in batches:
        pieces = _pieces(b)
        assert sum(len(p) for p in pieces) == B * SEQ  # no padding inside the stream


def test_rows_do_not_depend_on_the_process_count(dataset):
    """Two processes of two rows each read exactly the rows one process of four reads."""
    directory, _ = dataset
    whole = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=2)
    halves = [
        PackedRows(directory, seq_len=SEQ, global_batch=B, seed=2, process_index=p, process_count=2)
        for p in range(2)
    ]
    for _ in range(5):
        w = next(whole)
        parts = [next(h) for h in halves]
        np.testing.assert_array_equal(w.tokens, np.concatenate([p.tokens for p in parts]))
        np.testing.assert_array_equal(w.segment_ids, np.concatenate([p.segment_ids for p in parts]))
    other_seed = next(PackedRows(directory, seq_len=SEQ, global_batch=B, seed=3))
    assert not np.array_equal(
        other_seed.tokens, next(PackedRows(directory, seq_len=SEQ, global_batch=B, seed=2)).tokens
    )


def test_a_restored_state_continues_exactly(dataset):
    directory, _ = dataset
    run = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=4)
    for _ in range(6):
        next(run)
    state = json.loads(json.dumps(run.state()))  # as a checkpoint stores it
    want = [next(run) for _ in range(5)]
    resumed = PackedRows(directory, seq_len=SEQ, global_batch=B, seed=4)
    resumed.restore(state)
    for w in want:
        got = next(resumed)
        for a, b in zip(got, w):
            np.testing.assert_array_equal(a, b)


def test_bad_datasets_name_the_file(dataset, tmp_path):
    directory, _ = dataset
    with pytest.raises(DatasetError, match=r"no manifest\.json"):
        load_manifest(tmp_path)
    copy = tmp_path / "ds"
    copy.mkdir()
    for f in directory.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "shard-00002.array_record"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[-30] ^= 0xFF  # the same size, one byte of the shard's footer changed
    shard.write_bytes(bytes(flipped))
    with pytest.raises(DatasetError, match=r"shard-00002\.array_record: its sha256 differs"):
        PackedRows(copy, seq_len=SEQ, global_batch=B, seed=0)
    shard.write_bytes(good[:-5])
    with pytest.raises(
        DatasetError, match=r"shard-00002.array_record: \d+ bytes, the manifest records"
    ):
        load_manifest(copy)
    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard-00002\.array_record: missing"):
        load_manifest(copy)
    with pytest.raises(DatasetError, match="global batch 4 does not split over 3 processes"):
        PackedRows(directory, seq_len=SEQ, global_batch=4, seed=0, process_count=3)
