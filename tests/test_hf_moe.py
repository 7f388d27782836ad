"""`MoELayer` against transformers' own MoE blocks: GPT-OSS's `GptOssMLP` (top-k-softmax router
with its bias, clamped SwiGLU, expert biases) and DeepSeek-V3's `DeepseekV3MoE` (grouped sigmoid
router with the selection bias and routed scaling, routed and ungated shared experts), from the
fixtures in tests/fixtures/hf_moe/ (made once with torch; README there). The output, the chosen
experts and every parameter's and the input's gradient, for the ring in both routing modes and the
all-to-all."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_cases import mesh
from relaymoe_jax.models import MoEConfig, MoELayer
from relaymoe_jax.op.options import MoEOptions

FIXTURES = Path(__file__).parent / "fixtures" / "hf_moe"
DISPATCHERS = [
    dict(dispatcher="ring", routing="expert"),
    dict(dispatcher="ring", routing="token"),
    dict(dispatcher="alltoall"),
]


def _load(name):
    z = np.load(FIXTURES / f"{name}.npz", allow_pickle=False)
    return {k: z[k] for k in z.files}, json.loads(str(z["config_json"]))


def gpt_oss(hf, options):
    """(MoEConfig, {our parameter: value}, {our parameter: HF gradient}) of the GPT-OSS block."""
    cfg = MoEConfig(
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        router="topk_softmax",
        router_bias=True,
        activation="gpt_oss",
        swiglu_limit=float(hf["swiglu_limit"]),
        expert_biases=True,
        options=options,
    )

    def ours(get):  # HF layouts -> ours (gate and up interleaved in GPT-OSS's gate_up_proj)
        gu, gub = get("experts.gate_up_proj"), get("experts.gate_up_proj_bias")
        return {
            "gate": get("router.weight").T,
            "gate_bias": get("router.bias"),
            "w_gate": gu[:, :, ::2],
            "w_up": gu[:, :, 1::2],
            "b_gate": gub[:, ::2],
            "b_up": gub[:, 1::2],
            "w_down": get("experts.down_proj"),
            "b_down": get("experts.down_proj_bias"),
        }

    return cfg, ours


def deepseek_v3(hf, options):
    f = hf["moe_intermediate_size"]
    cfg = MoEConfig(
        num_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=f,
        router="sigmoid_group",
        n_group=hf["n_group"],
        topk_group=hf["topk_group"],
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        norm_topk_prob=hf["norm_topk_prob"],
        expert_bias=True,
        shared_expert_intermediate_size=f * hf["n_shared_experts"],
        shared_expert_gated=False,
        options=options,
    )

    def ours(get):  # gate and up are concatenated halves of [E, 2F, H], stored [out, in]
        gu = get("experts.gate_up_proj")
        return {
            "gate": get("gate.weight").T,
            "w_gate": gu[:, :f, :].transpose(0, 2, 1),
            "w_up": gu[:, f:, :].transpose(0, 2, 1),
            "w_down": get("experts.down_proj").transpose(0, 2, 1),
            "shared_expert.gate_proj": get("shared_experts.gate_proj.weight").T,
            "shared_expert.up_proj": get("shared_experts.up_proj.weight").T,
            "shared_expert.down_proj": get("shared_experts.down_proj.weight").T,
        }

    return cfg, ours


FAMILIES = {"gpt_oss_mlp": gpt_oss, "deepseek_v3_moe": deepseek_v3}


def _variables(layer):
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(layer))}


@pytest.mark.parametrize("options", DISPATCHERS, ids=lambda o: "-".join(o.values()))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_moe_layer_matches_transformers(name, options):
    data, hf = _load(name)
    cfg, ours = FAMILIES[name](hf, MoEOptions(**options))
    m = mesh("dp2_ep4")
    layer = MoELayer(cfg, hidden_size=hf["hidden_size"], mesh=m, rngs=nnx.Rngs(0))
    variables = _variables(layer)
    values = ours(lambda k: data[k])
    if name == "deepseek_v3_moe":
        values["expert_bias"] = data["gate.e_score_correction_bias"]
    assert set(values) == set(variables), set(values) ^ set(variables)
    for k, v in values.items():
        old = variables[k].get_value()
        variables[k].set_value(jax.device_put(jnp.asarray(v, old.dtype), old.sharding))

    x = jax.device_put(jnp.asarray(data["hidden_states"]), NamedSharding(m, P("data")))
    r = jnp.asarray(data["r"])

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(y * r), (y, aux)

    (_, (y, aux)), (d_layer, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        layer, x
    )

    def close(got, want, what):
        want = np.asarray(want, np.float64)
        scale = np.max(np.abs(want))
        err = np.max(np.abs(np.asarray(got, np.float64) - want))
        assert err <= 2e-5 * scale, f"{name} {what}: max |ours - HF| = {err:.3g} of {scale:.3g}"

    close(y, data["output"], "output")
    close(dx, data["grad/hidden_states"], "gradient w.r.t. hidden_states")
    e = cfg.num_experts
    load = np.bincount(data["topk_idx"].ravel(), minlength=e)
    np.testing.assert_array_equal(np.asarray(aux.expert_load), load)
    grads = {k: v.get_value() for k, v in _variables(d_layer).items()}
    want = ours(lambda k: data[f"grad/{k}"] if f"grad/{k}" in data else None)
    for k, g in want.items():
        close(grads[k], g, f"gradient w.r.t. {k}")
    assert "expert_bias" not in grads  # a buffer in HF, selection only: no gradient
