"""What the flash-attention kernels share: the checks, the kernel's config, and the prepared
masks (padded per-token arrays and, per block, the range of blocks it must visit).

Masking is the chunked XLA path's (`blocks.py`): key t is visible to query q
iff `k_index[t] <= q_index[q]` and, with segment ids, `kseg[t] == qseg[q]`. The queries are cut
into blocks of `block_q` and the keys into blocks of `block_k`, padded to whole blocks (padded
queries: index PAD_QUERY, segment PAD_QUERY_SEG; padded keys: index PAD_KEY, segment
PAD_KEY_SEG). `blocks.key_ranges` / `blocks.query_ranges` give each block the blocks of the
other side it must visit as one range over a sorted order (`BlockRanges`: int32, O(nq + nk));
each kernel program walks only its block's range, reading the block numbers one by one from GPU
memory (`keys.perm[keys.start[i] + t]` for t < `keys.end[i] - keys.start[i]` for query block i,
`queries.perm[queries.start[j] + u]` for key block j). So a pair that the causal rule or the
documents mask entirely is never computed, forward or backward, whatever the order of the
tokens (zigzag included; see `blocks.py` for where the ranges are exact and where conservative).
"""

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from relaymoe_jax.kernels.attention.blocks import (
    PAD_KEY,
    PAD_KEY_SEG,
    PAD_QUERY,
    PAD_QUERY_SEG,
    BlockRanges,
    blocks,
    key_ranges,
    query_ranges,
)

HEAD_DIMS = (64, 128)  # what the kernels take (wgmma tiles of 64 columns, 128-byte swizzle)
DTYPES = (jnp.bfloat16, jnp.float16)
# The forward's lse (float32, natural log) of a query row that sees no key (padding, or a row
# whose documents hold no earlier key): o = 0 there. The backward must mask P with a select
# (`where(mask, p, 0)`), not a product: exp(s - EMPTY_LSE) is +inf on such rows.
EMPTY_LSE = float("-inf")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The Mosaic GPU kernels' tiling: `block_q` query rows per warpgroup (one wgmma M tile),
    `block_k` keys per step (64 or 128), `heads_per_program` query heads of one kv group per
    program (one warpgroup each, sharing the K/V tiles; lowered to a divisor of N // K).

    The defaults, from the deviceless H100 compile at head_dim 128 (ptxas, sm_90a): the forward
    at H=2 uses 181 registers and 122 KB of shared memory, no spills, and loads each K/V tile
    once for two query heads; the dQ kernel at H=2 218 registers, 154 KB; the dK/dV kernel (one
    warpgroup per 64 keys) 248, 113 KB. block_k=128 puts the forward and dQ at the 255-register
    cap (H=2 dQ overflows shared memory). Unmeasured on a GPU so far."""

    block_q: int = 64
    block_k: int = 64
    heads_per_program: int = 2


def check_head_dim(d: int) -> int:
    """`d` if the kernels take it, else a ValueError naming head_dim."""
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d}: the pallas attention kernel takes {HEAD_DIMS}")
    return d


def check_dtype(name: str, dtype) -> None:
    """A ValueError unless `dtype` is a 16-bit float (the kernels multiply on the tensor cores)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        raise ValueError(
            f"{name}: the pallas attention kernel takes bfloat16 or float16, got {dtype}"
        )


class Masks(NamedTuple):
    """The per-token arrays padded to whole blocks (int32 [B, S_pad] / [B, T_pad]; the segment
    ids None when there are none) and the block ranges (`BlockRanges`, int32): `keys` (per
    query block, its key blocks: perm [nk], start and end [nq]) and `queries` (per key block,
    the query blocks that visit it: perm [nq], start and end [nk])."""

    qi_bs: object
    ki_bt: object
    qseg_bs: object
    kseg_bt: object
    keys: BlockRanges
    queries: BlockRanges


def _pad(x_bs, size: int, fill):
    pad = -x_bs.shape[1] % size
    return jnp.pad(x_bs, ((0, 0), (0, pad)), constant_values=fill) if pad else x_bs


def prepare_masks(qi_bs, ki_bt, qseg_bs, kseg_bt, block_q: int, block_k: int, anchor=None) -> Masks:
    """The `Masks` of int32 indices qi [B, S], ki [B, T] and segment ids (both or neither);
    `anchor` (the keys, say) as in `blocks.key_ranges`."""
    qi, ki = _pad(qi_bs, block_q, PAD_QUERY), _pad(ki_bt, block_k, PAD_KEY)
    qseg = None if qseg_bs is None else _pad(qseg_bs, block_q, PAD_QUERY_SEG)
    kseg = None if kseg_bt is None else _pad(kseg_bt, block_k, PAD_KEY_SEG)
    blk = lambda x, size: None if x is None else blocks(x, size, 0)
    blocked = (blk(qi, block_q), blk(ki, block_k), blk(qseg, block_q), blk(kseg, block_k))
    keys = key_ranges(*blocked, anchor=anchor)
    queries = query_ranges(*blocked, anchor=anchor)
    return Masks(qi, ki, qseg, kseg, keys, queries)
