"""The e4m3 grouped matmul (`gmm_fp8`: `kernels/gmm/mosaic_fp8.py` and its custom VJP) in jax's
GPU interpreter on CPU, race detector on, against float64 numpy of the rounded operands
(`fp8_cases.ref_fake`: ml_dtypes' e4m3 and scales found by search, not the library's code).

The inputs make every scale matter: rows span 2^-6..2^6 and each 128-column tile of a row its own
factor (x's tile scales), and each 128 x 128 block of w its own factor (w's block scales), so a
kernel that dropped a scale, applied a neighbour's or applied one per K step to the wrong block
is off by factors of two, far past float32's accumulation error. Products of e4m3 values are
exact in float32 and the scales are powers of two, so the kernel agrees with float64 to float32
accumulation. NaN in every padding row proves none reaches a stored row or a weight gradient;
the interpreter fills outputs with NaN first, so finite outputs with zero padding rows prove
every element is stored once. moe_ffn through this kernel: test_dispatch_mosaic.py; the
deviceless H100 compile (PTX e4m3 wgmma): test_gmm_mosaic_compile.py.
"""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_cases import BLOCK, TILE, ref_fake

from gmm_cases import F32_RTOL, assert_close, fails_close, sabotaged
from relaymoe_jax.kernels.gmm import gmm_fp8, mosaic, mosaic_fp8
from relaymoe_jax.kernels.gmm import reference as ref
from relaymoe_jax.quant import fp8

BF16 = jnp.bfloat16
G, M, K, N = 4, 192, 256, 256  # three row tiles, two K steps, one tile of 2 x 128 columns
PATTERNS = {
    "balanced": np.full(G, 40),
    "skewed": np.array([0, 90, 40, 20]),  # half the rows in one group, one empty, then fewer
    "all-empty": np.zeros(G, np.int64),
}
ODD = (100, 200, 72, [90])  # one group; M, K, N no multiple of the tiles (padded by the wrapper)


def _operands(m, k, n, g, sizes, seed=0):
    """bf16 x [m, k] and w [g, k, n] with magnitudes varying per row, per 128-column tile and per
    128 x 128 block (module doc), a float32 cotangent d [m, n] varying per row; rows past
    sum(sizes) NaN in x and d."""
    rng = np.random.default_rng(seed)
    end = min(int(np.sum(sizes)), m)
    tiles = lambda r, c: np.repeat(2.0 ** rng.integers(-3, 4, (r, -(-c // 128))), 128, 1)
    x = rng.standard_normal((m, k)) * 2.0 ** rng.integers(-6, 7, (m, 1)) * tiles(m, k)[:, :k]
    blocks = 2.0 ** rng.integers(-4, 5, (g, -(-k // 128), -(-n // 128)))
    w = rng.standard_normal((g, k, n)) * np.repeat(np.repeat(blocks, 128, 1), 128, 2)[:, :k, :n]
    d = rng.standard_normal((m, n)) * 2.0 ** rng.integers(-4, 5, (m, 1))
    x, d = x.astype(np.float32), d.astype(np.float32)
    x[end:], d[end:] = np.nan, np.nan
    return jnp.asarray(x, BF16), jnp.asarray(w, BF16), jnp.asarray(d)


def _expected(x, w, d, sizes):
    """float64 out, dx, dW of the rounded operands (the cotangent rounded per 1 x 128 tile)."""
    x64 = np.nan_to_num(ref_fake(np.asarray(x, np.float64), TILE))
    d64 = np.nan_to_num(ref_fake(np.asarray(d, np.float64), TILE))
    w64 = ref_fake(np.asarray(w, np.float64), BLOCK)
    dx, dw = ref.gmm_grads(x64, w64, sizes, d64)
    return dict(out=ref.gmm(x64, w64, sizes), dx=dx, dw=dw)


def _program(interpret):
    """One program: the forward (float32 out), its VJP (dx: the kernel on the other orientation;
    dW: the 16-bit tgmm), and the transposed forward on an `Fp8` w (the ring's relayed weights)."""

    def f(x, w, d, gs):
        kw = dict(preferred_element_type=jnp.float32, interpret=interpret)
        out, vjp = jax.vjp(lambda x, w: gmm_fp8(x, w, gs, **kw), x, w)
        dx, dw = vjp(d)
        w_t = fp8.quantize(jnp.swapaxes(w, 1, 2))  # [G, N, K]: the blocks of w transposed
        out_t = gmm_fp8(x, w_t, gs, transpose_rhs=True, **kw)
        return dict(out=out, dx=dx, dw=dw, out_t=out_t)

    return jax.jit(f)


@pytest.fixture(scope="module")
def results():
    """{case: (got, want, first padding row)} for every pattern and the odd shape."""
    run = _program(plgpu.InterpretGPUParams(detect_races=True))
    out = {}
    for name, sizes in [*PATTERNS.items(), ("odd-shape", ODD[3])]:
        m, k, n = (M, K, N) if name != "odd-shape" else ODD[:3]
        x, w, d = _operands(m, k, n, len(sizes), sizes)
        got = run(x, w, d, jnp.asarray(sizes, jnp.int32))
        want = _expected(x, w, d, sizes)
        out[name] = ({k: np.asarray(v, np.float64) for k, v in got.items()}, want, sum(sizes))
    return out


CASES = [*PATTERNS, "odd-shape"]


@pytest.mark.parametrize("case", CASES)
def test_forward_on_both_orientations(results, case):
    """out (x @ w: w transposed to K-major by XLA) and out_t (an `Fp8` w already [G, N, K])
    within float32 accumulation of float64; padding rows stored as exact zeros."""
    got, want, end = results[case]
    for key in ("out", "out_t"):
        assert_close(got[key], want["out"], F32_RTOL)
        assert np.all(got[key][end:] == 0.0), key


@pytest.mark.parametrize("case", CASES)
def test_vjp_rounds_the_cotangent_and_reuses_the_e4m3_weights(results, case):
    """dx (the e4m3 kernel on the forward's quantised w, other orientation; bf16 like x) within
    its bf16 rounding; dW (tgmm of the rounded values, bf16 like w) within its own; empty groups'
    dW exact zeros and padding rows' dx exact zeros."""
    got, want, end = results[case]
    for key in ("dx", "dw"):
        rounding = np.abs(np.asarray(jnp.asarray(want[key], BF16), np.float64) - want[key])
        bound = 2 * rounding.max() + F32_RTOL * max(np.abs(want[key]).max(), 1)
        assert np.isfinite(got[key]).all(), key
        assert np.abs(got[key] - want[key]).max() <= bound, key
    assert np.all(got["dx"][end:] == 0.0)
    empty = [g for g in range(want["dw"].shape[0]) if not np.any(want["dw"][g])]
    assert np.all(got["dw"][empty] == 0.0)


# ------------------------------------------------------------- sabotage: the tests can fail

SMALL = (64, 256, 128, [30, 0, 20])  # two K steps, three groups (one empty), padding rows


def _small(x_scales=None):
    """(the kernel's float32 output on SMALL, float64's); `x_scales(scale)` replaces x's tile
    scales [M, K / 128] (what a kernel reading the wrong ones would compute)."""
    m, k, n, sizes = SMALL
    x, w, _ = _operands(m, k, n, len(sizes), sizes, seed=1)
    x_q = fp8.quantize(x, TILE)
    if x_scales is not None:
        x_q = fp8.Fp8(x_q.q, x_scales(x_q.scale), x_q.block, x_q.dtype)
    cfg = mosaic.make_config(True)
    gs = jnp.asarray(sizes, jnp.int32)
    got = mosaic_fp8.gmm_fp8_call(x_q, fp8.quantize(w), gs, False, np.float32, cfg)
    return got, _expected(x, w, jnp.zeros((m, n)), sizes)["out"]


def test_sabotage_is_caught(monkeypatch):
    """The comparison fails when the kernel skips a K block, drops a work item (a group's rows in
    one tile, left NaN), takes the weight scale of the wrong K block, or x's row scales of the
    wrong one; untouched, it passes."""
    got, want = _small()
    assert not fails_close(got, want)
    first_block = lambda scale: jnp.broadcast_to(scale[:, :1], scale.shape)
    assert fails_close(_small(first_block)[0], want)
    with sabotaged(monkeypatch) as mp:
        mp.setattr(mosaic_fp8._Spec, "k_steps", property(lambda sp: sp.k // mosaic_fp8.BK - 1))
        assert fails_close(_small()[0], want)
    with sabotaged(monkeypatch) as mp:
        items = mosaic_fp8.row_items
        fewer = lambda *a: items(*a)._replace(count=items(*a).count - 1)
        mp.setattr(mosaic_fp8, "row_items", fewer)
        assert fails_close(_small()[0], want)
    with sabotaged(monkeypatch) as mp:
        consume = mosaic_fp8._consume

        def first_scale(*args):  # every K step scaled by the first K block's weight scale
            *rest, w_scale = args
            return consume(*rest, lambda j: w_scale(j * 0))

        mp.setattr(mosaic_fp8, "_consume", first_scale)
        assert fails_close(_small()[0], want)


# ------------------------------------------------------------------ the entry point's checks


@pytest.mark.parametrize(
    "args,msg",
    [
        ((jnp.ones((64, 128), jnp.int32), jnp.ones((1, 128, 128))), "lhs must be a 2-D float"),
        ((jnp.ones((64, 128)), jnp.ones((1, 64, 128))), r"rhs.shape\[1\]=64 must equal K=.*128"),
        ((jnp.ones((64, 128)), jnp.ones((128, 128))), r"rhs must be 3-D \[G, K, N\]"),
        ((jnp.ones((64, 128)), fp8.quantize(jnp.ones((1, 128, 128)), TILE)), "128 x 128 blocks"),
    ],
)
def test_bad_operands_are_refused(args, msg):
    with pytest.raises(ValueError, match=msg):
        gmm_fp8(*args, jnp.array([64]), interpret=True)


def test_group_sizes_must_match_the_groups():
    with pytest.raises(ValueError, match=r"group_sizes must be integer \[G=2\], got int32\(3,\)"):
        gmm_fp8(jnp.ones((64, 128)), jnp.ones((2, 128, 128)), jnp.array([1, 2, 3]), interpret=True)
