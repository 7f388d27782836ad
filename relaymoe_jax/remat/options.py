"""The recomputation options of one attention block, as `jax.checkpoint` policies over the
model's checkpoint names (`relaymoe_jax.models.qwen`).

The attention block is `x -> o_proj(attention(rope(qk_norm(qkv_proj(attn_norm(x))))))`; its
input `x` (the residual stream) is kept in every option. From least to most memory:

    option          kept for the backward               recomputed in the backward
    full            nothing                             norm, q/k/v projections, attention
    save_qkv        q_proj, k_proj, v_proj outputs      norm, q/k norm, rope, attention
    save_attn_out   + the attention output (and the     norm, q/k norm, rope; with XLA's
                    chunked attention's log-sum-exp)    attention also the scores and
                                                        softmax (not P @ V)
    save_all        everything (no jax.checkpoint)      nothing

The projections are kept before the q/k RMSNorm, as the norm's backward needs its input: keeping
only the normed q/k would still recompute the projection matmuls. `save_attn_out` is the option
"attention output + log-sum-exp" of flash attention. With `attention_impl="chunked"` the
custom_vjp names its o and lse residuals "attn_out" and "attn_lse", so its backward starts from
them and the forward scan is not re-run. With XLA's attention (CPU, and GPU where cuDNN does not
apply) there is no log-sum-exp, and the backward still recomputes the scores and softmax from q
and k, so only the P @ V product is avoided (see `costs.py`).
"""

import typing
from typing import Literal

import jax

RematOption = Literal["full", "save_qkv", "save_attn_out", "save_all"]
OPTIONS: tuple[str, ...] = typing.get_args(RematOption)

SAVED_NAMES = {
    "full": (),
    "save_qkv": ("q_proj", "k_proj", "v_proj"),
    "save_attn_out": ("q_proj", "k_proj", "v_proj", "attn_out", "attn_lse"),
}


def check_option(option: str, what: str = "option") -> str:
    if option not in OPTIONS:
        raise ValueError(f"{what}={option!r}: expected one of {OPTIONS}")
    return option


def policy(option: str):
    """The `jax.checkpoint` policy of `option`; None for "save_all" (no checkpoint at all)."""
    check_option(option)
    if option == "save_all":
        return None
    if option == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[option])


def layer_policy(offload_input: bool = False):
    """The policy of a whole decoder layer under one checkpoint (`full` with `moe_remat`): keep
    nothing but the layer's input, on the device, or with `offload_input` (the model config's
    `offload_layer_inputs`) in pinned host memory, as the value named "layer_input" inside the
    checkpoint (naming the input outside it, e.g. the scan's carry, offloads nothing: jax#23869).
    XLA brings it back to the device for that layer's backward."""
    if not offload_input:
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["layer_input"],
        offload_src="device",
        offload_dst="pinned_host",
    )
