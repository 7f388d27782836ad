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

Both modes are one schedule, `relay`: a payload (weights; tokens) visits every device once, and
an accumulator (none; dW; out; dx and d expert_weights) trails it by one hop and ends on the
payload's owner. On a ring of two nothing trails: shift(shift(a) + b) = a + shift(b), so the
owner keeps its own part and the other comes home after the last hop (one transfer fewer, and no
accumulator in flight beside the last hop).

Hierarchical ring (`cfg.hierarchical`, expert axes (outer..., inner), M = outer size, L = inner
size; ring position = outer * L + inner). `relay` nests: an outer hop is a round, and a round is
a whole inner relay. At round r, inner hop h, device (o, i) holds the payload of (o - r, i - h).
    round r:   payload_next, A_out = ppermute_outer((payload, A_out + P_round))   # r >= 1
               P_round = inner relay of `payload` over the L devices of this node
    The payload this device holds at the start of round r (which it also computes at hop 0) goes
    to the same local index on the next node while the round's L hops run: one inter-node
    transfer per round per GPU, by all L GPUs of a node in parallel, none per inner hop. P_round
    is the node's summed parts for that payload, delivered by the inner relay to the device that
    held it at the round's start; the outer accumulator trails it by one round (backward dW,
    token routing's outputs and dx), then goes home over the outer axis after the last round.
    A flat ring over the same devices sends N - 1 payloads across hosts per boundary GPU per
    pass; this one M - 1 per GPU. The cost, while a round runs: the round-start payload (held for
    its send) and the next round's (received), and in the backward the outer accumulator's send
    and receive buffers (float32 dW: two bf16 payloads each). At M = 2 no accumulator crosses
    (the ring of two above): the owner's own part waits through the second round instead.

dW is summed over `reduce_axes` (mesh axes whose devices hold other tokens for the same weights).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch.activation import SWIGLU, Activation
from relaymoe_jax.dispatch.experts import Experts
from relaymoe_jax.dispatch.hop import Hop, make_tokens, shift, zeros_f32
from relaymoe_jax.quant import fp8
from relaymoe_jax.util.first_order import first_order

__all__ = ["RingConfig", "ring_moe"]

add = functools.partial(jax.tree.map, jnp.add)


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Everything static about one device's ring (hashable: one custom VJP per config)."""

    axis: tuple  # the expert mesh axis (or axes) the ring runs over
    num_experts: int  # E (global)
    chunk: int  # C, pairs per chunk
    reduce_axes: tuple  # mesh axes whose devices hold other tokens for the same weights
    routing: str = "expert"  # "expert": weights travel; "token": tokens travel
    gmm_impl: str = "auto"
    poison: bool = False  # fill padding rows with NaN (tests)
    hierarchical: bool = False  # rounds of an inner ring over axis[-1], rounds over axis[:-1]
    activation: Activation = SWIGLU  # the experts' gated activation
    # the FP8 recipe (docs/precision.md): the weights are quantised once, at the ring's entry, to
    # e4m3 and 128 x 128 block scales (`Experts.quantized`): what expert routing relays (half the
    # bytes), what token routing's hops multiply, and the backward's residual either way (their
    # gradient passes straight through, as `Experts.fake_quantized`'s); the activation side is
    # `experts.expert_mlp`'s and `Hop`'s, and token routing relays x and dy (already e4m3's
    # values per 1 x 128 tile) as e4m3 and tile scales (`_send`)
    fp8_acts: bool = False


class RingLevel(NamedTuple):
    """One ring of `relay`: its mesh axes, its size and this device's index on it."""

    axes: tuple
    size: int
    index: jax.Array


def _rings(cfg, hop) -> tuple[RingLevel, ...]:
    """The rings, outermost first: the one flat ring over all of `cfg.axis` (the hop's own size
    and index), or (hierarchical) the outer ring over `axis[:-1]` and the inner over `axis[-1]`.
    Ring position = outer index * inner size + inner index = the flat index over `cfg.axis`."""
    if not cfg.hierarchical:
        return (RingLevel(cfg.axis, hop.n, hop.me),)
    return tuple(
        RingLevel(a, lax.axis_size(a), lax.axis_index(a)) for a in (cfg.axis[:-1], cfg.axis[-1:])
    )


def relay(rings, payload, visit, state, zero_acc=None, base=None):
    """Circulate `payload` over `rings` so that every device holds every device's payload once.

    visit(src, payload, state) -> (part, state): `src` is the ring position the payload started
    on; `part` (None without `zero_acc`) is this visit's contribution to that payload's
    accumulator, which trails the payload by one hop and is delivered to its owner at the end.
    Returns (state, the payload's accumulated parts, on its owner; None without `zero_acc`).

    With two rings the outer one moves a payload once per round and a round is a whole inner
    ring (the nested call): the payload held at the start of a round goes to the next node while
    the round's inner hops run, and the round's accumulated parts trail it by one round.
    """
    (axis, n, me), inner = rings[0], rings[1:]

    def hop(h, payload, state):
        src = (me - h) % n if base is None else base * n + (me - h) % n
        if not inner:
            return visit(src, payload, state)
        rnd = lambda payload, state: relay(inner, payload, visit, state, zero_acc, src)
        if n == 1:  # one node: nothing of this level in flight
            state, part = rnd(payload, state)
            return part, state
        # A round: one instruction for the scheduler (a conditional that always takes it), so
        # that XLA:GPU keeps this level's transfer in flight across the whole round. Inlined,
        # the round's peeled inner transfers sit beside it and its scheduler starts it after
        # them (measured on the compiled 1x4x8 program: 0 of 8 hops).
        never = lambda payload, state: (state, zero_acc() if zero_acc else None)
        state, part = lax.cond(me < n, rnd, never, payload, state)
        return part, state

    if n == 1:
        part, state = hop(0, payload, state)
        return state, part
    if n == 2 and zero_acc is not None:  # shift(shift(a) + b) == a + shift(b): nothing trails
        payload_next = shift(payload, axis, n)
        part, state = hop(0, payload, state)  # the owner's own part stays
        other, state = hop(1, payload_next, state)
        return state, add(part, shift(other, axis, n))  # the other part comes home
    if zero_acc is None:  # nothing trails the payload

        def body(h, carry):
            payload, state = carry
            return shift(payload, axis, n), hop(h, payload, state)[1]

        payload, state = lax.fori_loop(0, n - 1, body, (payload, state))
        return hop(n - 1, payload, state)[1], None
    payload_next = shift(payload, axis, n)  # hop 0: the payload only
    part, state = hop(0, payload, state)

    def body(h, carry):  # hops 1..n-2: + trailing parts
        payload, part, acc, state = carry
        payload_next, acc = shift((payload, add(acc, part)), axis, n)  # independent of hop h
        part, state = hop(h, payload, state)
        return payload_next, part, acc, state

    payload, part, acc, state = lax.fori_loop(
        1, n - 1, body, (payload_next, part, zero_acc(), state)
    )
    acc = shift(add(acc, part), axis, n)  # hop n-1: the parts only
    part, state = hop(n - 1, payload, state)
    if inner:  # the trip home waits for all of acc's arrays: none combines with their send
        acc, part = lax.optimization_barrier((acc, part))
    return state, shift(add(acc, part), axis, n)  # home to the payload's owner


def _expert_forward(cfg, tk, w):
    hop = Hop(cfg, tk)
    visit = lambda src, w, out_th: (None, hop.forward(tk, src, hop.weights(w), out_th))
    return relay(_rings(cfg, hop), w, visit, zeros_f32(tk.x_th.shape, tk.x_th))[0]


def _zero_grads(w: Experts, like):
    """float32 zeros shaped as each of w's arrays, anchored to it (`zeros_f32`); an e4m3 matrix
    anchors its zeros by its values: no dequantised copy is made for them."""
    is_fp8 = lambda a: isinstance(a, fp8.Fp8)
    return jax.tree.map(lambda a: zeros_f32(a.shape, a, like), w, is_leaf=is_fp8)


def _expert_backward(cfg, tk, w, dy_th):
    hop = Hop(cfg, tk)
    # zeros made once the weights they pair with exist (`late_zero`): anchored to the home
    # weights, the last hop's partial would be allocated before the loop and live through it
    zeros = lambda w: _zero_grads(w, tk.x_th)

    def visit(src, w, state):  # partial dW of the visiting w
        dw, dx_th, dwts_p = hop.backward(tk, src, hop.weights(w), dy_th, *state, zeros(w))
        return dw, (dx_th, dwts_p)

    state = (zeros_f32(tk.x_th.shape, tk.x_th), zeros_f32(tk.wts_p.shape, tk.wts_p))
    (dx_th, dwts_p), dw = relay(_rings(cfg, hop), w, visit, state, lambda: zeros(w))
    return dw, dx_th, dwts_p


def _send(cfg, a_th):
    """A token matrix as it travels: with the FP8 recipe as e4m3 and its 1 x 128 tile scales, half
    the bytes (x rounded here to what the hop would round it to; dy is rounded so by the ring's
    backward itself), and the hop dequantises each chunk's rows of it (`Hop.rows`, exact)."""
    return fp8.quantize(a_th, fp8.TILE) if cfg.fp8_acts else a_th


def _token_forward(cfg, tk, w):
    hop = Hop(cfg, tk)
    w_mm = hop.weights(w)  # the local experts, quantised once for every visitor

    def visit(src, tk, state):  # an e4m3 x is dequantised per chunk in the hop (`Hop.rows`)
        return hop.forward(tk, hop.me, w_mm, zeros_f32(tk.x_th.shape, tk.x_th)), state

    zero = lambda: zeros_f32(tk.x_th.shape, tk.x_th)
    return relay(_rings(cfg, hop), tk._replace(x_th=_send(cfg, tk.x_th)), visit, (), zero)[1]


def _token_backward(cfg, tk, w, dy_th):
    hop = Hop(cfg, tk)
    zeros = lambda tk: (zeros_f32(tk.x_th.shape, tk.x_th), zeros_f32(tk.wts_p.shape, tk.wts_p))
    w_mm = hop.weights(w)

    def visit(src, travel, dw):  # (dx_th, dwts_p) of the visitor
        tk, dy_th = travel  # e4m3 x and dy dequantised per chunk in the hop (`Hop.rows`)
        dw, dx_th, dwts_p = hop.backward(tk, hop.me, w_mm, dy_th, *zeros(tk), dw)
        return (dx_th, dwts_p), dw

    dw = _zero_grads(w, tk.x_th)
    # x rounded for its trip again, behind a barrier: XLA would otherwise merge this rounding
    # with the forward's (the same op on the same x) and keep that e4m3 x from the forward to
    # the backward, which cost 545 MiB of peak at the paper shape (BENCHMARKS, the E128 FP8
    # rows). Tied to dy, so that neither it nor the backward's first permute of it can run
    # beside the forward's ring: XLA:CPU's in-process collectives mix up the participants of two
    # permutes in flight at once ("Unexpected number of participants", an abort: 1 run in 6 of
    # tests/test_fp8_op.py with x alone behind the barrier, 2026-12-08)
    x_th = tk.x_th if not cfg.fp8_acts else lax.optimization_barrier((tk.x_th, dy_th))[0]
    travel = (tk._replace(x_th=_send(cfg, x_th)), dy_th)  # dy: an e4m3 record already (`bwd`)
    dw, (dx_th, dwts_p) = relay(_rings(cfg, hop), travel, visit, dw, lambda: zeros(tk))
    return dw, dx_th, dwts_p


_MODES = {"expert": (_expert_forward, _expert_backward), "token": (_token_forward, _token_backward)}


@functools.cache
def _ring_op(cfg: RingConfig):
    forward, backward = _MODES[cfg.routing]

    def fwd(x_th, ids_tk, wts_tk, w):
        tk = make_tokens(cfg, x_th, ids_tk, wts_tk)
        w = w.quantized() if cfg.fp8_acts else w  # what travels or stays, and the residual
        return forward(cfg, tk, w).astype(x_th.dtype), (tk, w)

    def bwd(res, dy_th):
        (tk, w), dy_th = first_order((res, dy_th))
        if cfg.fp8_acts:  # rounded per 1 x 128 tile once: e4m3 and scales, half the bytes of
            dy_th = fp8.quantize(dy_th, fp8.TILE)  # bf16; the hops dequantise a chunk's rows
        dw, dx_th, dwts_p = backward(cfg, tk, w, dy_th)
        if cfg.reduce_axes:
            dw = lax.psum(dw, cfg.reduce_axes)
        dw = jax.tree.map(lambda d, a: d.astype(a.dtype), dw, w.dequantized())
        return (
            dx_th.astype(tk.x_th.dtype),
            None,
            dwts_p.reshape(-1, tk.top_k).astype(tk.wts_p.dtype),
            dw,
        )

    @jax.custom_vjp
    def ring(x_th, ids_tk, wts_tk, w):
        return fwd(x_th, ids_tk, wts_tk, w)[0]

    ring.defvjp(fwd, bwd)
    return ring


def ring_moe(cfg: RingConfig, x_th, ids_tk, wts_tk, experts: Experts):
    """Per-device body (call inside shard_map): y[T, H] for the local tokens. `experts`: this
    device's partition, the payload of expert routing (biases, if any, travel with their weights,
    and the weight gradient, an `Experts` too, comes home like them)."""
    return _ring_op(cfg)(x_th, ids_tk, wts_tk, experts)
