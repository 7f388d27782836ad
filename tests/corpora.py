"""A prepared corpus of short word documents, for the trainer tests that need rows holding
several documents (segment ids)."""

import json
from pathlib import Path

import numpy as np

from train.data import prepare

WORDS = "the a cat dog sat on mat log and ran far away home".split()


def word_corpus(directory: Path, n_docs: int, seed: int = 0, max_words: int = 40) -> Path:
    """`n_docs` JSONL documents of 2..max_words words drawn from `seed`, prepared byte-level into
    directory/ds (directory/corpus.jsonl their source); returns directory/ds."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = [
        json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(2, max_words + 1)))})
        for _ in range(n_docs)
    ]
    (directory / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    prepare.prepare([str(directory / "corpus.jsonl")], directory / "ds", workers=1, progress=False)
    return directory / "ds"
