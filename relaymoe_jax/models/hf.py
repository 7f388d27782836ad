"""Hugging Face checkpoints (Qwen3MoeForCausalLM / Qwen2MoeForCausalLM) <-> `QwenMoe`.

`from_pretrained(path, mesh=mesh)` reads a local directory holding `config.json` and
`model.safetensors` (or a sharded `model.safetensors.index.json` with its files); nothing is
downloaded. `save_pretrained(model, path)` writes the same layout back.

Loading never builds the model on one device. The model's structure comes from `nnx.eval_shape`
(no weights), and each parameter is made by `jax.make_array_from_callback` on its
`NamedSharding`: the callback returns only the slice a device holds, read lazily with
`safetensors.safe_open(framework="numpy")`. Held in host memory at once: one non-expert tensor
(a replicated tensor is read once and handed to every device), or one device's experts of one
stacked tensor ([E/EP, H, F]: the per-expert tensors it needs, or a slice of a fused 3-D tensor);
with `scan_layers`, the same for all L layers of one parameter at once.

Weight mapping (torch `Linear.weight` is [out, in], ours are [in, out]; `mapping` is the code).
Prefix `model.layers.i.` = ours `layers[i].`; e = expert; T = transpose:

    model.embed_tokens.weight [V, H]           embed_tokens [V, H]
    input_layernorm / post_attention_layernorm.weight [H]     same names, .weight [H]
    self_attn.q_proj.weight [N*D, H]           self_attn.q_proj [H, N, D]           T, reshape
    self_attn.{k,v}_proj.weight [K*D, H]       self_attn.{k,v}_proj [H, K, D]       T, reshape
    self_attn.{q,k,v}_proj.bias [N*D | K*D]    self_attn.{q,k,v}_bias [N | K, D]    reshape
    self_attn.o_proj.weight [H, N*D]           self_attn.o_proj [N, D, H]           T, reshape
    self_attn.o_proj.bias [H] (qwen3)          self_attn.o_bias [H]
    self_attn.{q,k}_norm.weight [D] (qwen3)    self_attn.{q,k}_norm.weight [D]
    mlp.gate.weight [E, H]                     mlp.gate [H, E]                      T
    mlp.experts.e.{gate,up}_proj.weight [F, H] mlp.w_{gate,up}[e] [H, F]            T, stack
    mlp.experts.e.down_proj.weight [H, F]      mlp.w_down[e] [F, H]                 T, stack
    mlp.experts.gate_up_proj [E, 2F, H] (fused)  w_gate = [:, :F]^T, w_up = [:, F:]^T per expert
    mlp.experts.down_proj [E, H, F] (fused)    mlp.w_down [E, F, H]                 T per expert
    mlp.shared_expert.{gate,up,down}_proj.weight (qwen2)  mlp.shared_expert.*       T
    mlp.shared_expert_gate.weight [1, H] (qwen2)          mlp.shared_expert_gate [H, 1]  T
    mlp.{gate,up,down}_proj.weight (dense layers)         mlp.{gate,up,down}_proj   T
    model.norm.weight [H]                      norm.weight [H]
    lm_head.weight [V, H] (absent when tied)   lm_head [H, V]                       T

With `scan_layers=True` the model holds one stacked tensor per parameter of the layers, [L, ...]
(`qwen.py`): loading stacks the L per-layer tensors of each (`model.layers.i.<name>` goes to
`layers.<name>[i]`), each device reading its own slice of every layer, and export writes one
tensor per layer as above. The files are the same either way.

`transformers` 5.x `save_pretrained` writes the per-expert names (it reverts its fused in-memory
layout on save); the fused names are read too. `save_pretrained` here writes per-expert names by
default (`expert_layout="fused"` for the other).
"""

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from relaymoe_jax.models.config import ModelConfig, from_hf_dict
from relaymoe_jax.models.qwen import QwenMoe
from relaymoe_jax.models.sharding import AxisRules

_ARCH_NAMES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
_OURS_ONLY = (
    "arch",
    "router_z_loss_coef",
    "expert_bias",
    "expert_bias_rate",
    "dispatcher",
    "routing",
    "capacity_factor",
    "chunk_size",
    "gmm_impl",
    "attention_remat",
    "attention_impl",
    "attention_block_k",
    "moe_remat",
    "scan_layers",
)


# ---------------------------------------------------------------------------------------------
# the mapping


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: our path, its Hugging Face name, and how the layouts relate.

    kind: "same"; "T" (torch Linear: ours = W.T reshaped; `n_in` leading dims of ours are the
    input); "reshape" (a bias); "expert" (stacked experts: `name` is the experts prefix and
    `which` is "gate", "up" or "down").
    """

    path: tuple
    name: str
    kind: str
    n_in: int = 1
    which: str = ""


def mapping(cfg: ModelConfig) -> list[Entry]:
    """Every parameter of a `QwenMoe` of `cfg`, in Hugging Face's state-dict order."""
    out = [Entry(("embed_tokens",), "model.embed_tokens.weight", "same")]
    qwen3 = cfg.arch == "qwen3_moe"
    qkv_bias = cfg.attention_bias if qwen3 else cfg.qkv_bias
    for i in range(cfg.num_hidden_layers):
        p, q = ("layers", i), f"model.layers.{i}"
        a, sa = (*p, "self_attn"), f"{q}.self_attn"
        out.append(Entry((*p, "input_layernorm", "weight"), f"{q}.input_layernorm.weight", "same"))
        for x in "qkv":
            out.append(Entry((*a, f"{x}_proj"), f"{sa}.{x}_proj.weight", "T"))
            if qkv_bias:
                out.append(Entry((*a, f"{x}_bias"), f"{sa}.{x}_proj.bias", "reshape"))
        out.append(Entry((*a, "o_proj"), f"{sa}.o_proj.weight", "T", n_in=2))
        if qwen3 and cfg.attention_bias:
            out.append(Entry((*a, "o_bias"), f"{sa}.o_proj.bias", "same"))
        if qwen3:
            for x in "qk":
                out.append(Entry((*a, f"{x}_norm", "weight"), f"{sa}.{x}_norm.weight", "same"))
        out.append(
            Entry(
                (*p, "post_attention_layernorm", "weight"),
                f"{q}.post_attention_layernorm.weight",
                "same",
            )
        )
        m, sm = (*p, "mlp"), f"{q}.mlp"
        if cfg.is_moe_layer(i):
            out.append(Entry((*m, "gate"), f"{sm}.gate.weight", "T"))
            for w in ("gate", "up", "down"):
                out.append(Entry((*m, f"w_{w}"), f"{sm}.experts", "expert", which=w))
            if cfg.shared_expert_intermediate_size:
                for w in ("gate", "up", "down"):
                    out.append(
                        Entry(
                            (*m, "shared_expert", f"{w}_proj"),
                            f"{sm}.shared_expert.{w}_proj.weight",
                            "T",
                        )
                    )
                out.append(
                    Entry((*m, "shared_expert_gate"), f"{sm}.shared_expert_gate.weight", "T")
                )
        else:
            for w in ("gate", "up", "down"):
                out.append(Entry((*m, f"{w}_proj"), f"{sm}.{w}_proj.weight", "T"))
    out.append(Entry(("norm", "weight"), "model.norm.weight", "same"))
    if not cfg.tie_word_embeddings:
        out.append(Entry(("lm_head",), "lm_head.weight", "T"))
    return out


# ---------------------------------------------------------------------------------------------
# config.json


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a Hugging Face config dict, refusing what the model does not implement."""
    hf = dict(hf)
    if "num_experts" not in hf and "num_local_experts" in hf:
        hf["num_experts"] = hf["num_local_experts"]
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError(
            f"config.json: rope_parameters={rope!r}, rope_scaling="
            f"{hf.get('rope_scaling')!r}: only the default RoPE is implemented"
        )
    if "rope_theta" in rope:
        hf["rope_theta"] = rope["rope_theta"]
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError("config.json: sliding-window attention is not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}: expected 'silu'")
    return from_hf_dict(hf, **overrides)


def config_to_hf(cfg: ModelConfig, dtype) -> dict:
    """The Hugging Face config.json dict of `cfg`."""
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _OURS_ONLY}
    if cfg.arch == "qwen3_moe":
        d.pop("qkv_bias")
        d.pop("shared_expert_intermediate_size")
    else:
        d.pop("attention_bias")
    d["mlp_only_layers"] = list(cfg.mlp_only_layers)
    if cfg.head_dim is None:
        d.pop("head_dim")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    d.update(
        architectures=[_ARCH_NAMES[cfg.arch]],
        model_type=cfg.arch,
        hidden_act="silu",
        use_sliding_window=False,
        dtype=jnp.dtype(dtype).name,
    )
    return dict(sorted(d.items()))


# ---------------------------------------------------------------------------------------------
# reading


class _Checkpoint:
    """Lazy tensor access over one or several .safetensors files."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.path, self.weight_map, self._open = path, weight_map, {}

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
    **overrides,
) -> QwenMoe:
    """Load a local Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint directory onto `mesh`.

    `overrides` replace ModelConfig fields after reading config.json: the execution ones
    (`dispatcher`, `routing`, `capacity_factor`, `chunk_size`, `gmm_impl`) and the router
    options (`router_z_loss_coef`, `expert_bias`, ...). Parameters are stored in `dtype`.
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
        stacked = _variable(model, entries[0])[1] is not None
        var.set_value(
            _place(
                entries, stacked, var.get_value(), sharding, ckpt, dtype, cfg.moe_intermediate_size
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
                f"{entry.name}.{e}.{entry.which}_proj.weight" for e in range(cfg.num_experts)
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
    cfg = model.config
    entries = mapping(cfg)
    for n, entry in enumerate(entries):
        a = _value(model, entry)
        if entry.kind == "same":
            yield entry.name, a
        elif entry.kind == "reshape":
            yield entry.name, a.reshape(-1)
        elif entry.kind == "T":
            yield (
                entry.name,
                np.ascontiguousarray(a.reshape(math.prod(a.shape[: entry.n_in]), -1).T),
            )
        elif expert_layout == "per_expert":
            for e in range(a.shape[0]):
                yield f"{entry.name}.{e}.{entry.which}_proj.weight", np.ascontiguousarray(a[e].T)
        elif entry.which == "down":
            yield f"{entry.name}.down_proj", np.ascontiguousarray(np.swapaxes(a, 1, 2))
        elif entry.which == "up":  # gate was stacked just before: read it again
            gate = _value(model, entries[n - 1])
            yield (
                f"{entry.name}.gate_up_proj",
                np.ascontiguousarray(np.swapaxes(np.concatenate([gate, a], axis=2), 1, 2)),
            )


def _size_bytes(s) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", str(s), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={s!r}: expected bytes or e.g. '200KB', '5GB', '2GiB'")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** "KMG".index(unit[0]) * base)


def save_pretrained(
    model: QwenMoe, path: str, *, max_shard_size=None, expert_layout: str = "per_expert"
) -> None:
    """Write `config.json` and the weights with Hugging Face names into directory `path`.

    One `model.safetensors` (the whole model passes through host memory), or, with
    `max_shard_size` (bytes or a string like "200KB", "5GB", "2GiB"), files
    `model-0000i-of-0000n.safetensors` of at most that size (a larger tensor gets a file of its
    own) and `model.safetensors.index.json`: host memory then holds one file's tensors plus one
    stacked tensor. Tensors are gathered from the devices one at a time.
    """
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.config, model.dtype), f, indent=2)
        f.write("\n")
    limit = None if max_shard_size is None else _size_bytes(max_shard_size)
    files, current, size = [], {}, 0

    def flush():
        nonlocal current, size
        save_file(current, os.path.join(path, f"shard-{len(files)}.tmp"), metadata={"format": "pt"})
        files.append({k: v.nbytes for k, v in current.items()})
        current, size = {}, 0

    for name, a in hf_tensors(model, expert_layout):
        if limit is not None and current and size + a.nbytes > limit:
            flush()
        current[name] = a
        size += a.nbytes
    if current or not files:
        flush()
    if len(files) == 1:
        os.replace(os.path.join(path, "shard-0.tmp"), os.path.join(path, "model.safetensors"))
        return
    weight_map, total = {}, 0
    for i, names in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(path, f"shard-{i}.tmp"), os.path.join(path, fname))
        for name, nbytes in names.items():
            weight_map[name] = fname
            total += nbytes
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
