"""The Megatron-style all-to-all baseline (per device, inside `jax.shard_map`).

Pipeline (paper Figure 2), each stage one buffer, no needless copies:
  1. permute + expand: pairs sorted by global expert, token rows gathered into the send buffer
     [N * B, H] (one block of B rows per destination device, rows sorted by local expert);
  2. `lax.all_to_all` of the send buffer (and of the [N, E_l] counts);
  3. sort the received rows by local expert (one gather) -> [N * B, H];
  4. grouped matmuls gate/up -> SwiGLU -> down (bf16 operands in both passes: the kernels cast
     a float32 cotangent down, `kernels/gmm/common.py`; no work for the padding rows, which the
     Pallas kernel leaves unwritten: `zero_padding=False`);
  5. unsort back to the receive layout;
  6. `lax.all_to_all` back;
  7. unpermute: scale by the router weight and scatter-add into [T, H].
Autodiff gives the backward (as in Megatron, the expanded intermediates are kept for it).

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
import math

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch import pairs
from relaymoe_jax.dispatch.activation import SWIGLU, Activation
from relaymoe_jax.kernels.gmm import gmm, impl_kwargs
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


def block_rows(tokens, top_k, num_experts, n, capacity_factor):
    """B, the rows one device sends to one destination device."""
    e_local = num_experts // n
    if capacity_factor is None:
        return tokens * min(top_k, e_local)
    return e_local * expert_capacity(tokens, top_k, num_experts, capacity_factor)


def expert_capacity(tokens, top_k, num_experts, capacity_factor):
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def alltoall_moe(cfg: AllToAllConfig, x_th, ids_tk, wts_tk, w_gate, w_up, w_down, *biases):
    """Returns (y [T, H], dropped_pairs int32 summed over the token axes)."""
    n = lax.axis_size(cfg.axis)
    t, k = ids_tk.shape
    num_e = cfg.num_experts
    e_local = num_e // n
    b = block_rows(t, k, num_e, n, cfg.capacity_factor)
    rows = n * b

    with jax.named_scope("a2a_permute"):
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

    with jax.named_scope("a2a_dispatch"):
        recv_rh = lax.all_to_all(send_rh, cfg.axis, 0, 0, tiled=True)
        recv_counts = lax.all_to_all(send_counts, cfg.axis, 0, 0, tiled=True)  # [src, E_l]

    with jax.named_scope("a2a_sort_local"):
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
        xs_rh = pairs.take_rows_masked_grad(
            recv_rh, jnp.minimum(src_of, rows - 1), sorted_ok, cfg.poison
        )

    with jax.named_scope("a2a_experts"):
        # Padding rows (past the received pairs: ~7/8 of a dropless buffer at EP=8) get no kernel
        # work and stay unwritten; every read of them below is a select (`where`), never a product.
        mm = lambda a, w: gmm(
            a,
            w,
            group_sizes,
            **impl_kwargs(cfg.gmm_impl),
            preferred_element_type=jnp.float32,
            zero_padding=False,
        )
        gate, up = mm(xs_rh, w_gate), mm(xs_rh, w_up)
        if biases:  # the rows are sorted by local expert: padding rows (past them) add 0
            group = pairs.group_of_rows(group_sizes, rows)
            gate, up = (pairs.add_group_bias(a, b, group) for a, b in zip((gate, up), biases))
        act = cfg.activation(gate, up).astype(x_th.dtype)
        ys_rh = mm(act, w_down)
        if biases:
            ys_rh = pairs.add_group_bias(ys_rh, biases[2], group)
        ys_rh = ys_rh.astype(x_th.dtype)

    with jax.named_scope("a2a_combine"):
        yr_rh = pairs.take_rows(ys_rh, jnp.minimum(dst, rows - 1), row_ok.reshape(-1), cfg.poison)
        yb_rh = lax.all_to_all(yr_rh, cfg.axis, 0, 0, tiled=True)
        w_slot = jnp.where(slot_ok, wts_tk.reshape(-1)[slot_pair], 0).astype(jnp.float32)
        contrib = jnp.where(slot_ok[:, None], yb_rh.astype(jnp.float32) * w_slot[:, None], 0.0)
        out_th = jnp.zeros(x_th.shape, jnp.float32).at[slot_pair // k].add(contrib)

    if cfg.stat_axes:
        dropped = lax.psum(dropped, cfg.stat_axes)
    return out_th.astype(x_th.dtype), dropped
