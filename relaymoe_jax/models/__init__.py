"""Qwen3-style MoE models (Flax NNX) on the RelayMoE op, and the Hugging Face bridge."""

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.hf import from_pretrained, save_pretrained
from relaymoe_jax.models.hf_config import config_from_hf, config_to_hf
from relaymoe_jax.models.moe_config import MoEConfig
from relaymoe_jax.models.moe_layer import MoELayer
from relaymoe_jax.models.qwen import QwenMoe
from relaymoe_jax.models.router_losses import (
    expert_bias_update,
    load_balancing_loss,
    load_balancing_loss_per_layer,
    route,
    z_loss,
)
from relaymoe_jax.models.sharding import AxisRules, rules_for

__all__ = [
    "AxisRules",
    "MoEConfig",
    "MoELayer",
    "ModelConfig",
    "QwenMoe",
    "config_from_hf",
    "config_to_hf",
    "expert_bias_update",
    "from_pretrained",
    "load_balancing_loss",
    "load_balancing_loss_per_layer",
    "route",
    "rules_for",
    "save_pretrained",
    "z_loss",
]
