"""One ring hop: the (token, expert) pairs of one token partition that meet one expert partition.

Shared by both routing modes (paper §3.1, §3.2). Expert routing calls it with the local tokens and
the visiting expert partition; token routing with a visiting token partition and the local experts.

The token side is a `Tokens` record: activations, router weights and the pair order sorted once by
global expert id (indices only, padded by one chunk) with per-expert counts. Partition p's pairs
are one contiguous segment of that order. A hop walks it in chunks of C pairs with a
`lax.while_loop` whose trip count ceil(count / C) is traced: dropless, memory bounded by C.
Rows of the last chunk past the segment are don't-care (zero router weight; the grouped matmuls
return exact zeros for them and never read them as group members).

With the Triton kernel (gmm_impl "pallas") the chunk's token rows (x forward; x and dy backward)
are never gathered into a [C, H] buffer: the kernel reads them from the [T, H] matrix by index (a
fused row gather), except with the FP8 recipe (`cfg.fp8_acts`), whose x rows are rounded to e4m3
here, per chunk, so that the ring keeps no rounded [T, H] copy of x. The other implementations
gather the chunk's rows first (NaN-filled past the segment when poisoned), our Mosaic GPU kernel
included (Hopper's TMA cannot gather rows).

The expert side is an `Experts` record (`dispatch.experts`): the forward is `expert_mlp` with the
chunk's grouped matmuls; the backward recomputes `gate_up` and writes out the rest of the chain
rule, its weight gradient an `Experts` of float32 accumulators.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch import pairs
from relaymoe_jax.dispatch.experts import Experts, act_operand, expert_mlp, gate_up, row_bias
from relaymoe_jax.kernels.gmm import gmm, gmm_fp8, impl_kwargs, resolve_impl, tgmm
from relaymoe_jax.quant import fp8
from relaymoe_jax.util.late import late_zero
from relaymoe_jax.util.typed import varying_like


class Chunk(NamedTuple):
    """C consecutive pairs of one partition's segment (the last chunk runs past its end)."""

    pidx: jax.Array  # [C] int32 pair indices (t * k + slot)
    tok: jax.Array  # [C] int32 their token rows
    valid: jax.Array  # [C] bool: inside the segment
    gs: jax.Array  # [E_local] int32 rows per local expert within the chunk
    wts_c: jax.Array  # [C] f32 router weights, 0 past the segment


class Tokens(NamedTuple):
    """One token partition and its routing metadata (a pytree: it can travel the ring)."""

    x_th: jax.Array  # [T, H] activations
    wts_p: jax.Array  # [T*k] router weights per pair
    order: jax.Array  # [T*k + C] int32 pair indices sorted by global expert id, padded
    counts_e: jax.Array  # [E] int32 pairs per global expert

    @property
    def top_k(self):
        return self.wts_p.shape[0] // self.x_th.shape[0]


def make_tokens(cfg, x_th, ids_tk, wts_tk):
    order, counts_e = pairs.sort_pairs(ids_tk, cfg.num_experts)
    order = jnp.concatenate([order, jnp.zeros((cfg.chunk,), order.dtype)])  # slices never run off
    tk = Tokens(x_th, wts_tk.reshape(-1), order, counts_e)
    return Tokens(*(varying_like(a, *tk) for a in tk))  # one type for a loop carry


class Oriented(NamedTuple):
    """One expert matrix for the e4m3 kernel, which reads both operands with the contraction as
    the minor dimension (`kernels/gmm/mosaic_fp8.py`): `kn` as stored, [E, K, N] (what dgrad
    contracts over N), and `nk` its transpose [E, N, K] (the forward's); one 128 x 128 block's
    scale serves both."""

    kn: fp8.Fp8
    nk: fp8.Fp8


def shift(tree, axis, n):
    """Send to the next device of the ring (i -> i + 1)."""
    return lax.ppermute(tree, axis, [(i, (i + 1) % n) for i in range(n)])


class Hop:
    """Forward and recomputing backward of one hop, on one device (inside shard_map)."""

    def __init__(self, cfg, tk):
        self.cfg = cfg
        self.k = tk.top_k
        self.n = lax.axis_size(cfg.axis)
        self.me = lax.axis_index(cfg.axis)
        self.e_local = cfg.num_experts // self.n
        self.mm_kw = impl_kwargs(cfg.gmm_impl)
        impl = resolve_impl(**self.mm_kw)
        # the kernel gathers token rows; not with the FP8 recipe, whose x rows are rounded here
        self.fused = impl == "pallas" and not cfg.fp8_acts
        self.fp8_kernel = cfg.fp8_acts and impl == "mosaic"  # e4m3 wgmma: `gmm_fp8`

    def weights(self, w: Experts) -> Experts:
        """The expert matrices as the hop's grouped matmuls take them: for the e4m3 kernel each
        an `Oriented` pair of `fp8.Fp8` records (the ring quantised them at its entry, or here
        if given plain; transposed once per visit, not per chunk), else plain arrays (e4m3
        records dequantised: exact)."""
        if not self.fp8_kernel:
            return w.dequantized()
        q = w.quantized()
        return q._replace(**{n: Oriented(m, m.transposed()) for n, m in q.named_weights()})

    def _chunks(self, tk, p, body, carry):
        """Run body(chunk, carry) over the chunks of partition p's segment of `tk`'s pairs."""
        c, el = self.cfg.chunk, self.e_local
        counts_p = tk.counts_e.reshape(self.n, el).sum(axis=1)
        start, count = pairs.exclusive_cumsum(counts_p)[p], counts_p[p]
        seg_counts = lax.dynamic_slice(tk.counts_e, (p * el,), (el,))
        n_chunks = (count + c - 1) // c

        def step(state):
            i, carry = state
            pos0 = i * c
            pidx = lax.dynamic_slice(tk.order, (start + pos0,), (c,))
            valid = jnp.arange(c) < count - pos0
            tok = pidx // self.k
            chunk = Chunk(
                pidx=pidx,
                tok=tok,
                valid=valid,
                gs=pairs.chunk_group_sizes(seg_counts, pos0, c),
                wts_c=jnp.where(valid, tk.wts_p[pidx], 0).astype(jnp.float32),
            )
            return i + 1, body(chunk, carry)

        return lax.while_loop(lambda s: s[0] < n_chunks, step, (jnp.int32(0), carry))[1]

    def rows(self, a_th, ch):
        """The chunk's C token rows of a_th as (matrix, row index): (a_th, tok) for the kernel to
        read, or the gathered rows (past the segment don't-care, NaN when poisoned) and None. An
        `fp8.Fp8` a_th (token routing's visiting x and dy under the FP8 recipe) gives its rows'
        e4m3 values and tile scales gathered, then dequantised (exact): the [T, H] matrix is
        never dequantised whole."""
        take = lambda a: pairs.take_rows(a, ch.tok, ch.valid, self.cfg.poison)
        if isinstance(a_th, fp8.Fp8):
            return fp8.dequantize(
                fp8.Fp8(take(a_th.q), take(a_th.scale), a_th.block, a_th.dtype)
            ), None
        if self.fused:
            return a_th, ch.tok
        return take(a_th), None

    def x_rows(self, tk, ch):
        """`rows` of the tokens' x; with the FP8 recipe rounded to e4m3 per 1 x 128 tile here,
        per chunk (the ring takes x unrounded: its residual is then the caller's x, not a rounded
        [T, H] copy kept from the forward to the backward)."""
        x_ch, x_rows = self.rows(tk.x_th, ch)
        return (fp8.fake_quantize(x_ch, fp8.TILE), None) if self.cfg.fp8_acts else (x_ch, x_rows)

    def _mm(self, a, w, gs, transpose=False, a_rows=None):
        if self.fp8_kernel:  # a (x, act, dy, d gate, d up) is on e4m3's grid already: exact
            return gmm_fp8(
                a,
                w.kn if transpose else w.nk,  # K-major either way: the kernel transposes nothing
                gs,
                preferred_element_type=jnp.float32,
                transpose_rhs=True,
                lhs_rows=a_rows,
                interpret=self.mm_kw.get("interpret", False),
            )
        return gmm(
            a,
            w,
            gs,
            **self.mm_kw,
            preferred_element_type=jnp.float32,
            transpose_rhs=transpose,
            lhs_rows=a_rows,
        )

    def _tmm(self, acc, a, b, gs, a_rows=None, b_rows=None):
        """acc + the chunk's weight gradient, summed in place: the experts the chunk does not
        touch are not read or written (`tgmm(acc=)`), so small chunks stay cheap."""
        return tgmm(
            a,
            b,
            gs,
            num_groups=self.e_local,
            **self.mm_kw,
            preferred_element_type=jnp.float32,
            lhs_rows=a_rows,
            rhs_rows=b_rows,
            acc=acc,
        )

    def _mlp_rows(self, ch):
        """How the chunk's rows meet their experts: the grouped matmul, each row's expert."""
        matmul = lambda a, w, a_rows=None: self._mm(a, w, ch.gs, a_rows=a_rows)
        return matmul, lambda: pairs.group_of_rows(ch.gs, self.cfg.chunk)  # invalid: past them

    def forward(self, tk, p, w: Experts, out_th):
        """out_th + the routed expert outputs of `tk`'s pairs with expert partition p (= w)."""
        dt = tk.x_th.dtype

        def body(ch, out_th):
            x_ch, x_rows = self.x_rows(tk, ch)
            matmul, groups = self._mlp_rows(ch)
            y_ch = expert_mlp(
                w, self.cfg.activation, x_ch, matmul, groups, dt, x_rows, self.cfg.fp8_acts
            )
            return out_th.at[ch.tok].add(y_ch * ch.wts_c[:, None])  # invalid rows: 0

        with jax.named_scope("ring_fwd_hop"):
            return self._chunks(tk, p, body, out_th)

    def backward(self, tk, p, w: Experts, dy_th, dx_th, dwts_p, dw: Experts):
        """Recompute the hop and add its gradients: returns (dw, dx_th, dwts_p) accumulated."""
        dt = tk.x_th.dtype

        def body(ch, carry):
            dx_th, dwts_p, dw = carry
            gs = ch.gs
            x_ch, x_rows = self.x_rows(tk, ch)
            dy_src = dy_th if isinstance(dy_th, fp8.Fp8) else dy_th.astype(dt)  # cast before
            dy_ch, dy_rows = self.rows(dy_src, ch)  # the gather; an e4m3 dy: its rows dequantised
            dy_ch = dy_ch.astype(dt)
            gate, up, group = gate_up(w, x_ch, *self._mlp_rows(ch), x_rows)
            act_f32, act_vjp = jax.vjp(self.cfg.activation, gate, up)
            act = act_operand(act_f32, dt, self.cfg.fp8_acts)
            # d act (before router weight) = dy @ w_down^T; d weight = <act, that>.
            dact0 = self._mm(dy_ch, w.w_down, gs, transpose=True, a_rows=dy_rows)
            dwts_c = jnp.sum(act.astype(jnp.float32) * dact0, axis=-1)
            db_down = dw.b_down
            if group is not None:  # y = act @ w_down + b_down: b_down's share of d weight
                db_down, dwts_b = self._bias_down_grads(db_down, dy_th, ch, group, w.b_down)
                dwts_c = dwts_c + dwts_b
            dwts_p = dwts_p.at[ch.pidx].add(dwts_c)  # invalid rows: act = dact0 = 0
            wts = ch.wts_c[:, None]
            # dW_down = (wts * act)^T dy; invalid rows: the weight is 0 and tgmm ignores them.
            dwd = self._tmm(dw.w_down, (act * wts).astype(dt), dy_ch, gs, b_rows=dy_rows)
            dact = dact0 * wts
            dgate_f32, dup_f32 = act_vjp(dact)
            db_gate, db_up = dw.b_gate, dw.b_up
            if group is not None:
                db_gate = db_gate + pairs.group_bias_grad(dgate_f32, group, self.e_local)
                db_up = db_up + pairs.group_bias_grad(dup_f32, group, self.e_local)
            if self.cfg.fp8_acts:  # as `gate_up(fp8_grads=True)`: the biases' are not rounded
                dgate_f32, dup_f32 = (fp8.fake_quantize(d, fp8.TILE) for d in (dgate_f32, dup_f32))
            dgate, dup = dgate_f32.astype(dt), dup_f32.astype(dt)
            dwg = self._tmm(dw.w_gate, x_ch, dgate, gs, a_rows=x_rows)
            dwu = self._tmm(dw.w_up, x_ch, dup, gs, a_rows=x_rows)
            dx_ch = self._mm(dgate, w.w_gate, gs, transpose=True) + self._mm(
                dup, w.w_up, gs, transpose=True
            )
            dx_th = dx_th.at[ch.tok].add(dx_ch)  # gmm: invalid rows are exact 0
            return dx_th, dwts_p, Experts(dwg, dwu, dwd, db_gate, db_up, db_down)

        with jax.named_scope("ring_bwd_hop"):
            dx_th, dwts_p, dw = self._chunks(tk, p, body, (dx_th, dwts_p, dw))
        return dw, dx_th, dwts_p

    def _bias_down_grads(self, db_down, dy_th, ch, group, b_down):
        """b_down's gradient (router-weighted dy rows summed per expert) and its term of the
        router weights' (dy . b_down[e]); the chunk's dy rows are gathered here, in float32
        (invalid rows masked: poisoned, they are NaN)."""
        dy_rows = self.rows(dy_th, ch)[0] if isinstance(dy_th, fp8.Fp8) else dy_th[ch.tok]
        dy_ch = jnp.where(ch.valid[:, None], dy_rows.astype(jnp.float32), 0.0)
        db_down = db_down + pairs.group_bias_grad(dy_ch * ch.wts_c[:, None], group, self.e_local)
        return db_down, jnp.sum(dy_ch * row_bias(b_down, group), axis=-1)


def zeros_f32(shape, *refs):
    """f32 zeros that vary over the same manual axes as `refs` (an accumulator), made once
    `refs[0]` exists (`relaymoe_jax.util.late.late_zero`); an `fp8.Fp8` ref stands by its e4m3
    values (no dequantised copy is made for the anchor)."""
    refs = tuple(r.q if isinstance(r, fp8.Fp8) else r for r in refs)
    return varying_like(
        jnp.broadcast_to(late_zero(jnp.zeros((), jnp.float32), refs[0]), shape), *refs
    )
