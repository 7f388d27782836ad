"""The dense single-device definition of the MoE FFN: the ground truth for every test.

    y[t] = sum_j expert_weights[t, j] * expert_{expert_ids[t, j]}(x[t])
    expert_e(x) = act(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]

with `act` the experts' gated activation (`dispatch.activation`; SwiGLU by default: silu(g) * u)
and the biases optional (GPT-OSS has them).

Computed pair by pair: for each slot j, every token's own expert weights are gathered ([T, H, F]
per slot), so a token meets only the experts it is routed to. A NaN in one expert's weights (or
in one token) stays in the tokens routed to that expert (or in that token), values and gradients,
as in the ring and the all-to-all. Ids outside [0, E) gather zero weights and contribute nothing
(no gradient either), as in every dispatcher. For tests and small shapes only.
"""

import jax
import jax.numpy as jnp

from relaymoe_jax.dispatch.activation import SWIGLU


def reference_moe(
    x_th, ids_tk, wts_tk, w_gate_ehf, w_up_ehf, w_down_efh, activation=SWIGLU, biases=None
):
    """y [T, H] (x's dtype); `biases` None or (b_gate [E, F], b_up [E, F], b_down [E, H])."""
    num_experts = w_gate_ehf.shape[0]
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    x = x_th.astype(f32)
    valid_tk = (ids_tk >= 0) & (ids_tk < num_experts)
    rows_tk = jnp.where(valid_tk, ids_tk, num_experts)  # out of range: zero weights

    def expert(w, rows_t):
        return w.astype(f32).at[rows_t].get(mode="fill", fill_value=0)

    y_th = jnp.zeros(x.shape, f32)
    for j in range(ids_tk.shape[1]):
        rows_t = rows_tk[:, j]
        gate_tf = jnp.einsum("th,thf->tf", x, expert(w_gate_ehf, rows_t), precision=hi)
        up_tf = jnp.einsum("th,thf->tf", x, expert(w_up_ehf, rows_t), precision=hi)
        if biases is not None:
            gate_tf = gate_tf + expert(biases[0], rows_t)
            up_tf = up_tf + expert(biases[1], rows_t)
        out_th = jnp.einsum(
            "tf,tfh->th", activation(gate_tf, up_tf), expert(w_down_efh, rows_t), precision=hi
        )
        if biases is not None:
            out_th = out_th + expert(biases[2], rows_t)
        y_th = y_th + wts_tk[:, j, None].astype(f32) * out_th
    return y_th.astype(x_th.dtype)
