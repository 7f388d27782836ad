"""Next-token cross-entropy without the [tokens, vocab] logits: the LM head and the loss in
chunks of tokens, each chunk's logits re-materialised in a custom VJP.

A full-vocabulary head makes the largest buffers of a long-sequence step: at 61,440 tokens per
device and Qwen3's 151,936-entry vocabulary, the logits are 18.7 GB in bf16 and the float32
log-softmax and its gradient 37 GB each. `lm_loss` never builds them. Per device (inside a
`shard_map` over the token axes), the tokens are cut into chunks of `chunk` rows:

    forward   per chunk: logits_cv = x_ch @ w_hv (float32 accumulation), lse_c, nll_c;
              keeps only lse [tokens] (4 bytes a token)
    backward  per chunk: logits again, dlogits_cv = g * weight_c * (softmax - onehot),
              dx_ch = dlogits @ w_hv.T, dw_hv += x_ch.T @ dlogits (a float32 accumulator)

so the head's memory is a few [chunk, vocab] float32 buffers plus one [hidden, vocab] float32
accumulator, whatever the sequence length. The head weight enters replicated (the default rules
never shard `embed` or `vocab`); its gradient is summed over the token axes by the transpose of
the `pcast` that makes it vary over them.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models.sharding import AxisRules, constrain, token_layout
from relaymoe_jax.util.typed import varying_like

DEFAULT_CHUNK = 1024


def lm_loss(x_bsh, w_hv, targets_bs, weights_bs, rules: AxisRules, chunk: int = DEFAULT_CHUNK):
    """sum over (b, s) of weights[b, s] * -log softmax(x[b, s] @ w)[targets[b, s]], a float32
    scalar; the same as the full-logits formula, in chunks of `chunk` tokens per device.

    x_bsh      [B, S, H] the final-norm hidden states (any float dtype; the matmuls accumulate
               in float32)
    w_hv       [H, V] the LM head (a tied embedding passes `embed.T`)
    targets_bs [B, S] int, in [0, V)
    weights_bs [B, S] float, 0 where a position has no target
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(
            f"lm_loss: chunk={chunk!r}: expected a positive int (tokens per chunk per device)"
        )
    b, s, h = x_bsh.shape
    if w_hv.ndim != 2 or w_hv.shape[0] != h:
        raise ValueError(
            f"lm_loss: head weight shape {w_hv.shape}: expected [{h}, vocab] for "
            f"hidden states {x_bsh.shape}"
        )
    for name, a in (("targets", targets_bs), ("weights", weights_bs)):
        if a.shape != (b, s):
            raise ValueError(f"lm_loss: {name} shape {a.shape}: expected {(b, s)}")
    mesh = rules.mesh
    act = rules.fit((b, s), "batch", "seq")
    batch_axes, seq_axes, nb, ns = token_layout(rules, b, s)
    axes = batch_axes + seq_axes
    x_bsh = constrain(x_bsh, mesh, P(*act, None))
    w_hv = constrain(w_hv, mesh, P())
    targets_bs = constrain(jnp.asarray(targets_bs, jnp.int32), mesh, act)
    weights_bs = constrain(jnp.asarray(weights_bs, jnp.float32), mesh, act)
    c = min(chunk, (b // nb) * (s // ns))  # at most the tokens one device holds

    def body(x, w, t, wt):
        if axes:
            w = lax.pcast(w, axes, to="varying")
        total = _nll_sum(x.reshape(-1, h), w, t.reshape(-1), wt.reshape(-1), c)
        return lax.psum(total, axes) if axes else total

    return jax.shard_map(body, mesh=mesh, in_specs=(P(*act, None), P(), act, act), out_specs=P())(
        x_bsh, w_hv, targets_bs, weights_bs
    )


def _pad_chunks(a, c):
    """[n, ...] -> [ceil(n/c), c, ...], zero-padded (a padded token has weight 0)."""
    n = a.shape[0]
    pad = -n % c
    if pad:
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(-1, c, *a.shape[1:])


def _chunk_logits(x_ch, w_hv):
    return jnp.dot(x_ch, w_hv, preferred_element_type=jnp.float32)


def _target_logit(logits_cv, t_c):
    return jnp.take_along_axis(logits_cv, t_c[:, None], axis=1)[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _nll_sum(x_nh, w_hv, t_n, wt_n, c):
    return _nll_fwd(x_nh, w_hv, t_n, wt_n, c)[0]


def _nll_fwd(x_nh, w_hv, t_n, wt_n, c):
    xs, ts, wts = _pad_chunks(x_nh, c), _pad_chunks(t_n, c), _pad_chunks(wt_n, c)

    def hop(total, chunk):
        x_ch, t_c, wt_c = chunk
        logits_cv = _chunk_logits(x_ch, w_hv)
        lse_c = jax.nn.logsumexp(logits_cv, axis=1)
        nll_c = lse_c - _target_logit(logits_cv, t_c)
        return total + jnp.sum(nll_c * wt_c), lse_c

    total, lse = lax.scan(hop, varying_like(jnp.zeros((), jnp.float32), wt_n), (xs, ts, wts))
    return total, (x_nh, w_hv, t_n, wt_n, lse)


def _nll_bwd(c, res, g):
    x_nh, w_hv, t_n, wt_n, lse = res
    n, v = x_nh.shape[0], w_hv.shape[1]
    xs, ts, wts = _pad_chunks(x_nh, c), _pad_chunks(t_n, c), _pad_chunks(wt_n, c)

    def hop(dw_hv, chunk):
        x_ch, t_c, wt_c, lse_c = chunk
        p_cv = jnp.exp(_chunk_logits(x_ch, w_hv) - lse_c[:, None])
        onehot_cv = jax.nn.one_hot(t_c, v, dtype=jnp.float32)
        dlogits_cv = ((g * wt_c)[:, None] * (p_cv - onehot_cv)).astype(x_ch.dtype)
        dx_ch = jnp.dot(dlogits_cv, w_hv.T, preferred_element_type=jnp.float32)
        dw_hv = dw_hv + jnp.dot(x_ch.T, dlogits_cv, preferred_element_type=jnp.float32)
        return dw_hv, dx_ch.astype(x_ch.dtype)

    dw_hv, dxs = lax.scan(
        hop, varying_like(jnp.zeros(w_hv.shape, jnp.float32), w_hv), (xs, ts, wts, lse)
    )
    dx_nh = dxs.reshape(-1, x_nh.shape[1])[:n]
    return dx_nh, dw_hv.astype(w_hv.dtype), None, None


_nll_sum.defvjp(_nll_fwd, _nll_bwd)
