"""Packed rows of a prepared dataset (`train.data.format`, written by `train.data.prepare`), read
through grain, each process reading only the rows its devices hold.

The corpus is its documents back to back in prepare's order (each ends with the end-of-document
token): one stream of T tokens, cut into N = T // seq_len rows (the last T - N * seq_len < seq_len
tokens are in none: `unused_tokens`, which the trainer logs). Each epoch visits the rows in
grain's deterministic shuffle (from the seed, a new permutation each epoch). Global sample i
(batch i // B, row i % B) is row perm_e(i mod N) of epoch e = i // N. A row holds documents back
to back, a document that does not fit continued in another row: `segment_ids` number the pieces
of documents in the row 1, 2, ... and `positions` restart at 0 at each piece's first token, so
attention and the loss stay inside a document (`train.step.train_step`). This is the trainer's old
text packing (cut, then shuffle) with document boundaries kept: documents next to each other in
the corpus can share a row; shuffle the input beforehand if its order means something.

A row is found without reading anything before it: the manifest's per-shard token counts name the
shard, the shard's lengths file (prepare's index) the documents, and only those records are read
(ArrayRecord: random access; at most `Corpus.OPEN_SHARDS` shards open, and as many lengths files
cached). So the loader's memory does not grow with the corpus, and a process reads only its rows:
`rows` (the global row indices its devices hold, `rows_of_process`) select the samples, so what a
row holds does not depend on how many processes read the batch.

The state is grain's iterator state (`{"next_index": batches read}`), saved with each checkpoint;
`restore(state)` continues there at once (every row is computed from its index). Background
threads (`threads`) read the next batches while a step runs. The shards are checked against the
manifest first (`format.load_manifest`): present, the recorded size, (unless
`verify_hashes=False`) the recorded sha256, and the counts by which rows are found against the
lengths files; past that, riegeli's checksums fail a damaged chunk when it is read (a
`DatasetError` naming the shard).
"""

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .format import MANIFEST, DatasetError, Manifest, load_manifest, read_lengths
from .source import Batch

SHUFFLE_SALT = 0x5EED  # grain's shuffle seeds epoch e with seed + e: spread the trainer's seeds
PACKING = "packed-documents-v1"  # how rows are packed (the run identity's "loader")


class Corpus:
    """The documents of a prepared dataset as one token stream with random access by token.

    Shards are opened as rows need them and at most `OPEN_SHARDS` at a time (an open ArrayRecord
    reader holds ~0.6 MiB, opening one takes ~3 ms), so memory does not grow with the corpus."""

    OPEN_SHARDS = 64

    def __init__(self, directory, manifest: Manifest, grain):
        self.directory, self._grain = Path(directory), grain
        shards = manifest.shards
        self._files = [self.directory / s.file for s in shards]
        self._lengths_files = [self.directory / s.lengths_file for s in shards]
        self.shard_token_starts = np.cumsum([0] + [s.tokens for s in shards], dtype=np.int64)
        self.shard_doc_starts = np.cumsum([0] + [s.documents for s in shards], dtype=np.int64)
        self.tokens = int(self.shard_token_starts[-1])

    @functools.lru_cache(maxsize=OPEN_SHARDS)  # noqa: B019 (the loader lives as long as its cache)
    def _source(self, shard: int):
        return self._grain.sources.ArrayRecordDataSource([str(self._files[shard])])

    def record(self, i: int) -> bytes:
        """Document `i` (in corpus order) as stored: int32 little-endian token ids. A shard that
        fails riegeli's checksums (its sha256 was not checked at start) is named."""
        shard = int(np.searchsorted(self.shard_doc_starts, i, side="right")) - 1
        try:
            return self._source(shard)[i - int(self.shard_doc_starts[shard])]
        except (RuntimeError, IndexError) as e:  # IndexError: fewer records than documents
            raise DatasetError(f"{self._files[shard]}: corrupt ({e}); prepare it again") from None

    @functools.lru_cache(maxsize=OPEN_SHARDS)  # noqa: B019 (80 KB each at 10,000 documents)
    def _doc_ends(self, shard: int) -> np.ndarray:
        """The token offsets (within shard `shard`) at which its documents end."""
        return np.cumsum(read_lengths(self._lengths_files[shard]), dtype=np.int64)

    def pieces(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """(record, first, stop) token ranges of the documents covering tokens [start, start+n)."""
        out, t, end = [], start, start + n
        while t < end:
            shard = int(np.searchsorted(self.shard_token_starts, t, side="right")) - 1
            ends = self._doc_ends(shard)
            local = t - int(self.shard_token_starts[shard])
            doc = int(np.searchsorted(ends, local, side="right"))
            doc_start = int(ends[doc - 1]) if doc else 0
            first = local - doc_start
            stop = min(int(ends[doc]) - doc_start, first + end - t)
            out.append((int(self.shard_doc_starts[shard]) + doc, first, stop))
            t += stop - first
        return out

    def read(self, start: int, n: int) -> Batch:
        """Tokens [start, start + n) with their segment ids and positions (module docstring)."""
        pieces = self.pieces(start, n)
        # one record at a time: ArrayRecord's batch read (__getitems__) costs ~1 ms of
        # thread-pool setup per call, single reads ~20 us; a row spans few documents
        records = [self.record(p[0]) for p in pieces]
        for r, (i, _, stop) in zip(records, pieces):
            if len(r) < 4 * stop:  # a record shorter than its lengths file says (unhashed)
                shard = int(np.searchsorted(self.shard_doc_starts, i, side="right")) - 1
                raise DatasetError(
                    f"{self._files[shard]}: a record of {len(r)} bytes, shorter than its lengths "
                    "file says (corrupt: prepare it again)"
                )
        tokens = np.concatenate(
            [np.frombuffer(r, "<i4")[a:b] for r, (_, a, b) in zip(records, pieces)]
        )
        lengths = [b - a for _, a, b in pieces]
        return Batch(
            tokens=tokens.astype(np.int32),
            segment_ids=np.repeat(np.arange(1, len(pieces) + 1, dtype=np.int32), lengths),
            positions=np.concatenate([np.arange(m, dtype=np.int32) for m in lengths]),
        )


def row_ranges(rows) -> str:
    """`rows` as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    out, rows = [], sorted(rows)
    start = prev = rows[0]
    for r in [*rows[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    return ", ".join(out)


def rows_of_process(sharding, global_shape) -> list[int]:
    """The rows of the global batch that this process's devices hold under `sharding`."""
    rows = set()
    for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(*idx[0].indices(global_shape[0])))
    return sorted(rows)


class PackedRows:
    """Batches of the rows `rows` (default all) of a global batch of `global_batch` rows (see
    the module docstring); an iterator of `Batch`."""

    def __init__(
        self,
        directory,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        rows: Sequence[int] | None = None,
        verify_hashes=True,
        threads: int = 2,
    ):
        import grain

        self.manifest = load_manifest(directory, verify_hashes)
        self.corpus = Corpus(directory, self.manifest, grain)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.threads = threads
        self.num_rows = self.corpus.tokens // seq_len
        if self.num_rows < 1:
            raise DatasetError(
                f"{Path(directory) / MANIFEST}: seq_len={seq_len} is longer than the "
                f"whole corpus ({self.corpus.tokens:,} tokens): no row can be filled"
            )
        self.unused_tokens = self.corpus.tokens - self.num_rows * seq_len
        order = grain.MapDataset.range(self.num_rows).shuffle(seed=self._shuffle_seed())
        self._order = order.repeat()
        self.select_rows(range(global_batch) if rows is None else rows)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Read the rows `rows` of each global batch from batch 0 on (`restore` to continue)."""
        import grain

        rows = [int(r) for r in rows]
        if (
            not rows
            or min(rows) < 0
            or max(rows) >= self.global_batch
            or len(set(rows)) < len(rows)
        ):
            raise DatasetError(
                f"rows {rows}: expected distinct rows of a batch of {self.global_batch}"
            )
        self.rows = rows
        samples = grain.MapDataset.range(2**62).map(self.sample_of_local).batch(len(rows))
        options = grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=2 * self.threads)
        self._it = iter(samples.to_iter_dataset(options))

    def _shuffle_seed(self) -> int:
        return int(np.random.Generator(np.random.PCG64([self.seed, SHUFFLE_SALT])).integers(2**31))

    def sample(self, i: int) -> Batch:
        """Global sample `i` (batch i // B, row i % B)."""
        return self.corpus.read(int(self._order[i]) * self.seq_len, self.seq_len)

    def sample_of_local(self, j: int) -> Batch:
        """This process's `j`-th sample: row rows[j % R] of batch j // R."""
        local = len(self.rows)
        return self.sample((j // local) * self.global_batch + self.rows[j % local])

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return next(self._it)

    def state(self) -> dict:
        """grain's iterator state (JSON), for the checkpoint."""
        return self._it.get_state()

    def position(self) -> int:
        """The batches read so far (the index of the next)."""
        return int(self.state()["next_index"])

    def restore(self, state: dict) -> None:
        """Continue from `state` (`state()` of a loader with the same settings)."""
        try:
            self._it.set_state(state)
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"loader state {state!r} does not fit this loader ({e})") from None
