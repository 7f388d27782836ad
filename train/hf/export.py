"""`relaymoe-train export RUN_DIR --out HF_DIR [--step N] [--dtype bfloat16]` (also
`python -m train export ...`, `python -m train.export ...`): a run's checkpoint as a Hugging Face
checkpoint directory (config.json, safetensors files of at most `--max-shard-size`, default 5GB,
with `model.safetensors.index.json` when there are several) that transformers'
Qwen3MoeForCausalLM / Qwen2MoeForCausalLM loads, and `relaymoe_jax.models.from_pretrained` too.

Streaming: the checkpoint is opened read-only (orbax's `PyTreeCheckpointer` on the step's `state`
directory, no `CheckpointManager`: nothing is cleaned up or written there) and only `params` is
read, one saved leaf at a time (a partial restore of that leaf into host memory; with
`scan_layers` a leaf is one parameter of all layers, [L, ...]). Each leaf is checked against the
checksums the trainer saved with it (`train.state.checkpoint`), turned into its Hugging Face tensors
(`hf_files.hf_tensors_of`, the same transformation as `save_pretrained`) in `--dtype`, and
handed to the `hf_files.ShardWriter`, which writes a file whenever the next tensor would take it
past the limit. So the host holds one leaf plus one file's tensors, never the whole model.

Everything is written into a temporary directory beside `--out` and renamed to it at the end: a
failed export leaves nothing behind. Bad input is one line (`error: ...`, exit status 1) before
anything is written: RUN_DIR missing or without a checkpoint, `--step` not saved (the saved steps
are listed), `--out` a file or a non-empty directory, a bad `--dtype` or `--max-shard-size`, a
model the Hugging Face architectures cannot hold (`hf_config.check_hf(export=True)`).
"""

import argparse
import dataclasses
import gc
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, keystr

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.hf_config import config_to_hf
from relaymoe_jax.models.hf_files import ShardWriter, hf_tensors_of, size_bytes, write_config
from relaymoe_jax.models.hf_mapping import Entry, mapping

from ..errors import MissingExtraError, describe_write_error, require_train_extra

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = "5GB"
_CHUNK = 1 << 24  # elements per step of the host checksum
COLLECT_BYTES = 16 << 20  # a leaf this large is freed by a garbage collection once written


class ExportError(ValueError):
    """Bad input to the export, or a checkpoint it cannot read (one line)."""


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


def saved_steps(run_dir: Path) -> list[int]:
    """The committed checkpoint steps of a run directory, ascending (orbax renames a step's
    temporary directory to its number only when the save is complete)."""
    ckpts = Path(run_dir) / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit() and p.is_dir())


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


def _host_sums(a: np.ndarray) -> list[int] | None:
    """`train.state.checkpoint._leaf_sums` on the host: [sum(w), sum(w * (2 i + 1))] mod 2**32 over
    the leaf's words w (flat index i), in chunks; None for an 8-byte type (not a parameter)."""
    a = a.astype(np.uint8) if a.dtype == np.bool_ else a
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}.get(a.dtype.itemsize)
    if bits is None:
        return None
    words, total, weighted = a.reshape(-1).view(bits), 0, 0
    for start in range(0, words.size, _CHUNK):
        w = words[start : start + _CHUNK].astype(np.uint64)
        i = np.arange(start, start + w.size, dtype=np.uint64)
        total += int(w.sum(dtype=np.uint64))
        weighted += int((w * (2 * i + 1)).sum(dtype=np.uint64))
    return [total % 2**32, weighted % 2**32]


class _Params:
    """Single saved leaves of one checkpoint step, read-only, verified against its checksums."""

    def __init__(self, step_dir: Path, meta: dict, where: str):
        import orbax.checkpoint as ocp

        self.ocp, self.where, self.state_dir = ocp, where, step_dir / "state"
        self.ckptr = ocp.PyTreeCheckpointer()
        self.index = {p: i for i, p in enumerate(meta["leaf_paths"])}
        self.types, self.sums = meta.get("leaf_types"), meta.get("checksums")

    def read(self, path: str) -> np.ndarray:
        """The saved leaf `path` as one numpy array (only it is read)."""
        from ..state.checkpoint import short_error

        i = self.index[path]
        key, like = f"{i:06d}", 0
        if self.types:  # e.g. "float32[2, 64]"
            dtype, shape = re.fullmatch(r"(\w+)\[(.*)\]", self.types[i]).groups()
            like = jax.ShapeDtypeStruct(tuple(int(d) for d in shape.split(",") if d), dtype)
        args = self.ocp.args.PyTreeRestore(
            item={key: like},
            restore_args={key: self.ocp.RestoreArgs(restore_type=np.ndarray)},
            partial_restore=True,
        )
        try:
            a = self.ckptr.restore(self.state_dir, args=args)[key]
        except Exception as e:  # tensorstore raises plain Exception
            raise ExportError(f"{self.where}: cannot read {path}: {short_error(e)}") from e
        if not isinstance(a, np.ndarray):  # a key orbax does not have comes back as given
            raise ExportError(f"{self.where}: {path} (leaf {key}) is not in the checkpoint")
        if self.sums is not None and _host_sums(a) not in (None, self.sums[i]):
            raise ExportError(
                f"{self.where}: {path} fails its checksum (the checkpoint is damaged); "
                "export another --step"
            )
        return a


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
) -> Exported:
    """Write the Hugging Face checkpoint of `run_dir`'s checkpoint `step` (default the latest)
    into the new or empty directory `out`, weights in `dtype`; ExportError (one line) for bad
    input, before anything is written. `on_flush`: `hf_files.ShardWriter`'s hook (tests)."""
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
    params = _Params(step_dir, meta, where)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        write_config(str(tmp), cfg, dtype)
        writer = ShardWriter(str(tmp), limit, on_flush=on_flush)
        np_dtype = jnp.dtype(dtype)
        for leaf, entries in plan:
            a = params.read(leaf)
            big = a.nbytes >= COLLECT_BYTES
            for name, t in _hf_tensors(a, entries, np_dtype):
                writer.add(name, t)
            del a
            if big:  # orbax's finished asyncio future still holds the leaf, in a cycle
                gc.collect()
        files = writer.close()
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sizes = [n for f in writer.files for n in f.values()]
    return Exported(out, step, dtype, tuple(files), len(sizes), sum(sizes))


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
        help="the largest safetensors file, e.g. 200KB, 5GB, 2GiB (a larger tensor gets a file "
        f"of its own; default: {DEFAULT_MAX_SHARD_SIZE})",
    )
    return p


def main(argv=None) -> int:
    """The command line: exit status 0, 1 for bad input (one `error:` line), 2 for bad
    arguments."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        require_train_extra()
        done = export(
            args.run_dir,
            args.out,
            step=args.step,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except (ValueError, MissingExtraError) as e:  # ExportError
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:  # a failed write (disk full, read-only) or read
        print(f"error: {describe_write_error(e)}", file=sys.stderr, flush=True)
        return 1
    print(
        f"exported step {done.step} of {args.run_dir} to {done.out}: {done.tensors} tensors, "
        f"{done.total_bytes / 1e6:.1f} MB of {done.dtype} in {len(done.files)} file(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
