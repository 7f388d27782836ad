"""Blockwise e4m3 quantisation (`relaymoe_jax.quant.fp8`) against a float64 numpy reference
written here from the definition (ml_dtypes' e4m3 rounding, a power-of-two scale found by
search, not by the module's exponent arithmetic), and its edge cases: partial blocks, an all-zero
block, one huge value, NaN and infinities, amax far below e4m3's range (no scale floor), the
error bound an e4m3 value has, and the FP8 recipe's operand and gradient roundings."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_cases import ref_dequantize, ref_quantize, ref_scale_exp

from relaymoe_jax.quant import fp8


def _assert_matches_reference(x, block):
    f = fp8.quantize(jnp.asarray(x), block)
    q_ref, s_ref = ref_quantize(np.asarray(x, np.float32), block)
    np.testing.assert_array_equal(np.asarray(f.scale, np.float64), s_ref)
    finite = np.isfinite(ref_dequantize(q_ref, s_ref, block))
    got = np.asarray(fp8.dequantize(f, jnp.float32), np.float64)
    np.testing.assert_array_equal(got[finite], ref_dequantize(q_ref, s_ref, block)[finite])
    assert np.all(np.isnan(got[~finite]))
    return f, got


def _assert_within_e4m3_error(got, x64, f):
    """e4m3's 3 mantissa bits: a relative error of at most 2^-4 at and above its smallest normal
    (2^-6 of the block's scale), an absolute one of at most half its smallest subnormal
    (2^-10 of the scale) below."""
    block = f.block
    scale = np.repeat(np.repeat(np.asarray(f.scale, np.float64), block[0], -2), block[1], -1)
    scale = scale[..., : x64.shape[-2], : x64.shape[-1]]
    normal = np.abs(x64) >= 2.0**-6 * scale
    err = np.abs(got - x64)
    assert np.all(err[normal] <= 2.0**-4 * np.abs(x64)[normal])
    assert np.all(err[~normal] <= 2.0**-10 * scale[~normal])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "shape, block", [((2, 200, 300), (128, 128)), ((130, 260), (1, 128)), ((5, 7), (128, 128))]
)
def test_quantize_matches_the_reference_with_partial_blocks(dtype, shape, block):
    """Weights' 128 x 128 blocks and activations' 1 x 128 tiles, including partial blocks at
    the ends of both dimensions; bf16 and f32 inputs. Dequantising is exact: bf16 == f32."""
    x = (jax.random.normal(jax.random.key(1), shape) * 3.0).astype(dtype)
    f, got = _assert_matches_reference(x, block)
    assert f.q.dtype == fp8.E4M3 and f.q.shape == shape
    assert f.scale.shape == (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    np.testing.assert_array_equal(
        np.asarray(fp8.dequantize(f, jnp.bfloat16), np.float64), got
    )  # q * 2^e is exact in bf16
    _assert_within_e4m3_error(got, np.asarray(x.astype(jnp.float32), np.float64), f)
    # every block's largest value uses the top binary order of e4m3's range: (224, 448]
    amax = np.max(np.abs(np.asarray(f.q, np.float64)))
    assert 224 < amax <= 448


def test_edge_blocks_zero_huge_nonfinite_and_tiny():
    """Four 128 x 128 blocks of one matrix, each an edge case, and their neighbours untouched:
    all zeros (exact zeros, the smallest scale, finite); one huge value (its block's small values
    flush to zero, the other blocks quantise as they would alone); NaN and inf (the whole block
    NaN, never a finite value); amax 1e-30 (no scale floor: quantised as finely as normal values,
    where a clamp of amax at 1e-4 would flush the block to zero)."""
    base = np.asarray(jax.random.normal(jax.random.key(2), (256, 384)), np.float32)
    x = base.copy()
    x[:128, :128] = 0.0
    x[:128, 128:256] *= 1e-30
    x[128:, :128][5, 7] = 1e30
    x[128:, 128:256][0, 0] = np.nan
    x[128:, 256:][3, 3] = np.inf
    f, got = _assert_matches_reference(x, (128, 128))
    scale = np.asarray(f.scale)
    assert np.all(got[:128, :128] == 0) and scale[0, 0] == 2.0**-126
    # the tiny block: the same relative error as any block, its scale far above the floor
    tiny = fp8.quantize(jnp.asarray(x[:128, 128:256]))
    amax = float(np.max(np.abs(x[:128, 128:256])))
    assert float(tiny.scale[0, 0]) == 2.0 ** ref_scale_exp(amax) > 2.0**-120
    _assert_within_e4m3_error(got[:128, 128:256], x[:128, 128:256].astype(np.float64), tiny)
    huge = got[128:, :128]
    assert huge[5, 7] == pytest.approx(1e30, rel=2.0**-4)
    assert np.count_nonzero(huge) == 1  # its neighbours (|x| < 5) flushed: 1e30 * 2^-17 >> 5
    assert np.all(np.isnan(got[128:, 128:])) and np.all(np.isnan(scale[1, 1:]))
    # the untouched blocks are exactly what they are when quantised without their neighbours
    for rows, cols in [(slice(0, 128), slice(256, 384))]:
        alone = fp8.dequantize(fp8.quantize(jnp.asarray(base[rows, cols])), jnp.float32)
        np.testing.assert_array_equal(got[rows, cols], np.asarray(alone))


def test_the_payload_is_half_the_bf16_bytes():
    """What a ring hop would send for one partition of Qwen3-30B-A3B's experts (16 of them,
    H=2048, F=768): the e4m3 values and float32 block scales, at most 0.52 x the bf16 weights."""
    w = jax.ShapeDtypeStruct((16, 2048, 768), jnp.bfloat16)
    f = jax.eval_shape(fp8.quantize, w)
    assert fp8.nbytes(f) <= 0.52 * math.prod(w.shape) * 2
    assert f.scale.shape == (16, 16, 6)


def test_a_quantised_array_is_a_pytree_with_a_static_block():
    """`Fp8` travels through jit and lax.ppermute like an array pair: leaves q and scale."""
    f = fp8.quantize(jnp.ones((4, 256, 128)), (1, 128))
    leaves, tree = jax.tree.flatten(f)
    assert [a.dtype for a in leaves] == [fp8.E4M3, jnp.float32]
    again = jax.jit(lambda f: f)(f)
    assert again.block == (1, 128) and jax.tree.structure(again) == tree


@pytest.mark.parametrize(
    "x, block, match",
    [
        (jnp.ones((128,)), (128, 128), r"rank >= 2 \(\[\.\.\., R, C\]\), got shape \(128,\)"),
        (
            jnp.ones((4, 4)),
            (0, 128),
            r"block must be \(rows, cols\) of positive ints, got \(0, 128\)",
        ),
        (jnp.ones((4, 4)), 128, r"block must be \(rows, cols\) of positive ints, got 128"),
    ],
)
def test_bad_arguments_are_named(x, block, match):
    with pytest.raises(ValueError, match=match):
        fp8.quantize(x, block)


def test_the_recipes_operand_and_gradient_roundings():
    """`quantize_operand`: the value rounded per 1 x 128 tile, the gradient the identity;
    `quantize_grad`: the value itself, the cotangent rounded per tile; both against the float64
    reference (bitwise: the inputs are float32)."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((5, 200)) * np.logspace(-3, 3, 5)[:, None]).astype(np.float32)
    g = (rng.standard_normal((5, 200)) * np.logspace(2, -2, 5)[:, None]).astype(np.float32)
    ref = lambda v: ref_dequantize(*ref_quantize(v, fp8.TILE), fp8.TILE)
    value, vjp = jax.vjp(fp8.quantize_operand, jnp.asarray(a))
    np.testing.assert_array_equal(np.asarray(value, np.float64), ref(a))
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(g))[0]), g)
    value, vjp = jax.vjp(fp8.quantize_grad, jnp.asarray(a))
    np.testing.assert_array_equal(np.asarray(value), a)
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(g))[0], np.float64), ref(g))
