"""The trainer's data: the prepared-dataset format, prepare, the loader, the tokenizers, and the
sources the trainer reads, behind one protocol.

Modules, writer and reader apart (neither imports the other; both use `format`):

* `format`: the prepared dataset on disk, the `Manifest` record read from manifest.json in one
  place and checked on load (`load_manifest`: keys, types, files, and the counts against the
  lengths files), `sha256_file`, `DatasetError`;
* `tokenizers`: the byte-level tokenizer and a local Hugging Face tokenizer.json, with the
  end-of-document token (`Tokenizer`);
* `prepare`: `relaymoe-train prepare`, a corpus tokenized once into shards (the writer), and
  `inputs`, its input files, documents and texts (every bad input one line naming the file);
* `loader`: the packed rows of a prepared dataset, read through grain (the reader);
* `source`: the `Batch` record and the `Source` protocol (next batch, `state` / `restore` /
  `seek`, `identity`: what the checkpoint records of the data);
* `synthetic`, `prepared`: the two sources, `SyntheticSource` (`--synthetic`) and
  `PreparedSource` (`--data DIR`, or `--data FILE...` prepared into a cache first).

Tokenizers: by default the byte-level one (UTF-8 bytes, ids 0..255, "\\n" between documents),
which needs no download and no extra package. `tokenizer=PATH` instead loads a local Hugging
Face `tokenizer.json` (the `tokenizers` package, imported only then), encoded without the
post-processor's special tokens (`add_special_tokens=False`); between documents the id of the
first of `tokenizers.EOS_TOKENS` that its vocabulary holds, or nothing when it holds none.

The folder also holds the shipped training text, `declaration.txt` (README.md says what it is),
the default `--data`.
"""

from pathlib import Path

from .format import DatasetError
from .prepared import DEFAULT_TEXT, PreparedSource, prepared_text
from .source import Batch, Source
from .synthetic import SyntheticSource
from .tokenizers import load_hf_tokenizer

__all__ = ["DEFAULT_TEXT", "Batch", "DatasetError", "Source", "make_source"]


def make_source(
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
) -> Source:
    """The trainer's data source: `SyntheticSource` if `synthetic` (then `paths` and `tokenizer`
    are ignored), else `PreparedSource` over the prepared dataset `paths` (one directory) or the
    cache's preparation of the files `paths` (default: the shipped text), reading the global
    batch's rows `rows` (default all)."""
    if synthetic:
        return SyntheticSource(seq_len, batch_size, seed, vocab_size)
    paths = [Path(p) for p in (paths or [DEFAULT_TEXT])]
    dirs = [p for p in paths if p.is_dir()]
    if dirs and len(paths) > 1:
        raise DatasetError(
            f"--data {dirs[0]} is a prepared dataset: give it alone, no other --data"
        )
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer}")
    if dirs:
        directory, files = dirs[0], None
    else:
        if tokenizer is not None:
            load_hf_tokenizer(tokenizer, vocab_size)  # a bad tokenizer.json, before preparing
        directory, files = prepared_text(paths, tokenizer, log=log), paths
    source = PreparedSource(
        directory,
        seq_len=seq_len,
        global_batch=batch_size,
        seed=seed,
        rows=rows,
        files=files,
        tokenizer=None if dirs else tokenizer,
    )
    source.check(vocab_size, tokenizer if dirs else None)
    return source
