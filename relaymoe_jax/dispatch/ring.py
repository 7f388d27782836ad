"""RelayMoE's ring: expert routing and token routing, each a forward and a recomputing backward.

Runs per device inside `jax.shard_map`. Per device: T local tokens, k slots, E experts in N
partitions of E_l = E / N (partition p lives on ring position p). Both modes compute every
(token, expert) pair exactly once, with `hop.Hop`, and give identical results (paper §3.1-§3.2).

Expert routing (weights travel, tokens stay). At hop h device `me` holds partition (me - h) mod N.
    forward:   for h < N-1: w_next = ppermute(w); out += hop(w); w = w_next
               out += hop(w)                              # the last transfer is peeled off
    backward:  nothing per hop saved; weights circulate again, each hop recomputes its chunks,
               adds dx and d expert_weights locally and computes the partial dW of the visiting
               partition. The dW accumulator trails its weights by one hop, merged and sent on
               with the next weights; a final gradient-only ppermute returns it to its owner:
        hop 0:        w_next = ppermute(w)                       P = partial(w)
        hop 1..N-2:   w_next, A = ppermute((w, A + P))           P = partial(w)
        hop N-1:      A = ppermute(A + P)                        P = partial(w)
        return:       dW = ppermute(A + P)

Token routing (experts stay, tokens travel). At hop h device `me` holds the token partition of
device (me - h) mod N, with its routing metadata (pair order, counts). Each hop computes the
visiting partition's partial output P into fresh zeros; the output accumulator A of that partition
trails its tokens by one hop, merged with P and sent on with the next tokens, so nothing a loop
body sends depends on that body's compute (the transfer can hide behind the hop's chunk loop):
    forward:
        hop 0:        tk_next = ppermute(tk)                     P = hop(tk)
        hop 1..N-2:   tk_next, A = ppermute((tk, A + P))         P = hop(tk)
        hop N-1:      A = ppermute(A + P)                        P = hop(tk)   # tokens stay
        return:       out = ppermute(A + P)                      # each partition's full sum, home
    backward:  tokens and output gradients travel like tk above; the dx and d expert_weights
               accumulators trail them exactly like A / P; dW accumulates locally. Nothing per
               hop saved.
    N == 1: out = hop(tk), no transfers. Bytes sent are those of accumulating in place (tokens
    N-1 times, accumulator N times); the cost is the partial next to the accumulator in flight:
    forward one more [T, H] f32, backward one more [T, H] f32 (dx) + [T*k] f32 (d weights). With
    the transfer asynchronous its send and receive buffers are both live during the hop's compute
    (measured, XLA:GPU, 8 x H100, T=1024 H=256 bf16: +1.6 MiB forward, +2.1 MiB fwd+bwd temps).

dW is summed over `reduce_axes` (mesh axes whose devices hold other tokens for the same weights).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch.hop import Hop, RingConfig, make_tokens, shift, zeros_f32
from relaymoe_jax.first_order import first_order

__all__ = ["RingConfig", "ring_moe"]


def _expert_forward(cfg, tk, w):
    hop = Hop(cfg, tk)
    n = hop.n
    out_th = zeros_f32(tk.x_th.shape, tk.x_th)

    def body(h, carry):
        w, out_th = carry
        w_next = shift(w, cfg.axis, n)
        return w_next, hop.forward(tk, (hop.me - h) % n, w, out_th)

    w, out_th = lax.fori_loop(0, n - 1, body, (w, out_th))
    return hop.forward(tk, (hop.me + 1) % n, w, out_th)   # partition me - (N-1)


def _expert_backward(cfg, tk, w, dy_th):
    hop = Hop(cfg, tk)
    n, me = hop.n, hop.me
    dx_th = zeros_f32(tk.x_th.shape, tk.x_th)
    dwts_p = zeros_f32(tk.wts_p.shape, tk.wts_p)
    zero_dw = lambda: tuple(zeros_f32(a.shape, a, tk.x_th) for a in w)
    partial = lambda h, w, dx_th, dwts_p: hop.backward(tk, (me - h) % n, w, dy_th, dx_th,
                                                       dwts_p, zero_dw())
    add = functools.partial(jax.tree.map, jnp.add)
    if n == 1:
        dw, dx_th, dwts_p = partial(0, w, dx_th, dwts_p)
        return dw, dx_th, dwts_p
    w_next = shift(w, cfg.axis, n)                            # hop 0: weights only
    part, dx_th, dwts_p = partial(0, w, dx_th, dwts_p)

    def body(h, carry):                                       # hops 1..N-2: weights + trailing dW
        w, part, acc, dx_th, dwts_p = carry
        w_next, acc = shift((w, add(acc, part)), cfg.axis, n)
        part, dx_th, dwts_p = partial(h, w, dx_th, dwts_p)
        return w_next, part, acc, dx_th, dwts_p

    w, part, acc, dx_th, dwts_p = lax.fori_loop(
        1, n - 1, body, (w_next, part, zero_dw(), dx_th, dwts_p))
    acc = shift(add(acc, part), cfg.axis, n)                  # hop N-1: gradient only
    part, dx_th, dwts_p = partial(n - 1, w, dx_th, dwts_p)
    return shift(add(acc, part), cfg.axis, n), dx_th, dwts_p  # return dW to its owner


def _token_forward(cfg, tk, w):
    hop = Hop(cfg, tk)
    n = hop.n
    partial = lambda tk: hop.forward(tk, hop.me, w, zeros_f32(tk.x_th.shape, tk.x_th))
    if n == 1:
        return partial(tk)
    tk_next = shift(tk, cfg.axis, n)                          # hop 0: tokens only
    part = partial(tk)

    def body(h, carry):                                       # hops 1..N-2: tokens + trailing out
        tk, part, acc = carry
        tk_next, acc = shift((tk, acc + part), cfg.axis, n)   # independent of this hop's compute
        return tk_next, partial(tk), acc

    tk, part, acc = lax.fori_loop(1, n - 1, body,
                                  (tk_next, part, zeros_f32(tk.x_th.shape, tk.x_th)))
    acc = shift(acc + part, cfg.axis, n)                      # hop N-1: output only
    part = partial(tk)
    return shift(acc + part, cfg.axis, n)                     # return out to its owner


def _token_backward(cfg, tk, w, dy_th):
    hop = Hop(cfg, tk)
    n = hop.n
    zero_acc = lambda tk: (zeros_f32(tk.x_th.shape, tk.x_th), zeros_f32(tk.wts_p.shape, tk.wts_p))
    add = functools.partial(jax.tree.map, jnp.add)

    def partial(travel, dw):                                  # (dx_th, dwts_p) of this hop, dW
        tk, dy_th = travel
        dw, dx_th, dwts_p = hop.backward(tk, hop.me, w, dy_th, *zero_acc(tk), dw)
        return (dx_th, dwts_p), dw

    travel = (tk, dy_th)
    dw = tuple(zeros_f32(a.shape, a, tk.x_th) for a in w)
    if n == 1:
        (dx_th, dwts_p), dw = partial(travel, dw)
        return dw, dx_th, dwts_p
    travel_next = shift(travel, cfg.axis, n)                  # hop 0: tokens and dy only
    part, dw = partial(travel, dw)

    def body(h, carry):                                       # hops 1..N-2: + trailing dx, dwts
        travel, part, acc, dw = carry
        travel_next, acc = shift((travel, add(acc, part)), cfg.axis, n)
        part, dw = partial(travel, dw)
        return travel_next, part, acc, dw

    travel, part, acc, dw = lax.fori_loop(1, n - 1, body, (travel_next, part, zero_acc(tk), dw))
    acc = shift(add(acc, part), cfg.axis, n)                  # hop N-1: gradients only
    part, dw = partial(travel, dw)
    dx_th, dwts_p = shift(add(acc, part), cfg.axis, n)        # return dx, dwts to their owner
    return dw, dx_th, dwts_p


_MODES = {"expert": (_expert_forward, _expert_backward),
          "token": (_token_forward, _token_backward)}


@functools.cache
def _ring_op(cfg: RingConfig):
    forward, backward = _MODES[cfg.routing]

    def fwd(x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
        tk = make_tokens(cfg, x_th, ids_tk, wts_tk)
        w = (w_gate, w_up, w_down)
        return forward(cfg, tk, w).astype(x_th.dtype), (tk, w)

    def bwd(res, dy_th):
        (tk, w), dy_th = first_order((res, dy_th))
        dw, dx_th, dwts_p = backward(cfg, tk, w, dy_th)
        if cfg.reduce_axes:
            dw = lax.psum(dw, cfg.reduce_axes)
        dw = tuple(d.astype(a.dtype) for d, a in zip(dw, w))
        return (dx_th.astype(tk.x_th.dtype), None,
                dwts_p.reshape(-1, tk.top_k).astype(tk.wts_p.dtype), *dw)

    @jax.custom_vjp
    def ring(x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
        return fwd(x_th, ids_tk, wts_tk, w_gate, w_up, w_down)[0]

    ring.defvjp(fwd, bwd)
    return ring


def ring_moe(cfg: RingConfig, x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
    """Per-device body (call inside shard_map): y[T, H] for the local tokens."""
    return _ring_op(cfg)(x_th, ids_tk, wts_tk, w_gate, w_up, w_down)
