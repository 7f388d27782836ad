"""The Pallas (Triton lowering) kernel bodies of the grouped matmul and their `pallas_call`s.

`gmm_call` and `tgmm_call` launch them (not differentiable; `pallas.py` wraps them in custom
VJPs and checks the arguments). `Config` holds the static block sizes and Triton launch
parameters (`check_block`: powers of two >= MIN_BLOCK), `compiler_params` fits the pipeline
stages to shared memory (SMEM_BYTES). Row layout and the zero-row contract are `pallas.py`'s.

gmm kernel, `out[M, N]`. Grid = (work item, n tile). The grid must be static, and
the Triton backend has no scalar prefetch, so the work list is computed with jnp
outside the kernel (`common.row_items`). The kernel receives it as four small int32
arrays, and each program reads its own entries as scalars from those refs. A work
item is one (row tile of `block_m` rows, group) pair whose intersection is
non-empty. Consecutive groups share at most one boundary tile. The padding rows
[sum, M) are counted as an extra group G. So there are at most
cdiv(M, block_m) + G items, and programs past the real item count do nothing.
A program:
  1. masks rows to [lo, hi) = its group's rows intersected with its tile;
  2. loops over K in `block_k` chunks (a traced trip count; Triton lowers it to
     an `scf.for`, which it can software-pipeline) and accumulates
     `x[rows, k] @ w[g][k, n]` in f32. Loads are masked (`other=0`), so rows
     outside [lo, hi), and K/N past the array edge, are never read;
  3. does a masked store of rows [lo, hi) of its n tile.
Padding items (group G) run zero K iterations and store the zero accumulator.
With `zero_padding=False` there is no group G: the padding rows get no work
item at all (their programs exit at once), so a mostly-padding buffer, such as
the static dropless all-to-all's, costs the work of its real rows only; those
rows, in the output and in the lhs gradient, are then left unwritten.

Zero-row guarantee (the default). A GPU leaves unwritten memory as garbage, so
every element of `out` must be stored. It is, exactly once, and nothing else writes it. The
G + 1 groups, real plus padding, partition the rows [0, M). Each (tile, group)
intersection is exactly one work item. The n grid axis covers [0, N). So
padding rows receive an explicit zero store. No memset and no
`input_output_aliases` are needed, and no two programs store the same element.

tgmm kernel, `out[G, K, N] = lhs[rows of g].T @ rhs[rows of g]` (the weight
gradient). Grid = (G, k tile, n tile). Each program loops over its group's rows
in `block_m` chunks (traced trip count cdiv(size_g, block_m)), loads both
operands with the rows masked to [start_g, end_g), and accumulates the
[block_k, block_n] f32 tile. An empty group runs zero iterations, so it stores
an exact zero slice. Every output element is stored exactly once.

Fused row gather (optional). With `lhs_rows` (an [M] row-index vector), gmm's
grouped row r is `lhs[lhs_rows[r]]`, loaded by the kernel straight from the
[T, K] token matrix, so the gathered [M, K] matrix is never built. tgmm takes
`lhs_rows` / `rhs_rows` the same way. Entries are read only for rows inside a
group, so padding entries may hold any value. In-group indices are clamped into
[0, T) to keep every load in bounds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from relaymoe_jax.kernels.gmm.common import (
    clamp_group_bounds,
    operand_dtype,
    precision,
    row_items,
)

DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 128
DEFAULT_BLOCK_K = 64
MIN_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16


@dataclasses.dataclass(frozen=True)
class Config:
    """Static kernel configuration: block sizes and Triton launch parameters."""

    block_m: int = DEFAULT_BLOCK_M
    block_n: int = DEFAULT_BLOCK_N
    block_k: int = DEFAULT_BLOCK_K
    num_warps: int | None = None  # None: 4
    num_stages: int | None = None  # None: 3 for <= 2-byte operands, else 2
    interpret: bool = False
    zero_padding: bool = True  # gmm: store zeros in rows >= sum(group_sizes) (False: skip them)


def check_block(name: str, block) -> int:
    """Holds `block` as an int, checked to be a power of two >= MIN_BLOCK."""
    if (
        isinstance(block, bool)
        or not isinstance(block, (int, np.integer))
        or block < MIN_BLOCK
        or block & (block - 1)
    ):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK} (Triton), got {block!r}")
    return int(block)


def _fit_block(block: int, dim: int) -> int:
    """Holds `block` shrunk to the smallest power of two >= dim (but >= MIN_BLOCK)."""
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(max(dim, 1))))


# Shared memory one Triton program may use on Hopper (H100/H200: 227 KiB opt-in per block). Triton
# keeps `num_stages` copies of each pipelined operand tile there. A config over it compiles (the
# limit is checked when the kernel is loaded) and then fails at launch with RESOURCE_EXHAUSTED, as
# 128 x 256 x 64 with 3 stages did for tgmm on an H200 (245,760 bytes; BENCHMARKS.md).
SMEM_BYTES = 232_448


def compiler_params(cfg: Config, name: str, tiles) -> plt.CompilerParams:
    """Holds the Triton launch parameters for kernel `name` whose pipelined operand tiles are
    `tiles` ((rows, cols, dtype) each). Default stages: 3 for <= 2-byte operands, else 2, fewer
    when the tiles' copies would not fit SMEM_BYTES; explicit `num_stages` that do not fit are
    refused (ValueError naming the bytes) instead of failing at launch on the GPU."""
    per_stage = sum(r * c * np.dtype(d).itemsize for r, c, d in tiles)
    itemsize = max(np.dtype(d).itemsize for _, _, d in tiles)
    if cfg.num_stages is not None:
        stages = cfg.num_stages
        if stages * per_stage > SMEM_BYTES:
            raise ValueError(
                f"{name}: num_stages={stages} keeps {stages} x {per_stage:,} = "
                f"{stages * per_stage:,} bytes of operand tiles in shared memory, more than the "
                f"{SMEM_BYTES:,} a Hopper block may use; use fewer stages or smaller blocks "
                f"(or num_stages=None to fit them)"
            )
    else:
        stages = 3 if itemsize <= 2 else 2
        while stages > 1 and stages * per_stage > SMEM_BYTES:
            stages -= 1
    return plt.CompilerParams(num_warps=cfg.num_warps or 4, num_stages=stages)


def _in_bounds(start, size: int, bound: int):
    """Holds the [size] mask of start + arange(size) < bound, or None if always true."""
    if bound % size == 0:
        return None  # start is a multiple of size here, so the block never overruns
    return start + jnp.arange(size, dtype=jnp.int32) < bound


def _and(a, b):
    """Holds the 2-D mask a[:, None] & b[None, :] (None is all-true)."""
    if a is None and b is None:
        return None
    if a is None:
        return b[None, :]
    if b is None:
        return a[:, None]
    return a[:, None] & b[None, :]


def _out_shape(shape, dtype, operand) -> jax.ShapeDtypeStruct:
    """Holds the kernel's output type, varying over the shard_map axes `operand` varies over.

    Inside shard_map, pallas_call needs the output's manual axes spelled out; the
    public entry points make every operand vary over the same axes (`match_vma`).
    """
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(operand).manual_axis_type)


class _Call(NamedTuple):
    """A kernel launch's static description (hashable): `pallas_call(partial(kernel, **params))`
    with an output of `shape` and `dtype` varying like operand `like` (`_out_shape`)."""

    kernel: object
    params: tuple  # (name, value) pairs
    shape: tuple
    dtype: np.dtype
    grid: tuple
    compiler: plt.CompilerParams
    interpret: bool
    name: str
    like: int  # the operand whose shard_map axes the output varies over
    aliases: tuple = ()  # input_output_aliases as (operand, output) pairs


@functools.partial(jax.jit, static_argnums=0)
def _launch(call: _Call, *args):
    """The kernel of `call` on `args`, as a jitted function of its static description: a program
    whose calls share a kernel (the gate and up projections, a hop's forward and its recomputation
    in the backward) lowers it once, not once per call."""
    return pl.pallas_call(
        functools.partial(call.kernel, **dict(call.params)),
        out_shape=_out_shape(call.shape, call.dtype, args[call.like]),
        grid=call.grid,
        input_output_aliases=dict(call.aliases),
        compiler_params=call.compiler,
        interpret=call.interpret,
        name=call.name,
    )(*args)


def _load(ref, mask):
    """Holds ref[...] with masked-off elements read as 0 (and never fetched)."""
    if mask is None:
        return plt.load(ref)
    return plt.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


# ---------------------------------------------------------------- gmm kernel


def _source_rows(rows_ref, row0, size: int, ok, num_rows: int):
    """Holds the [size] source rows rows_ref[row0 + i], clamped into [0, num_rows).

    Entries where `ok` is False are not read (they may be garbage) and give row 0.
    """
    src = plt.load(rows_ref.at[pl.ds(row0, size)], mask=ok, other=0)
    return jnp.clip(src, 0, num_rows - 1)


def _load_rows(ref, src, row0, bm: int, col0, bc: int, mask):
    """Holds the [bm, bc] block of grouped rows row0 + i and columns col0 + j.

    Grouped row r is ref row r, or ref row src[r - row0] when `src` is given
    (the fused gather). Masked-off elements read as 0 and are never fetched.
    """
    if src is None:
        return _load(ref.at[pl.ds(row0, bm), pl.ds(col0, bc)], mask)
    cols = col0 + jnp.arange(bc, dtype=jnp.int32)
    return _load(ref.at[src[:, None], cols[None, :]], mask)


def _gmm_kernel(
    group_ref,
    row0_ref,
    lo_ref,
    hi_ref,
    x_ref,
    w_ref,
    *refs,
    bm: int,
    bn: int,
    bk: int,
    transpose_rhs: bool,
    gather: bool,
    compute,
):
    """One (work item, n tile): o[lo:hi, n tile] = x[lo:hi] @ w[g][:, n tile].

    With `gather`, refs = (rows_ref, o_ref) and x row r is x[rows_ref[r]].
    """
    rows_ref, o_ref = refs if gather else (None, *refs)
    item, n_tile = pl.program_id(0), pl.program_id(1)
    g, row0 = group_ref[item], row0_ref[item]
    lo, hi = lo_ref[item], hi_ref[item]
    num_groups = w_ref.shape[0]
    k_dim, n_dim = x_ref.shape[1], o_ref.shape[1]
    n0 = n_tile * bn
    rows_t = row0 + jnp.arange(bm, dtype=jnp.int32)
    own_t = (rows_t >= lo) & (rows_t < hi)
    src_t = _source_rows(rows_ref, row0, bm, own_t, x_ref.shape[0]) if gather else None
    cols_ok = _in_bounds(n0, bn, n_dim)
    w_g = jnp.minimum(g, num_groups - 1)  # padding items (g == G) load no weights
    # An int32 product, not jnp.where: Pallas' Triton lowering types a select of two Python
    # ints as its i1 predicate, and the scf.for then fails XLA's Triton verifier (issue 13).
    live = ((g < num_groups) & (hi > lo)).astype(jnp.int32)
    trips = live * jnp.int32(pl.cdiv(k_dim, bk))
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def body(kb, acc_tn):
        k0 = kb * bk
        k_ok = _in_bounds(k0, bk, k_dim)
        x_tk = _load_rows(x_ref, src_t, row0, bm, k0, bk, _and(own_t, k_ok))
        if transpose_rhs:
            w = _load(w_ref.at[w_g, pl.ds(n0, bn), pl.ds(k0, bk)], _and(cols_ok, k_ok))
        else:
            w = _load(w_ref.at[w_g, pl.ds(k0, bk), pl.ds(n0, bn)], _and(k_ok, cols_ok))
        return acc_tn + lax.dot_general(
            x_tk.astype(compute),
            w.astype(compute),
            (contract, ((), ())),
            precision=precision(compute),
            preferred_element_type=jnp.float32,
        )

    acc_tn = lax.fori_loop(jnp.int32(0), trips, body, jnp.zeros((bm, bn), jnp.float32))
    store_ok = own_t[:, None] if cols_ok is None else own_t[:, None] & cols_ok[None, :]
    plt.store(
        o_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)],
        acc_tn.astype(o_ref.dtype),
        mask=jnp.broadcast_to(store_ok, (bm, bn)),
    )


def gmm_call(x, w_gkn, group_sizes_g, rows_m, transpose_rhs: bool, out_dtype, cfg: Config):
    """Holds out[M, N] of the gmm kernel (not differentiable); M = len(rows_m) if given."""
    m, k = x.shape if rows_m is None else (rows_m.shape[0], x.shape[1])
    num_groups = w_gkn.shape[0]
    n = w_gkn.shape[1] if transpose_rhs else w_gkn.shape[2]
    if m == 0 or n == 0 or k == 0 or num_groups == 0 or x.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = _fit_block(cfg.block_m, m), _fit_block(cfg.block_n, n), _fit_block(cfg.block_k, k)
    meta = row_items(group_sizes_g, m, bm, cfg.zero_padding)[:4]
    compute = operand_dtype(x.dtype, w_gkn.dtype)  # bf16 x f32 -> bf16 (tensor cores)
    x, w_gkn = x.astype(compute), w_gkn.astype(compute)
    params = dict(
        bm=bm, bn=bn, bk=bk, transpose_rhs=transpose_rhs, gather=rows_m is not None, compute=compute
    )
    rows = () if rows_m is None else (rows_m,)
    call = _Call(
        _gmm_kernel,
        tuple(params.items()),
        (m, n),
        np.dtype(out_dtype),
        (meta[0].shape[0], pl.cdiv(n, bn)),
        compiler_params(cfg, "gmm", ((bm, bk, x.dtype), (bk, bn, w_gkn.dtype))),
        cfg.interpret,
        "relaymoe_gmm",
        like=len(meta),
    )
    return _launch(call, *meta, x, w_gkn, *rows)


# --------------------------------------------------------------- tgmm kernel


def _tgmm_kernel(
    start_ref,
    end_ref,
    x_ref,
    y_ref,
    *refs,
    bm: int,
    bk: int,
    bn: int,
    gather_x: bool,
    gather_y: bool,
    accumulate: bool,
    compute,
):
    """One (group, k tile, n tile): o[g, k tile, n tile] = x[rows of g].T @ y[rows of g].

    refs = ([x_rows_ref if gather_x], [y_rows_ref if gather_y], [acc_ref if accumulate], o_ref).
    With `accumulate`, o is acc's buffer (aliased): o[g] += ..., and a group with no rows is
    neither read nor written.
    """
    *rows_refs, o_ref = refs
    x_rows_ref = rows_refs.pop(0) if gather_x else None
    y_rows_ref = rows_refs.pop(0) if gather_y else None
    g, k_tile, n_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]
    k_dim, n_dim = x_ref.shape[1], y_ref.shape[1]
    k0, n0 = k_tile * bk, n_tile * bn
    k_ok, n_ok = _in_bounds(k0, bk, k_dim), _in_bounds(n0, bn, n_dim)

    def body(c, acc_kn):
        r0 = start + c * bm
        rows_ok = r0 + jnp.arange(bm, dtype=jnp.int32) < end
        x_src = _source_rows(x_rows_ref, r0, bm, rows_ok, x_ref.shape[0]) if gather_x else None
        y_src = _source_rows(y_rows_ref, r0, bm, rows_ok, y_ref.shape[0]) if gather_y else None
        x_tk = _load_rows(x_ref, x_src, r0, bm, k0, bk, _and(rows_ok, k_ok))
        y_tn = _load_rows(y_ref, y_src, r0, bm, n0, bn, _and(rows_ok, n_ok))
        return acc_kn + lax.dot_general(
            x_tk.astype(compute),
            y_tn.astype(compute),
            (((0,), (0,)), ((), ())),
            precision=precision(compute),
            preferred_element_type=jnp.float32,
        )

    trips = pl.cdiv(end - start, jnp.int32(bm))  # int32 under x64 too
    out = o_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)]
    store_ok = _and(k_ok, n_ok)
    if accumulate:  # masked by the group's rows: an empty group's tile is never touched
        live = jnp.broadcast_to(end > start, (bk, bn))
        store_ok = live if store_ok is None else live & store_ok
        init_kn = _load(out, store_ok).astype(jnp.float32)
    else:
        init_kn = jnp.zeros((bk, bn), jnp.float32)
    acc_kn = lax.fori_loop(jnp.int32(0), trips, body, init_kn)
    if store_ok is None:
        plt.store(out, acc_kn.astype(o_ref.dtype))
    else:
        plt.store(out, acc_kn.astype(o_ref.dtype), mask=jnp.broadcast_to(store_ok, (bk, bn)))


def tgmm_call(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg: Config, acc=None):
    """Holds out[G, K, N] of the tgmm kernel, plus `acc` (added in place) if given (not
    differentiable)."""
    m = (x if x_rows_m is None else x_rows_m).shape[0]
    k, n = x.shape[1], y.shape[1]
    num_groups = group_sizes_g.shape[0]
    if m == 0 or n == 0 or k == 0 or num_groups == 0 or x.shape[0] == 0 or y.shape[0] == 0:
        return jnp.zeros((num_groups, k, n), out_dtype) if acc is None else acc
    bm, bn, bk = _fit_block(cfg.block_m, m), _fit_block(cfg.block_n, n), _fit_block(cfg.block_k, k)
    start_g, end_g = clamp_group_bounds(group_sizes_g, m)
    compute = operand_dtype(x.dtype, y.dtype)  # bf16 x f32 -> bf16 (tensor cores)
    x, y = x.astype(compute), y.astype(compute)
    params = dict(
        bm=bm,
        bk=bk,
        bn=bn,
        compute=compute,
        gather_x=x_rows_m is not None,
        gather_y=y_rows_m is not None,
        accumulate=acc is not None,
    )
    rows = tuple(r for r in (x_rows_m, y_rows_m) if r is not None)
    tail = () if acc is None else (acc,)
    call = _Call(
        _tgmm_kernel,
        tuple(params.items()),
        (num_groups, k, n),
        np.dtype(out_dtype),
        (num_groups, pl.cdiv(k, bk), pl.cdiv(n, bn)),
        compiler_params(cfg, "tgmm", ((bm, bk, x.dtype), (bm, bn, y.dtype))),
        cfg.interpret,
        "relaymoe_tgmm",
        like=2,
        aliases=() if acc is None else ((4 + len(rows), 0),),
    )
    return _launch(call, start_g, end_g, x, y, *rows, *tail)
