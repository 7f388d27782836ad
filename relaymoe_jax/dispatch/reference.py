"""The dense single-device definition of the MoE FFN: the ground truth for every test.

    y[t] = sum_j expert_weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t])
    SwiGLU_e(x) = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]

Every token goes through every expert (an [T, E, F] intermediate), so this is for tests and small
shapes only. Ids outside [0, E) match no expert and contribute nothing, as in every dispatcher.
"""

import jax
import jax.numpy as jnp


def reference_moe(x_th, ids_tk, wts_tk, w_gate_ehf, w_up_ehf, w_down_efh):
    num_experts = w_gate_ehf.shape[0]
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    # combine[t, e] = total router weight token t gives expert e (one_hot of a bad id is all 0).
    combine_te = jnp.einsum(
        "tk,tke->te", wts_tk.astype(f32), jax.nn.one_hot(ids_tk, num_experts, dtype=f32),
        precision=hi)
    x = x_th.astype(f32)
    gate_tef = jnp.einsum("th,ehf->tef", x, w_gate_ehf.astype(f32), precision=hi)
    up_tef = jnp.einsum("th,ehf->tef", x, w_up_ehf.astype(f32), precision=hi)
    act_tef = jax.nn.silu(gate_tef) * up_tef
    y_th = jnp.einsum("tef,efh,te->th", act_tef, w_down_efh.astype(f32), combine_te, precision=hi)
    return y_th.astype(x_th.dtype)
