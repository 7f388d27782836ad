"""The model configuration: one frozen dataclass with named sizes, checked on construction.

Field names follow Hugging Face's `Qwen3MoeConfig` / `Qwen2MoeConfig` where one exists, so a
`config.json` maps onto it directly (`hf_config.from_hf_dict`). The MoE block is one `MoEConfig`,
`moe` (its sizes, router, experts, shared expert and how `moe_ffn` runs, the `MoEOptions`
`moe.options`), checked by `MoEConfig` itself; a dense model has `num_experts=0`. What is the
model's (the hidden size, the initializer's std, the router losses' coefficients) is here.

The flat form: in YAML, on the command line, in a checkpoint's run identity and wherever a config
is written or compared, the records' fields are keys next to the others (`KEYS`, in field order:
`moe` spelled out as `MoEConfig`'s fields, its `options` as `MoEOptions`' dispatcher, routing,
ring, capacity_factor, chunk_size, gmm_impl, expert_fp8). `ModelConfig.from_dict` is the strict
loader of that form behind the YAML files in `configs/`, `as_dict` writes it, and
`cfg.replace(dispatcher="alltoall", num_experts=16)` changes fields by flat key. An unknown key,
a wrong type or inconsistent sizes raise a ValueError that names the key and what it accepts
(`key=value: expected ...`).
"""

import dataclasses
import typing
from collections.abc import Mapping
from typing import Literal

from relaymoe_jax.dispatch.experts import check_experts_divide
from relaymoe_jax.kernels.attention.common import HEAD_DIMS
from relaymoe_jax.models.context import LAYOUTS as CONTEXT_LAYOUTS
from relaymoe_jax.models.context import ContextLayout
from relaymoe_jax.models.layers import ATTENTION_IMPLS, AttentionImpl
from relaymoe_jax.models.moe_config import MOE_KEYS, MoEConfig
from relaymoe_jax.op.options import MoEOptions, unused_error
from relaymoe_jax.remat.options import OPTIONS as REMAT_OPTIONS
from relaymoe_jax.remat.options import RematOption
from relaymoe_jax.util.checks import fail, finite_number, int_at_least, is_bool, is_int, one_of

Arch = Literal["qwen3_moe", "qwen2_moe"]
ARCHS: tuple[str, ...] = typing.get_args(Arch)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # architecture
    arch: Arch = "qwen3_moe"  # "qwen3_moe": q/k RMSNorm, no qkv bias; "qwen2_moe": qkv
    # bias, no q/k norm, optional shared expert
    vocab_size: int = 256
    hidden_size: int = 64  # H
    num_hidden_layers: int = 2  # L
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    intermediate_size: int = 128  # ffn of the dense MLP layers
    attention_bias: bool = False  # qwen3_moe: bias on q/k/v/o (qwen2_moe: q/k/v always)
    qkv_bias: bool = True  # qwen2_moe: bias on q/k/v (HF Qwen2MoeConfig.qkv_bias)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02  # std of the normal random init (HF's)
    # the router losses' weights in the model's objective (models/router_losses.py)
    router_aux_loss_coef: float = 0.001  # Switch/Qwen load-balancing loss coefficient
    router_z_loss_coef: float = 0.0  # router z-loss coefficient
    # the MoE block (sizes, router, experts, shared expert, `moe_ffn`'s options); the flat
    # form spells its fields as keys (num_experts, router, dispatcher, ...); num_experts=0: dense
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    attention_impl: AttentionImpl = "xla"  # "xla" (jax.nn.dot_product_attention: [S, S]
    # scores on the XLA path), "chunked" (blocks; only the visible pairs), "pallas" (the same
    # in our Mosaic GPU kernel; "pallas-interpret": its interpreter on CPU) or "auto" ("pallas"
    # on GPUs where the kernel takes head_dim and the dtype, else "chunked"; layers.py)
    attention_block_k: int = 512  # queries and keys per block of "chunked" (and "auto" off GPUs)
    # the order of the sequence over a `context` axis (models/context.py): "zigzag" (device c
    # holds pieces c and 2C - 1 - c of 2C: equal causal work) or "contiguous" (piece c); the
    # blockwise attention only: with "xla", which masks by place, the order is contiguous
    context_layout: ContextLayout = "zigzag"
    # attention recomputation (relaymoe_jax.remat.options): one option for every layer, or one
    # per layer; "save_all" = no jax.checkpoint
    attention_remat: RematOption | tuple[RematOption, ...] = "save_all"
    # recompute the whole MLP/MoE block (its norm, router and dispatcher) in the backward,
    # keeping only its input: Megatron's full recomputation of the MoE activations. It drops the
    # all-to-all's dispatch buffers kept for the backward; the ring's custom_vjp keeps only its
    # inputs already, so for the ring it mostly costs a second forward ring.
    moe_remat: bool = False
    # put each decoder layer's input (the one residual a fully recomputed layer keeps for its
    # backward) in pinned host memory in the forward and bring it back for that layer's
    # backward: needs moe_remat=true and attention_remat="full" (the layer is then one
    # checkpoint whose only residual is its input). Same math: the values are moved, not changed.
    offload_layer_inputs: bool = False
    # store the decoder layers' parameters stacked on a leading "layers" axis and run them with
    # one `jax.lax.scan`: the compiled program holds one layer body whatever the depth (compile
    # time no longer grows with num_hidden_layers). The layers must be alike: all MoE or all
    # dense, one attention_remat option (see `qwen.py`, "Scanned layers").
    scan_layers: bool = False

    def __post_init__(self):
        check(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        """A config from the flat form (`KEYS`; an omitted key takes its default). Strict: an
        unknown key is an error; lists become tuples and ints given for float keys floats."""
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(KEYS)}")
        d = {k: _normalise(k, v) for k, v in d.items()}
        moe = MoEConfig.from_dict({k: v for k, v in d.items() if k in MOE_KEYS})
        return cls(**{k: v for k, v in d.items() if k not in MOE_KEYS}, moe=moe)

    def as_dict(self) -> dict:
        """The flat form: every key of `KEYS`, in order, with its value."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.update(value.as_dict() if f.name == "moe" else {f.name: value})
        return out

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes` (flat keys, or `moe=` a whole record), normalised like
        `from_dict`'s and checked."""
        changes = {k: _normalise(k, v) for k, v in changes.items()}
        block = {k: changes.pop(k) for k in list(changes) if k in MOE_KEYS}
        if block:
            changes["moe"] = changes.get("moe", self.moe).replace(**block)
        return dataclasses.replace(self, **changes)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def remat_option(self, i: int) -> str:
        """The attention recomputation option of layer i."""
        r = self.attention_remat
        return r if isinstance(r, str) else r[i]

    def is_moe_layer(self, i: int) -> bool:
        """Hugging Face's rule for which decoder layers hold the MoE block."""
        return (
            not self.moe.is_dense
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )


# The flat keys: ModelConfig's fields with `moe` spelled out as its own flat keys.
KEYS: tuple[str, ...] = tuple(
    k for f in dataclasses.fields(ModelConfig) for k in (MOE_KEYS if f.name == "moe" else (f.name,))
)


def _float_keys(*classes) -> frozenset:
    hints = {k: h for cls in classes for k, h in typing.get_type_hints(cls).items()}
    return frozenset(k for k, h in hints.items() if h is float or float in typing.get_args(h))


# an int given here is a float
FLOAT_KEYS = _float_keys(ModelConfig, MoEConfig, MoEOptions) & set(KEYS)


def _normalise(key, value):
    if isinstance(value, list):
        return tuple(value)
    if key in FLOAT_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# ---------------------------------------------------------------------------------------------
# checks


def _head_dim(name, v):
    if not (v is None or (is_int(v) and v >= 2 and v % 2 == 0)):
        want = (
            "an even int >= 2 (RoPE rotates pairs), or null for hidden_size // num_attention_heads"
        )
        fail(name, v, want)


def _layer_indices(name, v):
    if not (isinstance(v, tuple) and all(map(is_int, v))):
        fail(name, v, "a list of layer indices (a tuple in Python)")


def _remat(name, v):
    names = (v,) if isinstance(v, str) else v
    if not (
        isinstance(names, tuple) and all(isinstance(o, str) and o in REMAT_OPTIONS for o in names)
    ):
        fail(name, v, f"one of {REMAT_OPTIONS}, or a list (tuple) of them, one per layer")


def _moe(name, v):
    if not isinstance(v, MoEConfig):
        fail(name, v, f"a MoEConfig (in the flat form the keys {MOE_KEYS})")


_size = lambda name, v: int_at_least(name, v, 1)
_rate = lambda name, v: finite_number(name, v, low=0)

# One check per field (it raises `name=value: expected ...`). The rules that tie fields together
# (heads that divide, ...) are `_CONSISTENCY` below; the MoE block's are `MoEConfig`'s.
FIELD_CHECKS = {
    "arch": lambda name, v: one_of(name, v, ARCHS),
    "vocab_size": _size,
    "hidden_size": _size,
    "num_hidden_layers": _size,
    "num_attention_heads": _size,
    "num_key_value_heads": _size,
    "head_dim": _head_dim,
    "intermediate_size": _size,
    "attention_bias": is_bool,
    "qkv_bias": is_bool,
    "decoder_sparse_step": _size,
    "mlp_only_layers": _layer_indices,
    "rope_theta": lambda name, v: finite_number(name, v, low=0, strict=True),
    "rms_norm_eps": _rate,
    "tie_word_embeddings": is_bool,
    "max_position_embeddings": _size,
    "initializer_range": _rate,
    "router_aux_loss_coef": _rate,
    "router_z_loss_coef": _rate,
    "moe": _moe,
    "attention_impl": lambda name, v: one_of(name, v, ATTENTION_IMPLS),
    "attention_block_k": _size,
    "context_layout": lambda name, v: one_of(name, v, CONTEXT_LAYOUTS),
    "attention_remat": _remat,
    "moe_remat": is_bool,
    "offload_layer_inputs": is_bool,
    "scan_layers": is_bool,
}
assert list(FIELD_CHECKS) == [f.name for f in dataclasses.fields(ModelConfig)]


def _heads(cfg):
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_attention_heads:
        want = f"a divisor of hidden_size={cfg.hidden_size} (or set head_dim)"
        fail("num_attention_heads", cfg.num_attention_heads, want)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        want = f"a divisor of num_attention_heads={cfg.num_attention_heads}"
        fail("num_key_value_heads", cfg.num_key_value_heads, want)


def _shared_expert(cfg):
    size = cfg.moe.shared_expert_intermediate_size
    if size and cfg.arch != "qwen2_moe":
        fail("shared_expert_intermediate_size", size, "0 unless arch='qwen2_moe'")


def _layer_lists(cfg):
    n = cfg.num_hidden_layers
    if any(not 0 <= i < n for i in cfg.mlp_only_layers):
        fail("mlp_only_layers", cfg.mlp_only_layers, f"layer indices in [0, num_hidden_layers={n})")
    remat = cfg.attention_remat
    if not isinstance(remat, str) and len(remat) != n:
        want = f"one option or {n} (num_hidden_layers), got {len(remat)}"
        fail("attention_remat", remat, want)


# field -> (the setting that decides whether it is used, the values of it that use it): the
# model's own table of "used or refused" (the MoE block's is `moe_config.USED_WHEN`); a field away
# from its default that the setting ignores is refused.
USED_WHEN = {
    "attention_bias": ("arch", ("qwen3_moe",)),  # qwen2_moe: q/k/v biases are qkv_bias
    "qkv_bias": ("arch", ("qwen2_moe",)),
    # xla: one [S, S] block; pallas: the kernel's own blocks
    "attention_block_k": ("attention_impl", ("chunked", "auto")),
}


def _unused(cfg):
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name, (setting, users) in USED_WHEN.items():
        value, chosen = getattr(cfg, name), getattr(cfg, setting)
        if value != defaults[name] and chosen not in users:
            raise unused_error(name, value, setting, users, chosen, defaults[name])


def _offload(cfg):
    """offload_layer_inputs moves the one residual of a layer under one checkpoint (attention
    `full` and the MLP/MoE block, dense or not, recomputed: `moe_remat`); any other layer keeps
    more than its input, so the flag would move only part of what it keeps."""
    if not cfg.offload_layer_inputs:
        return
    remat = cfg.attention_remat
    partial = [i for i in range(cfg.num_hidden_layers) if cfg.remat_option(i) != "full"]
    if not cfg.moe_remat or partial:
        got = [] if cfg.moe_remat else ["moe_remat=False"]
        got += [f"attention_remat={remat!r} (not full in layers {partial})"] if partial else []
        fail(
            "offload_layer_inputs",
            cfg.offload_layer_inputs,
            "moe_remat=true and attention_remat='full' for every layer (each layer one "
            "checkpoint whose only residual, its input, goes to host memory); got "
            + " and ".join(got),
        )


def _attention_kernel(cfg):
    """The Pallas attention kernel takes head_dim 64 or 128 (`kernels.attention`)."""
    if cfg.attention_impl in ("pallas", "pallas-interpret") and cfg.head_size not in HEAD_DIMS:
        want = f"one of {HEAD_DIMS} with attention_impl={cfg.attention_impl!r} (or 'chunked')"
        fail("head_dim", cfg.head_size, want)


_CONSISTENCY = (_heads, _shared_expert, _layer_lists, _unused, _offload, _attention_kernel)


def check(cfg: ModelConfig) -> None:
    """Every field on its own (`FIELD_CHECKS`), then how they fit together; a ValueError names
    the offending key and what it accepts."""
    for name, check_field in FIELD_CHECKS.items():
        check_field(name, getattr(cfg, name))
    for rule in _CONSISTENCY:
        rule(cfg)
    if cfg.scan_layers:
        check_scannable(cfg)


def check_scannable(cfg: ModelConfig) -> None:
    """`scan_layers=True` runs one layer body for every layer, so the layers must be alike."""
    if not isinstance(cfg.attention_remat, str) and len(set(cfg.attention_remat)) > 1:
        fail(
            "attention_remat",
            cfg.attention_remat,
            "one option for every layer with scan_layers=True (the scanned layers share one "
            "body; set scan_layers=false for a per-layer plan)",
        )
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if moe and dense:
        fail(
            "scan_layers",
            cfg.scan_layers,
            f"layers of one kind (the scanned layers share one body), but layers {dense} are "
            f"dense and {moe} MoE (decoder_sparse_step={cfg.decoder_sparse_step}, "
            f"mlp_only_layers={list(cfg.mlp_only_layers)}); set scan_layers=false",
        )


def check_mesh(cfg: ModelConfig, expert_size: int) -> None:
    """The experts must split evenly over the expert axis (of size `expert_size`)."""
    check_experts_divide(cfg.moe.num_experts, expert_size)
