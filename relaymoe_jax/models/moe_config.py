"""`MoEConfig`: the MoE block's sizes, its router, its experts, its shared expert, and how
`moe_ffn` runs. `ModelConfig.moe` holds one; `MoELayer` is built from one.

Every field is checked on construction by one validator (`FIELD_CHECKS`, the shared helpers of
`relaymoe_jax.util.checks`); an error names the field as the flat key it is in the YAML files and
on the command line (`router='topk': expected one of (...)`). A field that the chosen router or
activation does not use must stay at its default (a value that would be ignored is refused, naming
what uses it): `USED_WHEN` is the one table of which field each router, activation or setting
uses. The `options` record may hold several dispatchers' options (one config for several
dispatchers, as the trainer's --memory-table and the planner use it); what runs them applies
`MoEOptions`' own table (`MoELayer` refuses what its dispatcher ignores, the Qwen model runs
`options.applicable()`).

The sizes:
    num_experts            E; 0 in a dense model's config (no layer holds the block)
    num_experts_per_tok    k, in [1, E]
    moe_intermediate_size  F, one expert's ffn
The router (`routers.py` has the formulas):
    router                 "softmax_topk" (Qwen, default), "topk_softmax" (GPT-OSS, Mixtral),
                           "sigmoid_group" (DeepSeek-V3)
    norm_topk_prob         renormalise the k weights (softmax_topk, sigmoid_group; topk_softmax's
                           softmax over the k sums to 1 already)
    router_bias            a learned bias in the router's logits (GPT-OSS)
    expert_bias            the aux-loss-free selection bias (DeepSeek-V3), updated outside the
                           optimizer at `expert_bias_rate` (set only with expert_bias)
    n_group, topk_group    sigmoid_group: expert groups, and how many are kept per token
    routed_scaling_factor  sigmoid_group: the weights' scale
The experts (`relaymoe_jax.dispatch.activation`):
    activation             "swiglu" (default), "geglu", "geglu_exact", "gpt_oss"
    swiglu_limit           gpt_oss: the clamp L (GPT-OSS's config key; alpha is 1.702)
    expert_biases          b_gate, b_up [E, F] and b_down [E, H] parameters (GPT-OSS)
The shared expert:
    shared_expert_intermediate_size   its ffn (0: none)
    shared_expert_gated    Qwen2-MoE's sigmoid gate on it (default); False: added as it is
                           (DeepSeek-V3's shared experts, one MLP of n_shared * F)
How `moe_ffn` runs:
    options                one `MoEOptions` (flat keys dispatcher, routing, ring,
                           capacity_factor, chunk_size, gmm_impl, expert_fp8)

The hidden size and the initializer's std are the model's (`ModelConfig`), given to `MoELayer`
as arguments. The router losses' coefficients are the model's too: they weigh the layers' losses
in the model's objective (`ModelConfig.router_aux_loss_coef`, `router_z_loss_coef`).
"""

import dataclasses
from collections.abc import Mapping

from relaymoe_jax.dispatch.activation import (
    ACTIVATIONS,
    GPT_OSS_LIMIT,
    Activation,
    ActivationName,
)
from relaymoe_jax.models.routers import ROUTERS, RouterKind
from relaymoe_jax.op.options import FIELDS as OPTION_KEYS
from relaymoe_jax.op.options import MoEOptions, unused_error
from relaymoe_jax.util.checks import fail, finite_number, int_at_least, is_bool, is_int, one_of

# field -> (the setting that decides whether the field is used, the values of it that use it):
# the one table of "used or refused" of the block's fields (the op's options have theirs,
# `op.options.USED_BY`). A field away from its default while the setting has another value would
# be ignored, and is refused naming the setting. Fields not listed are used by every router and
# activation (router_bias, expert_bias, expert_biases).
USED_WHEN = {
    "norm_topk_prob": ("router", ("softmax_topk", "sigmoid_group")),  # topk_softmax: a softmax
    "n_group": ("router", ("sigmoid_group",)),
    "topk_group": ("router", ("sigmoid_group",)),
    "routed_scaling_factor": ("router", ("sigmoid_group",)),
    "swiglu_limit": ("activation", ("gpt_oss",)),
    "expert_bias_rate": ("expert_bias", (True,)),
    "shared_expert_gated": ("has_shared_expert", (True,)),
}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE block's sizes, router, experts and shared expert, and how `moe_ffn` runs
    (`options`, one `MoEOptions`; `MoEConfig.from_dict` takes its fields as flat keys, like the
    YAML files). See the module docstring for each field."""

    num_experts: int = 8  # E (0: a dense model's config)
    num_experts_per_tok: int = 2  # k
    moe_intermediate_size: int = 32  # F, one expert's ffn
    router: RouterKind = "softmax_topk"
    norm_topk_prob: bool = True  # renormalise the top-k weights
    router_bias: bool = False
    expert_bias: bool = False  # aux-loss-free bias (DeepSeek-V3), selection only
    expert_bias_rate: float = 0.001
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    activation: ActivationName = "swiglu"
    swiglu_limit: float = GPT_OSS_LIMIT
    expert_biases: bool = False
    shared_expert_intermediate_size: int = 0  # the shared expert's ffn (0: none)
    shared_expert_gated: bool = True
    options: MoEOptions = dataclasses.field(default_factory=MoEOptions)

    def __post_init__(self):
        for name, check in FIELD_CHECKS.items():
            check(name, getattr(self, name))
        _check_top_k(self)
        _check_unused(self)
        _check_groups(self)

    @property
    def has_shared_expert(self) -> bool:
        """A shared expert (shared_expert_intermediate_size > 0)."""
        return self.shared_expert_intermediate_size > 0

    @property
    def is_dense(self) -> bool:
        """No experts: the config of a model without the MoE block."""
        return self.num_experts == 0

    def expert_activation(self) -> Activation:
        """The experts' `Activation` (`swiglu_limit` is gpt_oss's clamp)."""
        if self.activation == "gpt_oss":
            return Activation("gpt_oss", limit=self.swiglu_limit)
        return Activation(self.activation)

    @classmethod
    def from_dict(cls, d: Mapping) -> "MoEConfig":
        """From flat keys (`MOE_KEYS`): the fields, with `MoEOptions`' fields (dispatcher,
        routing, ...) in place of `options`; an unknown key is an error."""
        unknown = sorted(set(d) - set(MOE_KEYS))
        if unknown:
            raise ValueError(f"unknown MoEConfig key(s) {unknown}; known keys: {list(MOE_KEYS)}")
        options = MoEOptions.from_mapping(d)
        return cls(**{k: v for k, v in d.items() if k not in OPTION_KEYS}, options=options)

    def as_dict(self) -> dict:
        """The flat form: every key of `MOE_KEYS`, in order, with its value."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.update(value.as_dict() if f.name == "options" else {f.name: value})
        return out

    def replace(self, **changes) -> "MoEConfig":
        """A copy with `changes` (flat keys, or `options=` a whole record), checked."""
        options = {k: changes.pop(k) for k in list(changes) if k in OPTION_KEYS}
        if options:
            changes["options"] = changes.get("options", self.options).replace(**options)
        return dataclasses.replace(self, **changes)


# The flat keys: MoEConfig's fields with `options` spelled out as MoEOptions' fields.
MOE_KEYS: tuple[str, ...] = tuple(
    k
    for f in dataclasses.fields(MoEConfig)
    for k in (OPTION_KEYS if f.name == "options" else (f.name,))
)


def _options(name, value):
    if not isinstance(value, MoEOptions):
        fail(name, value, f"a MoEOptions (in the flat form the keys {OPTION_KEYS})")


def _int(name, value):
    if not is_int(value):
        fail(name, value, "an int")


# One check per field; the rules that tie fields together are the `_check_*` functions below.
FIELD_CHECKS = {
    "num_experts": lambda n, v: int_at_least(n, v, 0),
    "num_experts_per_tok": _int,
    "moe_intermediate_size": lambda n, v: int_at_least(n, v, 1),
    "router": lambda n, v: one_of(n, v, ROUTERS),
    "norm_topk_prob": is_bool,
    "router_bias": is_bool,
    "expert_bias": is_bool,
    "expert_bias_rate": lambda n, v: finite_number(n, v, low=0),
    "n_group": lambda n, v: int_at_least(n, v, 1),
    "topk_group": lambda n, v: int_at_least(n, v, 1),
    "routed_scaling_factor": lambda n, v: finite_number(n, v, low=0, strict=True),
    "activation": lambda n, v: one_of(n, v, ACTIVATIONS),
    "swiglu_limit": lambda n, v: finite_number(n, v, low=0, strict=True),
    "expert_biases": is_bool,
    "shared_expert_intermediate_size": lambda n, v: int_at_least(n, v, 0),
    "shared_expert_gated": is_bool,
    "options": _options,
}
assert list(FIELD_CHECKS) == [f.name for f in dataclasses.fields(MoEConfig)]


def _check_top_k(cfg: MoEConfig) -> None:
    if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        want = f"an int in [1, num_experts={cfg.num_experts}]"
        fail("num_experts_per_tok", cfg.num_experts_per_tok, want)


def _check_unused(cfg: MoEConfig) -> None:
    """`USED_WHEN`: a field away from its default that the config's router, activation or
    other setting would ignore is refused, naming what uses it."""
    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    for name, (setting, users) in USED_WHEN.items():
        value, chosen = getattr(cfg, name), getattr(cfg, setting)
        if value != defaults[name] and chosen not in users:
            if setting == "has_shared_expert":
                raise ValueError(
                    f"{name}={value!r} applies to a shared expert only "
                    "(shared_expert_intermediate_size=0): it would be ignored"
                )
            raise unused_error(name, value, setting, users, chosen, defaults[name])


def _check_groups(cfg: MoEConfig) -> None:
    if cfg.router != "sigmoid_group" or cfg.is_dense:
        return
    e, g, tg, k = cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    if e % g or tg > g or k > tg * (e // g):
        raise ValueError(
            f"n_group={g}, topk_group={tg} with num_experts={e} and num_experts_per_tok={k}: "
            "expected n_group dividing num_experts, topk_group <= n_group, and "
            "num_experts_per_tok <= topk_group * num_experts / n_group (the experts the kept "
            "groups hold)"
        )
