"""Packed rows of a prepared dataset (`train/prepare.py`), read through grain, each process
reading only its own rows.

The global batch has B rows. Row r of every batch comes from its own stream: the documents of
the corpus in a deterministic global shuffle (grain's, from `seed`, reshuffled each epoch),
taking every B-th from position r, packed back to back into rows of `seq_len` tokens by grain's
`ConcatThenSplitIterDataset`: a document longer than what is left of a row is split, and each
row carries `segment_ids` (1, 2, ... per piece of document in the row, 0 for padding) and
`positions` (restarting at 0 for each piece). So the rows, and a process's share of them, do not
depend on how many processes read them: process p of P (B divisible by P) reads only the streams
of its rows p * B / P .. (p + 1) * B / P - 1, lazily (ArrayRecord: random access by record).

`state()` is every local stream's grain iterator state (JSON-serialisable); `restore(state)`
continues exactly there, without reading from the start. The shards are checked against the
manifest before anything is read: present, the recorded size and (unless
`verify_hashes=False`, for corpora too large to hash at every start) the recorded sha256; past
that, riegeli's own checksums (under ArrayRecord) fail a damaged chunk when it is read.
"""

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .prepare import sha256_file


class Batch(NamedTuple):
    """One process's rows of a global batch: int32 [rows, seq_len] each."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


class DatasetError(ValueError):
    """A prepared dataset that cannot be read as asked: one line naming the file."""


def load_manifest(directory, verify_hashes: bool = False) -> dict:
    """The manifest, with every shard checked to be there at its recorded size, and with
    `verify_hashes` its sha256 too (about a second per GB)."""
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise DatasetError(
            f"{directory}: no manifest.json (not a prepared dataset: python -m train.prepare)"
        )
    manifest = json.loads(path.read_text())
    for shard in manifest["shards"]:
        f = directory / shard["file"]
        if not f.is_file():
            raise DatasetError(f"{f}: missing (listed in {path})")
        size = f.stat().st_size
        if size != shard["bytes"]:
            raise DatasetError(
                f"{f}: {size} bytes, the manifest records {shard['bytes']} (truncated or "
                "rewritten: prepare it again)"
            )
        if verify_hashes and sha256_file(f) != shard["sha256"]:
            raise DatasetError(
                f"{f}: its sha256 differs from the manifest's (corrupt: prepare it again)"
            )
    return manifest


def _open(grain, shards):
    """grain's ArrayRecord source over `shards`; a shard that fails its checksums is named."""
    try:
        return grain.sources.ArrayRecordDataSource(shards)
    except RuntimeError as e:
        for shard in shards:
            try:
                grain.sources.ArrayRecordDataSource([shard])
            except RuntimeError as err:
                raise DatasetError(f"{shard}: corrupt ({err}); prepare it again") from None
        raise DatasetError(f"cannot read the shards: {e}") from None


class PackedRows:
    """The rows of process `process_index` of `process_count` (see the module docstring)."""

    def __init__(
        self, directory, *, seq_len: int, global_batch: int, seed: int, process_index=0,
        process_count=1, verify_hashes=True,
    ):  # fmt: skip
        import grain
        import grain.experimental as grain_exp

        if global_batch % process_count:
            raise DatasetError(
                f"global batch {global_batch} does not split over {process_count} processes"
            )
        self.manifest = load_manifest(directory, verify_hashes)
        shards = [str(Path(directory) / s["file"]) for s in self.manifest["shards"]]
        self.seq_len, self.global_batch = seq_len, global_batch
        per = global_batch // process_count
        self.rows = range(process_index * per, (process_index + 1) * per)
        docs = grain.MapDataset.source(_open(grain, shards))
        docs = docs.shuffle(seed=seed).repeat()  # a new permutation every epoch
        docs = docs.map(lambda record: {"tokens": np.frombuffer(record, "<i4")})
        self._iters = [
            iter(
                grain_exp.ConcatThenSplitIterDataset(
                    docs[r::global_batch].to_iter_dataset(), length_struct={"tokens": seq_len}
                )
            )
            for r in self.rows
        ]

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        rows = [next(it) for it in self._iters]
        stack = lambda key: np.stack([row[key] for row in rows]).astype(np.int32)
        return Batch(stack("tokens"), stack("tokens_segment_ids"), stack("tokens_positions"))

    def state(self) -> dict:
        """{row: its stream's grain iterator state}, for the checkpoint."""
        return {str(r): it.get_state() for r, it in zip(self.rows, self._iters)}

    def restore(self, state: dict) -> None:
        missing = [r for r in self.rows if str(r) not in state]
        if missing:
            raise DatasetError(f"loader state: no stream state for rows {missing}")
        for r, it in zip(self.rows, self._iters):
            it.set_state(state[str(r)])
