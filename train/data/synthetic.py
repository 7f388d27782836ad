"""The synthetic stream (`--synthetic`): per (seed, step), arithmetic progressions of token ids
(random start and stride), a learnable stream that needs no files."""

import numpy as np

from .source import Batch


class SyntheticSource:
    """Arithmetic progressions mod vocab: row r of step s starts at a random token and adds a
    random stride in 1..7, both drawn from (seed, step). A `Source` from step 0 (`seek`); every
    process draws the whole batch, without segment ids."""

    packed = False

    def __init__(self, seq_len: int, batch_size: int, seed: int, vocab_size: int):
        self.seq_len, self.batch_size, self.seed, self.vocab = seq_len, batch_size, seed, vocab_size
        self.step = 0

    def batch(self, step: int) -> np.ndarray:
        """The [batch_size, seq_len] int32 batch of 0-based `step`."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 1_000_003, step]))
        start = rng.integers(0, self.vocab, (self.batch_size, 1))
        stride = rng.integers(1, 8, (self.batch_size, 1))
        return ((start + stride * np.arange(self.seq_len)) % self.vocab).astype(np.int32)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        self.step += 1
        return Batch(self.batch(self.step - 1))

    def state(self) -> dict:
        return {"step": self.step}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])

    def seek(self, step: int) -> None:
        self.step = step

    def position(self) -> int:
        return self.step

    def identity(self) -> dict:
        return {"synthetic": True}

    def summary(self) -> None:
        return None
