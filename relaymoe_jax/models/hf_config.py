"""Hugging Face `config.json` <-> `ModelConfig` (Qwen3MoeForCausalLM / Qwen2MoeForCausalLM).

The field names are Hugging Face's where one exists, so most keys map one to one.
`config_from_hf` refuses what the model does not implement (RoPE scaling, sliding-window
attention, another activation) and `from_hf_dict` maps the keys; `config_to_hf` writes the
dict back without our own keys (`OURS_ONLY`: the op's options, recomputation, layer scan, the
router options HF has no key for). A key config.json leaves out takes transformers' default for
its architecture (`HF_DEFAULTS`: `Qwen3MoeConfig()`'s / `Qwen2MoeConfig()`'s, e.g. top-k 8 and
`norm_topk_prob=False` for Qwen3-MoE), not `ModelConfig`'s, so the model is the one transformers
builds from the same file. Both refuse a config that uses what Qwen3-MoE and Qwen2-MoE
do not have (`NOT_IN_HF`: another router or activation, router or expert biases, an ungated
shared expert; on export also the aux-loss-free `expert_bias`, which would route differently
there), naming the key (`check_hf`). The weights' names are `hf_mapping.py`.
"""

import jax.numpy as jnp

from relaymoe_jax.models.config import ARCHS, KEYS, ModelConfig
from relaymoe_jax.models.moe_config import MoEConfig
from relaymoe_jax.op.options import FIELDS as OPTION_KEYS

HF_ARCHS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
assert tuple(HF_ARCHS) == ARCHS
# the MoE block's keys the Qwen architectures do not have: refused away from their defaults
NOT_IN_HF = (
    "router",
    "router_bias",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "activation",
    "swiglu_limit",
    "expert_biases",
    "shared_expert_gated",
)
# transformers' defaults (5.24; 4.x's are the same) of the keys we read, for a config.json that
# leaves one out: `Qwen3MoeConfig()` / `Qwen2MoeConfig()` (`num_experts`: Qwen3-MoE's
# `num_local_experts`; `rope_theta`: `rope_parameters["rope_theta"]`). `head_dim` is not here:
# absent, both compute hidden_size // num_attention_heads, as `ModelConfig` does.
# tests/test_hf_import.py checks them against transformers' own (recorded in
# tests/fixtures/hf/transformers_defaults.json).
_COMMON_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "router_aux_loss_coef": 0.001,
    "norm_topk_prob": False,
}
HF_DEFAULTS = {
    "qwen3_moe": {
        **_COMMON_DEFAULTS,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "attention_bias": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    "qwen2_moe": {
        **_COMMON_DEFAULTS,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "qkv_bias": True,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
}
assert tuple(HF_DEFAULTS) == ARCHS
# our keys with no Hugging Face counterpart: not written to config.json
OURS_ONLY = (
    "arch",
    "router_z_loss_coef",
    "expert_bias",
    "expert_bias_rate",
    *OPTION_KEYS,
    "attention_remat",
    "attention_impl",
    "attention_block_k",
    "context_layout",
    "moe_remat",
    "offload_layer_inputs",
    "scan_layers",
    *NOT_IN_HF,
)


def check_hf(cfg: ModelConfig, *, export: bool) -> None:
    """Refuse, naming the key, a config that uses what the Hugging Face Qwen3-MoE / Qwen2-MoE
    architectures do not have (`NOT_IN_HF` away from its default; on `export` also
    `expert_bias`: the bias would be lost and the routing differ)."""
    default = MoEConfig()
    for key in (*NOT_IN_HF, "expert_bias") if export else NOT_IN_HF:
        value = getattr(cfg.moe, key)
        if value != getattr(default, key):
            raise ValueError(
                f"{key}={value!r}: the Hugging Face {HF_ARCHS[cfg.arch]} has no such option "
                f"(expected {getattr(default, key)!r})"
            )


def from_hf_dict(hf: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a Hugging Face `config.json` (Qwen3-MoE or Qwen2-MoE): its keys that
    are ours (Qwen3-MoE's `num_local_experts` as `num_experts`, `rope_parameters["rope_theta"]`
    as `rope_theta`), transformers' defaults for those it leaves out (`HF_DEFAULTS`), then
    `overrides` (flat keys, e.g. `dispatcher="alltoall"`)."""
    archs = hf.get("architectures") or []
    ours = {name: arch for arch, name in HF_ARCHS.items()}
    arch = next((ours[a] for a in archs if a in ours), None)
    arch = arch or (hf.get("model_type") if hf.get("model_type") in ARCHS else None)
    if arch is None:
        raise ValueError(
            f"config.json: architectures={archs!r}, model_type="
            f"{hf.get('model_type')!r}: expected Qwen3MoeForCausalLM or "
            "Qwen2MoeForCausalLM"
        )
    hf = dict(hf)
    if "num_experts" not in hf and "num_local_experts" in hf:
        hf["num_experts"] = hf["num_local_experts"]
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        hf["rope_theta"] = rope["rope_theta"]
    d = {k: v for k, v in hf.items() if k in KEYS and k not in NOT_IN_HF}
    d = {**HF_DEFAULTS[arch], **d, "arch": arch}
    d["mlp_only_layers"] = tuple(d["mlp_only_layers"] or ())
    if d.get("head_dim") is None:
        d.pop("head_dim", None)
    d["rope_theta"] = float(d["rope_theta"])
    d.update(overrides)
    cfg = ModelConfig.from_dict(d)
    check_hf(cfg, export=False)
    return cfg


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a Hugging Face config dict, refusing what the model does not implement."""
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError(
            f"config.json: rope_parameters={rope!r}, rope_scaling="
            f"{hf.get('rope_scaling')!r}: only the default RoPE is implemented"
        )
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError("config.json: sliding-window attention is not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}: expected 'silu'")
    return from_hf_dict(hf, **overrides)


def config_to_hf(cfg: ModelConfig, dtype) -> dict:
    """The Hugging Face config.json dict of `cfg`, read alike by transformers 5.x (which writes
    `dtype` and `rope_parameters`) and 4.x (`torch_dtype`, a top-level `rope_theta`): both kept.
    `num_experts` is 4.x's key and, for Qwen3-MoE, 5.x's alias of `num_local_experts`."""
    check_hf(cfg, export=True)
    d = {k: v for k, v in cfg.as_dict().items() if k not in OURS_ONLY}
    if cfg.arch == "qwen3_moe":
        d.pop("qkv_bias")
        d.pop("shared_expert_intermediate_size")
    else:
        d.pop("attention_bias")
    d["mlp_only_layers"] = list(cfg.mlp_only_layers)
    if cfg.head_dim is None:
        d.pop("head_dim")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d["rope_theta"]}
    d.update(
        architectures=[HF_ARCHS[cfg.arch]],
        model_type=cfg.arch,
        hidden_act="silu",
        use_sliding_window=False,
        dtype=jnp.dtype(dtype).name,
        torch_dtype=jnp.dtype(dtype).name,
    )
    return dict(sorted(d.items()))
