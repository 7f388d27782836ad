"""Training data: a prepared dataset (`train.prepare`) read in packed rows (`train.loader`), or a
synthetic stream.

`--data DIR` names a prepared dataset. `--data FILE...` (text or JSONL files; default the
shipped text) is prepared first into a cache directory keyed by the files' contents and the
tokenizer (`cache_dir`: `$RELAYMOE_DATA_CACHE`, else ~/.cache/relaymoe-jax/datasets), so a second
run reads the cache, and then goes through the same loader. As prepare reads them: a text file
is one document, a JSONL file one per line (its "text" field); each is followed by the
end-of-document token.

Tokenizers: by default a byte-level one (UTF-8 bytes, ids 0..255, "\\n" between documents), which
needs no download and no extra package. `tokenizer=PATH` instead loads a local Hugging Face
`tokenizer.json` (the `tokenizers` package, imported only then), encoded without the
post-processor's special tokens (`add_special_tokens=False`); between documents the id of the
first of `EOS_TOKENS` that its vocabulary holds, or nothing when it holds none of them.

`--synthetic` instead draws, per (seed, step), arithmetic progressions of token ids (random start
and stride), a learnable stream that needs no files.

Both sources are iterators of `loader.Batch` (the synthetic one without segment ids) with a
JSON `state()` saved in every checkpoint and `restore(state)` / `seek(step)` to continue.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from . import prepare
from .loader import Batch, DatasetError, PackedRows
from .prepare import sha256_file
from .tokens import EOS_TOKENS, byte_tokenize, eos_id, load_hf_tokenizer  # noqa: F401

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "declaration.txt"


class SyntheticData:
    """Arithmetic progressions mod vocab: row r of step s starts at a random token and adds a
    random stride in 1..7, both drawn from (seed, step). An iterator from step 0 (`seek`)."""

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
        return Batch(self.batch(self.step - 1), None, None)

    def state(self) -> dict:
        return {"step": self.step}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])

    def seek(self, step: int) -> None:
        self.step = step

    def position(self) -> int:
        return self.step


class PackedData(PackedRows):
    """`loader.PackedRows` as a trainer data source. A corpus of one document (the shipped text)
    has no boundary in any row: its batches then carry no segment ids (`packed` False), and the
    trainer compiles the step without the masks, the same math."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = self.manifest["documents"] > 1

    def __next__(self) -> Batch:
        b = super().__next__()
        return b if self.packed else Batch(b.tokens, None, None)

    def seek(self, step: int) -> None:
        """Continue at 0-based batch `step`."""
        self.restore({"next_index": step})


def cache_dir() -> Path:
    """Where `--data FILE...` is prepared."""
    env = os.environ.get("RELAYMOE_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "relaymoe-jax" / "datasets"


def prepared_text(paths, tokenizer=None, field: str = "text", log=print) -> Path:
    """The prepared dataset of the files `paths` in the cache, prepared now if it is not there
    (in a directory of this process's own, renamed into place: processes preparing the same
    files at once each finish, and one copy stays)."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"data file not found: {p}")
    key = {
        "format": prepare.FORMAT,
        "files": [sha256_file(p) for p in paths],
        "tokenizer": None if tokenizer is None else sha256_file(tokenizer),
        "field": field,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    final = cache_dir() / digest
    if (final / "manifest.json").is_file():
        return final
    tmp = cache_dir() / f".{digest}.{os.getpid()}.{os.uname().nodename}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log(f"preparing {len(paths)} file(s) into {final} (once; later runs read it)")
    try:
        prepare.prepare(
            [str(p) for p in paths], tmp, tokenizer=tokenizer, field=field, workers=1,
            progress=False,
        )  # fmt: skip
    except prepare.MissingFieldError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DatasetError(
            f"{e}; --data reads the {field!r} field of JSONL files: prepare them with "
            f"`relaymoe-train prepare FILE --field NAME --out DIR`, then train with --data DIR"
        ) from None
    try:
        tmp.rename(final)
    except OSError:  # another process put it there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "manifest.json").is_file():
            raise
    return final


def check_dataset(directory, manifest: dict, vocab_size: int, tokenizer=None) -> None:
    """DatasetError naming the manifest if its tokenizer does not fit the model's `vocab_size`
    or is not the `tokenizer` file given."""
    path = Path(directory) / "manifest.json"
    tok = manifest["tokenizer"]
    name = "the byte-level tokenizer" if tok["kind"] == "bytes" else f"tokenizer {tok['path']}"
    if manifest["vocab_size"] > vocab_size:
        raise DatasetError(
            f"{path}: prepared with {name} of {manifest['vocab_size']} tokens, more than the "
            f"model's vocab_size={vocab_size}"
        )
    if tokenizer is not None and tok["sha256"] != sha256_file(tokenizer):
        raise DatasetError(
            f"{path}: prepared with {name}, not --tokenizer {tokenizer} (another sha256); "
            f"drop --tokenizer or prepare the corpus with it"
        )


def make_data(
    paths,
    *,
    synthetic: bool,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    tokenizer=None,
    rows=None,
    log=print,
):
    """The trainer's data source: `SyntheticData` if `synthetic` (then `paths` and `tokenizer`
    are ignored), else `PackedData` over the prepared dataset `paths` (one directory) or the
    cache's preparation of the files `paths` (default: the shipped text), reading the global
    batch's rows `rows` (default all)."""
    if synthetic:
        return SyntheticData(seq_len, batch_size, seed, vocab_size)
    paths = [Path(p) for p in (paths or [DEFAULT_TEXT])]
    dirs = [p for p in paths if p.is_dir()]
    if dirs and len(paths) > 1:
        raise DatasetError(
            f"--data {dirs[0]} is a prepared dataset: give it alone, no other --data"
        )
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer}")
    if dirs:
        directory = dirs[0]
    else:
        if tokenizer is not None:
            load_hf_tokenizer(tokenizer, vocab_size)  # a bad tokenizer.json, before preparing
        directory = prepared_text(paths, tokenizer, log=log)
    data = PackedData(directory, seq_len=seq_len, global_batch=batch_size, seed=seed, rows=rows)
    check_dataset(directory, data.manifest, vocab_size, tokenizer if dirs else None)
    return data
