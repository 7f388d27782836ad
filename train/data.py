"""Training data: a byte-level tokenizer over local text, packed into fixed-length sequences, in an
order fixed by (seed, step) alone, so a resumed run reads exactly the batches an uninterrupted one
would have read. The data position is simply the step: batch `s` (0-based) holds the global samples
`s*B .. s*B+B-1`; sample `i` is sequence `perm(seed, i // N)[i % N]` of epoch `i // N`, where `N`
is the number of packed sequences and `perm` a permutation drawn from numpy's PCG64 seeded with
(seed, epoch).

`--synthetic` instead draws, per (seed, step), arithmetic progressions of bytes (random start and
stride), a learnable stream that needs no files.
"""

from pathlib import Path

import numpy as np

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "declaration.txt"


def byte_tokenize(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids 0..255."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


class TextData:
    """Fixed-length sequences packed from the concatenated bytes of `paths` (files are joined
    with a newline; the tail that does not fill a sequence is dropped)."""

    def __init__(self, paths, seq_len: int, batch_size: int, seed: int, vocab_size: int):
        paths = [Path(p) for p in paths]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"data file not found: {p}")
        if vocab_size < 256:
            raise ValueError(f"the byte-level tokenizer needs vocab_size >= 256, got {vocab_size}")
        tokens = np.concatenate([byte_tokenize(p.read_text(encoding="utf-8") + "\n")
                                 for p in paths])
        self.num_seqs = len(tokens) // seq_len
        if self.num_seqs < 1:
            raise ValueError(f"the data ({len(tokens)} tokens in {[str(p) for p in paths]}) "
                             f"cannot fill one sequence of seq_len={seq_len}")
        self.seqs = tokens[: self.num_seqs * seq_len].reshape(self.num_seqs, seq_len)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm_cache = {epoch: rng.permutation(self.num_seqs)}
        return self._perm_cache[epoch]

    def batch(self, step: int) -> np.ndarray:
        """The [batch_size, seq_len] int32 batch of 0-based `step`."""
        idx = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        rows = [self._perm(int(i) // self.num_seqs)[int(i) % self.num_seqs] for i in idx]
        return self.seqs[rows]


class SyntheticData:
    """Arithmetic progressions mod vocab: row r of step s starts at a random token and adds a
    random stride in 1..7, both drawn from (seed, step)."""

    def __init__(self, seq_len: int, batch_size: int, seed: int, vocab_size: int):
        self.seq_len, self.batch_size, self.seed, self.vocab = seq_len, batch_size, seed, vocab_size

    def batch(self, step: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, 1_000_003, step]))
        start = rng.integers(0, self.vocab, (self.batch_size, 1))
        stride = rng.integers(1, 8, (self.batch_size, 1))
        return ((start + stride * np.arange(self.seq_len)) % self.vocab).astype(np.int32)


def make_data(paths, *, synthetic: bool, seq_len: int, batch_size: int, seed: int,
              vocab_size: int):
    if synthetic:
        return SyntheticData(seq_len, batch_size, seed, vocab_size)
    return TextData(paths or [DEFAULT_TEXT], seq_len, batch_size, seed, vocab_size)
