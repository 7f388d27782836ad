"""Tests of the Pallas (Triton) gmm / tgmm kernels in interpret mode on CPU.

The GPU compiles (XLA's Triton pipeline, abstract H100s) are in test_gpu_compile.py.

Interpret mode compiles one XLA while loop per kernel and shape, so group
patterns are swept through a jitted function with traced group sizes (one
compile each). Blocks of 16 with M, K, N that are not multiples of 16 give
many tiles, tiles that span groups, and ragged edges on every axis. The
interpreter fills kernel outputs with NaN before the kernel runs (checked
below), so exact-zero padding rows and all-finite outputs prove that every
output element is stored, as it must be on a GPU.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from gmm_cases import BF16_RTOL, F32_RTOL, assert_close, rand
from relaymoe_jax.kernels.gmm import pallas as gp
from relaymoe_jax.kernels.gmm import pallas_kernels as gk
from relaymoe_jax.kernels.gmm import reference as ref

SMALL = dict(interpret=True, block_m=16, block_n=16, block_k=16)
M, K, N = 40, 20, 24  # K and N not multiples of the 16-wide blocks

# G = 3 group patterns for one M: sum == M, sum < M, sum > M (truncated), empties.
PATTERNS_G3 = [[40, 0, 0], [0, 40, 0], [0, 0, 40], [10, 20, 15], [3, 10, 6], [17, 1, 5]]
PATTERNS_G3 += [
    [s * k for s, k in zip([7, 9, 5], keep)]  # every zero pattern of G = 3
    for keep in itertools.product([0, 1], repeat=3)
]
# (M, group_sizes) with their own shapes: M not a multiple of block_m, G = 1, G = 6.
SHAPE_CASES = {
    "m_not_multiple_of_block": (37, [10, 1, 20, 6]),
    "one_group_g1": (24, [24]),
    "empty_groups_g6": (24, [5, 0, 0, 11, 0, 8]),
}


def _pad_start(sizes, m):
    """Holds the first row past every group (sum of the clamped sizes)."""
    return min(int(np.sum(np.maximum(sizes, 0))), m)


def _poison(x, sizes):
    """Holds x with every row past sum(sizes) set to NaN."""
    return x.at[_pad_start(sizes, x.shape[0]) :].set(jnp.nan)


def _rhs(seed, g, transpose_rhs, dtype=jnp.float32, k=K, n=N):
    """Holds rhs [G, K, N] (or [G, N, K] when transposed) and its [G, K, N] view."""
    w = rand(seed, (g, n, k) if transpose_rhs else (g, k, n), dtype)
    return w, (jnp.swapaxes(w, 1, 2) if transpose_rhs else w)


@functools.cache
def _gmm_with_vjp(transpose_rhs, out_dtype=None, **cfg):
    """Holds jit((lhs, rhs, sizes, dout) -> (out, dlhs, drhs)); sizes are traced."""
    cfg = cfg or SMALL

    def f(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(
            lambda a, b: gp.gmm(
                a, b, sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype, **cfg
            ),
            lhs,
            rhs,
        )
        return (out, *vjp(dout.astype(out.dtype)))

    return jax.jit(f)


@functools.cache
def _tgmm_with_vjp(out_dtype=None):
    """Holds jit((lhs, rhs, sizes, dout) -> (out, dlhs, drhs)) for tgmm; sizes traced."""

    def f(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(
            lambda a, b: gp.tgmm(a, b, sizes, preferred_element_type=out_dtype, **SMALL), lhs, rhs
        )
        return (out, *vjp(dout.astype(out.dtype)))

    return jax.jit(f)


def _check_gmm(lhs, rhs, w_gkn, sizes, dout, got, rtol=F32_RTOL, transpose_rhs=False):
    """Asserts (out, dlhs, drhs) of gmm against the float64 reference."""
    out, dlhs, drhs = got
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
    lhs_ok = np.nan_to_num(f32(lhs))  # NaN only in padding rows, which must be ignored
    want = ref.gmm(lhs_ok, f32(w_gkn), sizes)
    want_dlhs, want_drhs = ref.gmm_grads(lhs_ok, f32(rhs), sizes, f32(dout), transpose_rhs)
    pad = _pad_start(sizes, lhs.shape[0])
    np.testing.assert_array_equal(np.asarray(out, np.float64)[pad:], 0.0)
    np.testing.assert_array_equal(np.asarray(dlhs, np.float64)[pad:], 0.0)
    assert_close(out, want, rtol)
    assert_close(dlhs, want_dlhs, rtol)
    assert_close(drhs, want_drhs, rtol)


# ------------------------------------------------------------------ values and grads


def test_interpreter_leaves_unwritten_outputs_nan():
    # The premise of the zero-row checks: an element no program stores is NaN.
    def kernel(x_ref, o_ref):
        pass

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4, 16), jnp.float32), interpret=True
    )(jnp.zeros((4, 16)))
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_group_patterns_with_nan_padding(transpose_rhs):
    # One compile, every G = 3 pattern; padding rows of lhs AND of the
    # cotangent are NaN, which must reach neither out, dlhs nor drhs.
    lhs = rand(0, (M, K))
    rhs, w_gkn = _rhs(1, 3, transpose_rhs)
    dout = rand(2, (M, N))
    f = _gmm_with_vjp(transpose_rhs)
    for sizes in PATTERNS_G3:
        x, d = _poison(lhs, sizes), _poison(dout, sizes)
        got = f(x, rhs, jnp.asarray(sizes, jnp.int32), d)
        _check_gmm(
            x, rhs, w_gkn, sizes, np.nan_to_num(np.asarray(d)), got, transpose_rhs=transpose_rhs
        )


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("name", list(SHAPE_CASES))
def test_gmm_shapes(name, transpose_rhs):
    m, sizes = SHAPE_CASES[name]
    lhs, dout = rand(3, (m, K)), rand(4, (m, N))
    rhs, w_gkn = _rhs(5, len(sizes), transpose_rhs)
    got = _gmm_with_vjp(transpose_rhs)(lhs, rhs, jnp.asarray(sizes, jnp.int32), dout)
    _check_gmm(lhs, rhs, w_gkn, sizes, dout, got, transpose_rhs=transpose_rhs)


def test_gmm_default_blocks():
    # Default 64 x 128 x 64 blocks (shrunk to the dims), ragged on every axis.
    m, k, n, sizes = 150, 72, 40, [60, 0, 50, 30]
    lhs, dout = rand(6, (m, k)), rand(7, (m, n))
    rhs, w_gkn = _rhs(8, len(sizes), False, k=k, n=n)
    got = _gmm_with_vjp(False, interpret=True)(lhs, rhs, jnp.asarray(sizes, jnp.int32), dout)
    _check_gmm(lhs, rhs, w_gkn, sizes, dout, got)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_bf16(transpose_rhs):
    m, sizes = SHAPE_CASES["m_not_multiple_of_block"]
    lhs, dout = rand(3, (m, K), jnp.bfloat16), rand(4, (m, N), jnp.bfloat16)
    rhs, w_gkn = _rhs(5, len(sizes), transpose_rhs, jnp.bfloat16)
    sizes_j = jnp.asarray(sizes, jnp.int32)
    got = _gmm_with_vjp(transpose_rhs)(lhs, rhs, sizes_j, dout)
    assert [a.dtype for a in got] == [jnp.bfloat16] * 3
    _check_gmm(lhs, rhs, w_gkn, sizes, dout, got, BF16_RTOL, transpose_rhs)
    # An f32 output of bf16 operands is f32-accurate (bf16 products are exact in f32).
    out = gp.gmm(
        lhs, rhs, sizes_j, transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32, **SMALL
    )
    assert out.dtype == jnp.float32
    assert_close(out, ref.gmm(lhs.astype(jnp.float32), w_gkn.astype(jnp.float32), sizes))


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_mixed_operands_multiply_in_bf16(transpose_rhs):
    """The kernel given f32 rows and bf16 weights, and in its backward an f32 cotangent (the
    f32 output's), multiplies the operands rounded to bf16 (the tensor-core path), not promoted:
    f32-accurate against the rounded operands, off by bf16 rounding from the unrounded ones.
    The row gradient stays f32, the weight gradient bf16. tests/test_gpu_compile.py reads the
    compiled kernels' operand types and their wgmma instructions."""
    m, sizes = SHAPE_CASES["m_not_multiple_of_block"]
    lhs, dout = rand(3, (m, K)), rand(4, (m, N))
    rhs, w_gkn = _rhs(5, len(sizes), transpose_rhs, jnp.bfloat16)
    r16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64)
    mm = lambda a, b: gp.gmm(
        a,
        b,
        jnp.asarray(sizes, jnp.int32),
        transpose_rhs=transpose_rhs,
        preferred_element_type=jnp.float32,
        **SMALL,
    )
    out, vjp = jax.vjp(mm, lhs, rhs)
    want = ref.gmm(r16(lhs), r16(w_gkn), sizes)
    assert_close(out, want)
    assert (
        np.abs(np.asarray(out) - ref.gmm(np.asarray(lhs, np.float64), r16(w_gkn), sizes)).max()
        > 1e-4 * np.abs(want).max()
    )
    dlhs, drhs = vjp(dout)
    assert (dlhs.dtype, drhs.dtype) == (jnp.float32, jnp.bfloat16)
    assert_close(dlhs, ref.gmm(r16(dout), np.swapaxes(r16(w_gkn), 1, 2), sizes))
    dw = ref.tgmm(r16(lhs), r16(dout), sizes)
    assert_close(drhs, np.swapaxes(dw, 1, 2) if transpose_rhs else dw, BF16_RTOL)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_zero_padding_false_gives_the_padding_rows_no_work(transpose_rhs):
    """zero_padding=False: the real rows as before, and no program stores the padding rows of
    the output or of the lhs gradient (the interpreter leaves unwritten rows NaN); the weight
    gradient is unchanged (tgmm never reads padding)."""
    m, sizes = 70, [10, 1, 0, 20, 6]  # rows 37..69 are padding: 2+ row tiles of 16
    end = sum(sizes)
    lhs, dout = rand(3, (m, K)), rand(4, (m, N))
    rhs, w_gkn = _rhs(5, len(sizes), transpose_rhs)
    sizes_j = jnp.asarray(sizes, jnp.int32)
    mm = lambda a, b: gp.gmm(
        a, b, sizes_j, transpose_rhs=transpose_rhs, zero_padding=False, **SMALL
    )
    out, vjp = jax.vjp(mm, lhs, rhs)
    dlhs, drhs = vjp(dout)
    want_dlhs, want_drhs = ref.gmm_grads(
        np.asarray(lhs), np.asarray(rhs), sizes, np.asarray(dout), transpose_rhs
    )
    assert_close(out[:end], ref.gmm(lhs, w_gkn, sizes)[:end])
    assert_close(dlhs[:end], want_dlhs[:end])
    assert_close(drhs, want_drhs)
    assert np.isnan(np.asarray(out[end:])).all() and np.isnan(np.asarray(dlhs[end:])).all()
    with pytest.raises(ValueError, match="zero_padding must be a bool, got 'no'"):
        gp.gmm(lhs, rhs, sizes_j, zero_padding="no", **SMALL)


def test_tgmm_accumulates_in_place_and_skips_empty_groups():
    """tgmm(acc=): the kernel adds into acc's aliased buffer (the interpreter would leave an
    unwritten output NaN, so an empty group equal to acc shows the alias), with the fused
    gather; values against the float64 reference."""
    m, sizes = SHAPE_CASES["empty_groups_g6"]
    x, y = rand(1, (T, K)), rand(2, (m, N))
    rows = np.random.default_rng(3).integers(0, T, m)
    acc = rand(4, (len(sizes), K, N))
    out = jax.jit(lambda a, b, r, c: gp.tgmm(a, b, jnp.asarray(sizes), lhs_rows=r, acc=c, **SMALL))(
        x, y, jnp.asarray(rows), acc
    )
    want = np.asarray(acc, np.float64) + ref.tgmm(np.asarray(x)[rows], y, sizes)
    assert_close(out, want)
    empty = np.asarray(sizes) == 0
    np.testing.assert_array_equal(np.asarray(out)[empty], np.asarray(acc)[empty])


def test_gmm_output_dtype_selection():
    m, sizes = SHAPE_CASES["empty_groups_g6"]
    lhs, dout = rand(3, (m, K)), rand(4, (m, N))
    rhs, w_gkn = _rhs(5, len(sizes), False)
    got = _gmm_with_vjp(False, jnp.bfloat16)(lhs, rhs, jnp.asarray(sizes, jnp.int32), dout)
    # out in the preferred type; gradients in the operands' types.
    assert [a.dtype for a in got] == [jnp.bfloat16, jnp.float32, jnp.float32]
    assert_close(got[0], ref.gmm(lhs, w_gkn, sizes), BF16_RTOL)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[sum(sizes) :], 0.0)


def test_gmm_nan_row_stays_in_its_row():
    m, sizes = SHAPE_CASES["m_not_multiple_of_block"]
    lhs, rhs = rand(3, (m, K)), rand(5, (len(sizes), K, N))
    out = np.asarray(gp.gmm(lhs.at[12].set(jnp.inf), rhs, jnp.asarray(sizes), **SMALL))
    assert not np.isfinite(out[12]).all()
    want = ref.gmm(lhs, rhs, sizes)
    assert_close(np.delete(out, 12, 0), np.delete(want, 12, 0))


def test_tgmm_group_patterns_with_nan_padding():
    lhs, rhs, dout = rand(0, (M, K)), rand(1, (M, N)), rand(2, (3, K, N))
    f = _tgmm_with_vjp()
    for sizes in PATTERNS_G3:
        x, y = _poison(lhs, sizes), _poison(rhs, sizes)
        out, dlhs, drhs = f(x, y, jnp.asarray(sizes, jnp.int32), dout)
        assert_close(out, ref.tgmm(lhs, rhs, sizes))
        for g, size in enumerate(sizes):
            if size == 0:
                np.testing.assert_array_equal(np.asarray(out)[g], 0.0)
        want_dlhs, want_drhs = ref.tgmm_grads(lhs, rhs, sizes, dout)
        assert_close(dlhs, want_dlhs)
        assert_close(drhs, want_drhs)


def test_tgmm_bf16():
    m, sizes = SHAPE_CASES["empty_groups_g6"]
    lhs, rhs = rand(0, (m, K), jnp.bfloat16), rand(1, (m, N), jnp.bfloat16)
    sizes_j = jnp.asarray(sizes, jnp.int32)
    want = ref.tgmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    out = gp.tgmm(lhs, rhs, sizes_j, **SMALL)
    assert out.dtype == jnp.bfloat16
    assert_close(out, want, BF16_RTOL)
    out = gp.tgmm(lhs, rhs, sizes_j, preferred_element_type=jnp.float32, **SMALL)
    assert out.dtype == jnp.float32
    assert_close(out, want)
    np.testing.assert_array_equal(np.asarray(out)[[1, 2, 4]], 0.0)


# ------------------------------------------------------------------------ edges


def test_negative_sizes_and_degenerate_shapes():
    lhs, rhs = rand(0, (24, K)), rand(1, (3, K, N))
    out = gp.gmm(lhs, rhs, jnp.asarray([5, -3, 11]), **SMALL)
    assert_close(out, ref.gmm(lhs, rhs, [5, 0, 11]))
    assert gp.gmm(lhs[:0], rhs, jnp.zeros(3, jnp.int32), **SMALL).shape == (0, N)
    np.testing.assert_array_equal(
        np.asarray(gp.gmm(lhs, rhs[:0], jnp.zeros(0, jnp.int32), **SMALL)), 0.0
    )
    out = gp.tgmm(lhs[:0], jnp.zeros((0, N)), jnp.zeros(3, jnp.int32), **SMALL)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, K, N)))


@pytest.mark.parametrize("block", [0, 8, 48, 2.0, True])
def test_block_must_be_power_of_two(block):
    lhs, rhs = rand(0, (8, K)), rand(1, (2, K, N))
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        gp.gmm(lhs, rhs, jnp.asarray([3, 5]), block_n=block, interpret=True)


def test_shard_map_interpret_without_vma_check():
    # Per-device group sizes and a replicated rhs (its gradient is summed).
    n_dev, m, g = 4, 16, 3
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_dev]), ("x",))
    sizes_dg = np.array([[d % 4, 7 - d % 5, 2 * d % 9] for d in range(n_dev)], np.int32)
    lhs, w, dout = rand(0, (n_dev * m, K)), rand(1, (g, K, N)), rand(2, (n_dev * m, N))

    def body(x, w, sizes, d):
        loss = lambda a, b: jnp.sum(gp.gmm(a, b, sizes, **SMALL) * d)
        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        return gp.gmm(x, w, sizes, **SMALL), dx, jax.lax.psum(dw, "x")

    p, r = jax.P("x"), jax.P()
    # check_vma=False: see test_interpret_under_vma_check_is_a_jax_limitation.
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(p, r, p, p), out_specs=(p, p, r), check_vma=False)
    )
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, p))
    out, dlhs, dw = map(np.asarray, f(put(lhs), w, put(sizes_dg.reshape(-1)), put(dout)))
    want_dw = 0
    for d in range(n_dev):
        rows = slice(d * m, (d + 1) * m)
        assert_close(out[rows], ref.gmm(lhs[rows], w, sizes_dg[d]))
        gx, gw = ref.gmm_grads(lhs[rows], w, sizes_dg[d], dout[rows])
        assert_close(dlhs[rows], gx)
        want_dw = want_dw + gw
    assert_close(dw, want_dw)


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="jax 0.12: the Pallas HLO interpreter evaluates kernel ops on "
    "varying and non-varying values and fails the vma check",
)
def test_interpret_under_vma_check_is_a_jax_limitation():
    # If this starts passing, interpret mode works under shard_map(check_vma=True).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    body = lambda x, s: gp.gmm(x, rand(1, (1, K, N)), s, **SMALL)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("x")))
    f(put(rand(0, (32, K))), put(jnp.asarray([16, 16], jnp.int32)))


# ------------------------------------------------------------------ fused gather

T = 13  # token rows; grouped rows gather them (with repeats, as top-k routing does)


def _gather_case(sizes, m=M, seed=0):
    """Holds (tokens [T, K], rows [M]); rows past sum(sizes) are garbage indices."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, T, m).astype(np.int32)
    pad = _pad_start(sizes, m)
    rows[pad:] = rng.choice([-7, T, 10 * T], m - pad)  # never read, never scattered to
    tokens = rand(seed + 1, (T, K))
    if pad < m:
        tokens = tokens.at[T - 1].set(jnp.nan)  # only padding-row entries may point here
        rows[:pad] = np.minimum(rows[:pad], T - 2)
    return tokens, jnp.asarray(rows)


def _scatter_ref(d_mk, rows, sizes):
    """Holds the float64 [T, K] scatter-add of grouped-row gradients (reference)."""
    out = np.zeros((T, d_mk.shape[1]))
    pad = _pad_start(sizes, d_mk.shape[0])
    np.add.at(out, np.asarray(rows)[:pad], np.asarray(d_mk)[:pad])
    return out


@functools.cache
def _gathered_gmm(transpose_rhs):
    """Holds jit((tokens, rhs, sizes, rows, dout) -> (out, dtokens, drhs)), sizes traced."""

    def f(tokens, rhs, sizes, rows, dout):
        out, vjp = jax.vjp(
            lambda a, b: gp.gmm(a, b, sizes, lhs_rows=rows, transpose_rhs=transpose_rhs, **SMALL),
            tokens,
            rhs,
        )
        return (out, *vjp(dout))

    return jax.jit(f)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_fused_gather(transpose_rhs):
    rhs, w_gkn = _rhs(1, 3, transpose_rhs)
    dout = rand(2, (M, N))
    for sizes in ([10, 20, 10], [3, 0, 6], [0, 0, 0], [0, 40, 0], [10, 20, 15]):
        tokens, rows = _gather_case(sizes)
        out, dtok, drhs = _gathered_gmm(transpose_rhs)(tokens, rhs, jnp.asarray(sizes), rows, dout)
        pad = _pad_start(sizes, M)
        x_mk = np.asarray(tokens)[np.clip(np.asarray(rows), 0, T - 1)]
        x_mk[pad:] = 0.0  # garbage rows: never read
        want = ref.gmm(x_mk, w_gkn, sizes)
        want_dx, want_dw = ref.gmm_grads(x_mk, rhs, sizes, dout, transpose_rhs)
        assert_close(out, want)
        np.testing.assert_array_equal(np.asarray(out)[pad:], 0.0)
        assert_close(dtok, _scatter_ref(want_dx, rows, sizes))
        assert_close(drhs, want_dw)


def test_tgmm_fused_gather_either_operand():
    sizes = [10, 0, 17]
    tokens, rows = _gather_case(sizes, seed=3)
    other, dout = rand(5, (M, N)), rand(6, (3, K, N))
    x_mk = np.asarray(tokens)[np.clip(np.asarray(rows), 0, T - 1)]
    x_mk[_pad_start(sizes, M) :] = 0.0
    sizes_j = jnp.asarray(sizes)
    # gather on lhs: out_g = tokens[rows_g].T @ other_g
    out, vjp = jax.vjp(lambda a, b: gp.tgmm(a, b, sizes_j, lhs_rows=rows, **SMALL), tokens, other)
    dtok, doth = vjp(dout)
    want_dx, want_dy = ref.tgmm_grads(x_mk, other, sizes, dout)
    assert_close(out, ref.tgmm(x_mk, other, sizes))
    assert_close(dtok, _scatter_ref(want_dx, rows, sizes))
    assert_close(doth, want_dy)
    # gather on rhs: out_g = other_g.T @ tokens[rows_g]  ([G, N, K])
    dout_t = jnp.swapaxes(dout, 1, 2)
    out, vjp = jax.vjp(lambda a, b: gp.tgmm(a, b, sizes_j, rhs_rows=rows, **SMALL), other, tokens)
    doth, dtok = vjp(dout_t)
    want_dy, want_dx = ref.tgmm_grads(other, x_mk, sizes, dout_t)
    assert_close(out, ref.tgmm(other, x_mk, sizes))
    assert_close(doth, want_dy)
    assert_close(dtok, _scatter_ref(want_dx, rows, sizes))


# ------------------------------------------------------- shared memory per stage

BF, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(
    "name, tiles, cfg, want",
    [
        ("gmm", ((64, 64, BF), (64, 128, BF)), gk.Config(), 3),  # default blocks
        ("gmm", ((64, 64, F32), (64, 128, F32)), gk.Config(), 2),  # 4-byte operands
        # the H200 failure: tgmm 128 x 256 x 64, 3 stages = 245,760 bytes > 232,448; fitted to 2
        ("tgmm", ((128, 64, BF), (128, 256, BF)), gk.Config(128, 256, 64), 2),
        ("tgmm", ((128, 64, F32), (128, 256, F32)), gk.Config(128, 256, 64), 1),
        ("gmm", ((128, 64, BF), (64, 256, BF)), gk.Config(128, 256, 64, num_stages=3), 3),
    ],
)
def test_stages_fit_shared_memory(name, tiles, cfg, want):
    got = gk.compiler_params(cfg, name, tiles).num_stages
    assert got == want
    per_stage = sum(r * c * np.dtype(d).itemsize for r, c, d in tiles)
    assert got * per_stage <= gk.SMEM_BYTES


def test_explicit_stages_over_shared_memory_are_refused():
    cfg = gk.Config(128, 256, 64, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match=r"tgmm: num_stages=3 keeps 3 x 81,920 = 245,760 bytes"):
        gk.compiler_params(cfg, "tgmm", ((128, 64, BF), (128, 256, BF)))
    # end to end: the public tgmm refuses before any kernel runs (interpret mode on CPU)
    x = jnp.zeros((256, 64), BF)
    with pytest.raises(ValueError, match="245,760 bytes"):
        gp.tgmm(
            x,
            jnp.zeros((256, 256), BF),
            jnp.array([128, 128]),
            interpret=True,
            block_m=128,
            block_n=256,
            block_k=64,
            num_stages=3,
        )
