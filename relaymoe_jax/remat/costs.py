"""What each attention recomputation option keeps (bytes, `m`) and saves (backward FLOPs, `c`),
per device and per layer, relative to "full" recomputation (which keeps only the block input).

Shapes per device: `b` local sequences (the batch over its data/fsdp/node/expert axes), `s` local
query positions (the sequence over `context`), `S` key positions (all of them: keys and values
are all-gathered over `context`), `N` query heads, `K` key/value heads, `D` head dim, `H` hidden
size, `e` bytes per element of the compute dtype.

    m(save_qkv)      = b s (N + 2K) D e                      q, k, v projections
    m(save_attn_out) = m(save_qkv) + b s N D e               + attention output
    m(save_all)      = m(save_attn_out) + 2 b s H e          + the norm output (and its cast
                                                               before the weight)
                       + 8 b s H                             + the RMSNorm's float32 copies
                       + [qk norm] 8 b s (N + K) D           + the q/k norms' float32 copies
                       + b s (N + K) D e + 4 b s D e         + q, k after RoPE, and RoPE's
                                                               cos, sin broadcast for each
                       + [S > s] 2 b S K D e                 + gathered k, v (context parallel)
                       + b N s S (9 + e)                     + per score: the causal mask (1),
                                                               masked scores and exp (float32),
                                                               probabilities (e)

    c(save_qkv)      = 2 b s H (N + 2K) D                    the three projection matmuls
    c(save_attn_out) = c(save_qkv) + 2 b N s S D             + P @ V
    c(save_all)      = c(save_attn_out) + 2 b N s S D        + Q @ K^T

`c` counts matmul FLOPs only (the norms, RoPE and softmax are elementwise: XLA's cost_analysis
counts them too, ~7 FLOPs per score for the softmax on CPU). The attention terms above are those
of XLA's attention (`attention_impl="xla"`), which computes all S x S scores and masks them, keeps
no log-sum-exp, and so recomputes the scores and softmax in the backward whatever is kept.

With a blockwise attention_impl ("chunked", "pallas", "auto": `models/attention.py`, a
custom_vjp whose residuals are q, k, v, o and the float32 log-sum-exp, named "attn_out" and
"attn_lse", whether XLA or the Pallas kernel computes the blocks) nothing of size S x S is kept,
and keeping o and lse spares the backward the whole forward pass (Q @ K^T and P @ V over the
pairs of blocks it visits: causally about half of the s x S scores, counted as the half; the
diagonal blocks' masked halves and, with packed documents, the cross-document blocks it skips
are not counted):

    m(save_attn_out) = m(save_qkv) + b s N D e + 4 b s N     + attention output, lse (float32)
    m(save_all)      = m(save_attn_out) + the XLA rest above without the b N s S (9 + e) scores
    c(save_attn_out) = c(save_qkv) + 2 b N s S D             Q @ K^T and P @ V, causal half
    c(save_all)      = c(save_attn_out)                       (so the solver never picks it)

With `moe_remat` (the MLP/MoE block recomputed too), "full" is one checkpoint around the whole
decoder layer that keeps only the layer's input (`models/decoder.py`), while every other option
checkpoints the two blocks apart, and the MLP block's checkpoint keeps its own input, the residual
stream after the attention: each option's `m` then adds that activation,

    [moe_remat] + b s H e                                    the MLP block's input

Every `m` is relative to the fully recomputed step, whose peak sets the planner's budget: without
this term a plan the solver counts as within its budget is over it by one activation per planned
layer.

The memory terms of save_qkv and save_attn_out are exactly the tensors the policy names; those of
save_all are the residuals jax hands to XLA without a checkpoint, less the small ones ([b, s, 1]
statistics, RoPE tables). `tests/test_remat.py` compares both with
`jax.ad_checkpoint.print_saved_residuals` (exact, and within 5%). XLA's buffer assignment may fuse
or reuse some of them, so a plan is checked by compiling (`train.planner`).
"""

import dataclasses

import numpy as np

from relaymoe_jax.remat.options import OPTIONS

BATCH_AXES = ("data", "fsdp", "node", "expert")  # models.sharding.rules_for's batch axes


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Per-device sizes of one attention block (see the module docstring)."""

    b: int
    s: int
    S: int
    N: int
    K: int
    D: int
    H: int
    e: int
    qk_norm: bool
    chunked: bool = False  # a blockwise attention_impl (not "xla"; the module docstring)
    layer_remat: bool = False  # moe_remat: "full" is the whole-layer checkpoint (see above)

    @classmethod
    def of(cls, cfg, batch: int, seq: int, mesh_shape: dict, dtype) -> "AttentionShape":
        """From a ModelConfig, the global micro-batch and sequence length, the mesh's
        {axis: size} and the compute dtype. Axes that do not divide their dimension are dropped,
        as the model's sharding rules do (`AxisRules.fit`)."""
        if batch < 1 or seq < 1:
            raise ValueError(f"batch={batch} and seq={seq} must be >= 1")
        size = 1
        for a in (a for a in mesh_shape if a in BATCH_AXES):
            if batch % (size * mesh_shape[a]):
                break
            size *= mesh_shape[a]
        b = batch // size
        ctx = mesh_shape.get("context", 1)
        s = seq // ctx if seq % ctx == 0 else seq
        return cls(
            b=b,
            s=s,
            S=seq,
            N=cfg.num_attention_heads,
            K=cfg.num_key_value_heads,
            D=cfg.head_size,
            H=cfg.hidden_size,
            e=np.dtype(dtype).itemsize,
            qk_norm=cfg.arch == "qwen3_moe",
            chunked=cfg.attention_impl != "xla",
            layer_remat=bool(getattr(cfg, "moe_remat", False)),
        )


@dataclasses.dataclass(frozen=True)
class Cost:
    bytes: int  # m: kept for the backward, beyond "full"
    flops: int  # c: backward recomputation avoided, beyond "full"


def option_costs(sh: AttentionShape) -> dict[str, Cost]:
    """{option: Cost} of one attention layer for every option but "full" (which is 0, 0)."""
    b, s, S, N, K, D, H, e = sh.b, sh.s, sh.S, sh.N, sh.K, sh.D, sh.H, sh.e
    qkv = Cost(b * s * (N + 2 * K) * D * e, 2 * b * s * H * (N + 2 * K) * D)
    rest = (
        2 * b * s * H * e
        + 8 * b * s * H
        + (8 * b * s * (N + K) * D if sh.qk_norm else 0)
        + b * s * (N + K) * D * e
        + 4 * b * s * D * e
        + (2 * b * S * K * D * e if S > s else 0)
    )
    if sh.chunked:
        out = Cost(qkv.bytes + b * s * N * D * e + 4 * b * s * N, qkv.flops + 2 * b * N * s * S * D)
        every = Cost(out.bytes + rest, out.flops)
    else:
        out = Cost(qkv.bytes + b * s * N * D * e, qkv.flops + 2 * b * N * s * S * D)
        every = Cost(out.bytes + rest + b * N * s * S * (9 + e), out.flops + 2 * b * N * s * S * D)
    costs = {"save_qkv": qkv, "save_attn_out": out, "save_all": every}
    if sh.layer_remat:  # the MLP block's own checkpoint keeps its input (module docstring)
        costs = {o: Cost(c.bytes + b * s * H * e, c.flops) for o, c in costs.items()}
    assert tuple(costs) == OPTIONS[1:]
    return costs


def layer_costs(cfg, batch: int, seq: int, mesh_shape: dict, dtype) -> list[dict[str, Cost]]:
    """`option_costs` for every layer of the model (all attention layers have the same shape)."""
    c = option_costs(AttentionShape.of(cfg, batch, seq, mesh_shape, dtype))
    return [dict(c) for _ in range(cfg.num_hidden_layers)]
