"""Hugging Face checkpoints (Qwen3MoeForCausalLM / Qwen2MoeForCausalLM) <-> `QwenMoe`.

`from_pretrained(path, mesh=mesh)` reads a local directory holding `config.json` and
`model.safetensors` (or a sharded `model.safetensors.index.json` with its files); nothing is
downloaded. `save_pretrained(model, path)` writes the same layout back. Every weights file's
header is checked before anything is read (`weight_map`): a truncated file, or a tensor stored in
an integer dtype, is a ValueError naming the file (and the tensor), not the safetensors reader's
traceback or a silent cast to float.

Loading never builds the model on one device. The model's structure comes from `nnx.eval_shape`
(no weights), and each parameter is made by `jax.make_array_from_callback` on its
`NamedSharding`: the callback returns only the slice a device holds, read lazily with
`safetensors.safe_open(framework="numpy")`. Held in host memory at once: one non-expert tensor
(a replicated tensor is read once and handed to every device), or one device's experts of one
stacked tensor ([E/EP, H, F]: the per-expert tensors it needs, or a slice of a fused 3-D tensor);
with `scan_layers`, the same for all L layers of one parameter at once.

The weights' names and layouts are `hf_mapping.py` (`mapping(cfg)`, one `Entry` per parameter),
the config.json keys `hf_config.py`. With `scan_layers=True` the model holds one stacked tensor
per parameter of the layers, [L, ...] (`qwen.py`): loading stacks the L per-layer tensors of each
(`model.layers.i.<name>` goes to `layers.<name>[i]`), each device reading its own slice of every
layer, and export writes one tensor per layer. The files are the same either way.

`transformers` 5.x `save_pretrained` writes the per-expert names (it reverts its fused in-memory
layout on save); the fused names are read too. `save_pretrained` here writes per-expert names by
default (`expert_layout="fused"` for the other).
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.hf_config import config_from_hf
from relaymoe_jax.models.hf_files import (
    ShardWriter,
    hf_tensors_of,
    weights_header,
    write_config,
)
from relaymoe_jax.models.hf_mapping import Entry, mapping
from relaymoe_jax.models.qwen import QwenMoe
from relaymoe_jax.models.sharding import AxisRules

# ---------------------------------------------------------------------------------------------
# reading

SINGLE = "model.safetensors"


def weight_map(path: str) -> dict[str, str]:
    """{tensor name: its file} of the checkpoint directory `path` (its
    `model.safetensors.index.json`, else `model.safetensors`), every file's header checked first
    (`hf_files.weights_header`: ValueError, one line naming the file, for a truncated file or a
    tensor stored as an integer) and every tensor the index lists found in its file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        for fname in sorted(set(wmap.values())):
            held = weights_header(os.path.join(path, fname))
            lost = sorted(n for n, f in wmap.items() if f == fname and n not in held)
            if lost:
                raise ValueError(
                    f"{os.path.join(path, fname)}: does not hold {lost[:4]}"
                    f"{'...' if len(lost) > 4 else ''}, which model.safetensors.index.json "
                    "puts there"
                )
        return wmap
    if os.path.exists(os.path.join(path, SINGLE)):
        return dict.fromkeys(weights_header(os.path.join(path, SINGLE)), SINGLE)
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


class _Checkpoint:
    """Lazy tensor access over one or several .safetensors files (checked: `weight_map`)."""

    def __init__(self, path: str):
        self.path, self.weight_map, self._open = path, weight_map(path), {}

    def __contains__(self, name):
        return name in self.weight_map

    def _file(self, name):
        if name not in self.weight_map:
            raise KeyError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        fname = self.weight_map[name]
        if fname not in self._open:
            self._open[fname] = safe_open(os.path.join(self.path, fname), framework="numpy")
        return self._open[fname]

    def get(self, name) -> np.ndarray:
        return self._file(name).get_tensor(name)

    def get_rows(self, name, start, stop) -> np.ndarray:
        return self._file(name).get_slice(name)[start:stop]

    def shape(self, name) -> tuple:
        return tuple(self._file(name).get_slice(name).get_shape())

    def names(self):
        return set(self.weight_map)


def _ours_from_hf(entry: Entry, w: np.ndarray, shape) -> np.ndarray:
    if entry.kind == "T":
        return w.T.reshape(shape)
    return w.reshape(shape)


def _expert_rows(ckpt: _Checkpoint, entry: Entry, e0: int, e1: int, ffn: int) -> np.ndarray:
    """Experts e0:e1 of one stacked weight, in our layout ([n, H, F] or [n, F, H])."""
    fused = f"{entry.name}.gate_up_proj" in ckpt
    if fused:
        if entry.which == "down":
            return np.swapaxes(ckpt.get_rows(f"{entry.name}.down_proj", e0, e1), 1, 2)
        gate_up = ckpt.get_rows(f"{entry.name}.gate_up_proj", e0, e1)  # [n, 2F, H]
        half = gate_up[:, :ffn] if entry.which == "gate" else gate_up[:, ffn:]
        return np.swapaxes(half, 1, 2)
    return np.stack(
        [ckpt.get(f"{entry.name}.{e}.{entry.which}_proj.weight").T for e in range(e0, e1)]
    )


def _reader(entry: Entry, shape, ckpt: _Checkpoint, dtype, ffn: int):
    """index -> the part `index` of our tensor of `shape` (its layout), read from `ckpt`."""
    shape = tuple(shape)
    np_dtype = jnp.dtype(dtype)
    cache = {}

    def full():
        if "w" not in cache:
            w = ckpt.get(entry.name)
            expect = math.prod(shape)
            if w.size != expect:
                raise ValueError(
                    f"{entry.name}: shape {w.shape}, expected {expect} elements "
                    f"(ours {shape}); does config.json match the weights?"
                )
            cache["w"] = _ours_from_hf(entry, w, shape).astype(np_dtype)
        return cache["w"]

    def callback(index):
        if entry.kind != "expert":
            return full()[index]
        e0, e1, _ = index[0].indices(shape[0])
        rows = _expert_rows(ckpt, entry, e0, e1, ffn)
        if rows.shape[1:] != shape[1:]:
            raise ValueError(
                f"{entry.name} ({entry.which}): expert shape {rows.shape[1:]}, expected {shape[1:]}"
            )
        return rows[(slice(None), *index[1:])].astype(np_dtype)

    return callback


def _place(
    entries: list[Entry], stacked: bool, abstract, sharding, ckpt: _Checkpoint, dtype, ffn: int
):
    """Our parameter on `sharding` from its checkpoint entry, or, `stacked` (scanned) [L, ...],
    from the L entries of its layers: each device reads only its slice of every layer."""
    shape = tuple(abstract.shape)
    if not stacked:
        return jax.make_array_from_callback(
            shape, sharding, _reader(entries[0], shape, ckpt, dtype, ffn)
        )
    readers = [_reader(e, shape[1:], ckpt, dtype, ffn) for e in entries]
    if len(readers) != shape[0]:
        raise ValueError(f"{entries[0].path}: {len(readers)} layers for a stack of {shape[0]}")
    read_rows = lambda index: np.stack(
        [readers[i](index[1:]) for i in range(*index[0].indices(shape[0]))]
    )
    return jax.make_array_from_callback(shape, sharding, read_rows)


def _layer_of(entry: Entry) -> int | None:
    """The decoder layer of an entry (`("layers", i, ...)`), else None."""
    return entry.path[1] if entry.path[0] == "layers" else None


def _get_path(module, path):
    node = module
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _variable(model, entry: Entry):
    """(our variable of `entry`, the layer to take from it or None): with `scan_layers` a
    decoder-layer entry `("layers", i, *rest)` is row i of the stacked variable `layers.rest`."""
    i = _layer_of(entry)
    if i is not None and model.config.scan_layers:
        return _get_path(model.layers, entry.path[2:]), i
    return _get_path(model, entry.path), None


def _grouped(model, entries: list[Entry]):
    """[(variable, [entries])]: one entry per variable, or a scanned variable's L entries (in
    layer order), in the order of the first entry of each."""
    groups: dict[int, tuple] = {}
    for entry in entries:
        var, _ = _variable(model, entry)
        groups.setdefault(id(var), (var, []))[1].append(entry)
    return list(groups.values())


def _value(model, entry: Entry) -> np.ndarray:
    """Our tensor of `entry` on the host (one layer's row of a stacked variable, gathered
    alone)."""
    var, i = _variable(model, entry)
    value = var[...]
    return np.asarray(jax.device_get(value if i is None else value[i]))


def from_pretrained(
    path: str,
    *,
    mesh: jax.sharding.Mesh,
    dtype=jnp.float32,
    rules: AxisRules | None = None,
    storage=None,
    **overrides,
) -> QwenMoe:
    """Load a local Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint directory onto `mesh`.

    `overrides` (flat keys, `config.KEYS`) replace config.json's values: the op's options
    (`dispatcher`, `routing`, `ring`, `capacity_factor`, `chunk_size`, `gmm_impl`, `expert_fp8`) and
    the router options (`router_z_loss_coef`, `expert_bias`, ...); what the Hugging Face
    architecture does not have (another router or activation, biases: `hf_config.check_hf`) is
    refused. Parameters are
    stored in `dtype`; `storage(abstract)`, if given, says where each is placed instead of its
    model sharding (`abstract`: a `jax.ShapeDtypeStruct` on that sharding; the trainer stores its
    state over `fsdp` and `context` too, `train.step.storage`).
    """
    with open(os.path.join(path, "config.json")) as f:
        cfg = config_from_hf(json.load(f), **overrides)
    ckpt = _Checkpoint(path)
    wanted = mapping(cfg)
    _check_names(ckpt, wanted, cfg)
    model = nnx.eval_shape(
        lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0), dtype=dtype, rules=rules)
    )
    model_rules = model.rules
    for var, entries in _grouped(model, wanted):
        names = var.get_metadata()["logical_axes"]
        sharding = model_rules.sharding(*names)
        if storage is not None:
            abstract = var.get_value()
            sharding = storage(jax.ShapeDtypeStruct(abstract.shape, dtype, sharding=sharding))
        stacked = _variable(model, entries[0])[1] is not None
        var.set_value(
            _place(
                entries,
                stacked,
                var.get_value(),
                sharding,
                ckpt,
                dtype,
                cfg.moe.moe_intermediate_size,
            )
        )
    return model


def _check_names(ckpt: _Checkpoint, wanted: list[Entry], cfg: ModelConfig):
    """Every tensor of the checkpoint is used and every parameter found, or a clear error."""
    expected = set()
    for entry in wanted:
        if entry.kind != "expert":
            expected.add(entry.name)
        elif f"{entry.name}.gate_up_proj" in ckpt:
            expected.add(f"{entry.name}.{'down_proj' if entry.which == 'down' else 'gate_up_proj'}")
        else:
            expected.update(
                f"{entry.name}.{e}.{entry.which}_proj.weight" for e in range(cfg.moe.num_experts)
            )
    have = ckpt.names()
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")  # a tied copy, if the writer kept one
    missing, unused = sorted(expected - have), sorted(have - expected)
    if missing or unused:
        raise ValueError(
            f"{ckpt.path}: checkpoint does not match config.json ({cfg.arch}): "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unused[:8]}{'...' if len(unused) > 8 else ''}"
        )


# ---------------------------------------------------------------------------------------------
# writing


def hf_tensors(model: QwenMoe, expert_layout: str = "per_expert"):
    """Yield (Hugging Face name, numpy array) in state-dict order, one stacked tensor at a time."""
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout={expert_layout!r}: expected 'per_expert' or 'fused'")
    entries = mapping(model.config)
    for n, entry in enumerate(entries):
        fused_up = expert_layout == "fused" and entry.kind == "expert" and entry.which == "up"
        gate = _value(model, entries[n - 1]) if fused_up else None  # stacked just before
        yield from hf_tensors_of(entry, _value(model, entry), expert_layout, gate)


def save_pretrained(
    model: QwenMoe, path: str, *, max_shard_size=None, expert_layout: str = "per_expert"
) -> None:
    """Write `config.json` and the weights with Hugging Face names into directory `path`.

    One `model.safetensors` (the whole model passes through host memory), or, with
    `max_shard_size` (bytes or a string like "200KB", "5GB", "2GiB"), files
    `model-0000i-of-0000n.safetensors` of at most that size (a larger tensor gets a file of its
    own) and `model.safetensors.index.json`: host memory then holds one file's tensors plus one
    stacked tensor. Tensors are gathered from the devices one at a time (`hf_files.ShardWriter`).
    """
    os.makedirs(path, exist_ok=True)
    write_config(path, model.config, model.dtype)
    writer = ShardWriter(path, max_shard_size)
    for name, a in hf_tensors(model, expert_layout):
        writer.add(name, a)
    writer.close()
