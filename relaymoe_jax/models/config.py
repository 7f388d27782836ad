"""The model configuration: one frozen dataclass with named sizes, checked on construction.

Field names follow Hugging Face's `Qwen3MoeConfig` / `Qwen2MoeConfig` where one exists, so a
`config.json` maps onto it directly (`from_hf_dict`). `from_dict` is the strict loader behind the
YAML files in `configs/`: an unknown key, a wrong type or inconsistent sizes raise a ValueError
naming the key.
"""

import dataclasses
import types
import typing

from relaymoe_jax.topology import RINGS  # moe_ffn's ring=: "auto", "flat", "hierarchical"

ARCHS = ("qwen3_moe", "qwen2_moe")
DISPATCHERS = ("ring", "alltoall", "reference")
ROUTINGS = ("expert", "token", "auto")
ATTENTION_IMPLS = ("xla", "chunked")
REMAT_OPTIONS = ("full", "save_qkv", "save_attn_out", "save_all")  # relaymoe_jax.remat.options


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
    # execution
    dispatcher: str = "ring"
    routing: str = "auto"
    ring: str = "auto"  # ring only (moe_ffn's ring=): "flat", "hierarchical"
    # (experts over (node, expert) axes) or "auto"
    capacity_factor: float | None = None
    chunk_size: int | None = None
    gmm_impl: str = "auto"
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


def _fail(key, value, want):
    raise ValueError(f"{key}={value!r}: expected {want}")


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, tuple) and all(_type_ok(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def check(cfg: ModelConfig) -> None:
    """Types, ranges and consistency of the sizes; a ValueError names the offending key."""
    hints = typing.get_type_hints(ModelConfig)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _type_ok(value, hints[f.name]):
            _fail(f.name, value, f"a value of type {hints[f.name]}")
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "max_position_embeddings",
    ):
        if getattr(cfg, name) < 1:
            _fail(name, getattr(cfg, name), "an int >= 1")
    if cfg.arch not in ARCHS:
        _fail("arch", cfg.arch, f"one of {ARCHS}")
    if cfg.dispatcher not in DISPATCHERS:
        _fail("dispatcher", cfg.dispatcher, f"one of {DISPATCHERS}")
    if cfg.routing not in ROUTINGS:
        _fail("routing", cfg.routing, f"one of {ROUTINGS}")
    if cfg.ring not in RINGS:
        _fail("ring", cfg.ring, f"one of {RINGS}")
    for name in ("num_experts", "shared_expert_intermediate_size"):
        if getattr(cfg, name) < 0:
            _fail(name, getattr(cfg, name), "an int >= 0")
    if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        _fail(
            "num_experts_per_tok",
            cfg.num_experts_per_tok,
            f"an int in [1, num_experts={cfg.num_experts}]",
        )
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_attention_heads:
        _fail(
            "num_attention_heads",
            cfg.num_attention_heads,
            f"a divisor of hidden_size={cfg.hidden_size} (or set head_dim)",
        )
    if cfg.head_dim is not None and (cfg.head_dim < 2 or cfg.head_dim % 2):
        _fail("head_dim", cfg.head_dim, "an even int >= 2 (RoPE rotates pairs)")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        _fail(
            "num_key_value_heads",
            cfg.num_key_value_heads,
            f"a divisor of num_attention_heads={cfg.num_attention_heads}",
        )
    if cfg.shared_expert_intermediate_size and cfg.arch != "qwen2_moe":
        _fail(
            "shared_expert_intermediate_size",
            cfg.shared_expert_intermediate_size,
            "0 unless arch='qwen2_moe'",
        )
    bad = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        _fail(
            "mlp_only_layers",
            cfg.mlp_only_layers,
            f"layer indices in [0, num_hidden_layers={cfg.num_hidden_layers})",
        )
    for name in (
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "expert_bias_rate",
        "initializer_range",
    ):
        if getattr(cfg, name) < 0:
            _fail(name, getattr(cfg, name), "a number >= 0")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        _fail("capacity_factor", cfg.capacity_factor, "a number > 0 or null")
    if cfg.attention_impl not in ATTENTION_IMPLS:
        _fail("attention_impl", cfg.attention_impl, f"one of {ATTENTION_IMPLS}")
    if cfg.attention_block_k < 1:
        _fail("attention_block_k", cfg.attention_block_k, "an int >= 1")
    if not isinstance(cfg.moe_remat, bool):
        _fail("moe_remat", cfg.moe_remat, "true or false")
    remat = cfg.attention_remat
    names = (remat,) if isinstance(remat, str) else remat
    if any(o not in REMAT_OPTIONS for o in names):
        _fail("attention_remat", remat, f"one of {REMAT_OPTIONS} or a tuple of them")
    if not isinstance(remat, str) and len(remat) != cfg.num_hidden_layers:
        _fail(
            "attention_remat",
            remat,
            f"one option or {cfg.num_hidden_layers} (num_hidden_layers), got {len(remat)}",
        )
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


def from_dict(d: dict) -> ModelConfig:
    """Strict: every key must be a field; lists become tuples; types are checked."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(names)}")
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return ModelConfig(**d)


_HF_ARCHS = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}


def from_hf_dict(hf: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a Hugging Face `config.json` (Qwen3-MoE or Qwen2-MoE)."""
    archs = hf.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    arch = arch or {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe"}.get(hf.get("model_type"))
    if arch is None:
        raise ValueError(
            f"config.json: architectures={archs!r}, model_type="
            f"{hf.get('model_type')!r}: expected Qwen3MoeForCausalLM or "
            "Qwen2MoeForCausalLM"
        )
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    d = {k: v for k, v in hf.items() if k in names}
    d["arch"] = arch
    d["mlp_only_layers"] = tuple(hf.get("mlp_only_layers") or ())
    if d.get("head_dim") is None:
        d.pop("head_dim", None)
    d["rope_theta"] = float(d.get("rope_theta", ModelConfig.rope_theta))
    d.update(overrides)
    return ModelConfig(**d)
