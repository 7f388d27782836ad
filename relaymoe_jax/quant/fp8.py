"""Blockwise e4m3 quantisation with power-of-two scales: DeepSeek-V3's tiling, exact dequantising.

    f = quantize(w_ehf, (BLOCK, BLOCK))   # weights: one scale per 128 x 128 block
    f = quantize(x_th, TILE)              # activations: one scale per 1 x 128 tile of a row
    dequantize(f, jnp.bfloat16)           # q * scale, exact (below)

The blocks tile the last two dimensions (leading ones, e.g. experts, are batch); a dimension that
the block does not divide ends in a partial block. Each block gets the smallest power of two
`scale` with amax / scale <= 448 (e4m3's largest finite value), and its values are
`q = e4m3(x / scale)`, rounded to nearest even.

Why powers of two (as MXFP8's E8M0 and DeepSeek-V3.1's UE8M0 scales) rather than amax / 448:
`q * scale` is then exact in bfloat16 and float32 (e4m3 has 4 significant bits, bf16 8, and
scaling by 2^e only moves the exponent), so an FP8 GEMM with block scales computes exactly what a
16-bit GEMM of the dequantised operands computes, up to the order of the float32 sums. That is
what lets the CPU (and any 16-bit kernel) compute the same quantised math as an e4m3 tensor-core
kernel, and the tests be exact about it. The price: up to one binary order of the e4m3 range is
unused (a block's largest value lands in (224, 448] instead of at 448), about half a bit.

No floor on the scale beyond float32's normal range (2^-126: GPUs and XLA:CPU flush subnormal
scales to zero): a clamp of amax (1e-4 in a published design) flushed whole blocks of small
gradients to zero. An all-zero block has the smallest scale, 2^-126, and dequantises to zeros.
Within a block, values below about amax * 2^-17 (e4m3's smallest subnormal, 2^-9, against 448)
flush to zero: one huge value costs its own block's small values, not its neighbours'. A block
holding NaN or an infinity gets a NaN scale, so the whole block dequantises to NaN (a non-finite
weight is never turned into a finite one; the loss goes NaN, as it would without FP8, and the
trainer's guard stops).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # 0.875 * 2^9
BLOCK = 128
TILE = (1, BLOCK)  # activations and output gradients: per row, per 128 channels
F32 = np.dtype(np.float32)
MIN_SCALE_EXP = -126  # float32's smallest normal: GPUs and XLA:CPU flush subnormals to zero


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=["block", "dtype"]
)
@dataclasses.dataclass(frozen=True)
class Fp8:
    """A blockwise-quantised array (a pytree whose leaves are `q` and `scale`; `block` is
    static): x ~ q * scale, each scale broadcast over its block of the last two dimensions."""

    q: jax.Array  # e4m3, x's shape
    scale: jax.Array  # float32 powers of two: x's shape with the last two dims / block (ceil)
    block: tuple = (BLOCK, BLOCK)  # rows and columns of one block
    dtype: np.dtype = F32  # what was quantised: dequantize's default

    @property
    def shape(self) -> tuple:
        return self.q.shape

    def transposed(self) -> "Fp8":
        """The last two dimensions swapped, blocks and scales with them (exact: no rounding)."""
        swap = lambda a: jnp.swapaxes(a, -1, -2)
        return Fp8(swap(self.q), swap(self.scale), self.block[::-1], self.dtype)


def _check_block(block) -> tuple[int, int]:
    if (
        not isinstance(block, tuple)
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in block)
    ):
        raise ValueError(f"block must be (rows, cols) of positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def _blocked(x, block):
    """x [..., R, C] zero-padded to whole blocks and split: [..., R/br, br, C/bc, bc]."""
    br, bc = block
    *lead, r, c = x.shape
    pr, pc = -(-r // br) * br, -(-c // bc) * bc
    if (pr, pc) != (r, c):
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pr - r), (0, pc - c)])
    return x.reshape(*lead, pr // br, br, pc // bc, bc)


def _expand(scale, block, shape):
    """A per-block array [..., R/br, C/bc] broadcast to `shape` [..., R, C]."""
    br, bc = block
    full = jnp.repeat(jnp.repeat(scale, br, axis=-2), bc, axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def scale_exponent(amax):
    """The exponent e of the smallest power of two with amax / 2^e <= 448, at least -126 (-126 for
    amax = 0); exact
    (from the binary exponent, no logarithm): amax = m 2^p, m in [0.5, 1), needs
    m 2^(p - e) <= 0.875 2^9."""
    m, p = jnp.frexp(amax.astype(jnp.float32))
    e = jnp.where(m <= 0.875, p - 9, p - 8)
    return jnp.where(amax == 0, MIN_SCALE_EXP, jnp.maximum(e, MIN_SCALE_EXP))


def quantize(x, block=(BLOCK, BLOCK)) -> Fp8:
    """x [..., R, C] (R, C >= 1) in e4m3 with one power-of-two scale per `block` of the last two
    dimensions (module doc)."""
    block = _check_block(block)
    if x.ndim < 2:
        raise ValueError(f"quantize needs x of rank >= 2 ([..., R, C]), got shape {x.shape}")
    x32 = x.astype(jnp.float32)
    blocks = _blocked(x32, block)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    e = scale_exponent(amax)
    finite = jnp.all(jnp.isfinite(blocks), axis=(-3, -1))  # XLA's max may drop a NaN
    scale = jnp.where(finite, jnp.ldexp(jnp.float32(1), e), jnp.float32(np.nan))
    q = jnp.ldexp(x32, -_expand(e, block, x.shape)).astype(E4M3)
    return Fp8(q, scale, block, np.dtype(x.dtype))


def dequantize(f: Fp8, dtype=None) -> jax.Array:
    """q * scale in `dtype` (default: the quantised array's; exact in bfloat16 and float32:
    module doc)."""
    out = f.q.astype(jnp.float32) * _expand(f.scale, f.block, f.q.shape)
    return out.astype(f.dtype if dtype is None else dtype)


def fake_quantize(x, block=(BLOCK, BLOCK)) -> jax.Array:
    """dequantize(quantize(x, block)) in x's dtype: the values an FP8 GEMM multiplies.
    Idempotent: its values quantise to themselves (each block's largest keeps its scale)."""
    return dequantize(quantize(x, block), x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quantize_ste(x, block=(BLOCK, BLOCK)) -> jax.Array:
    """`fake_quantize` whose gradient passes straight through (the identity): the gradient of
    the quantised weights is applied to the full-precision master weights, as in every FP8
    training recipe (the rounding has no useful derivative)."""
    return fake_quantize(x, block)


fake_quantize_ste.defvjp(lambda x, block: (fake_quantize(x, block), None), lambda block, _, g: (g,))


def nbytes(f: Fp8) -> int:
    """Bytes of the payload and its scales."""
    return f.q.size * f.q.dtype.itemsize + f.scale.size * f.scale.dtype.itemsize


def quantize_operand(a) -> jax.Array:
    """An activation as an FP8 GEMM's left operand sees it: `fake_quantize(a, TILE)` (one scale
    per row and 128 channels, the contraction's), its gradient straight through."""
    return fake_quantize_ste(a, TILE)


@jax.custom_vjp
def quantize_grad(y) -> jax.Array:
    """y itself; its cotangent rounded as an FP8 dgrad GEMM's left operand (`fake_quantize(dy,
    TILE)`): the gradient that reaches the GEMM producing y is the e4m3 one."""
    return y


quantize_grad.defvjp(lambda y: (y, None), lambda _, g: (fake_quantize(g, TILE),))
