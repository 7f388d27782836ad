"""Orbax checkpoints of the train state, and the metrics log kept consistent with them.

The state pytree is saved as a flat dict `{"000000": leaf, ...}` (leaves in `jax.tree` order) so
that orbax never has to understand nnx/optax container types; the restore target is the freshly
initialised state's leaves (shape, dtype, sharding), unflattened with its treedef. The leaf paths
are saved in the JSON metadata and checked on restore. Orbax writes each step to a temporary
directory and renames it when complete, so an interrupted save never becomes the latest step.
"""

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp


def manager(out_dir: Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=1)
    return ocp.CheckpointManager(Path(out_dir).resolve() / "checkpoints", options=opts)


def _paths(state) -> list[str]:
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    leaves = jax.tree.leaves(state)
    flat = {f"{i:06d}": x for i, x in enumerate(leaves)}
    meta = {**meta, "step": step, "leaf_paths": _paths(state)}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def restore(mngr: ocp.CheckpointManager, like_state):
    """(step, state, meta) of the latest checkpoint, restored with `like_state`'s shardings, or
    None if there is none."""
    step = mngr.latest_step()
    if step is None:
        return None
    leaves, treedef = jax.tree.flatten(like_state)
    abstract = {f"{i:06d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                for i, x in enumerate(leaves)}
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    meta = dict(out["meta"])
    if meta.get("leaf_paths") != _paths(like_state):
        raise ValueError(f"checkpoint step {step} in {mngr.directory} does not match this model "
                         "and optimizer (different state structure); use a new --out")
    state = jax.tree.unflatten(treedef, [out["state"][f"{i:06d}"] for i in range(len(leaves))])
    return step, state, meta


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
        except json.JSONDecodeError:        # a line cut short by a crash
            continue
        if rec.get("step", 0) <= last_step:
            keep.append(line)
    path.write_text("".join(k + "\n" for k in keep))
