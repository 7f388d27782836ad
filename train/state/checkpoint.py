"""Orbax checkpoints of the train state, and the metrics log kept consistent with them.

The state pytree is saved as a flat dict `{"000000": leaf, ...}` (leaves in `jax.tree` order) so
that orbax never has to understand nnx/optax container types; the restore target is the freshly
initialised state's leaves (shape, dtype, sharding), unflattened with its treedef. The leaf paths
and types are saved in the JSON metadata and checked on restore.

Crash safety:

* Orbax writes each step to a temporary directory `<step>.orbax-checkpoint-tmp-<time>` and
  renames it to `<step>` only when complete, so an interrupted save never becomes a step; the
  manager deletes such leftovers when it is created (`cleanup_tmp_directories`).
* A finalized checkpoint can still be damaged later (a truncated or deleted file, flipped bits).
  Orbax raises on a missing or truncated data file, but it silently restores wrong values for
  many single-bit flips inside a (zstd-compressed) data file. So `save` also stores a checksum
  of every leaf in the metadata (two uint32 sums of the leaf's bits, computed on device, no host
  copy) and `restore` verifies it.
* `restore` tries the steps newest first: a step that fails to restore or to verify is reported
  with a warning on stderr and the previous one is tried; the failed newer steps are then moved
  to `<run>/corrupt_checkpoints/` (kept for inspection, out of orbax's way so the run can save
  those step numbers again). If no step restores, `CorruptCheckpointError` names them all; a
  checkpoint of a different model or optimizer raises `StateMismatchError` at once.
* `restore(..., check_meta=f)` calls `f(meta)` on each step's metadata before its arrays are
  read (the trainer's run-identity check, `train.state.identity`); a `StateMismatchError` it raises
  (the run refuses to resume) is passed on at once.

Test-only fault hook: with the environment variable `RELAYMOE_TRAIN_FAULT=kill-during-save:<N>`
the process SIGKILLs itself while saving step N, after orbax has written the whole temporary
directory `N.orbax-checkpoint-tmp-*` and before the rename that commits it (orbax's
`AsyncOptions.post_finalization_callback`), leaving exactly the state of a crash mid-save.
"""

import functools
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.experimental import multihost_utils

FAULT_ENV = "RELAYMOE_TRAIN_FAULT"
TMP_MARK = ".orbax-checkpoint-tmp"


class CorruptCheckpointError(ValueError):
    """A checkpoint fails its checksums, or no checkpoint of the run can be restored."""


class StateMismatchError(ValueError):
    """The checkpoint holds another model's or optimizer's state (not a corruption)."""


def manager(out_dir: Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
    """The run's checkpoint manager on `<out_dir>/checkpoints` (leftover temporary directories of
    an interrupted save are removed)."""
    directory = Path(out_dir).resolve() / "checkpoints"
    fault = _fault_step()
    async_opts = None
    if fault is not None:
        async_opts = ocp.AsyncOptions(
            post_finalization_callback=functools.partial(_kill_if_saving, directory, fault)
        )
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=1,
        cleanup_tmp_directories=True,
        async_options=async_opts,
    )
    return ocp.CheckpointManager(directory, options=opts)


def _fault_step() -> int | None:
    """N of `RELAYMOE_TRAIN_FAULT=kill-during-save:N`, None when the variable is unset."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    kind, _, step = value.partition(":")
    if kind != "kill-during-save" or not step.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r}: expected kill-during-save:<step>")
    return int(step)


def _kill_if_saving(directory: Path, step: int) -> None:
    """Orbax's post-finalization callback (all files written, not yet renamed): SIGKILL this
    process if the save being committed is `step`'s temporary directory, with files in it."""
    tmp = [
        p
        for p in directory.glob(f"{step}{TMP_MARK}*")
        if p.is_dir() and any(f.is_file() for f in p.rglob("*"))
    ]
    if tmp and not (directory / str(step)).exists():
        print(
            f"{FAULT_ENV}: killing the process during the save of step {step} ({tmp[0]})",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)


def _paths(state) -> list[str]:
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _types(state) -> list[str]:
    return [f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(state)]


def _words(x):
    """The bits of `x` as uint32 words (one per element; 8-byte types give two)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_sums(x):
    """[sum(w), sum(w * (2 i + 1))] mod 2**32 over the words w (flat index i) of a leaf: every
    changed word changes both sums, and moved words usually change the second. Built from
    iotas on the leaf's own sharding, so no reshape or gather of sharded arrays."""
    w = _words(x)
    sharding = jax.typeof(w).sharding
    idx, stride = jnp.zeros((), jnp.uint32), 1
    for d in reversed(range(w.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, w.shape, d, out_sharding=sharding)
        idx, stride = idx + iota * jnp.uint32(stride % 2**32), stride * w.shape[d]
    return jnp.stack([w.sum(dtype=jnp.uint32), (w * (idx * 2 + 1)).sum(dtype=jnp.uint32)])


@jax.jit
def _all_sums(leaves):
    return [_leaf_sums(x) for x in leaves]


@jax.jit
def _host_leaf_sums(x):
    return _leaf_sums(jax.device_put(x, jax.memory.Space.Device))


def _in_host_memory(x) -> bool:
    return getattr(x.sharding, "memory_kind", None) == "pinned_host"


def checksums(state) -> list[list[int]]:
    """Per leaf (in `jax.tree` order) the two uint32 sums of `_leaf_sums`, as Python ints. The
    device leaves are summed in one program; a leaf in host memory (`offload_optimizer`) in a
    program of its own, brought to the device alone (so the device never holds them all)."""
    leaves = jax.tree.leaves(state)
    host = [_in_host_memory(x) for x in leaves]
    on_device = iter(_all_sums([x for x, h in zip(leaves, host) if not h]))
    sums = [_host_leaf_sums(x) if h else next(on_device) for x, h in zip(leaves, host)]
    return [[int(v) for v in np.asarray(s)] for s in jax.device_get(sums)]


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    """Start an (async) save of `state` and `meta` (plus step, leaf paths, types, checksums)."""
    leaves = jax.tree.leaves(state)
    flat = {f"{i:06d}": x for i, x in enumerate(leaves)}
    meta = {
        **meta,
        "step": step,
        "leaf_paths": _paths(state),
        "leaf_types": _types(state),
        "checksums": checksums(state),
    }
    mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)),
        force=True,
    )


def _check_structure(mngr, step: int, meta: dict, like_state) -> None:
    """StateMismatchError if the checkpoint's leaves are not `like_state`'s (another model or
    optimizer)."""
    same = meta.get("leaf_paths") == _paths(like_state) and (
        "leaf_types" not in meta or meta["leaf_types"] == _types(like_state)
    )
    if not same:
        raise StateMismatchError(
            f"checkpoint step {step} in {mngr.directory} does not match this "
            "model and optimizer (different state structure); use a new --out"
        )


def _restore_step(mngr: ocp.CheckpointManager, step: int, like_state, check_meta=None):
    """(state, meta) of one step, verified against its checksums (raises if it cannot be);
    `check_meta(meta)` first, if given."""
    meta = dict(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    if check_meta is not None:
        check_meta(meta)
    _check_structure(mngr, step, meta, like_state)
    leaves, treedef = jax.tree.flatten(like_state)
    abstract = {
        f"{i:06d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for i, x in enumerate(leaves)
    }
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    state = jax.tree.unflatten(treedef, [out["state"][f"{i:06d}"] for i in range(len(leaves))])
    if "checksums" in meta:
        paths = _paths(like_state)
        bad = [p for p, want, got in zip(paths, meta["checksums"], checksums(state)) if want != got]
        if bad:
            raise CorruptCheckpointError(f"checksum mismatch in {len(bad)} leaves, e.g. {bad[0]}")
    return state, meta


def _quarantine(mngr: ocp.CheckpointManager, steps: list[int]) -> None:
    """Move the given step directories to `<run>/corrupt_checkpoints/` and forget them (process
    0 moves, every process waits for it: the directory is shared in a multi-process run)."""
    if not steps:
        return
    mngr.wait_until_finished()
    if jax.process_index() == 0:
        root = Path(str(mngr.directory))
        dest_root = root.parent / "corrupt_checkpoints"
        dest_root.mkdir(exist_ok=True)
        for step in steps:
            dest, k = dest_root / str(step), 1
            while dest.exists():
                dest, k = dest_root / f"{step}-{k}", k + 1
            shutil.move(str(root / str(step)), str(dest))
            _warn(f"moved the unreadable checkpoint step {step} to {dest}")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("relaymoe_quarantine_checkpoints")
    mngr.reload()


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def restore(mngr: ocp.CheckpointManager, like_state, check_meta=None):
    """(step, state, meta) of the newest checkpoint that restores and verifies, with
    `like_state`'s shardings, or None if there is none. Newer steps that fail are moved aside
    with a warning; `CorruptCheckpointError` if every step fails, `StateMismatchError` (a
    ValueError) if the checkpoints are of a different state structure or `check_meta(meta)`
    (called on each step's metadata before its arrays are read) raises one."""
    failed = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            state, meta = _restore_step(mngr, step, like_state, check_meta)
        except StateMismatchError:
            raise
        except Exception as e:  # tensorstore raises plain Exception
            _warn(
                f"checkpoint step {step} in {mngr.directory} cannot be restored "
                f"({type(e).__name__}: {short_error(e)}); trying the previous step"
            )
            failed.append(step)
            continue
        _quarantine(mngr, failed)
        return step, state, meta
    if failed:
        raise CorruptCheckpointError(
            f"no checkpoint in {mngr.directory} can be restored (steps "
            f"{failed} all failed; see the warnings above)"
        )
    return None


def short_error(err: BaseException, limit: int = 400) -> str:
    """The first line of an error and of its cause, cut to `limit` characters (tensorstore's
    messages go on with a whole JSON spec)."""
    parts = [err] if err.__cause__ is None else [err, err.__cause__]
    lines = [
        (str(e).splitlines() or [""])[0].split(" See full TensorStore details")[0] for e in parts
    ]
    return " <- ".join(lines)[:limit]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the metrics lines with step <= last_step (a run that crashed after logging
    steps past its last checkpoint must not leave duplicates when it resumes)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if rec.get("step", 0) <= last_step:
            keep.append(line)
    path.write_text("".join(k + "\n" for k in keep))
