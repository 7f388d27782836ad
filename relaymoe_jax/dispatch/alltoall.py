"""The Megatron-style all-to-all baseline (per device, inside `jax.shard_map`).

Pipeline (paper Figure 2), each stage one buffer, no needless copies; `alltoall_moe` calls the
stages in order, each under a `jax.named_scope` (in brackets):
  1. `permute` (a2a_permute): pairs sorted by global expert, token rows gathered into the send
     buffer [N * B, H] (one block of B rows per destination device, rows sorted by local expert);
  2. `lax.all_to_all` of the send buffer and of the [N, E_l] counts (a2a_dispatch);
  3. `sort_local` (a2a_sort_local): the received rows sorted by local expert (one gather);
  4. `expert_compute` (a2a_experts): the expert MLP (`dispatch.experts.expert_mlp`) with grouped
     matmuls (bf16 operands in both passes: the kernels cast a float32 cotangent down,
     `kernels/gmm/common.py`; no work for the padding rows, which the Pallas kernel leaves
     unwritten: `zero_padding=False`);
  5.-7. `combine` (a2a_combine): unsort back to the receive layout, `lax.all_to_all` back,
     unpermute: scale by the router weight and scatter-add into [T, H].
Autodiff gives the backward (as in Megatron, the expanded intermediates are kept for it).

With the FP8 recipe (`fp8_acts`, docs/precision.md) the rows are dispatched as e4m3 and tile
scales (`fp8_all_to_all`), each pair's router weight travels with its row (4 bytes, float32) and
is applied inside the down projection (`dispatch.weighted_down`: the e4m3 kernel's dgrad then
reads the rounded dy itself, as the ring's hop does), and the combine only sums.

Static sizing (XLA:CPU has no ragged all-to-all, so every block has a fixed size B):
- dropless (capacity_factor=None): B = T * min(k, E_l). A token picks at most min(k, E_l) experts
  of one device when its k ids are distinct (what a top-k router gives), so nothing is dropped.
  The receive buffer is N * B = T*k * min(N, E/k) rows: MaxText's "balanced x min(EP, E/k)".
  Should a token repeat an id, any overflow is counted in `dropped_pairs`, never lost silently.
- capacity_factor=c: each expert takes at most cap_e = ceil(c * T*k / E) pairs from each source
  device, in token order (GShard/MaxText expert capacity); B = E_l * cap_e, so the buffers are
  c x the balanced size. Excess pairs are dropped and counted in `dropped_pairs`.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch import pairs
from relaymoe_jax.dispatch.activation import SWIGLU, Activation
from relaymoe_jax.dispatch.experts import Experts, act_operand, expert_mlp, gate_up, row_bias
from relaymoe_jax.dispatch.weighted_down import Gemms, weighted_down
from relaymoe_jax.kernels.gmm import gmm, impl_kwargs, resolve_impl
from relaymoe_jax.quant import fp8
from relaymoe_jax.util.sorted_search import count_at_most


@dataclasses.dataclass(frozen=True)
class AllToAllConfig:
    axis: str
    num_experts: int
    capacity_factor: float | None  # None: dropless
    stat_axes: tuple  # all token axes: the drop count is summed over them
    gmm_impl: str = "auto"
    poison: bool = False
    activation: Activation = SWIGLU  # the experts' gated activation
    fp8_acts: bool = False  # the FP8 recipe's activation side (`experts.expert_mlp`)


def _all_to_all(a, axis):
    return lax.all_to_all(a, axis, 0, 0, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fp8_all_to_all(a_rh, axis):
    """The dispatch's all-to-all of rows whose values are already e4m3's per 1 x 128 tile (the
    FP8 recipe's `quantize_operand`): sent as e4m3 and tile scales, half the bytes, and
    dequantised exactly on arrival; the gradient goes back in 16 bits (as DeepSeek-V3 combines
    in bf16)."""
    sent = jax.tree.map(lambda a: _all_to_all(a, axis), fp8.quantize(a_rh, fp8.TILE))
    return fp8.dequantize(sent)


fp8_all_to_all.defvjp(
    lambda a_rh, axis: (fp8_all_to_all(a_rh, axis), None),
    lambda axis, _, g: (_all_to_all(g, axis),),  # a tiled all-to-all is its own transpose
)


def block_rows(tokens, top_k, num_experts, n, capacity_factor):
    """B, the rows one device sends to one destination device."""
    e_local = num_experts // n
    if capacity_factor is None:
        return tokens * min(top_k, e_local)
    return e_local * expert_capacity(tokens, top_k, num_experts, capacity_factor)


def expert_capacity(tokens, top_k, num_experts, capacity_factor):
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


class Sent(NamedTuple):
    """The send buffer of the permute stage, and where its rows came from."""

    send_rh: jax.Array  # [N * B, H] token rows, a block of B per destination, by local expert
    send_counts: jax.Array  # [N, E_l] int32 rows per destination device and local expert
    slot_pair: jax.Array  # [N * B] int32 the pair in each row (clamped for padding rows)
    slot_ok: jax.Array  # [N * B] bool: the row holds a pair
    dropped: jax.Array  # int32 pairs dropped on this device (over capacity or overflow)
    send_w: jax.Array | None = None  # [N * B] float32 router weights (FP8: sent with the rows)


class Sorted(NamedTuple):
    """The received rows sorted by local expert, and the way back to the receive layout."""

    xs_rh: jax.Array  # [N * B, H] rows by local expert (padding rows past them)
    group_sizes: jax.Array  # [E_l] int32 received rows per local expert
    dst: jax.Array  # [N * B] int32 each received row's sorted row (N * B: padding)
    row_ok: jax.Array  # [N, B] bool: the received row holds a pair
    wts_r: jax.Array | None = None  # [N * B] float32 each sorted row's router weight (FP8)


def alltoall_moe(cfg: AllToAllConfig, x_th, ids_tk, wts_tk, experts: Experts):
    """Returns (y [T, H], dropped_pairs int32 summed over the token axes): the stages in order,
    each under its `jax.named_scope`."""
    n = lax.axis_size(cfg.axis)
    b = block_rows(*ids_tk.shape, cfg.num_experts, n, cfg.capacity_factor)
    with jax.named_scope("a2a_permute"):
        sent = permute(cfg, x_th, ids_tk, wts_tk, n, b)
    with jax.named_scope("a2a_dispatch"):
        recv_rh = (fp8_all_to_all if cfg.fp8_acts else _all_to_all)(sent.send_rh, cfg.axis)
        recv_counts = lax.all_to_all(sent.send_counts, cfg.axis, 0, 0, tiled=True)  # [src, E_l]
        recv_w = None if sent.send_w is None else _all_to_all(sent.send_w, cfg.axis)
    with jax.named_scope("a2a_sort_local"):
        local = sort_local(cfg, recv_rh, recv_counts, b, recv_w)
    with jax.named_scope("a2a_experts"):
        ys_rh = expert_compute(cfg, experts, local, x_th.dtype)
    with jax.named_scope("a2a_combine"):
        out_th = combine(cfg, ys_rh, local, sent, wts_tk, x_th.shape)
    dropped = sent.dropped
    if cfg.stat_axes:
        dropped = lax.psum(dropped, cfg.stat_axes)
    return out_th.astype(x_th.dtype), dropped


def permute(cfg: AllToAllConfig, x_th, ids_tk, wts_tk, n, b) -> Sent:
    """Stage 1: pairs sorted by global expert (capacity applied), token rows gathered into the
    send buffer (and, FP8, their router weights into `send_w`)."""
    t, k = ids_tk.shape
    num_e = cfg.num_experts
    e_local, rows = num_e // n, n * b
    order, counts_e = pairs.sort_pairs(ids_tk, num_e)
    key_s = pairs.pair_keys(ids_tk, num_e)[order]  # sorted keys
    real = key_s < num_e
    start_e = pairs.exclusive_cumsum(counts_e)
    keep = real
    if cfg.capacity_factor is not None:
        cap = expert_capacity(t, k, num_e, cfg.capacity_factor)
        pos_in_e = jnp.arange(t * k) - start_e[jnp.minimum(key_s, num_e - 1)]
        keep = keep & (pos_in_e < cap)
    dest = jnp.minimum(key_s, num_e - 1) // e_local
    kept_e = jnp.zeros((num_e + 1,), jnp.int32).at[jnp.where(keep, key_s, num_e)].add(1)
    kept_e = kept_e[:num_e]
    kept_dev_start = pairs.exclusive_cumsum(kept_e.reshape(n, e_local).sum(1))
    slot = jnp.cumsum(keep) - 1 - kept_dev_start[dest]
    keep = keep & (slot < b)  # overflow (repeated ids) only
    send_counts = (
        jnp.zeros((num_e + 1,), jnp.int32)
        .at[jnp.where(keep, key_s, num_e)]
        .add(1)[:num_e]
        .reshape(n, e_local)
    )
    dropped = jnp.sum(real & ~keep).astype(jnp.int32)
    slot_g = jnp.where(keep, dest * b + slot, rows)
    slot_pair = jnp.full((rows,), t * k, jnp.int32).at[slot_g].set(order, mode="drop")
    slot_ok = slot_pair < t * k
    slot_pair = jnp.minimum(slot_pair, t * k - 1)
    send_rh = pairs.take_rows(x_th, slot_pair // k, slot_ok, cfg.poison)  # pads: never read
    send_w = _slot_weights(wts_tk, slot_pair, slot_ok) if cfg.fp8_acts else None
    return Sent(send_rh, send_counts, slot_pair, slot_ok, dropped, send_w)


def _slot_weights(wts_tk, slot_pair, slot_ok):
    """[N * B] float32: the router weight of each slot's pair (0 in padding slots)."""
    return jnp.where(slot_ok, wts_tk.reshape(-1)[slot_pair], 0).astype(jnp.float32)


def sort_local(cfg: AllToAllConfig, recv_rh, recv_counts, b, recv_w=None) -> Sorted:
    """Stage 3: the received rows ([src, E_l] blocks) sorted by local expert (one gather), and
    their router weights `recv_w` with them where given."""
    rows = recv_rh.shape[0]
    e_local = recv_counts.shape[1]
    group_sizes = recv_counts.sum(0)
    blk_end = jnp.cumsum(recv_counts, axis=1)  # [src, E_l]
    j = jnp.arange(b)
    e_of = count_at_most(blk_end, j[None, :])  # [src, b]
    row_ok = j[None, :] < blk_end[:, -1:]
    e_of = jnp.minimum(e_of, e_local - 1)
    rank = j[None, :] - jnp.take_along_axis(blk_end - recv_counts, e_of, axis=1)
    src_before = pairs.exclusive_cumsum(recv_counts, axis=0)  # [src, E_l]
    dst = (
        pairs.exclusive_cumsum(group_sizes)[e_of]
        + jnp.take_along_axis(src_before, e_of, axis=1)
        + rank
    )
    dst = jnp.where(row_ok, dst, rows).reshape(-1)
    src_of = (
        jnp.full((rows,), rows, jnp.int32)
        .at[dst]
        .set(jnp.arange(rows, dtype=jnp.int32), mode="drop")
    )
    sorted_ok = src_of < rows
    # the padding rows' gradient comes back unwritten from the kernels (zero_padding=False)
    src = jnp.minimum(src_of, rows - 1)
    xs_rh = pairs.take_rows_masked_grad(recv_rh, src, sorted_ok, cfg.poison)
    wts_r = None if recv_w is None else pairs.take_rows_masked_grad(recv_w, src, sorted_ok, False)
    return Sorted(xs_rh, group_sizes, dst, row_ok, wts_r)


def expert_compute(cfg: AllToAllConfig, experts: Experts, local: Sorted, dtype):
    """Stage 4: the experts' MLP on the sorted rows, as grouped matmuls ([N * B, H], `dtype`).

    Padding rows (past the received pairs: ~7/8 of a dropless buffer at EP=8) get no kernel work
    and stay unwritten (`zero_padding=False`); every read of them after is a select (`where`),
    never a product. Their expert is past the last one, so a bias adds 0 there.

    The FP8 recipe (`cfg.fp8_acts`): each row's router weight is applied here, inside the down
    projection (`weighted_down`: its dgrad runs on the rounded dy itself, the e4m3 kernel on
    Hopper, as the ring's hop), and the combine only sums."""
    if cfg.fp8_acts:
        return _expert_compute_fp8(cfg, experts, local, dtype)
    mm = lambda a, w, a_rows=None: gmm(
        a,
        w,
        local.group_sizes,
        **impl_kwargs(cfg.gmm_impl),
        preferred_element_type=jnp.float32,
        zero_padding=False,
    )
    rows = lambda: pairs.group_of_rows(local.group_sizes, local.xs_rh.shape[0])
    y = expert_mlp(experts, cfg.activation, local.xs_rh, mm, rows, dtype, fp8_acts=cfg.fp8_acts)
    return y.astype(dtype)


def _expert_compute_fp8(cfg: AllToAllConfig, experts: Experts, local: Sorted, dtype):
    """`expert_compute` under the FP8 recipe: `expert_mlp`'s formula with the router weight inside
    the down projection (and its bias), on the e4m3 kernel where it runs (`Gemms`)."""
    kw = impl_kwargs(cfg.gmm_impl)
    gemms = Gemms(tuple(sorted(kw.items())), resolve_impl(**kw) == "mosaic")
    gs, wts_r = local.group_sizes, local.wts_r
    mm = lambda a, w, a_rows=None: gemms.mm(a, w, gs)
    rows = lambda: pairs.group_of_rows(gs, local.xs_rh.shape[0])
    gate, up, expert_r = gate_up(experts, local.xs_rh, mm, rows, fp8_grads=True)
    act = act_operand(cfg.activation(gate, up), dtype, True)
    y = weighted_down(act, experts.w_down, wts_r, gs, gemms)
    if expert_r is not None:
        y = y + wts_r[:, None] * row_bias(experts.b_down, expert_r)
    return y.astype(dtype)


def combine(cfg: AllToAllConfig, ys_rh, local: Sorted, sent: Sent, wts_tk, shape):
    """Stages 5-7: unsort to the receive layout, all-to-all back, scale by the router weights and
    scatter-add into the tokens ([T, H] float32)."""
    rows, k = ys_rh.shape[0], wts_tk.shape[1]
    dst, ok = jnp.minimum(local.dst, rows - 1), local.row_ok.reshape(-1)
    yr_rh = pairs.take_rows(ys_rh, dst, ok, cfg.poison)
    yb_rh = lax.all_to_all(yr_rh, cfg.axis, 0, 0, tiled=True).astype(jnp.float32)
    slot_pair, slot_ok = sent.slot_pair, sent.slot_ok
    if sent.send_w is None:  # FP8: weighted already (`expert_compute`)
        yb_rh = yb_rh * _slot_weights(wts_tk, slot_pair, slot_ok)[:, None]
    contrib = jnp.where(slot_ok[:, None], yb_rh, 0.0)
    return jnp.zeros(shape, jnp.float32).at[slot_pair // k].add(contrib)
