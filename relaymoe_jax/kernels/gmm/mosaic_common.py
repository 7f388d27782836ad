"""What the Mosaic GPU grouped-matmul kernels (`mosaic_gmm`, `mosaic_tgmm`) share: the frozen
config, the operand checks, the tile fitting, the shared-memory layouts, the persistent loop over
the SMs and the warp-specialised pipeline's barriers.

Shape of both kernels (Hopper: TMA, wgmma, mbarriers). One program per SM (`num_sms`), each
walking the output tiles t = sm, sm + num_sms, ... (a persistent grid) in the order of the work
list: consecutive SMs take neighbouring tiles of the same rows and weights, so the tiles in
flight at once read a few groups' weights from L2. Three warpgroups: warpgroup 2 (the producer)
streams each tile's operand blocks by TMA through `stages` SMEM slots; warpgroups 0 and 1 (the
consumers) each own half of the tile's columns, wait on the slot's "full" barrier, multiply by
wgmma into a float32 accumulator, and arrive on its "free" barrier once their wgmma has read it
(one wgmma left in flight). The slot sequence runs on across tiles, so the producer loads the
next tile while the consumers finish this one and store it (the epilogue).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.kernels.attention.mosaic_common import interpret_params  # one switch for both
from relaymoe_jax.util import tracing
from relaymoe_jax.util.typed import varying_like

DTYPES = (jnp.bfloat16, jnp.float16)
CONSUMERS = 2  # warpgroups that multiply; one more streams the operands
WARPGROUPS = CONSUMERS + 1
PRODUCER = CONSUMERS  # the producer's warpgroup index
# Shared memory one block may use on Hopper (H100/H200: 227 KiB opt-in), less a margin for the
# barriers and Mosaic GPU's own scratch.
SMEM_BYTES = 232_448 - 2_048
ROW_ALIGN = 8  # rows of an (8, x) SMEM tile: a TMA into it starts at a multiple (M is one)
# Rows and columns of a wgmma B operand whose N is its minor dimension (gmm's w, tgmm's y) per
# consumer: narrower tiles (32 columns and a 64-byte swizzle, or 16 rows) fail Mosaic GPU's
# layout inference (jax 0.12), so K and N are padded to 64 and 2 x 64 there. A transposed B (dx's
# w, [N, K] with K minor) takes 16 of each.
MIN_N_MINOR = 64
H100_SMS = 132  # when neither a device nor an abstract mesh says how many SMs there are
# The interpreter runs every program of the grid in turn: two SMs walk the same persistent loop
# (several tiles each) at a fraction of 132's time.
INTERPRET_SMS = 2


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The Mosaic GPU grouped matmul's tiling (each consumer warpgroup's share of a tile).

    gmm: `block_m` rows x `block_n` columns per consumer (the tile is block_m x 2 block_n),
    `block_k` of the contraction per pipeline step. tgmm: `block_m` rows of the contraction per
    step, a block_k x 2 block_n output tile. `stages`: SMEM slots of the pipeline (None: as many
    as fit SMEM_BYTES, at most 4). `num_sms`: programs of the persistent grid (None: the
    device's, the abstract mesh's, else 132; INTERPRET_SMS in the interpreter). `interpret`: run
    in the Mosaic GPU interpreter. `zero_padding` (gmm): False leaves rows >= sum(group_sizes)
    unwritten (`api.gmm`)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    stages: int | None = None
    num_sms: int | None = None
    interpret: object = False  # bool, or plgpu.InterpretGPUParams (e.g. detect_races=True)
    zero_padding: bool = True  # gmm: store zeros in rows >= sum(group_sizes) (False: skip them)


def check_config(cfg: MosaicConfig) -> MosaicConfig:
    """`cfg` if its sizes are ones the kernels take, else a ValueError naming the field."""
    allowed = {"block_m": (64,), "block_n": (64, 128), "block_k": (64,)}
    for name, values in allowed.items():
        if getattr(cfg, name) not in values:
            raise ValueError(
                f"MosaicConfig.{name} must be one of {values}, got {getattr(cfg, name)!r}"
            )
    for name in ("stages", "num_sms"):
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"MosaicConfig.{name} must be a positive int or None, got {v!r}")
    return cfg


def check_dtype(dtype) -> np.dtype:
    """The 16-bit operand dtype, else a ValueError (the kernels run on the tensor cores only)."""
    if np.dtype(dtype) not in [np.dtype(d) for d in DTYPES]:
        raise ValueError(
            f"gmm_impl='mosaic' multiplies bfloat16 or float16 operands on the tensor cores, got "
            f"{np.dtype(dtype)}: cast the operands, or use 'xla' (float32 at IEEE precision)"
        )
    return np.dtype(dtype)


def fit(block: int, dim: int, smallest: int = 16) -> int:
    """The largest power of two <= `block` dividing `dim` (>= `smallest`), or 0 if none does."""
    b = block
    while b >= smallest:
        if dim % b == 0:
            return b
        b //= 2
    return 0


def padded(dim: int, multiple: int) -> int:
    """`dim` rounded up to a multiple of `multiple`."""
    return -(-dim // multiple) * multiple


def pad_to(a, shape):
    """`a` padded with zeros at the end of each dimension up to `shape` (itself if no padding)."""
    widths = [(0, want - have) for have, want in zip(a.shape, shape)]
    return a if not any(w for _, w in widths) else jnp.pad(a, widths)


def tiles(dtype, minor: int):
    """SMEM transforms of a wgmma operand whose minor dimension holds `minor` elements: (8, swizzle
    elements) tiles and the widest swizzle the row's bytes allow."""
    itemsize = np.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def stages(cfg: MosaicConfig, per_stage: int, fixed: int) -> int:
    """The pipeline's slots: cfg.stages (refused if they do not fit SMEM_BYTES), else as many as
    fit (at most 4, at least 2)."""
    if cfg.stages is not None:
        if cfg.stages * per_stage + fixed > SMEM_BYTES:
            raise ValueError(
                f"MosaicConfig.stages={cfg.stages}: {cfg.stages} x {per_stage:,} bytes of operand "
                f"slots + {fixed:,} of output tiles exceed the {SMEM_BYTES:,} bytes of shared "
                "memory a Hopper block may use; use fewer stages or smaller blocks"
            )
        return cfg.stages
    return max(2, min(4, (SMEM_BYTES - fixed) // per_stage))


def num_sms(cfg: MosaicConfig) -> int:
    """Programs of the persistent grid: cfg.num_sms, else INTERPRET_SMS in the interpreter, else
    the abstract mesh's or the GPU's SMs, else H100_SMS."""
    if cfg.num_sms is not None:
        return cfg.num_sms
    if cfg.interpret:
        return INTERPRET_SMS
    mesh = jax.sharding.get_abstract_mesh()
    dev = None if mesh.empty else getattr(mesh, "abstract_device", None)
    cores = getattr(dev, "num_cores", None)
    if cores:
        return int(cores)
    if jax.default_backend() == "gpu":
        return int(jax.devices()[0].core_count)
    return H100_SMS


def my_tiles(total, sms: int):
    """How many of `total` tiles (traced) the persistent program on this SM takes: t = sm,
    sm + sms, ..."""
    sm = lax.axis_index("sm")
    return jnp.where(sm < total, lax.div(total - sm - 1, jnp.int32(sms)) + 1, 0)


def row_mask(shape, rows0, lo, hi):
    """bool `shape` (WGMMA layout): row rows0 + i of the block lies in [lo, hi)."""
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, 0), plgpu.Layout.WGMMA) + rows0
    return (rows >= lo) & (rows < hi)


def store_rows(o_s, o_rows, off, count, most: int):
    """Stores rows [off, off + count) of the SMEM tile `o_s` by TMA to `o_rows(start, size)` (the
    GMEM rows [start, start + size) of the destination, counted from its first row), one copy per
    set bit of `count` (0 <= count <= most): a TMA copy's size is static, the count is not."""
    size = 1 << (most.bit_length() - 1)
    done = jnp.int32(0)
    while size >= 1:
        bit = (count & size) != 0

        @pl.when(bit)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(o_s.at[pl.ds(off + done, size)], o_rows(done, size))

        done = done + jnp.where(bit, size, 0)
        size //= 2


class RowTile(NamedTuple):
    """One output tile of a gmm kernel: work item `item` (group g, rows loaded from r0) and
    column tile `nt` (one block per consumer)."""

    item: jax.Array
    nt: jax.Array
    g: jax.Array
    trips: jax.Array  # K steps: 0 for the padding group's items (they store zeros)
    r0: jax.Array


def row_tile(sp, group_ref, row0_ref, t) -> RowTile:
    """Tile t of a gmm kernel whose static description `sp` has m, bm, groups, n_tiles and
    k_steps (`mosaic_gmm`, `mosaic_fp8`)."""
    item, nt = lax.div(t, jnp.int32(sp.n_tiles)), lax.rem(t, jnp.int32(sp.n_tiles))
    g = group_ref[item]
    trips = jnp.where(g < sp.groups, sp.k_steps, 0)
    # the last tile ends at row M; TMA into (8, x)-tiled SMEM starts at a multiple of 8 rows
    r0 = pl.multiple_of(jnp.minimum(row0_ref[item], sp.m - sp.bm), ROW_ALIGN)
    return RowTile(item, nt, g, trips, r0)


def store_tile(acc, o_s, o_ref, tile: RowTile, lo, hi, cols, bm: int):
    """A consumer's epilogue: its float32 tile `acc` into its SMEM tile `o_s` (once the previous
    tile's stores have read it), then rows [lo, hi) of it by TMA to `o_ref`'s columns `cols`."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read o_s
    o_s[...] = acc.astype(o_s.dtype)
    plgpu.commit_smem()
    store_rows(o_s, lambda a, n: o_ref.at[pl.ds(lo + a, n), cols], lo - tile.r0, hi - lo, bm)


class Pipeline(NamedTuple):
    """The SMEM slots' barriers: `full[slot]` (the producer's TMA copies landed), `free[slot]`
    (both consumers' wgmma read it). Pipeline step s (counted on across a program's tiles) uses
    slot s % stages; every waiter waits each barrier phase once, in order."""

    full: object
    free: object
    stages: int

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.stages))


def produce(pipe: Pipeline, trips, step, issue):
    """The producer's loop over `trips` steps from `step`: wait until the slot is free (from its
    second use on), then `issue(j, slot, full_barrier)` its TMA copies. Returns the next step."""

    def body(j, step):
        slot = pipe.slot(step)

        @pl.when(step >= pipe.stages)
        def _():
            plgpu.barrier_wait(pipe.free.at[slot])

        issue(j, slot, pipe.full.at[slot])
        return step + 1

    return lax.fori_loop(0, trips, body, step)


def consume(pipe: Pipeline, shape, trips, step, multiply):
    """A consumer's loop over `trips` steps from `step` into a fresh float32 accumulator of
    `shape`: wait for the slot, `multiply(j, slot, acc_ref)` (its wgmma), and free the previous
    step's slot once one wgmma is left in flight. Returns (the accumulator, the next step)."""

    def scope(acc_ref):
        def body(j, step):
            slot = pipe.slot(step)
            plgpu.barrier_wait(pipe.full.at[slot])
            multiply(j, slot, acc_ref)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: free its slot

            @pl.when(j > 0)
            def _():
                plgpu.barrier_arrive(pipe.free.at[pipe.slot(step - 1)])

            return step + 1

        end = lax.fori_loop(0, trips, body, step)
        plgpu.wgmma_wait(0)

        @pl.when(trips > 0)
        def _():
            plgpu.barrier_arrive(pipe.free.at[pipe.slot(end - 1)])

        return acc_ref[...], end

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def persistent(total, sms: int, tile_body) -> None:
    """The persistent grid: this SM's tiles t = sm, sm + sms, ... < `total` (traced), each
    `tile_body(t, step) -> step` with the pipeline step carried across tiles."""
    sm = lax.axis_index("sm")

    def body(i, step):
        return tile_body(sm + i * sms, step)

    lax.fori_loop(0, my_tiles(total, sms), body, jnp.int32(0))


def launch(name: str, body, sp, scratch, shape, dtype, interpret, *args, inplace: bool = False):
    """`body(sp, *refs, **scratch(sp))` as a persistent warp-specialised Mosaic GPU kernel named
    `name` (its name in the HLO's op_name and the dumps): sp.sms programs of WARPGROUPS
    warpgroups, one output of `shape` and `dtype`. The output varies over the shard_map axes its
    operands vary over (a Mosaic GPU kernel's output comes back varying over none).

    The call is a jitted function of its static description (`_launch`): a program whose calls
    share a kernel (the ring's gate and up projections, a hop's forward and its recomputation in
    the backward) lowers it once, not once per call: Mosaic GPU's lowering of each kernel costs
    about a quarter of a second of Python.

    `inplace`: the output is written into the last operand's buffer (of `shape` and `dtype`), an
    input-output alias of the custom call (`tracing.kernel_in_place`), so a loop-carried sum
    (the ring's float32 dW) is updated where it lies, not copied into a new buffer per call."""
    if inplace and (args[-1].shape, args[-1].dtype) != (tuple(shape), np.dtype(dtype)):
        raise ValueError(f"in place: the last operand must be {shape} {dtype}, got {args[-1]}")
    return _launch(name, body, sp, scratch, shape, np.dtype(dtype), interpret, inplace, *args)


@functools.partial(jax.jit, static_argnums=tuple(range(8)))
def _launch(name, body, sp, scratch, shape, dtype, interpret, inplace, *args):
    out_type = jax.ShapeDtypeStruct(shape, dtype)
    if not inplace:

        def kernel(*refs, **scratch_refs):
            body(sp, *refs, **scratch_refs)

        kernel.__name__ = kernel.__qualname__ = name
        call = plgpu.kernel(
            kernel,
            out_type=out_type,
            grid=(sp.sms,),
            grid_names=("sm",),
            num_threads=WARPGROUPS,
            thread_name="wg",
            scratch_types=scratch(sp),
            interpret=interpret_params(interpret),
        )
        return varying_like(call(*args), *args)

    def kernel_in_place(*refs):  # plgpu.kernel's scratch, as it allocates it
        pl.run_scoped(functools.partial(body, sp, *refs), collective_axes="wg", **scratch(sp))

    mesh = plgpu.Mesh(grid=(sp.sms,), grid_names=("sm",), num_threads=WARPGROUPS, thread_name="wg")
    call = tracing.kernel_in_place(
        kernel_in_place,
        mesh,
        out_type.update(manual_axis_type=jax.typeof(args[-1]).manual_axis_type),
        {len(args) - 1: 0},
        interpret=interpret_params(interpret),
        name=name,
    )
    return varying_like(call(*args), *args)
