"""Writing a Hugging Face checkpoint directory from a stream of tensors, shared by
`hf.save_pretrained` (from a model) and the trainer's `export` (from a run's checkpoint).

`hf_tensors_of(entry, a)` turns one parameter of one layer, in our layout (`hf_mapping.Entry`),
into its Hugging Face tensors. `ShardWriter` takes (name, array) pairs one at a time and writes a
`.safetensors` file whenever the next tensor would take the pending ones past `max_shard_size`
(a larger tensor gets a file of its own), so host memory holds at most one file's tensors; the
files are written by `write_safetensors` straight from the arrays' buffers (no second copy).
`close()` names them as transformers does: one `model.safetensors`, or
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` (`metadata.total_size`,
`weight_map`). `write_config` writes `config.json` (`hf_config.config_to_hf`). A file never
passes `max_shard_size`, its header included (`header_bytes`).

Reading: `weights_header(path)` reads and checks one weights file's header before any tensor is
read (loading, `hf.from_pretrained`, and the trainer's `--init-from-hf`): a truncated or padded
file, a header that is not safetensors', or a tensor stored in a non-floating dtype (an integer
router weight would be cast to float and trained) is one ValueError line naming the file (and
the tensor), not a traceback of the safetensors reader or a silent cast.
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


SHARD_METADATA = {"format": "pt"}  # what transformers writes in each file's header
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # what the weights may be stored as
_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_ITEMSIZE.update({"U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1})


def weights_header(path) -> dict:
    """{tensor name: its header entry (dtype, shape, data_offsets)} of the safetensors file
    `path`, checked: ValueError (one line naming the file) for a file shorter or longer than its
    header says (a partial download or copy), a header that is not safetensors' JSON, or a
    tensor stored in a dtype other than `FLOAT_DTYPES` (naming the tensor and its dtype)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(
                f"{path}: {size} bytes, shorter than "
                f"{'a safetensors header' if n < 0 else f'the header it announces ({n} bytes)'}: "
                "truncated (a partial download or copy?), or not a safetensors file"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        ends = [_checked_end(name, e) for name, e in entries.items()]
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"{path}: not a safetensors file (its header: {e})") from None
    data, need = size - 8 - n, max(ends, default=0)
    if data != need:
        short = data < need
        raise ValueError(
            f"{path}: {'truncated' if short else 'damaged'}: its header lists {need} bytes of "
            f"tensor data, the file holds {data} after the header "
            f"({'a partial download or copy?' if short else 'bytes after its last tensor'})"
        )
    for name, e in entries.items():
        if e["dtype"] not in FLOAT_DTYPES:
            kind = _NAMES.get(e["dtype"], e["dtype"])
            raise ValueError(
                f"{path}: tensor {name!r} is stored as {e['dtype']} ({kind}), expected a "
                f"floating-point weight ({', '.join(FLOAT_DTYPES)})"
            )
    return entries


def _checked_end(name: str, e: dict) -> int:
    """The end of tensor `name`'s data; ValueError if its entry is not safetensors'."""
    start, end = e["data_offsets"]
    nbytes = math.prod(e["shape"]) * _ITEMSIZE.get(e["dtype"], 0)
    if not 0 <= start <= end or (e["dtype"] in _ITEMSIZE and end - start != nbytes):
        raise ValueError(f"tensor {name!r}: data_offsets {e['data_offsets']} for {e}")
    return end


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


def _entry_json(name: str, a: np.ndarray, offset: int) -> str:
    """`"name":{...}`, the header entry of tensor `a` whose data starts at `offset`."""
    kind = SAFETENSORS_DTYPES.get(np.dtype(a.dtype).name)
    if kind is None:
        raise ValueError(f"{name}: dtype {a.dtype} cannot be written to safetensors")
    entry = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    return json.dumps(name) + ":" + json.dumps(entry, separators=(",", ":"))


def _metadata_json(metadata: dict | None) -> str:
    return "" if not metadata else '"__metadata__":' + json.dumps(metadata, separators=(",", ":"))


def header_bytes(json_len: int) -> int:
    """Bytes before the data of a file whose header JSON is `json_len` long: the 8-byte length
    and the JSON padded to 8 bytes (the data starts 8-byte aligned, as safetensors writes it)."""
    return 8 + json_len + (-json_len % 8)


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """One .safetensors file of `tensors` ({name: C-contiguous array}, stored in this order),
    written from the arrays' own buffers; its size is `header_bytes(len(header JSON))` plus the
    tensors' bytes."""
    parts, offset = [_metadata_json(metadata)] if metadata else [], 0
    for name, a in tensors.items():
        parts.append(_entry_json(name, a, offset))
        offset += a.nbytes
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # no copy


class ShardWriter:
    """Writes (name, array) pairs into `path` as safetensors files of at most `max_shard_size`
    bytes, each file's header included (None: one file), then names them and writes the index
    (`close`). `on_flush(tensors)`, if given, sees each file's tensors before they are written
    (tests count what is held)."""

    def __init__(self, path: str, max_shard_size=None, on_flush: Callable | None = None):
        self.path, self.on_flush = path, on_flush
        self.limit = None if max_shard_size is None else size_bytes(max_shard_size)
        self.files: list[dict[str, int]] = []  # per written file: {name: nbytes}
        self._reset()

    def _reset(self) -> None:
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.header_json = 2 + len(_metadata_json(SHARD_METADATA))  # "{...}" without entries

    def _file_bytes(self, name: str, a: np.ndarray) -> tuple[int, int]:
        """(the header JSON's length, the file's size) with `a` added to the pending file."""
        entry = len(_entry_json(name, a, self.pending_bytes)) + 1  # and its comma
        json_len = self.header_json + entry
        return json_len, header_bytes(json_len) + self.pending_bytes + a.nbytes

    def add(self, name: str, a: np.ndarray) -> None:
        if any(name in f for f in self.files) or name in self.pending:
            raise ValueError(f"tensor {name!r} written twice")
        json_len, size = self._file_bytes(name, a)
        if self.limit is not None and self.pending and size > self.limit:
            self._flush()
            json_len, _ = self._file_bytes(name, a)
        self.pending[name] = a
        self.pending_bytes += a.nbytes
        self.header_json = json_len

    def _flush(self) -> None:
        if self.on_flush is not None:
            self.on_flush(self.pending)
        tmp = os.path.join(self.path, f"shard-{len(self.files)}.tmp")
        write_safetensors(tmp, self.pending, metadata=SHARD_METADATA)
        self.files.append({k: v.nbytes for k, v in self.pending.items()})
        self._reset()

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
