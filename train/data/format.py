"""The prepared dataset's format: what `prepare` writes and `loader` reads, in one place.

A prepared dataset is a directory of ArrayRecord shards (`shard-NNNNN.array_record`: one record
per document, its token ids as int32 little-endian, the end-of-document token last), beside each
its lengths file (`shard-NNNNN.lengths.npy`: each document's token count, int32: the loader's
index) and `manifest.json`, the `Manifest` record as JSON:

    format          FORMAT ("relaymoe-tokens-v2": with the lengths files)
    inputs          [{path, bytes, sha256}] the input files, in order
    tokenizer       {kind: "bytes" | "hf", path, sha256} (path and sha256 null for bytes)
    field           the JSONL field read
    docs_per_shard  documents per shard
    vocab_size      the tokenizer's vocabulary (added tokens included)
    eod_id          the end-of-document id, null when the tokenizer has none
    documents, tokens             the totals
    skipped         {empty_documents, blank_lines}
    shards          [{file, documents, tokens, empty_skipped, bytes, sha256, lengths_file,
                      lengths_bytes, lengths_sha256}]

`load_manifest` is the one reader: the JSON, its format, every key there with a value of its type
(strings, counts >= 0, null where the field allows), every shard and lengths file at its recorded
size (and with `verify_hashes` its sha256), each shard's documents and tokens its lengths file's
size and sum, the totals the shards' sums (the loader finds rows by these counts), each failure a
one-line `DatasetError` naming the file (and the key). `Manifest.write` writes the same JSON back
(keys in this order).
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import types
import typing
from pathlib import Path

import numpy as np

FORMAT = "relaymoe-tokens-v2"
MANIFEST = "manifest.json"


class DatasetError(ValueError):
    """A prepared dataset that cannot be read as asked: one line naming the file."""


def sha256_file(path, chunk=1 << 20) -> str:
    """The hex sha256 of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer prepared the dataset: `kind` "bytes" (path, sha256 None) or "hf"."""

    kind: str
    path: str | None
    sha256: str | None

    def describe(self) -> str:
        return "the byte-level tokenizer" if self.kind == "bytes" else f"tokenizer {self.path}"


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Skipped:
    empty_documents: int
    blank_lines: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard: its ArrayRecord file and its lengths file, with their sizes and hashes."""

    file: str
    documents: int
    tokens: int
    empty_skipped: int
    bytes: int
    sha256: str
    lengths_file: str
    lengths_bytes: int
    lengths_sha256: str

    def files(self) -> tuple[tuple[str, int, str], ...]:
        """(name, bytes, sha256) of the shard and of its lengths file."""
        return (
            (self.file, self.bytes, self.sha256),
            (self.lengths_file, self.lengths_bytes, self.lengths_sha256),
        )

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """manifest.json as a record (the module docstring lists the fields)."""

    format: str
    inputs: tuple[InputFile, ...]
    tokenizer: TokenizerInfo
    field: str
    docs_per_shard: int
    vocab_size: int
    eod_id: int | None
    documents: int
    tokens: int
    skipped: Skipped
    shards: tuple[Shard, ...]

    @classmethod
    def from_json(cls, d) -> "Manifest":
        """The record of manifest.json's value; ValueError naming a missing or mistyped key."""
        top = _fields(cls, d, "")
        items = lambda key, rec: tuple(
            rec(**_fields(rec, x, f"{key}[{i}].")) for i, x in enumerate(_items(top[key], key))
        )
        return cls(
            **{
                **top,
                "inputs": items("inputs", InputFile),
                "tokenizer": TokenizerInfo(
                    **_fields(TokenizerInfo, top["tokenizer"], "tokenizer.")
                ),
                "skipped": Skipped(**_fields(Skipped, top["skipped"], "skipped.")),
                "shards": items("shards", Shard),
            }
        )

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, directory) -> None:
        """DIR/manifest.json."""
        (Path(directory) / MANIFEST).write_text(json.dumps(self.as_json(), indent=1))


_SCALARS = {str: "a string", int: "an integer >= 0"}


def _fields(cls, d, prefix: str) -> dict:
    """The values of `cls`'s fields in the JSON object `d` (at key `prefix` of the manifest),
    each string or count of the type its annotation says (records are checked by their own)."""
    if not isinstance(d, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'the manifest'} is not an object")
    for f in dataclasses.fields(cls):
        if f.name not in d:
            raise ValueError(f"no key {prefix + f.name!r}")
        allowed = typing.get_args(f.type) if isinstance(f.type, types.UnionType) else (f.type,)
        if not all(t in _SCALARS or t is type(None) for t in allowed):
            continue
        if not any(_is(d[f.name], t) for t in allowed):
            want = " or ".join("null" if t is type(None) else _SCALARS[t] for t in allowed)
            got = json.dumps(d[f.name])
            raise ValueError(f"key {prefix + f.name!r} is {got[:40]}, expected {want}")
    return {f.name: d[f.name] for f in dataclasses.fields(cls)}


def _is(v, t) -> bool:
    if t is type(None):
        return v is None
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    return isinstance(v, t)


def _items(v, key: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"key {key!r} is not a list")
    return v


def read_lengths(f: Path) -> np.ndarray:
    """A lengths file: each document's token count (one dimension, integers >= 0)."""
    try:
        lengths = np.load(f, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DatasetError(f"{f}: unreadable ({e}); prepare it again") from None
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
        raise DatasetError(
            f"{f}: not a lengths file (shape {lengths.shape}, dtype {lengths.dtype}, expected "
            "counts >= 0 in one dimension); prepare it again"
        )
    return lengths


def _check_counts(directory: Path, manifest: "Manifest", path: Path) -> None:
    """Each shard's documents and tokens are its lengths file's size and sum, and the totals
    the shards' sums: the loader finds rows by these counts, so none is taken on trust."""
    for i, s in enumerate(manifest.shards):
        lengths = read_lengths(directory / s.lengths_file)
        got = (len(lengths), int(lengths.sum(dtype=np.int64)))
        if got != (s.documents, s.tokens):
            raise DatasetError(
                f"{path}: shards[{i}] ({s.file}) records {s.documents} documents and {s.tokens} "
                f"tokens, its lengths file {s.lengths_file} holds {got[0]} and {got[1]} "
                "(edited or mixed up: prepare it again)"
            )
    shards = manifest.shards
    totals = {
        "documents": (manifest.documents, sum(s.documents for s in shards)),
        "tokens": (manifest.tokens, sum(s.tokens for s in shards)),
        "skipped.empty_documents": (
            manifest.skipped.empty_documents,
            sum(s.empty_skipped for s in shards),
        ),
    }
    for key, (have, want) in totals.items():
        if have != want:
            raise DatasetError(
                f"{path}: key {key!r} is {have}, its shards' sum is {want} (edited or mixed up: "
                "prepare it again)"
            )


def _check_size(f: Path, size: int, manifest: Path) -> None:
    if not f.is_file():
        raise DatasetError(f"{f}: missing (listed in {manifest})")
    if f.stat().st_size != size:
        raise DatasetError(
            f"{f}: {f.stat().st_size} bytes, the manifest records {size} (truncated or "
            "rewritten: prepare it again)"
        )


def _check_hashes(files: list[tuple[Path, str]]) -> None:
    """Each file's sha256 against the manifest's, hashed in parallel threads (hashlib releases
    the GIL on large blocks); the first mismatch in manifest order is reported."""
    workers = min(32, os.cpu_count() or 1, len(files) or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        got = list(pool.map(sha256_file, [f for f, _ in files]))
    for (f, want), h in zip(files, got):
        if h != want:
            raise DatasetError(
                f"{f}: its sha256 differs from the manifest's (corrupt: prepare it again)"
            )


def _read_json(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise DatasetError(
            f"{directory}: no manifest.json (not a prepared dataset: relaymoe-train prepare)"
        )
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e}); prepare it again") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else None
        raise DatasetError(f"{path}: format {got!r}, this trainer reads {FORMAT!r}: prepare again")
    return d


def load_manifest(directory, verify_hashes: bool = False) -> Manifest:
    """The manifest of the dataset in `directory`, with every shard and lengths file checked to
    be there at its recorded size, and with `verify_hashes` its sha256 too (in parallel threads:
    about a second per GB and core, or what the disk reads); then the counts against the lengths
    files (read whole: 4 bytes a document)."""
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        manifest = Manifest.from_json(_read_json(directory))
    except ValueError as e:
        raise DatasetError(f"{path}: not a {FORMAT} manifest ({e}); prepare it again") from None
    files = []
    for i, shard in enumerate(manifest.shards):
        for name, size, sha in shard.files():
            if Path(name).name != name or name in ("", ".", ".."):
                raise DatasetError(f"{path}: shards[{i}] names {name!r}, not a file in {directory}")
            _check_size(directory / name, size, path)
            files.append((directory / name, sha))
    if verify_hashes:
        _check_hashes(files)
    _check_counts(directory, manifest, path)
    return manifest
