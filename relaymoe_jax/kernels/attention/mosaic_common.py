"""What the Mosaic GPU attention kernels (`mosaic_fwd`, `mosaic_bwd`) share: the interpreter
switch, the heads per program, the shared-memory layout of a wgmma operand, a product into a
fresh float32 accumulator, the elementwise mask of a tile, and the stored visit counts."""

import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.kernels.attention.common import MosaicConfig

LOG2E = math.log2(math.e)  # the kernels keep scores in log2 units (exp2 is one instruction)
VISITS_WIDTH = 128  # int32 lanes per stored visit count (a splat of 64 does not compile)


def interpret_params(interpret):
    """plgpu.kernel's `interpret`: None (compile), or InterpretGPUParams (True: the defaults)."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None


def heads_per_program(config: MosaicConfig, group: int) -> int:
    """The largest divisor of `group` (query heads per kv head) not above the config's."""
    return max(h for h in range(1, min(config.heads_per_program, group) + 1) if group % h == 0)


def tiles(dtype):
    """SMEM transforms of a 16-bit wgmma operand: (8, 64) tiles, 128-byte swizzle."""
    return (
        plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(128),
    )


def wgmma_value(a, b, shape):
    """a @ b (SMEM refs, b possibly `.T`) into a fresh float32 accumulator, as a value."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def tile_mask(shape, ki_v, kseg_v, qi_v, qseg_v, k_dim: int):
    """bool `shape`: key (along `k_dim`) visible to query (along the other dimension): causal
    by index, and same segment unless the segment ids are None."""
    q_dim = 1 - k_dim
    mask = lax.broadcast_in_dim(ki_v, shape, [k_dim]) <= lax.broadcast_in_dim(qi_v, shape, [q_dim])
    if kseg_v is not None:
        kseg, qseg = (
            lax.broadcast_in_dim(x, shape, [dim]) for x, dim in ((kseg_v, k_dim), (qseg_v, q_dim))
        )
        mask &= kseg == qseg
    return mask


def issue_key_block(r, s, has_seg: bool, b, kvh, j, bk: int, slot):
    """TMA of key block j (its keys, indices, segment ids and values of kv head `kvh`, row b)
    into SMEM slot `slot`: K and the ids signal `bar_k[slot]`, V `bar_v[slot]`. `r` holds the
    GMEM refs (k, ki, kseg, v), `s` the scratch (k_s, ki_s, kseg_s, v_s, bar_k, bar_v)."""
    keys = pl.ds(j * bk, bk)
    bar_k = s["bar_k"].at[slot]
    plgpu.copy_gmem_to_smem(r.k.at[b, keys, kvh], s["k_s"].at[slot], bar_k)
    plgpu.copy_gmem_to_smem(r.ki.at[b, keys], s["ki_s"].at[slot], bar_k)
    if has_seg:
        plgpu.copy_gmem_to_smem(r.kseg.at[b, keys], s["kseg_s"].at[slot], bar_k)
    plgpu.copy_gmem_to_smem(r.v.at[b, keys, kvh], s["v_s"].at[slot], s["bar_v"].at[slot])


def store_visits(vis_w, visits):
    """A visit count into its SMEM row (`VISITS_WIDTH` copies), to be copied out."""
    vis_w[...] = jnp.full((VISITS_WIDTH,), visits, jnp.int32)
