"""RelayMoE expert routing: expert weights travel the EP ring, tokens stay (paper §3.1, §3.3).

Runs per device inside `jax.shard_map`. Per device: T local tokens, k slots, E experts in N
partitions of E_l = E / N (partition p lives on device p). At hop h device `me` holds the weights
of partition p = (me - h) mod N and computes the (token, expert) pairs that meet there.

Forward (no residuals beyond the inputs and the [T*k] pair order):
    w = my partition
    for h in 0..N-2:  w_next = ppermute(w, +1)   # independent of this hop's compute
                      out += hop(p_h, w);  w = w_next
    out += hop(p_{N-1}, w)                        # the last transfer is peeled off

Backward (`jax.custom_vjp`, nothing per hop saved): weights circulate again; each hop recomputes
its chunk intermediates, produces dx and d expert_weights (local accumulators) and the partial dW
of the visiting partition. The dW accumulator trails its weights by one hop: the partial of hop h
is computed without waiting, merged into the incoming accumulator at hop h+1 and sent on together
with the next weights; one final gradient-only ppermute returns each dW to its owner.

    hop 0:        w_next = ppermute(w)                       P = partial(w)
    hop 1..N-2:   w_next, A = ppermute((w, A + P))           P = partial(w)
    hop N-1:      A = ppermute(A + P)                        P = partial(w)
    return:       dW = ppermute(A + P)                       (+ psum over other token axes)

A hop walks its contiguous segment of the sorted pair order in chunks of C pairs with a
`lax.while_loop` whose trip count ceil(count / C) is traced: dropless, memory bounded by C.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch import plan
from relaymoe_jax.kernels import gmm, tgmm


@dataclasses.dataclass(frozen=True)
class RingConfig:
    axis: str               # the expert mesh axis the ring runs over
    num_experts: int        # E (global)
    chunk: int              # C, pairs per chunk
    reduce_axes: tuple      # token axes other than `axis`: dW is summed over them
    gmm_impl: str = "auto"
    poison: bool = False    # fill padding rows with NaN (tests)


def _shift(tree, axis, n):
    return lax.ppermute(tree, axis, [(i, (i + 1) % n) for i in range(n)])


class _Hops:
    """The per-hop forward and backward computations on one device (shared by fwd and bwd)."""

    def __init__(self, cfg, x_th, wts_tk, order, counts_e):
        self.cfg = cfg
        self.n = lax.axis_size(cfg.axis)
        self.me = lax.axis_index(cfg.axis)
        self.e_local = cfg.num_experts // self.n
        self.x_th = x_th
        self.k = wts_tk.shape[1]
        self.wts_p = wts_tk.reshape(-1)
        c = cfg.chunk
        # Pad the order by one chunk so a chunk slice never runs off the end (pads are masked).
        self.order = jnp.concatenate([order, jnp.zeros((c,), order.dtype)])
        self.counts_e = counts_e
        counts_p = counts_e.reshape(self.n, self.e_local).sum(axis=1)
        self.counts_p = counts_p
        self.starts_p = plan.exclusive_cumsum(counts_p)

    def partition(self, h):
        return (self.me - h) % self.n

    def _chunks(self, h, body, carry):
        """Run body(chunk_state, carry) over the chunks of hop h's segment."""
        c = self.cfg.chunk
        p = self.partition(h)
        start, count = self.starts_p[p], self.counts_p[p]
        seg_counts = lax.dynamic_slice(self.counts_e, (p * self.e_local,), (self.e_local,))
        n_chunks = (count + c - 1) // c

        def step(state):
            i, carry = state
            pos0 = i * c
            pidx = lax.dynamic_slice(self.order, (start + pos0,), (c,))
            valid = jnp.arange(c) < count - pos0
            gs = plan.chunk_group_sizes(seg_counts, pos0, c)
            tok = pidx // self.k
            wts_c = jnp.where(valid, self.wts_p[pidx], 0).astype(jnp.float32)
            chunk = dict(pidx=pidx, tok=tok, valid=valid, gs=gs, wts_c=wts_c,
                         x_ch=self.rows(self.x_th, tok, valid))
            return i + 1, body(chunk, carry)

        return lax.while_loop(lambda s: s[0] < n_chunks, step, (jnp.int32(0), carry))[1]

    def rows(self, a_th, tok, valid):
        """a_th[tok]: C token rows. Rows past the segment are don't-care: the grouped matmuls
        zero their outputs and ignore them, and their router weight is 0."""
        return plan.take_rows(a_th, tok, valid, self.cfg.poison)

    def _mm(self, a, w, gs, transpose=False):
        return gmm(a, w, gs, impl=self.cfg.gmm_impl, preferred_element_type=jnp.float32,
                   transpose_rhs=transpose)

    def _tmm(self, a, b, gs):
        return tgmm(a, b, gs, num_groups=self.e_local, impl=self.cfg.gmm_impl,
                    preferred_element_type=jnp.float32)

    def forward(self, h, w, out_th):
        w_gate, w_up, w_down = w
        dt = self.x_th.dtype

        def body(ch, out_th):
            gate = self._mm(ch["x_ch"], w_gate, ch["gs"])
            up = self._mm(ch["x_ch"], w_up, ch["gs"])
            act = (jax.nn.silu(gate) * up).astype(dt)
            y_ch = self._mm(act, w_down, ch["gs"])
            return out_th.at[ch["tok"]].add(y_ch * ch["wts_c"][:, None])   # invalid rows: 0

        with jax.named_scope("ring_fwd_hop"):
            return self._chunks(h, body, out_th)

    def backward(self, h, w, dy_th, dx_th, dwts_p):
        """Recompute hop h and return (partial dW of the visiting partition, dx, d weights)."""
        w_gate, w_up, w_down = w
        dt = self.x_th.dtype
        dw0 = tuple(plan.vary_like(jnp.zeros(a.shape, jnp.float32), a, self.x_th) for a in w)

        def body(ch, carry):
            dx_th, dwts_p, (dwg, dwu, dwd) = carry
            gs, valid = ch["gs"], ch["valid"]
            gate = self._mm(ch["x_ch"], w_gate, gs)
            up = self._mm(ch["x_ch"], w_up, gs)
            sig = jax.nn.sigmoid(gate)
            silu = gate * sig
            act = (silu * up).astype(dt)
            dy_ch = self.rows(dy_th, ch["tok"], valid).astype(dt)
            # d act (before router weight) = dy @ w_down^T; d weight = <act, that>.
            dact0 = self._mm(dy_ch, w_down, gs, transpose=True)
            dwts_c = jnp.sum(act.astype(jnp.float32) * dact0, axis=-1)
            dwts_p = dwts_p.at[ch["pidx"]].add(dwts_c)       # invalid rows: act = dact0 = 0
            wts = ch["wts_c"][:, None]
            dwd = dwd + self._tmm(act, (dy_ch * wts).astype(dt), gs)   # ignores invalid rows
            dact = dact0 * wts
            dgate = (dact * up * sig * (1.0 + gate * (1.0 - sig))).astype(dt)
            dup = (dact * silu).astype(dt)
            dwg = dwg + self._tmm(ch["x_ch"], dgate, gs)
            dwu = dwu + self._tmm(ch["x_ch"], dup, gs)
            dx_ch = (self._mm(dgate, w_gate, gs, transpose=True)
                     + self._mm(dup, w_up, gs, transpose=True))
            dx_th = dx_th.at[ch["tok"]].add(dx_ch)           # gmm: invalid rows are exact 0
            return dx_th, dwts_p, (dwg, dwu, dwd)

        with jax.named_scope("ring_bwd_hop"):
            dx_th, dwts_p, dw = self._chunks(h, body, (dx_th, dwts_p, dw0))
        return dw, dx_th, dwts_p


def _forward(cfg, x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
    order, counts_e = plan.sort_pairs(ids_tk, cfg.num_experts)
    hops = _Hops(cfg, x_th, wts_tk, order, counts_e)
    n = hops.n
    out_th = plan.vary_like(jnp.zeros(x_th.shape, jnp.float32), x_th)

    def hop(h, carry):
        w, out_th = carry
        w_next = _shift(w, cfg.axis, n)
        return w_next, hops.forward(h, w, out_th)

    w, out_th = lax.fori_loop(0, n - 1, hop, ((w_gate, w_up, w_down), out_th))
    out_th = hops.forward(n - 1, w, out_th)
    return out_th.astype(x_th.dtype), (order, counts_e)


def _backward(cfg, res, dy_th):
    x_th, wts_tk, w, order, counts_e = res
    hops = _Hops(cfg, x_th, wts_tk, order, counts_e)
    n = hops.n
    dx_th = plan.vary_like(jnp.zeros(x_th.shape, jnp.float32), x_th)
    dwts_p = plan.vary_like(jnp.zeros((wts_tk.size,), jnp.float32), wts_tk)
    add = functools.partial(jax.tree.map, jnp.add)

    if n == 1:
        dw, dx_th, dwts_p = hops.backward(0, w, dy_th, dx_th, dwts_p)
    else:
        w_next = _shift(w, cfg.axis, n)                      # hop 0: weights only
        part, dx_th, dwts_p = hops.backward(0, w, dy_th, dx_th, dwts_p)
        acc = jax.tree.map(jnp.zeros_like, part)

        def hop(h, carry):                                   # hops 1..N-2: weights + trailing dW
            w, part, acc, dx_th, dwts_p = carry
            w_next, acc = _shift((w, add(acc, part)), cfg.axis, n)
            part, dx_th, dwts_p = hops.backward(h, w, dy_th, dx_th, dwts_p)
            return w_next, part, acc, dx_th, dwts_p

        w, part, acc, dx_th, dwts_p = lax.fori_loop(
            1, n - 1, hop, (w_next, part, acc, dx_th, dwts_p))
        acc = _shift(add(acc, part), cfg.axis, n)            # hop N-1: gradient only
        part, dx_th, dwts_p = hops.backward(n - 1, w, dy_th, dx_th, dwts_p)
        dw = _shift(add(acc, part), cfg.axis, n)             # final return to the owner
    if cfg.reduce_axes:
        dw = lax.psum(dw, cfg.reduce_axes)
    dw = tuple(d.astype(a.dtype) for d, a in zip(dw, w))
    return (dx_th.astype(x_th.dtype), None, dwts_p.reshape(wts_tk.shape).astype(wts_tk.dtype),
            *dw)


@functools.cache
def _ring_op(cfg: RingConfig):
    @jax.custom_vjp
    def ring(x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
        return _forward(cfg, x_th, ids_tk, wts_tk, w_gate, w_up, w_down)[0]

    def fwd(x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
        y, (order, counts_e) = _forward(cfg, x_th, ids_tk, wts_tk, w_gate, w_up, w_down)
        return y, (x_th, wts_tk, (w_gate, w_up, w_down), order, counts_e)

    ring.defvjp(fwd, functools.partial(_backward, cfg))
    return ring


def ring_expert_routing(cfg: RingConfig, x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
    """Per-device body (call inside shard_map): y[T, H] for the local tokens."""
    return _ring_op(cfg)(x_th, ids_tk, wts_tk, w_gate, w_up, w_down)
