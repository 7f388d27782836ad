"""`prepare`'s inputs: the files the arguments name, the documents in them, and each document's
text, every failure a one-line `PrepareError` naming the file (and the JSONL line).

A text file is one document, decoded as UTF-8; a JSONL file (`*.jsonl`) one document per
non-blank line, its `--field` string. Refused, naming the file: a directory given as an input,
a file that vanished (or became unreadable) between being listed and being read, bytes that are
not UTF-8 (with the byte offset in the file: a binary file, or text in another encoding), a JSONL
line that is not JSON, has no `--field` string, or whose string holds a lone surrogate (`"\\ud800"`
is valid JSON but no UTF-8 text: no tokenizer can encode it).
"""

import codecs
import glob
import json
from pathlib import Path
from typing import NamedTuple

from .format import InputFile, sha256_file


class Doc(NamedTuple):
    """Where one document's text is: a whole text file, or a byte range of a JSONL line."""

    path: str
    offset: int
    length: int  # -1: the whole file
    line: int  # 1-based JSONL line number (0: a text file)


class PrepareError(ValueError):
    """Bad input to prepare: one line naming the file and what is wrong."""


class MissingFieldError(PrepareError):
    """A JSONL line without the `--field` string."""


def unreadable(path, e: OSError) -> PrepareError:
    """The one-line error for an input that `open` or `stat` failed on."""
    if isinstance(e, FileNotFoundError):
        return PrepareError(f"prepare: {path}: vanished (listed, then not found when read)")
    if isinstance(e, IsADirectoryError):
        return PrepareError(f"prepare: {path}: is a directory, not a file")
    return PrepareError(f"prepare: {path}: unreadable ({e.strerror or e})")


def expand_inputs(inputs) -> list[str]:
    """The input files: each argument a file, or a glob (its sorted matches that are files)."""
    out = []
    for arg in inputs:
        if any(c in arg for c in "*?["):
            matches = [m for m in sorted(glob.glob(arg, recursive=True)) if Path(m).is_file()]
            if not matches:
                raise PrepareError(f"prepare: no file matches {arg!r}")
            out.extend(matches)
        elif Path(arg).is_dir():
            raise PrepareError(
                f"prepare: {arg} is a directory: give its files, or a glob such as "
                f"'{Path(arg) / '*.txt'}'"
            )
        elif not Path(arg).is_file():
            raise PrepareError(f"prepare: input not found: {arg}")
        else:
            out.append(arg)
    return out


def input_file(path) -> InputFile:
    """What the plan and the manifest record of an input: its path as given, size and sha256."""
    try:
        return InputFile(str(path), Path(path).stat().st_size, sha256_file(path))
    except OSError as e:
        raise unreadable(path, e) from None


def scan(paths) -> tuple[list[Doc], int]:
    """The documents of the inputs in order, and the blank JSONL lines skipped."""
    docs, blank = [], 0
    for p in paths:
        if not p.endswith(".jsonl"):
            docs.append(Doc(p, 0, -1, 0))
            continue
        offset = 0
        try:
            with open(p, "rb") as f:
                for n, raw in enumerate(f, 1):
                    if raw.strip():
                        docs.append(Doc(p, offset, len(raw), n))
                    else:
                        blank += 1
                    offset += len(raw)
        except OSError as e:
            raise unreadable(p, e) from None
    return docs, blank


def _read(doc: Doc) -> bytes:
    try:
        with open(doc.path, "rb") as f:
            f.seek(doc.offset)
            return f.read() if doc.length < 0 else f.read(doc.length)
    except OSError as e:
        raise unreadable(doc.path, e) from None


def _decode(raw: bytes, doc: Doc, where: str) -> str:
    """`raw` as UTF-8 (a JSONL file's first line may start with a byte order mark)."""
    bom = len(codecs.BOM_UTF8) if doc.line == 1 and raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        raise PrepareError(
            f"prepare: {where}: not UTF-8 at byte {doc.offset + at} (0x{raw[at : at + 1].hex()}: "
            f"{e.reason}; "
            "a binary file, or text in another encoding: convert it to UTF-8)"
        ) from None


def read_text(doc: Doc, field: str) -> str:
    """The text of document `doc` (a JSONL line's `field`)."""
    raw = _read(doc)
    if doc.line == 0:
        return _decode(raw, doc, doc.path)
    where = f"{doc.path}:{doc.line}"
    try:
        record = json.loads(_decode(raw, doc, where))
    except json.JSONDecodeError as e:
        raise PrepareError(f"prepare: {where}: not a JSON line ({e.msg})") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise MissingFieldError(
            f"prepare: {where}: no string field {field!r} (keys: "
            f"{sorted(record) if isinstance(record, dict) else type(record).__name__})"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PrepareError(
            f"prepare: {where}: field {field!r} holds a lone surrogate "
            f"({text[e.start]!r} at character {e.start}), which is not text UTF-8 can hold"
        ) from None
    return text
