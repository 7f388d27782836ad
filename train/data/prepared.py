"""The prepared-dataset source: `--data DIR` (a prepared dataset) or `--data FILE...` (text or
JSONL files; default the shipped text), read in packed rows by `loader.PackedRows`.

`--data FILE...` is prepared first (`prepare`) into a cache directory keyed by the files'
contents and the tokenizer (`cache_dir`: `$RELAYMOE_DATA_CACHE`, else
~/.cache/relaymoe-jax/datasets), so a second run reads the cache, and then goes through the same
loader. As prepare reads them: a text file is one document, a JSONL file one per line (its
"text" field); each is followed by the end-of-document token.
"""

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from .format import FORMAT, MANIFEST, DatasetError, sha256_file
from .inputs import input_file
from .loader import PACKING, PackedRows
from .source import Batch

DEFAULT_TEXT = Path(__file__).resolve().parent / "declaration.txt"


class PreparedSource(PackedRows):
    """`loader.PackedRows` as a trainer `Source`. A corpus of one document (the shipped text)
    has no boundary in any row: its batches then carry no segment ids (`packed` False), and the
    trainer compiles the step without the masks, the same math.

    `files` (and `tokenizer`): the files the cache prepared `directory` of, which the run
    identity records instead of the directory (None: `directory` was given)."""

    def __init__(self, directory, *args, files=None, tokenizer=None, **kwargs):
        super().__init__(directory, *args, **kwargs)
        self.directory = Path(directory)
        self.files, self.tokenizer = files, tokenizer
        self.packed = self.manifest.documents > 1

    def __next__(self) -> Batch:
        b = super().__next__()
        return b if self.packed else Batch(b.tokens)

    def seek(self, step: int) -> None:
        """Continue at 0-based batch `step`."""
        self.restore({"next_index": step})

    def identity(self) -> dict:
        """A prepared dataset's directory and the sha256 of its manifest.json (which holds every
        shard's sha256 and the tokenizer's), or each file's path and sha256 (in order: the order
        changes the packing) and the tokenizer's (None: the byte-level one); the packing."""
        if self.files is None:
            tok = self.manifest.tokenizer
            return {
                "dataset": {
                    "path": str(self.directory.resolve()),
                    "manifest_sha256": sha256_file(self.directory / MANIFEST),
                },
                "tokenizer": None if tok.sha256 is None else dataclasses.asdict(tok),
                "loader": PACKING,
            }
        tok = self.tokenizer
        return {
            "files": [{"path": str(p.resolve()), "sha256": sha256_file(p)} for p in self.files],
            "tokenizer": None
            if tok is None
            else {"path": str(Path(tok).resolve()), "sha256": sha256_file(tok)},
            "loader": PACKING,
        }

    def summary(self) -> str:
        return (
            f"data: {self.manifest.documents:,} document(s), {self.corpus.tokens:,} tokens in "
            f"{self.num_rows:,} rows of {self.seq_len} (the last {self.unused_tokens} tokens in "
            "none)"
        )

    def check(self, vocab_size: int, tokenizer=None) -> None:
        """DatasetError naming the manifest if its tokenizer does not fit the model's
        `vocab_size` or is not the `tokenizer` file given."""
        path = self.directory / MANIFEST
        m = self.manifest
        name = m.tokenizer.describe()
        if m.vocab_size > vocab_size:
            raise DatasetError(
                f"{path}: prepared with {name} of {m.vocab_size} tokens, more than the "
                f"model's vocab_size={vocab_size}"
            )
        if tokenizer is not None and m.tokenizer.sha256 != sha256_file(tokenizer):
            raise DatasetError(
                f"{path}: prepared with {name}, not --tokenizer {tokenizer} (another sha256); "
                f"drop --tokenizer or prepare the corpus with it"
            )


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
        "format": FORMAT,
        "files": [input_file(p).sha256 for p in paths],  # one vanished: an error naming it
        "tokenizer": None if tokenizer is None else sha256_file(tokenizer),
        "field": field,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    final = cache_dir() / digest
    if (final / MANIFEST).is_file():
        return final
    tmp = cache_dir() / f".{digest}.{os.getpid()}.{os.uname().nodename}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log(f"preparing {len(paths)} file(s) into {final} (once; later runs read it)")
    from . import prepare  # here: `python -m train.data.prepare` imports the package first

    files = [str(p) for p in paths]
    try:
        prepare.prepare(files, tmp, tokenizer=tokenizer, field=field, workers=1, progress=False)
    except BaseException as e:  # a bad input, a full disk, a signal: nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, prepare.MissingFieldError):
            raise
        raise DatasetError(
            f"{e}; --data reads the {field!r} field of JSONL files: prepare them with "
            f"`relaymoe-train prepare FILE --field NAME --out DIR`, then train with --data DIR"
        ) from None
    try:
        tmp.rename(final)
    except OSError:  # another process put it there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / MANIFEST).is_file():
            raise
    return final
