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
(`--workers`, default the CPU count), with a progress line on stderr (shards, documents and
tokens so far, resumed shards included; this run's tokens/s; ETA). Each finished shard is renamed
into place and then recorded in DIR/done/, so a rerun of an interrupted prepare with the same
inputs and tokenizer (by resolved path and content: `./a.txt` is `a.txt`) skips the shards
already done; `--out` holding a prepare of other inputs is refused. SIGINT / SIGTERM stop the
workers and print one line (exit status 130 / 143); the rerun resumes.

The end-of-document token: "\\n" (10) for the byte-level tokenizer (as the trainer's text
path), the first of `train.data.tokenizers.EOS_TOKENS` in a HF tokenizer's vocabulary (none if it
has none: the manifest says so). Empty documents (an empty file, a JSONL field "") and blank JSONL
lines are skipped and counted in the manifest. Bad input (`train.data.inputs`: not UTF-8, a lone
surrogate, a JSONL line that is not JSON or has no `--field` string, a directory, a file that
vanished) is a one-line error naming the file (and line).
"""

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from .format import FORMAT, InputFile, Manifest, Shard, Skipped, TokenizerInfo, sha256_file
from .inputs import (  # noqa: F401 (Doc, MissingFieldError, PrepareError: prepare's names too)
    Doc,
    MissingFieldError,
    PrepareError,
    expand_inputs,
    input_file,
    read_text,
    scan,
)
from .tokenizers import Tokenizer

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    marker = Path(out) / "done" / f"{name}.json"  # written whole or not at all: a signal
    tmp_marker = marker.with_name(f".{marker.name}.tmp")  # between open and write would leave
    tmp_marker.write_text(json.dumps(entry.as_json()))  # an empty record a rerun cannot read
    os.replace(tmp_marker, marker)
    return entry


def _write_shards(todo, tokenizer, workers):
    """The finished shards' entries as they finish: in worker processes (spawned: no state of
    this process is forked into them), or in this process for one worker. Closing the generator
    (an error, or `main`'s `Interrupted`) terminates the workers."""
    if workers == 1:
        _init_worker(tokenizer)
        yield from map(write_shard, todo)
        return
    ctx = multiprocessing.get_context("spawn")
    # SIGINT ignored while the workers start: they inherit that from their first instruction,
    # so Ctrl-C (sent to the whole process group) stops only this process, which stops them (a
    # Ctrl-C in these few milliseconds is lost: press it again)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,))
    finally:
        signal.signal(signal.SIGINT, old)
    with pool:
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

    def identity(self, resolved=None) -> dict:
        """What makes two plans the same prepare: every field, each input file (and the
        tokenizer file) by resolved path and content, not by the path as given (`./a.txt` and
        `a.txt`, or a symlinked directory, are one file). `resolved`: the recorded paths."""
        d = self.as_json()
        paths = [i.path for i in self.inputs] + [self.tokenizer.path]
        resolved = resolved or [p and str(Path(p).resolve()) for p in paths]
        for i, r in zip([*d["inputs"], d["tokenizer"]], resolved):
            i["path"] = r
        return d


def _plan(paths, tokenizer: Tokenizer, field, per_shard) -> Plan:
    inputs = tuple(input_file(p) for p in paths)
    return Plan(FORMAT, inputs, tokenizer.describe(), field, per_shard)


def _recorded_plan(plan_file: Path) -> dict:
    """The identity of the plan DIR/plan.json records (an earlier prepare into DIR)."""
    try:
        d = json.loads(plan_file.read_text())
        resolved = d.pop("resolved_paths", None)
        recorded = Plan(
            **{
                **d,
                "inputs": tuple(InputFile(**i) for i in d["inputs"]),
                "tokenizer": TokenizerInfo(**d["tokenizer"]),
            }
        )
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise PrepareError(
            f"prepare: {plan_file}: unreadable ({type(e).__name__}: {e}); use another --out, "
            "or delete it"
        ) from None
    return recorded.identity(resolved)


def _check_out(out: Path, plan: Plan) -> None:
    """--out is new, or holds a prepare of the same plan (then it resumes)."""
    plan_file = out / "plan.json"
    if plan_file.exists():
        if _recorded_plan(plan_file) != plan.identity():
            raise PrepareError(
                f"prepare: --out {out} holds a prepare of other inputs, tokenizer or settings "
                f"({plan_file}); use another --out, or delete it"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise PrepareError(f"prepare: --out {out} exists and is not a prepare's directory")
    (out / "done").mkdir(parents=True, exist_ok=True)
    ident = plan.identity()
    resolved = [i["path"] for i in ident["inputs"]] + [ident["tokenizer"]["path"]]
    plan_file.write_text(json.dumps({**plan.as_json(), "resolved_paths": resolved}, indent=1))


class ShardProgress:
    """Prepare's progress: one line on stderr per finished shard, at most every `every` seconds,
    and at the end (the trainer's per-step line is `train.run.progress.StepProgress`). The counts
    include the shards `done` before (a resumed prepare); the rate and the ETA only this run's."""

    def __init__(self, shards: int, done: list[Shard], every=1.0, quiet=False):
        self.shards, self.done_before, self.every, self.quiet = shards, len(done), every, quiet
        self.start = self.last = time.monotonic()
        self.finished = self.new_tokens = 0
        self.docs = sum(e.documents for e in done)
        self.tokens = sum(e.tokens for e in done)

    def add(self, entry: Shard, final=False):
        self.finished += 1
        self.docs += entry.documents
        self.tokens += entry.tokens
        self.new_tokens += entry.tokens
        now = time.monotonic()
        if self.quiet or (not final and now - self.last < self.every):
            return
        self.last, elapsed = now, now - self.start
        done = self.done_before + self.finished
        eta = elapsed / self.finished * (self.shards - done)
        print(
            f"prepare: {done}/{self.shards} shards, {self.docs:,} documents, "
            f"{self.tokens:,} tokens, {self.new_tokens / max(elapsed, 1e-9):,.0f} tokens/s, "
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
    docs, blank = scan(paths)
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
    line = ShardProgress(len(tasks), list(done.values()), quiet=not progress)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    with contextlib.closing(_write_shards(todo, tokenizer, workers)) as entries:
        for i, entry in enumerate(entries):
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


class Interrupted(Exception):
    """SIGINT or SIGTERM during `main`; `exit_code` 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def _stop_on_signal(signum, frame):
    """Raise `Interrupted` in the main thread (once: a second signal is ignored, so the
    workers' shutdown is not cut short)."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def _stopped_line(out: Path, e: Interrupted) -> str:
    finished = len(list((out / "done").glob("*.json"))) if (out / "done").is_dir() else 0
    for tmp in [*out.glob(".shard-*.tmp"), *out.glob("done/.shard-*.tmp")]:  # what a stopped
        tmp.unlink(missing_ok=True)  # worker was writing
    return (
        f"prepare: stopped by {e} ({finished} shard(s) finished in {out}); the same command "
        "resumes there"
    )


def main(argv=None) -> int:
    """The command line: exit status 0, 1 for bad input (one `error:` line), 2 for bad
    arguments, 130 / 143 on SIGINT / SIGTERM (the workers stopped; one line; a rerun resumes)."""
    a = build_parser().parse_args(argv)
    for name in ("workers", "docs_per_shard"):
        v = getattr(a, name)
        if v is not None and v < 1:
            build_parser().error(f"--{name.replace('_', '-')} {v}: expected an integer >= 1")
    old = {s: signal.signal(s, _stop_on_signal) for s in SIGNALS}
    try:
        m = prepare(
            a.inputs,
            a.out,
            tokenizer=a.tokenizer,
            field=a.field,
            workers=a.workers,
            docs_per_shard=a.docs_per_shard,
        )
    except Interrupted as e:
        print(_stopped_line(Path(a.out), e), file=sys.stderr, flush=True)
        return e.exit_code
    except (ValueError, OSError) as e:  # PrepareError; a write to --out failing
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(
        f"prepared {m.documents:,} documents, {m.tokens:,} tokens in {len(m.shards)} shards "
        f"into {a.out} (skipped: {m.skipped.empty_documents} empty documents, "
        f"{m.skipped.blank_lines} blank lines)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
