"""A run's saved checkpoint as the export reads it (`train.hf.export`): its committed steps
(`saved_steps`) and its parameter arrays one saved leaf at a time (`SavedParams`: a partial orbax
restore of that leaf into host memory, read-only, checked against the checksums the trainer saved
with it, `train.state.checkpoint`). `ExportError` is the export's one-line error."""

import re
from pathlib import Path

import jax
import numpy as np

CHUNK = 1 << 24  # elements per step of the host checksum


class ExportError(ValueError):
    """Bad input to the export, or a checkpoint it cannot read (one line)."""


def saved_steps(run_dir: Path) -> list[int]:
    """The committed checkpoint steps of a run directory, ascending (orbax renames a step's
    temporary directory to its number only when the save is complete)."""
    ckpts = Path(run_dir) / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit() and p.is_dir())


def host_sums(a: np.ndarray) -> list[int] | None:
    """`train.state.checkpoint._leaf_sums` on the host: [sum(w), sum(w * (2 i + 1))] mod 2**32 over
    the leaf's words w (flat index i), in chunks; None for an 8-byte type (not a parameter)."""
    a = a.astype(np.uint8) if a.dtype == np.bool_ else a
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}.get(a.dtype.itemsize)
    if bits is None:
        return None
    words, total, weighted = a.reshape(-1).view(bits), 0, 0
    for start in range(0, words.size, CHUNK):
        w = words[start : start + CHUNK].astype(np.uint64)
        i = np.arange(start, start + w.size, dtype=np.uint64)
        total += int(w.sum(dtype=np.uint64))
        weighted += int((w * (2 * i + 1)).sum(dtype=np.uint64))
    return [total % 2**32, weighted % 2**32]


class SavedParams:
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
        if self.sums is not None and host_sums(a) not in (None, self.sums[i]):
            raise ExportError(
                f"{self.where}: {path} fails its checksum (the checkpoint is damaged); "
                "export another --step"
            )
        return a
