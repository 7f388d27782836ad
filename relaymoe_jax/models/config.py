"""The model configuration: one frozen dataclass with named sizes, checked on construction.

Field names follow Hugging Face's `Qwen3MoeConfig` / `Qwen2MoeConfig` where one exists, so a
`config.json` maps onto it directly (`hf_config.from_hf_dict`). How the MoE runs (dispatcher,
routing, ring, capacity_factor, chunk_size, gmm_impl) is one `MoEOptions` record,
`moe_options`, checked by `MoEOptions` itself.

The flat form: in YAML, on the command line, in a checkpoint's run identity and wherever a config
is written or compared, the record's fields are keys next to the others (`KEYS`, in field order).
`ModelConfig.from_dict` is the strict loader of that form behind the YAML files in `configs/`,
`as_dict` writes it, and `cfg.replace(dispatcher="alltoall", num_experts=16)` changes fields by
flat key. An unknown key, a wrong type or inconsistent sizes raise a ValueError that names the
key and what it accepts (`key=value: expected ...`).
"""

import dataclasses
import typing
from collections.abc import Mapping

from relaymoe_jax.models.layers import ATTENTION_IMPLS
from relaymoe_jax.op.options import FIELDS as OPTION_KEYS
from relaymoe_jax.op.options import MoEOptions
from relaymoe_jax.remat.options import OPTIONS as REMAT_OPTIONS

ARCHS = ("qwen3_moe", "qwen2_moe")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # architecture
    arch: str = "qwen3_moe"  # "qwen3_moe": q/k RMSNorm, no qkv bias; "qwen2_moe": qkv
    # bias, no q/k norm, optional shared expert
    vocab_size: int = 256
    hidden_size: int = 64  # H
    num_hidden_layers: int = 2  # L
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    intermediate_size: int = 128  # ffn of the dense MLP layers
    moe_intermediate_size: int = 32  # F, ffn of one expert
    num_experts: int = 8  # E
    num_experts_per_tok: int = 2  # k (top-k)
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities
    attention_bias: bool = False  # qwen3_moe: bias on q/k/v/o (qwen2_moe: q/k/v always)
    qkv_bias: bool = True  # qwen2_moe: bias on q/k/v (HF Qwen2MoeConfig.qkv_bias)
    shared_expert_intermediate_size: int = 0  # qwen2_moe: ffn of the shared expert (0: none)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02  # std of the normal random init (HF's)
    # router losses (see models/router.py for the formulas)
    router_aux_loss_coef: float = 0.001  # Switch/Qwen load-balancing loss coefficient
    router_z_loss_coef: float = 0.0  # router z-loss coefficient
    expert_bias: bool = False  # aux-loss-free bias (DeepSeek-V3), selection only
    expert_bias_rate: float = 0.001  # its update rate
    # execution: how `moe_ffn` runs (flat keys dispatcher, routing, ring, capacity_factor,
    # chunk_size, gmm_impl in the flat form); the op uses `moe_options.applicable()`
    moe_options: MoEOptions = dataclasses.field(default_factory=MoEOptions)
    attention_impl: str = "xla"  # "xla" (jax.nn.dot_product_attention: [S, S] scores on
    # the XLA path) or "chunked" (O(S * block) memory)
    attention_block_k: int = 512  # keys per block of "chunked"
    # attention recomputation (relaymoe_jax.remat.options): one option for every layer, or one
    # per layer; "save_all" = no jax.checkpoint
    attention_remat: str | tuple[str, ...] = "save_all"
    # recompute the whole MLP/MoE block (its norm, router and dispatcher) in the backward,
    # keeping only its input: Megatron's full recomputation of the MoE activations. It drops the
    # all-to-all's dispatch buffers kept for the backward; the ring's custom_vjp keeps only its
    # inputs already, so for the ring it mostly costs a second forward ring.
    moe_remat: bool = False
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
        options = MoEOptions.from_mapping(d)
        rest = {k: v for k, v in d.items() if k not in OPTION_KEYS}
        return cls(**rest, moe_options=options)

    def as_dict(self) -> dict:
        """The flat form: every key of `KEYS`, in order, with its value."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.update(value.as_dict() if f.name == "moe_options" else {f.name: value})
        return out

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes` (flat keys, or `moe_options=` a whole record), normalised like
        `from_dict`'s and checked."""
        changes = {k: _normalise(k, v) for k, v in changes.items()}
        options = {k: changes.pop(k) for k in list(changes) if k in OPTION_KEYS}
        if options:
            changes["moe_options"] = changes.get("moe_options", self.moe_options).replace(**options)
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
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )


# The flat keys: ModelConfig's fields with `moe_options` spelled out as its own fields.
KEYS: tuple[str, ...] = tuple(
    k
    for f in dataclasses.fields(ModelConfig)
    for k in (OPTION_KEYS if f.name == "moe_options" else (f.name,))
)


def _float_keys(*classes) -> frozenset:
    hints = {k: h for cls in classes for k, h in typing.get_type_hints(cls).items()}
    return frozenset(k for k, h in hints.items() if h is float or float in typing.get_args(h))


FLOAT_KEYS = _float_keys(ModelConfig, MoEOptions) & set(KEYS)  # an int given here is a float


def _normalise(key, value):
    if isinstance(value, list):
        return tuple(value)
    if key in FLOAT_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# ---------------------------------------------------------------------------------------------
# checks


def _fail(key, value, want):
    raise ValueError(f"{key}={value!r}: expected {want}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_from(lo: int):
    return (lambda v: _is_int(v) and v >= lo), f"an int >= {lo}"


def _number_from(lo: float):
    return (lambda v: _is_number(v) and v >= lo), f"a number >= {lo:g}"


def _one_of(allowed: tuple[str, ...]):
    return (lambda v: isinstance(v, str) and v in allowed), f"one of {allowed}"


def _remat_ok(v) -> bool:
    names = (v,) if isinstance(v, str) else v
    return isinstance(names, tuple) and all(
        isinstance(o, str) and o in REMAT_OPTIONS for o in names
    )


_BOOL = (lambda v: isinstance(v, bool)), "true or false"
_NUMBER = _is_number, "a number"

# One check per field: (accepts(value) -> bool, what it accepts). The rules that tie fields
# together (top-k within the experts, heads that divide, ...) are `_CONSISTENCY` below.
FIELD_CHECKS = {
    "arch": _one_of(ARCHS),
    "vocab_size": _int_from(1),
    "hidden_size": _int_from(1),
    "num_hidden_layers": _int_from(1),
    "num_attention_heads": _int_from(1),
    "num_key_value_heads": _int_from(1),
    "head_dim": (
        lambda v: v is None or (_is_int(v) and v >= 2 and v % 2 == 0),
        "an even int >= 2 (RoPE rotates pairs), or null for hidden_size // num_attention_heads",
    ),
    "intermediate_size": _int_from(1),
    "moe_intermediate_size": _int_from(1),
    "num_experts": _int_from(0),
    "num_experts_per_tok": (_is_int, "an int"),
    "norm_topk_prob": _BOOL,
    "attention_bias": _BOOL,
    "qkv_bias": _BOOL,
    "shared_expert_intermediate_size": _int_from(0),
    "decoder_sparse_step": _int_from(1),
    "mlp_only_layers": (
        lambda v: isinstance(v, tuple) and all(map(_is_int, v)),
        "a list of layer indices (a tuple in Python)",
    ),
    "rope_theta": _NUMBER,
    "rms_norm_eps": _NUMBER,
    "tie_word_embeddings": _BOOL,
    "max_position_embeddings": _int_from(1),
    "initializer_range": _number_from(0),
    "router_aux_loss_coef": _number_from(0),
    "router_z_loss_coef": _number_from(0),
    "expert_bias": _BOOL,
    "expert_bias_rate": _number_from(0),
    "moe_options": (
        lambda v: isinstance(v, MoEOptions),
        f"a MoEOptions (in the flat form the keys {OPTION_KEYS})",
    ),
    "attention_impl": _one_of(ATTENTION_IMPLS),
    "attention_block_k": _int_from(1),
    "attention_remat": (
        _remat_ok,
        f"one of {REMAT_OPTIONS}, or a list (tuple) of them, one per layer",
    ),
    "moe_remat": _BOOL,
    "scan_layers": _BOOL,
}
assert list(FIELD_CHECKS) == [f.name for f in dataclasses.fields(ModelConfig)]


def _top_k(cfg):
    if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        want = f"an int in [1, num_experts={cfg.num_experts}]"
        _fail("num_experts_per_tok", cfg.num_experts_per_tok, want)


def _heads(cfg):
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_attention_heads:
        want = f"a divisor of hidden_size={cfg.hidden_size} (or set head_dim)"
        _fail("num_attention_heads", cfg.num_attention_heads, want)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        want = f"a divisor of num_attention_heads={cfg.num_attention_heads}"
        _fail("num_key_value_heads", cfg.num_key_value_heads, want)


def _shared_expert(cfg):
    if cfg.shared_expert_intermediate_size and cfg.arch != "qwen2_moe":
        want = "0 unless arch='qwen2_moe'"
        _fail("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, want)


def _layer_lists(cfg):
    n = cfg.num_hidden_layers
    if any(not 0 <= i < n for i in cfg.mlp_only_layers):
        _fail(
            "mlp_only_layers", cfg.mlp_only_layers, f"layer indices in [0, num_hidden_layers={n})"
        )
    remat = cfg.attention_remat
    if not isinstance(remat, str) and len(remat) != n:
        want = f"one option or {n} (num_hidden_layers), got {len(remat)}"
        _fail("attention_remat", remat, want)


_CONSISTENCY = (_top_k, _heads, _shared_expert, _layer_lists)


def check(cfg: ModelConfig) -> None:
    """Every field on its own (`FIELD_CHECKS`), then how they fit together; a ValueError names
    the offending key and what it accepts."""
    for name, (accepts, want) in FIELD_CHECKS.items():
        value = getattr(cfg, name)
        if not accepts(value):
            _fail(name, value, want)
    for rule in _CONSISTENCY:
        rule(cfg)
    if cfg.scan_layers:
        check_scannable(cfg)


def check_scannable(cfg: ModelConfig) -> None:
    """`scan_layers=True` runs one layer body for every layer, so the layers must be alike."""
    if not isinstance(cfg.attention_remat, str) and len(set(cfg.attention_remat)) > 1:
        _fail(
            "attention_remat",
            cfg.attention_remat,
            "one option for every layer with scan_layers=True (the scanned layers share one "
            "body; set scan_layers=false for a per-layer plan)",
        )
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if moe and dense:
        _fail(
            "scan_layers",
            cfg.scan_layers,
            f"layers of one kind (the scanned layers share one body), but layers {dense} are "
            f"dense and {moe} MoE (decoder_sparse_step={cfg.decoder_sparse_step}, "
            f"mlp_only_layers={list(cfg.mlp_only_layers)}); set scan_layers=false",
        )


def check_mesh(cfg: ModelConfig, expert_size: int) -> None:
    """The experts must split evenly over the expert axis (of size `expert_size`)."""
    if cfg.num_experts % expert_size:
        _fail("num_experts", cfg.num_experts, f"a multiple of the expert axis size {expert_size}")
