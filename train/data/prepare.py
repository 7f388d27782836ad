"""`relaymoe-train prepare` (`python -m train prepare`): a text corpus tokenized once into shards.

    python -m train prepare INPUT... --out DIR [--tokenizer tokenizer.json] [--field text]
                            [--workers N] [--docs-per-shard N]

INPUT: text files (each file one document), JSONL files (`*.jsonl`: each line one document, its
`--field`), or globs of either. Out: the prepared dataset of `train.data.format` (its docstring
has the files and the manifest): DIR/shard-NNNNN.array_record, one record per document (its
token ids, int32 little-endian, followed by the end-of-document token), beside it
DIR/shard-NNNNN.lengths.npy (each document's token count, int32: the loader's index, so it finds
token t of the corpus without reading the documents before it), and DIR/manifest.json.

Why ArrayRecord: grain (the trainer's loader, MaxText's) reads it lazily with random access by
record, so each host reads only its rows and a shuffle needs no pass over the data; a shard is
written once and never rewritten.

The documents are numbered in input order (the files as given, globs sorted, JSONL lines in
order) and shard i holds documents [i * D, (i + 1) * D). Worker processes tokenize one shard each
(`--workers`, default the CPU count), with a progress line on stderr (shards, documents, tokens,
tokens/s, ETA). Each finished shard is renamed into place and then recorded in DIR/done/, so a
rerun of an interrupted prepare with the same inputs and tokenizer skips the shards already done;
`--out` holding a prepare of other inputs is refused.

The end-of-document token: "\\n" (10) for the byte-level tokenizer (as the trainer's text
path), the first of `train.data.tokenizers.EOS_TOKENS` in a HF tokenizer's vocabulary (none if it
has none: the manifest says so). Empty documents (an empty file, a JSONL field "") and blank JSONL
lines are skipped and counted in the manifest; a JSONL line that is not JSON, or has no `--field`
string, is an error naming the file and line.
"""

import argparse
import dataclasses
import glob
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .format import FORMAT, InputFile, Manifest, Shard, Skipped, TokenizerInfo, sha256_file
from .tokenizers import Tokenizer


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


def expand_inputs(inputs) -> list[str]:
    """The input files: each argument a file, or a glob (sorted matches)."""
    out = []
    for arg in inputs:
        if any(c in arg for c in "*?["):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise PrepareError(f"prepare: no file matches {arg!r}")
            out.extend(m for m in matches if Path(m).is_file())
        elif not Path(arg).is_file():
            raise PrepareError(f"prepare: input not found: {arg}")
        else:
            out.append(arg)
    return out


def scan(paths, field: str) -> tuple[list[Doc], int]:
    """The documents of the inputs in order, and the blank JSONL lines skipped."""
    docs, blank = [], 0
    for p in paths:
        if not p.endswith(".jsonl"):
            docs.append(Doc(p, 0, -1, 0))
            continue
        offset = 0
        with open(p, "rb") as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    docs.append(Doc(p, offset, len(raw), n))
                else:
                    blank += 1
                offset += len(raw)
    return docs, blank


def read_text(doc: Doc, field: str) -> str:
    with open(doc.path, "rb") as f:
        f.seek(doc.offset)
        raw = f.read() if doc.length < 0 else f.read(doc.length)
    if doc.line == 0:
        return raw.decode("utf-8")
    where = f"{doc.path}:{doc.line}"
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PrepareError(f"prepare: {where}: not a JSON line ({e.msg})") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise MissingFieldError(
            f"prepare: {where}: no string field {field!r} (keys: "
            f"{sorted(record) if isinstance(record, dict) else type(record).__name__})"
        )
    return text


_TOKENIZER = None


def _init_worker(path):
    global _TOKENIZER
    _TOKENIZER = Tokenizer(path)


def write_shard(task) -> Shard:
    """Tokenize one shard's documents into DIR/NAME (written to a temporary name, then renamed)
    and record it in DIR/done/; returns its manifest entry."""
    out, index, docs, field = task
    from array_record.python.array_record_module import ArrayRecordWriter

    name = f"shard-{index:05d}.array_record"
    tmp = Path(out) / f".{name}.tmp"
    lengths_name = f"shard-{index:05d}.lengths.npy"
    lengths, empty = [], 0
    writer = ArrayRecordWriter(str(tmp), "group_size:1")
    try:
        for doc in docs:
            text = read_text(doc, field)
            if not text:
                empty += 1
                continue
            ids = _TOKENIZER.ids(text).astype("<i4")
            writer.write(ids.tobytes())
            lengths.append(len(ids))
    finally:
        writer.close()
    with open(Path(out) / lengths_name, "wb") as f:
        np.save(f, np.asarray(lengths, "<i4"))
    os.replace(tmp, Path(out) / name)
    entry = Shard(
        file=name,
        documents=len(lengths),
        tokens=int(sum(lengths)),
        empty_skipped=empty,
        bytes=(Path(out) / name).stat().st_size,
        sha256=sha256_file(Path(out) / name),
        lengths_file=lengths_name,
        lengths_bytes=(Path(out) / lengths_name).stat().st_size,
        lengths_sha256=sha256_file(Path(out) / lengths_name),
    )
    (Path(out) / "done" / f"{name}.json").write_text(json.dumps(entry.as_json()))
    return entry


def _write_shards(todo, tokenizer, workers):
    """The finished shards' entries as they finish: in worker processes (spawned: no state of
    this process is forked into them), or in this process for one worker."""
    if workers == 1:
        _init_worker(tokenizer)
        yield from map(write_shard, todo)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        yield from pool.imap_unordered(write_shard, todo)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a prepare makes of what (DIR/plan.json): the manifest's first fields."""

    format: str
    inputs: tuple[InputFile, ...]
    tokenizer: TokenizerInfo
    field: str
    docs_per_shard: int

    def as_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _plan(paths, tokenizer: Tokenizer, field, per_shard) -> Plan:
    inputs = tuple(InputFile(p, Path(p).stat().st_size, sha256_file(p)) for p in paths)
    return Plan(FORMAT, inputs, tokenizer.describe(), field, per_shard)


def _check_out(out: Path, plan: Plan) -> None:
    """--out is new, or holds a prepare of the same plan (then it resumes)."""
    plan_file = out / "plan.json"
    if plan_file.exists():
        if json.loads(plan_file.read_text()) != plan.as_json():
            raise PrepareError(
                f"prepare: --out {out} holds a prepare of other inputs, tokenizer or settings "
                f"({plan_file}); use another --out, or delete it"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise PrepareError(f"prepare: --out {out} exists and is not a prepare's directory")
    (out / "done").mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps(plan.as_json(), indent=1))


class ShardProgress:
    """Prepare's progress: one line on stderr per finished shard, at most every `every` seconds,
    and at the end (the trainer's per-step line is `train.progress.StepProgress`)."""

    def __init__(self, shards: int, done_before: int, every=1.0, quiet=False):
        self.shards, self.done_before, self.every, self.quiet = shards, done_before, every, quiet
        self.start = self.last = time.monotonic()
        self.finished = self.docs = self.tokens = 0

    def add(self, entry: Shard, final=False):
        self.finished += 1
        self.docs += entry.documents
        self.tokens += entry.tokens
        now = time.monotonic()
        if self.quiet or (not final and now - self.last < self.every):
            return
        self.last, elapsed = now, now - self.start
        done = self.done_before + self.finished
        eta = elapsed / self.finished * (self.shards - done)
        print(
            f"prepare: {done}/{self.shards} shards, {self.docs:,} documents, "
            f"{self.tokens:,} tokens, {self.tokens / max(elapsed, 1e-9):,.0f} tokens/s, "
            f"ETA {eta:,.0f} s",
            file=sys.stderr,
            flush=True,
        )


def _shards_done(out: Path, tasks) -> dict[int, Shard]:
    """The shards an earlier prepare of the same plan finished (their DIR/done/ records)."""
    done = {}
    for t in tasks:
        marker = out / "done" / f"shard-{t[1]:05d}.array_record.json"
        if marker.exists():
            done[t[1]] = Shard(**json.loads(marker.read_text()))
    return done


def prepare(
    inputs,
    out,
    *,
    tokenizer=None,
    field="text",
    workers=None,
    docs_per_shard=10_000,
    progress=True,
) -> Manifest:
    """Prepare `inputs` into `out`; returns the manifest (also written to out/manifest.json).
    `progress=False`: no progress lines (the trainer's own small preparations)."""
    out = Path(out)
    paths = expand_inputs(inputs)
    tok = Tokenizer(tokenizer)
    docs, blank = scan(paths, field)
    if not docs:
        raise PrepareError(f"prepare: no documents in {inputs} (empty corpus)")
    plan = _plan(paths, tok, field, docs_per_shard)
    _check_out(out, plan)
    tasks = [
        (str(out), i, docs[s : s + docs_per_shard], field)
        for i, s in enumerate(range(0, len(docs), docs_per_shard))
    ]
    done = _shards_done(out, tasks)
    todo = [t for t in tasks if t[1] not in done]
    if done and progress:
        print(f"prepare: resuming: {len(done)} of {len(tasks)} shards done", file=sys.stderr)
    line = ShardProgress(len(tasks), len(done), quiet=not progress)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    for i, entry in enumerate(_write_shards(todo, tokenizer, workers)):
        done[int(entry.file[6:11])] = entry
        line.add(entry, final=i == len(todo) - 1)
    shards = tuple(done[i] for i in range(len(tasks)))
    docs_n = sum(e.documents for e in shards)
    if not docs_n:
        raise PrepareError(f"prepare: every document of {inputs} is empty (empty corpus)")
    manifest = Manifest(
        **{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)},
        vocab_size=tok.vocab_size,
        eod_id=tok.eod,
        documents=docs_n,
        tokens=sum(e.tokens for e in shards),
        skipped=Skipped(sum(e.empty_skipped for e in shards), blank),
        shards=shards,
    )
    manifest.write(out)
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relaymoe-train prepare",
        description="Tokenize a text corpus once into ArrayRecord shards and a manifest.json "
        "(train/data/format.py's docstring has the format).",
    )
    p.add_argument("inputs", nargs="+", help="text files, JSONL files (*.jsonl) or globs")
    p.add_argument("--out", required=True, help="the dataset directory to write")
    p.add_argument("--tokenizer", default=None, help="a HF tokenizer.json (default: bytes)")
    p.add_argument("--field", default="text", help="the JSONL field holding the text")
    p.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    p.add_argument("--docs-per-shard", type=int, default=10_000, help="default 10,000")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    for name in ("workers", "docs_per_shard"):
        v = getattr(a, name)
        if v is not None and v < 1:
            build_parser().error(f"--{name.replace('_', '-')} {v}: expected an integer >= 1")
    try:
        m = prepare(
            a.inputs,
            a.out,
            tokenizer=a.tokenizer,
            field=a.field,
            workers=a.workers,
            docs_per_shard=a.docs_per_shard,
        )
    except (PrepareError, FileNotFoundError, ValueError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"prepared {m.documents:,} documents, {m.tokens:,} tokens in {len(m.shards)} shards "
        f"into {a.out} (skipped: {m.skipped.empty_documents} empty documents, "
        f"{m.skipped.blank_lines} blank lines)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
