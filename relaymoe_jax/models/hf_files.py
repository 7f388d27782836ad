"""Writing a Hugging Face checkpoint directory from a stream of tensors, shared by
`hf.save_pretrained` (from a model) and the trainer's `export` (from a run's checkpoint).

`hf_tensors_of(entry, a)` turns one parameter of one layer, in our layout (`hf_mapping.Entry`),
into its Hugging Face tensors. `ShardWriter` takes (name, array) pairs one at a time and writes a
`.safetensors` file whenever the next tensor would take the pending ones past `max_shard_size`
(a larger tensor gets a file of its own), so host memory holds at most one file's tensors; the
files are written by `write_safetensors` straight from the arrays' buffers (no second copy).
`close()` names them as transformers does: one `model.safetensors`, or
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` (`metadata.total_size`,
`weight_map`). `write_config` writes `config.json` (`hf_config.config_to_hf`).
"""

import json
import math
import os
import re
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.hf_config import config_to_hf
from relaymoe_jax.models.hf_mapping import Entry

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def size_bytes(s) -> int:
    """Bytes of a size: an int, or a string like "200KB", "5GB", "2GiB"."""
    if isinstance(s, int) and not isinstance(s, bool):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", str(s), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={s!r}: expected bytes or e.g. '200KB', '5GB', '2GiB'")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** "KMG".index(unit[0]) * base)


def hf_tensors_of(
    entry: Entry, a: np.ndarray, expert_layout: str = "per_expert", gate=None, dtype=None
) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face (name, array) pairs of parameter `entry` of one layer, `a` in our layout;
    fused experts: the `up` entry yields `gate_up_proj` from `gate` (its layer's w_gate) and `a`,
    the `gate` entry nothing. Arrays are C-contiguous, in `dtype` (default: `a`'s)."""
    out = lambda x: np.ascontiguousarray(x, dtype=dtype)
    if entry.kind == "same":
        yield entry.name, out(a)
    elif entry.kind == "reshape":
        yield entry.name, out(a.reshape(-1))
    elif entry.kind == "T":
        yield entry.name, out(a.reshape(math.prod(a.shape[: entry.n_in]), -1).T)
    elif expert_layout == "per_expert":
        for e in range(a.shape[0]):
            yield f"{entry.name}.{e}.{entry.which}_proj.weight", out(a[e].T)
    elif entry.which == "down":
        yield f"{entry.name}.down_proj", out(np.swapaxes(a, 1, 2))
    elif entry.which == "up":
        yield (
            f"{entry.name}.gate_up_proj",
            out(np.swapaxes(np.concatenate([gate, a], axis=2), 1, 2)),
        )


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """One .safetensors file of `tensors` ({name: C-contiguous array}, stored in this order),
    written from the arrays' own buffers."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, a in tensors.items():
        kind = SAFETENSORS_DTYPES.get(np.dtype(a.dtype).name)
        if kind is None:
            raise ValueError(f"{name}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {
            "dtype": kind,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # no copy


class ShardWriter:
    """Writes (name, array) pairs into `path` as safetensors files of at most `max_shard_size`
    bytes (None: one file), then names them and writes the index (`close`). `on_flush(tensors)`,
    if given, sees each file's tensors before they are written (tests count what is held)."""

    def __init__(self, path: str, max_shard_size=None, on_flush: Callable | None = None):
        self.path, self.on_flush = path, on_flush
        self.limit = None if max_shard_size is None else size_bytes(max_shard_size)
        self.files: list[dict[str, int]] = []  # per written file: {name: nbytes}
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0

    def add(self, name: str, a: np.ndarray) -> None:
        if any(name in f for f in self.files) or name in self.pending:
            raise ValueError(f"tensor {name!r} written twice")
        if self.limit is not None and self.pending and self.pending_bytes + a.nbytes > self.limit:
            self._flush()
        self.pending[name] = a
        self.pending_bytes += a.nbytes

    def _flush(self) -> None:
        if self.on_flush is not None:
            self.on_flush(self.pending)
        tmp = os.path.join(self.path, f"shard-{len(self.files)}.tmp")
        write_safetensors(tmp, self.pending, metadata={"format": "pt"})
        self.files.append({k: v.nbytes for k, v in self.pending.items()})
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is pending, name the files and write the index; the file names."""
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            os.replace(
                os.path.join(self.path, "shard-0.tmp"), os.path.join(self.path, "model.safetensors")
            )
            return ["model.safetensors"]
        weight_map, total, names = {}, 0, []
        for i, tensors in enumerate(self.files):
            fname = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            os.replace(os.path.join(self.path, f"shard-{i}.tmp"), os.path.join(self.path, fname))
            names.append(fname)
            for name, nbytes in tensors.items():
                weight_map[name] = fname
                total += nbytes
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(os.path.join(self.path, "model.safetensors.index.json"), index)
        return names


def write_config(path: str, cfg: ModelConfig, dtype) -> None:
    """`config.json` of `cfg` with weights in `dtype` (refuses what Hugging Face cannot hold)."""
    _write_json(os.path.join(path, "config.json"), config_to_hf(cfg, jnp.dtype(dtype)))


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
