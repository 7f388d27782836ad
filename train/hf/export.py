"""`relaymoe-train export RUN_DIR --out HF_DIR [--step N] [--dtype bfloat16]` (also
`python -m train export ...`, `python -m train.export ...`): a run's checkpoint as a Hugging Face
checkpoint directory (config.json, safetensors files of at most `--max-shard-size`, default 5GB,
each file's header included, with `model.safetensors.index.json` only when there are several, as
transformers writes them) that transformers' Qwen3MoeForCausalLM / Qwen2MoeForCausalLM loads, and
`relaymoe_jax.models.from_pretrained` too. A run started with `--init-from-hf DIR` (recorded in
its checkpoints' `init`) gets DIR's tokenizer and generation files (`tokenizer_files.COPIED`:
tokenizer.json, tokenizer_config.json, ...) copied beside the weights, so
`AutoTokenizer.from_pretrained` reads the export; a run from a config whose data was tokenized
with `--tokenizer FILE` (recorded in its checkpoints' `data`) gets FILE as tokenizer.json. A
warning line says why not when the source is gone or is not the tokenizer the run's data was
prepared with.

Streaming: the checkpoint is opened read-only (orbax's `PyTreeCheckpointer` on the step's `state`
directory, no `CheckpointManager`: nothing is cleaned up or written there) and only `params` is
read, one saved leaf at a time (a partial restore of that leaf into host memory; with
`scan_layers` a leaf is one parameter of all layers, [L, ...]). Each leaf is checked against the
checksums the trainer saved with it (`train.state.checkpoint`), turned into its Hugging Face tensors
(`hf_files.hf_tensors_of`, the same transformation as `save_pretrained`) in `--dtype`, and
handed to the `hf_files.ShardWriter`, which writes a file whenever the next tensor would take it
past the limit. So the host holds one leaf plus one file's tensors, never the whole model.

Everything is written into a temporary directory beside `--out` (made with the user's umask, as
`mkdir` would, not 0700) and renamed to it at the end: a failed or interrupted export leaves
nothing behind; SIGINT (Ctrl-C) or SIGTERM stops it with one line, exit status 130 / 143. Bad
input is one line (`error: ...`, exit status 1) before anything is written: RUN_DIR missing or
without a checkpoint, `--step` not saved (the saved steps are listed), `--out` a file or a
non-empty directory, a bad `--dtype` or `--max-shard-size`, a model the Hugging Face architectures
cannot hold (`hf_config.check_hf(export=True)`). The checkpoint is read by `train.hf.saved`.
"""

import argparse
import dataclasses
import gc
import json
import os
import secrets
import shutil
import signal
import stat
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, keystr

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.hf_config import config_to_hf
from relaymoe_jax.models.hf_files import ShardWriter, hf_tensors_of, size_bytes, write_config
from relaymoe_jax.models.hf_mapping import Entry, mapping

from ..errors import MissingExtraError, describe_write_error, require_train_extra
from .saved import ExportError, SavedParams, saved_steps
from .tokenizer_files import source_files

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = "5GB"
COLLECT_BYTES = 16 << 20  # a leaf this large is freed by a garbage collection once written


class Stopped(BaseException):
    """SIGINT or SIGTERM during the export (`Signals`)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class Exported:
    """What `export` wrote: the directory, the step, the dtype, the files, their tensors and
    bytes."""

    out: Path
    step: int
    dtype: str
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    copied: tuple[str, ...] = ()  # the tokenizer and generation files copied
    source: Path | None = None  # from this --init-from-hf directory (or --tokenizer file)


def _param_key(entry: Entry, scan_layers: bool) -> tuple[str, int | None]:
    """(the saved leaf path of `entry`'s parameter, the layer row to take from it or None):
    with `scan_layers` a decoder-layer entry is row i of the stacked `layers.<rest>`."""
    path, row = entry.path, None
    if scan_layers and path[0] == "layers":
        path, row = (path[0], *path[2:]), path[1]
    keys = (DictKey("params"), *(DictKey(p) for p in path), GetAttrKey("value"))
    return keystr(keys), row


def _plan(cfg: ModelConfig, leaf_paths: list[str], where: str) -> list[tuple[str, list]]:
    """[(saved leaf path, [(entry, row)])] in Hugging Face's order of each leaf's first entry;
    ExportError unless the checkpoint's params are exactly the leaves `mapping(cfg)` needs."""
    groups: dict[str, list] = {}
    for entry in mapping(cfg):
        leaf, row = _param_key(entry, cfg.scan_layers)
        groups.setdefault(leaf, []).append((entry, row))
    saved = {p for p in leaf_paths if p.startswith("['params']")}
    missing, extra = sorted(set(groups) - saved), sorted(saved - set(groups))
    if missing or extra:
        raise ExportError(
            f"{where}: the saved parameters do not match the checkpoint's model_config "
            f"(missing {missing[:4]}, unexpected {extra[:4]})"
        )
    return list(groups.items())


def _hf_tensors(a: np.ndarray, entries: list, dtype):
    """The Hugging Face tensors of one saved leaf `a` (its entries: one, or one per layer row),
    none of them a view of `a`: once they are yielded, `a` can be freed."""
    for entry, row in entries:
        for name, t in hf_tensors_of(entry, a if row is None else a[row], dtype=dtype):
            yield name, t.copy() if np.shares_memory(t, a) else t


def _limit(max_shard_size) -> int:
    """Bytes of `--max-shard-size` (a number of bytes, or e.g. 200KB, 5GB, 2GiB), positive."""
    text = str(max_shard_size).strip()
    try:
        limit = int(text) if text.isdigit() else size_bytes(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ExportError(
            f"--max-shard-size {max_shard_size}: expected a positive number of bytes or e.g. "
            "200KB, 5GB, 2GiB"
        )
    return limit


def _check_out(out: Path) -> None:
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise ExportError(f"--out {out}: is a file; give a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"--out {out}: directory is not empty; give a new or empty directory")


def _step_of(run_dir: Path, step: int | None) -> int:
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    steps = saved_steps(run_dir)
    if not steps:
        raise ExportError(
            f"{run_dir}: no checkpoint to export ({run_dir / 'checkpoints'} holds no saved step)"
        )
    if step is not None and step not in steps:
        raise ExportError(
            f"{run_dir}: no checkpoint of step {step}; saved steps: " + ", ".join(map(str, steps))
        )
    return steps[-1] if step is None else step


def _new_dir_beside(out: Path) -> Path:
    """A new hidden directory beside `out`, made with the user's umask (tempfile.mkdtemp makes
    it 0700, which the rename would give `out`); an existing empty `out`'s mode is kept."""
    for _ in range(100):
        tmp = out.parent / f".{out.name}.export-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
        except FileExistsError:
            continue
        if out.is_dir():
            tmp.chmod(stat.S_IMODE(out.stat().st_mode))
        return tmp
    raise FileExistsError(f"{out.parent}: no free name for a temporary directory")


@contextmanager
def _signals_held():
    """SIGINT and SIGTERM ignored inside (in the main thread): the cleanup is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _model_config(meta: dict, where: str) -> ModelConfig:
    if "model_config" not in meta or "leaf_paths" not in meta:
        raise ExportError(
            f"{where}: the checkpoint's metadata has no model_config (written by an older "
            "trainer): cannot tell which model it holds"
        )
    try:
        return ModelConfig.from_dict(meta["model_config"])
    except (ValueError, TypeError) as e:
        raise ExportError(f"{where}: model_config: {e}") from e


def export(
    run_dir,
    out,
    *,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_size=DEFAULT_MAX_SHARD_SIZE,
    on_flush=None,
    log=print,
    check=None,
) -> Exported:
    """Write the Hugging Face checkpoint of `run_dir`'s checkpoint `step` (default the latest)
    into the new or empty directory `out`, weights in `dtype`, with the `tokenizer_files.COPIED`
    files of the run's --init-from-hf directory; ExportError (one line) for bad input, before
    anything is written. `on_flush`: `hf_files.ShardWriter`'s hook (tests); `log`: the warning
    lines; `check()`, if given, is called before each saved leaf is read and after each tensor is
    written (`Signals.check`: it raises to stop)."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    limit = _limit(max_shard_size)
    step = _step_of(run_dir, step)
    _check_out(out)
    where = f"{run_dir} step {step}"
    step_dir = run_dir / "checkpoints" / str(step)
    try:
        meta = json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{where}: cannot read the checkpoint's metadata: {e}") from e
    cfg = _model_config(meta, where)
    try:
        config_to_hf(cfg, dtype)
    except ValueError as e:
        raise ExportError(f"{where}: cannot export to Hugging Face: {e}") from e
    plan = _plan(cfg, meta["leaf_paths"], where)
    params = SavedParams(step_dir, meta, where)
    source, copied = source_files(meta, log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_dir_beside(out)
    try:
        write_config(str(tmp), cfg, dtype)
        for name, path in copied:
            shutil.copyfile(path, tmp / name)
        writer = ShardWriter(str(tmp), limit, on_flush=on_flush)
        np_dtype = jnp.dtype(dtype)
        check = check or (lambda: None)
        for leaf, entries in plan:
            check()
            a = params.read(leaf)
            big = a.nbytes >= COLLECT_BYTES
            for name, t in _hf_tensors(a, entries, np_dtype):
                writer.add(name, t)
                check()
            del a
            if big:  # orbax's finished asyncio future still holds the leaf, in a cycle
                gc.collect()
        files = writer.close()
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        with _signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    sizes = [n for f in writer.files for n in f.values()]
    names = tuple(name for name, _ in copied)
    return Exported(out, step, dtype, tuple(files), len(sizes), sum(sizes), names, source)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relaymoe-train export",
        description="Write a run's checkpoint as a Hugging Face checkpoint directory "
        "(config.json, safetensors files and their index), read one tensor at a time.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run's --out directory")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="the Hugging Face directory to write: new or empty (required)",
    )
    p.add_argument(
        "--step", type=int, default=None, help="the checkpoint step to export (default: the latest)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help=f"weights' dtype, one of {', '.join(DTYPES)} (default: float32, the master weights)",
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="the largest safetensors file, its header included, e.g. 200KB, 5GB, 2GiB (a "
        f"larger tensor gets a file of its own; default: {DEFAULT_MAX_SHARD_SIZE})",
    )
    return p


def main(argv=None) -> int:
    """The command line: exit status 0, 1 for bad input (one `error:` line), 2 for bad
    arguments, 130 / 143 for SIGINT / SIGTERM (one line; nothing is left behind)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with Signals() as signals:
            require_train_extra()
            done = export(
                args.run_dir,
                args.out,
                step=args.step,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                log=lambda line: print(line, file=sys.stderr, flush=True),
                check=signals.check,
            )
    except (KeyboardInterrupt, Stopped) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        # orbax's read cut short leaves a coroutine that would warn when collected
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        print(
            f"export interrupted by {signal.Signals(signum).name}: nothing written to {args.out}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + signum
    except (ValueError, MissingExtraError) as e:  # ExportError
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:  # a failed write (disk full, read-only) or read
        print(f"error: {describe_write_error(e)}", file=sys.stderr, flush=True)
        return 1
    print(
        f"exported step {done.step} of {args.run_dir} to {done.out}: {done.tensors} tensors, "
        f"{done.total_bytes / 1e6:.1f} MB of {done.dtype} in {len(done.files)} file(s)"
        + (f"; {', '.join(done.copied)} from {done.source}" if done.copied else "")
    )
    return 0


class Signals:
    """Inside (in the main thread): the first SIGINT or SIGTERM is recorded, and `check()` raises
    `Stopped` at the export's next point between tensors (a signal's exception raised anywhere
    would land inside jax's, orbax's or the garbage collector's callbacks, which print it, or
    swallow it and go on); a second one raises `Stopped` at once (a long read or write). The
    previous handlers are put back after."""

    def __init__(self):
        self.received: int | None = None
        self.old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
            return
        raise Stopped(self.received)

    def check(self) -> None:
        if self.received is not None:
            raise Stopped(self.received)


if __name__ == "__main__":
    sys.exit(main())
