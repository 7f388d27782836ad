"""What every data source gives the trainer: `Batch` records, through the `Source` protocol.

The sources are `synthetic.SyntheticSource` (a learnable stream that needs no files) and
`prepared.PreparedSource` (the packed rows of a prepared dataset, `loader.PackedRows`);
`train.data.make_source` builds the one a run asks for.
"""

from typing import NamedTuple, Protocol

import numpy as np


class Batch(NamedTuple):
    """Rows of a batch, int32 [rows, seq_len] each; what a source yields and the train step takes
    (a pytree: on device, each field is one array of the global batch). `segment_ids` number
    the pieces of documents in a row 1, 2, ... and `positions` restart at 0 at each piece's
    first token (`loader`); both None when the rows hold no document boundary (the synthetic
    stream, a corpus of one document): the step then compiles without the masks."""

    tokens: np.ndarray
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None


class Source(Protocol):
    """A trainer data source: an iterator of `Batch` whose position is saved in every
    checkpoint and restored on resume."""

    packed: bool  # its batches carry segment ids and positions

    def __next__(self) -> Batch:
        """The next batch (this process's rows of it)."""
        ...

    def state(self) -> dict:
        """Where it is, as JSON (saved with each checkpoint as `data_state`)."""
        ...

    def restore(self, state: dict) -> None:
        """Continue from `state()` of a source with the same settings."""
        ...

    def seek(self, step: int) -> None:
        """Continue at 0-based batch `step` (a checkpoint with no state of this source's kind)."""
        ...

    def position(self) -> int:
        """The batches read so far (the index of the next)."""
        ...

    def identity(self) -> dict:
        """What the run trains on, as the checkpoint metadata's `data` entry records it (what
        `train.state.identity` compares on resume)."""
        ...

    def summary(self) -> str | None:
        """The start-up line about the data, None for nothing to say."""
        ...
