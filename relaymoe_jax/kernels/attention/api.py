"""`flash_attention`: the Mosaic GPU flash-attention kernels (`mosaic_fwd`, `mosaic_bwd`) behind a
`jax.custom_vjp`, with the input checks and the padding to whole blocks.

q [B, S, N, D], k/v [B, T, K, D] (bf16 or f16, D in HEAD_DIMS, K divides N: query head n reads kv
head n // (N // K)), int token indices qi [B, S] / ki [B, T] and optional segment ids (both or
neither): key t is visible to query q iff ki[t] <= qi[q] and kseg[t] == qseg[q]. S and T are
padded to whole blocks (`common.prepare_masks`; q/k/v with zeros) and the padding is sliced off.
The forward saves q, k, v, o (named "attn_out") and lse (named "attn_lse", [B, N, S_pad] f32) for
the backward, which returns no cotangent for the integer inputs.

`interpret` is False (compile for the GPU), True (the Mosaic GPU interpreter on CPU) or a
`plgpu.InterpretGPUParams` (the interpreter with those settings, e.g. detect_races=True). The
interpreter's calls carry jax's ordered-IO effect, which `jax.checkpoint` refuses under AD
("Effects not supported in AD of checkpoint/remat") unless that effect is allowed in remat.
`check_static` runs the checks that need only q; `flash_attention_visits` is the forward alone
with the key blocks its loop visited (tests).
"""

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from relaymoe_jax.kernels.attention import mosaic_bwd, mosaic_fwd
from relaymoe_jax.kernels.attention.common import (
    MosaicConfig,
    check_dtype,
    check_head_dim,
    prepare_masks,
)
from relaymoe_jax.util.typed import varying_like


def check_static(q_bsnd) -> None:
    """The checks that need only q (its head_dim and dtype): ValueErrors before any tracing."""
    if q_bsnd.ndim != 4:
        raise ValueError(f"q must be [B, S, N, D], got shape {q_bsnd.shape}")
    check_head_dim(q_bsnd.shape[3])
    check_dtype("q", q_bsnd.dtype)


def _check_index(name: str, x, shape) -> None:
    if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}: expected integer {shape}, got {x.dtype} {x.shape}")


def _check(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, config) -> None:
    """One-line ValueErrors for inputs the kernels do not take."""
    check_static(q_bsnd)
    if k_btkd.ndim != 4:
        raise ValueError(f"k must be [B, T, K, D], got shape {k_btkd.shape}")
    b, s, n, d = q_bsnd.shape
    t, kh = k_btkd.shape[1], k_btkd.shape[2]
    if k_btkd.shape != (b, t, kh, d) or v_btkd.shape != k_btkd.shape:
        raise ValueError(
            f"k and v must be [B={b}, T, K, D={d}], got {k_btkd.shape}, {v_btkd.shape}"
        )
    if n % kh:
        raise ValueError(f"kv heads K={kh} must divide query heads N={n}")
    for name, x in (("k", k_btkd), ("v", v_btkd)):
        check_dtype(name, x.dtype)
    if not k_btkd.dtype == v_btkd.dtype == q_bsnd.dtype:
        raise ValueError(
            f"q, k, v must share a dtype: {q_bsnd.dtype}, {k_btkd.dtype}, {v_btkd.dtype}"
        )
    _check_index("qi", qi_bs, (b, s))
    _check_index("ki", ki_bt, (b, t))
    if (qseg_bs is None) != (kseg_bt is None):
        raise ValueError("segment ids: give both qseg and kseg, or neither")
    if qseg_bs is not None:
        _check_index("qseg", qseg_bs, (b, s))
        _check_index("kseg", kseg_bt, (b, t))
    if config.block_q != 64 or config.block_k not in (64, 128) or config.heads_per_program < 1:
        raise ValueError(f"config: block_q must be 64, block_k 64 or 128, got {config}")


def _pad_to(x, size: int):
    """x [B, L, ...] with zeros appended along axis 1 up to `size`."""
    pad = size - x.shape[1]
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x


def _prepare(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, scale, config):
    """(masks, scale, config) after the checks."""
    config = MosaicConfig() if config is None else config
    _check(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, config)
    masks = prepare_masks(
        qi_bs, ki_bt, qseg_bs, kseg_bt, config.block_q, config.block_k, anchor=k_btkd
    )
    scale = 1.0 / math.sqrt(q_bsnd.shape[-1]) if scale is None else float(scale)
    return masks, scale, config


def flash_attention(
    q_bsnd,
    k_btkd,
    v_btkd,
    qi_bs,
    ki_bt,
    qseg_bs=None,
    kseg_bt=None,
    *,
    scale=None,
    config: MosaicConfig | None = None,
    interpret=False,
):
    """o [B, S, N, D] (q's dtype): softmax(scale q k^T, masked) v, differentiable in q, k, v."""
    masks, scale, config = _prepare(
        q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, scale, config
    )
    s_pad, t_pad = masks.qi_bs.shape[1], masks.ki_bt.shape[1]
    s_len = q_bsnd.shape[1]
    kw = dict(scale=scale, config=config, interpret=interpret)

    def fwd(q, k, v, m):
        o, lse = mosaic_fwd.forward(
            _pad_to(q, s_pad), _pad_to(k, t_pad), _pad_to(v, t_pad), m, **kw
        )
        o = checkpoint_name(o[:, :s_len], "attn_out")
        lse = checkpoint_name(lse, "attn_lse")
        return o, (q, k, v, o, lse, m)

    def bwd(res, do):
        q, k, v, o, lse, m = res
        padded = [_pad_to(x, s_pad) for x in (q, o, do)] + [_pad_to(x, t_pad) for x in (k, v)]
        q_p, o_p, do_p, k_p, v_p = padded
        dq, dk, dv = mosaic_bwd.backward(q_p, k_p, v_p, o_p, lse, do_p, m, **kw)
        # under a shard_map, the cotangents vary over the manual axes their primals vary over
        dq, dk, dv = (varying_like(g[:, : x.shape[1]], x) for g, x in ((dq, q), (dk, k), (dv, v)))
        return dq, dk, dv, None

    @jax.custom_vjp
    def attention(q, k, v, m):
        return fwd(q, k, v, m)[0]

    attention.defvjp(fwd, bwd)
    return attention(q_bsnd, k_btkd, v_btkd, masks)


def flash_attention_visits(
    q_bsnd,
    k_btkd,
    v_btkd,
    qi_bs,
    ki_bt,
    qseg_bs=None,
    kseg_bt=None,
    *,
    scale=None,
    config: MosaicConfig | None = None,
    interpret=False,
):
    """The forward alone, for tests: (o [B, S, N, D], lse [B, N, S] f32, visits int32 [B, N,
    S_pad // block_q]: the key blocks the kernel's loop visited per row, head and query block)."""
    masks, scale, config = _prepare(
        q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, scale, config
    )
    s_pad, t_pad = masks.qi_bs.shape[1], masks.ki_bt.shape[1]
    o, lse, visits = mosaic_fwd.forward(
        _pad_to(q_bsnd, s_pad),
        _pad_to(k_btkd, t_pad),
        _pad_to(v_btkd, t_pad),
        masks,
        scale=scale,
        config=config,
        interpret=interpret,
        count_visits=True,
    )
    s_len = q_bsnd.shape[1]
    return o[:, :s_len], lse[:, :, :s_len], visits
