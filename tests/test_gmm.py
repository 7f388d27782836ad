"""Tests of gmm / tgmm against the float64 numpy reference, for every implementation."""

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gmm_cases import BF16_RTOL, F32_RTOL, assert_close, rand
from relaymoe_jax.kernels import gmm, tgmm
from relaymoe_jax.kernels.gmm import describe_impl, resolve_impl
from relaymoe_jax.kernels.gmm import reference as ref
from relaymoe_jax.kernels.gmm.common import work_items

# (M, group_sizes, tile_m): tile_m 8 makes many tiles and tiles that span groups.
GMM_CASES = {
    "one_group": (24, [24], 8),
    "all_rows_in_middle_group": (24, [0, 24, 0], 8),
    "empty_groups": (24, [5, 0, 0, 11, 0, 8], 8),
    "sum_lt_m": (40, [3, 10, 6], 8),
    "m_not_multiple_of_tile": (37, [10, 1, 20, 6], 8),
    "tile_larger_than_m": (20, [7, 0, 9], 64),
    "tile_of_one_row": (9, [2, 3, 0, 4], 1),
    "default_tile": (300, [100, 0, 150, 40], None),
    "sum_gt_m_truncated": (24, [10, 20, 5], 8),
}
# Every zero pattern of G=3 group sizes; sum < M leaves padding rows at the end.
GMM_CASES.update(
    {
        f"zeros_{''.join(map(str, keep))}": (24, [s * k for s, k in zip([7, 9, 5], keep)], 8)
        for keep in itertools.product([0, 1], repeat=3)
    }
)

K, N = 16, 12


def _case(name, seed=0, dtype=np.float32, transpose_rhs=False):
    """Holds (lhs, rhs, group_sizes, tile_m) for a GMM_CASES entry."""
    m, sizes, tile_m = GMM_CASES[name]
    rhs_shape = (len(sizes), N, K) if transpose_rhs else (len(sizes), K, N)
    return (
        rand(seed, (m, K), dtype),
        rand(seed + 1, rhs_shape, dtype),
        jnp.asarray(sizes, jnp.int32),
        tile_m,
    )


def _padding_start(sizes, m):
    """Holds the first row past every group (sum of sizes, clamped at m)."""
    return min(int(np.sum(sizes)), m)


class _GmmTests:
    """Tests shared by every implementation; subclasses set `impl`."""

    impl: str

    @pytest.mark.parametrize("transpose_rhs", [False, True])
    @pytest.mark.parametrize("name", list(GMM_CASES))
    def test_gmm_matches_reference(self, name, transpose_rhs):
        lhs, rhs, sizes, tile_m = _case(name, transpose_rhs=transpose_rhs)
        out = gmm(lhs, rhs, sizes, impl=self.impl, transpose_rhs=transpose_rhs, tile_m=tile_m)
        want = ref.gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
        assert out.dtype == jnp.float32
        assert_close(out, want)
        pad = _padding_start(sizes, lhs.shape[0])
        np.testing.assert_array_equal(np.asarray(out)[pad:], 0.0)

    @pytest.mark.parametrize(
        "name",
        [
            "empty_groups",
            "sum_lt_m",
            "m_not_multiple_of_tile",
            "zeros_010",
            "zeros_000",
            "sum_gt_m_truncated",
        ],
    )
    def test_tgmm_matches_reference(self, name):
        lhs, _, sizes, tile_m = _case(name)
        rhs = rand(7, (lhs.shape[0], N))
        out = tgmm(lhs, rhs, sizes, impl=self.impl, tile_m=tile_m)
        want = ref.tgmm(lhs, rhs, sizes)
        assert_close(out, want)
        for g, size in enumerate(np.asarray(sizes)):
            if size == 0:
                np.testing.assert_array_equal(np.asarray(out)[g], 0.0)

    @pytest.mark.parametrize("transpose_rhs", [False, True])
    def test_gmm_bf16(self, transpose_rhs):
        lhs, rhs, sizes, tile_m = _case(
            "m_not_multiple_of_tile", dtype=jnp.bfloat16, transpose_rhs=transpose_rhs
        )
        want = ref.gmm(
            lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, transpose_rhs=transpose_rhs
        )
        out = gmm(lhs, rhs, sizes, impl=self.impl, transpose_rhs=transpose_rhs, tile_m=tile_m)
        assert out.dtype == jnp.bfloat16
        assert_close(out, want, BF16_RTOL)
        # bf16 products are exact in f32, so an f32 output is f32-accurate.
        out = gmm(
            lhs,
            rhs,
            sizes,
            impl=self.impl,
            transpose_rhs=transpose_rhs,
            tile_m=tile_m,
            preferred_element_type=jnp.float32,
        )
        assert out.dtype == jnp.float32
        assert_close(out, want)

    def test_tgmm_bf16(self):
        lhs, _, sizes, tile_m = _case("empty_groups", dtype=jnp.bfloat16)
        rhs = rand(7, (lhs.shape[0], N), jnp.bfloat16)
        want = ref.tgmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
        out = tgmm(lhs, rhs, sizes, impl=self.impl, tile_m=tile_m)
        assert out.dtype == jnp.bfloat16
        assert_close(out, want, BF16_RTOL)
        out = tgmm(
            lhs, rhs, sizes, impl=self.impl, tile_m=tile_m, preferred_element_type=jnp.float32
        )
        assert out.dtype == jnp.float32
        assert_close(out, want)

    @pytest.mark.parametrize("transpose_rhs", [False, True])
    def test_mixed_dtypes_multiply_in_the_16_bit_type(self, transpose_rhs):
        """bf16 weights with f32 rows (and an f32 cotangent in the backward): the f32 operand is
        cast to bf16 (tensor cores), never promoted: the results are those of the rounded
        operands to f32 accuracy (bf16 products are exact in f32), which promoting misses by
        about bf16's rounding. Gradients keep their operands' dtypes."""
        lhs, rhs, sizes, tile_m = _case("empty_groups", transpose_rhs=transpose_rhs)
        rhs = rhs.astype(jnp.bfloat16)
        r16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64)
        mm = lambda a, b: gmm(
            a,
            b,
            sizes,
            impl=self.impl,
            transpose_rhs=transpose_rhs,
            tile_m=tile_m,
            preferred_element_type=jnp.float32,
        )
        out, vjp = jax.vjp(mm, lhs, rhs)
        assert_close(out, ref.gmm(r16(lhs), r16(rhs), sizes, transpose_rhs=transpose_rhs))
        dout = rand(9, out.shape)
        dlhs, drhs = vjp(dout)
        assert (dlhs.dtype, drhs.dtype) == (jnp.float32, jnp.bfloat16)
        # "ragged_dot" is differentiated by JAX through the cast: its dlhs is bf16-rounded
        tol = BF16_RTOL if self.impl == "ragged_dot" else F32_RTOL
        assert_close(
            dlhs, ref.gmm(r16(dout), r16(rhs), sizes, transpose_rhs=not transpose_rhs), tol
        )
        want_w = (
            ref.tgmm(r16(dout), r16(lhs), sizes)
            if transpose_rhs
            else ref.tgmm(r16(lhs), r16(dout), sizes)
        )
        assert_close(drhs, want_w, BF16_RTOL)
        assert float(
            np.abs(
                np.asarray(out, np.float64)
                - ref.gmm(np.asarray(lhs, np.float64), r16(rhs), sizes, transpose_rhs=transpose_rhs)
            ).max()
        ) > 1e-4 * float(np.abs(np.asarray(out)).max())  # promoting would give this one

    def test_tgmm_mixed_dtypes_multiply_in_the_16_bit_type(self):
        lhs, _, sizes, tile_m = _case("empty_groups", dtype=jnp.bfloat16)
        rhs = rand(7, (lhs.shape[0], N))  # f32
        r16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64)
        out = tgmm(
            lhs, rhs, sizes, impl=self.impl, tile_m=tile_m, preferred_element_type=jnp.float32
        )
        assert_close(out, ref.tgmm(r16(lhs), r16(rhs), sizes))

    def test_tgmm_accumulates_into_acc(self):
        """tgmm(acc=a) = a + tgmm (empty groups keep a's values exactly), its gradient in a is
        the output's cotangent and in lhs/rhs tgmm's; a wrong acc is refused naming it."""
        lhs, _, sizes, tile_m = _case("empty_groups")
        rhs = rand(7, (lhs.shape[0], N))
        acc = rand(8, (len(sizes), K, N))
        f = lambda a, b, c: tgmm(a, b, sizes, impl=self.impl, tile_m=tile_m, acc=c)
        out, vjp = jax.vjp(f, lhs, rhs, acc)
        assert_close(out, np.asarray(acc, np.float64) + ref.tgmm(lhs, rhs, sizes))
        empty = np.asarray(sizes) == 0
        np.testing.assert_array_equal(np.asarray(out)[empty], np.asarray(acc)[empty])
        dout = rand(9, out.shape)
        dl, dr, da = vjp(dout)
        want_l, want_r = jax.vjp(
            lambda a, b: tgmm(a, b, sizes, impl=self.impl, tile_m=tile_m), lhs, rhs
        )[1](dout)
        np.testing.assert_array_equal(np.asarray(da), np.asarray(dout))
        assert_close(dl, np.asarray(want_l, np.float64))
        assert_close(dr, np.asarray(want_r, np.float64))
        with pytest.raises(
            ValueError,
            match=r"acc must be the output's \[G, K, N\] = "
            r"\(6, 16, 12\) float32 \(preferred_element_type"
            r"\), got bfloat16",
        ):
            tgmm(lhs, rhs, sizes, impl=self.impl, acc=acc.astype(jnp.bfloat16))

    def test_two_different_16_bit_types_are_refused(self):
        lhs, rhs, sizes, _ = _case("one_group")
        with pytest.raises(ValueError, match="two different narrow types, bfloat16 and float16"):
            gmm(lhs.astype(jnp.bfloat16), rhs.astype(jnp.float16), sizes, impl=self.impl)
        with pytest.raises(ValueError, match="two different narrow types, float16 and bfloat16"):
            tgmm(lhs.astype(jnp.float16), lhs.astype(jnp.bfloat16), sizes, impl=self.impl)

    def test_no_groups(self):
        lhs = rand(0, (8, K))
        out = gmm(lhs, jnp.zeros((0, K, N)), jnp.zeros((0,), jnp.int32), impl=self.impl)
        np.testing.assert_array_equal(np.asarray(out), np.zeros((8, N)))
        out = tgmm(lhs, rand(1, (8, N)), jnp.zeros((0,), jnp.int32), impl=self.impl)
        assert out.shape == (0, K, N)

    def test_negative_group_size_counts_as_zero(self):
        lhs, rhs, _, _ = _case("empty_groups")
        out = gmm(lhs, rhs, jnp.asarray([5, -3, 0, 11, 0, 8]), impl=self.impl, tile_m=8)
        assert_close(out, ref.gmm(lhs, rhs, [5, 0, 0, 11, 0, 8]))

    def test_empty_m(self):
        lhs, w = jnp.zeros((0, K)), rand(0, (3, K, N))
        sizes = jnp.zeros((3,), jnp.int32)
        assert gmm(lhs, w, sizes, impl=self.impl).shape == (0, N)
        out = tgmm(lhs, jnp.zeros((0, N)), sizes, impl=self.impl)
        np.testing.assert_array_equal(np.asarray(out), np.zeros((3, K, N)))

    # --------------------------------------------------------------- NaN poison

    @pytest.mark.parametrize("name", ["sum_lt_m", "zeros_101"])
    def test_gmm_ignores_nan_padding_rows(self, name):
        lhs, rhs, sizes, tile_m = _case(name)
        pad = _padding_start(sizes, lhs.shape[0])
        want = ref.gmm(lhs, rhs, sizes)
        out = gmm(lhs.at[pad:].set(jnp.nan), rhs, sizes, impl=self.impl, tile_m=tile_m)
        np.testing.assert_array_equal(np.asarray(out)[pad:], 0.0)
        assert_close(out, want)

    def test_gmm_nan_row_stays_in_its_row(self):
        lhs, rhs, sizes, tile_m = _case("m_not_multiple_of_tile")
        out = np.asarray(gmm(lhs.at[12].set(jnp.inf), rhs, sizes, impl=self.impl, tile_m=tile_m))
        want = ref.gmm(lhs, rhs, sizes)
        assert not np.isfinite(out[12]).all()
        assert_close(np.delete(out, 12, 0), np.delete(want, 12, 0))

    def test_tgmm_ignores_nan_padding_rows(self):
        lhs, _, sizes, tile_m = _case("sum_lt_m")
        rhs = rand(7, (lhs.shape[0], N))
        pad = _padding_start(sizes, lhs.shape[0])
        want = ref.tgmm(lhs, rhs, sizes)
        out = tgmm(
            lhs.at[pad:].set(jnp.nan),
            rhs.at[pad:].set(jnp.nan),
            sizes,
            impl=self.impl,
            tile_m=tile_m,
        )
        assert_close(out, want)

    @pytest.mark.parametrize("transpose_rhs", [False, True])
    def test_gmm_vjp_ignores_nan_cotangent_padding(self, transpose_rhs):
        lhs, rhs, sizes, tile_m = _case("sum_lt_m", transpose_rhs=transpose_rhs)
        pad = _padding_start(sizes, lhs.shape[0])
        dout = rand(9, (lhs.shape[0], N))
        want_dlhs, want_drhs = ref.gmm_grads(lhs, rhs, sizes, dout, transpose_rhs)
        _, vjp = jax.vjp(
            lambda a, b: gmm(
                a, b, sizes, impl=self.impl, tile_m=tile_m, transpose_rhs=transpose_rhs
            ),
            lhs,
            rhs,
        )
        dlhs, drhs = vjp(dout.at[pad:].set(jnp.nan))
        np.testing.assert_array_equal(np.asarray(dlhs)[pad:], 0.0)
        assert_close(dlhs, want_dlhs)
        assert_close(drhs, want_drhs)

    # ---------------------------------------------------------------- gradients

    @pytest.mark.parametrize("transpose_rhs", [False, True])
    @pytest.mark.parametrize("name", ["empty_groups", "m_not_multiple_of_tile"])
    def test_gmm_grads(self, name, transpose_rhs):
        lhs, rhs, sizes, tile_m = _case(name, transpose_rhs=transpose_rhs)
        dout = rand(9, (lhs.shape[0], N))
        want_dlhs, want_drhs = ref.gmm_grads(lhs, rhs, sizes, dout, transpose_rhs)

        def loss(a, b):
            out = gmm(a, b, sizes, impl=self.impl, tile_m=tile_m, transpose_rhs=transpose_rhs)
            return jnp.sum(out * dout)

        dlhs, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
        assert_close(dlhs, want_dlhs)
        assert_close(drhs, want_drhs)

    @pytest.mark.parametrize("name", ["empty_groups", "m_not_multiple_of_tile"])
    def test_tgmm_grads(self, name):
        lhs, _, sizes, tile_m = _case(name)
        rhs = rand(7, (lhs.shape[0], N))
        dout = rand(9, (len(sizes), K, N))
        want_dlhs, want_drhs = ref.tgmm_grads(lhs, rhs, sizes, dout)
        _, vjp = jax.vjp(lambda a, b: tgmm(a, b, sizes, impl=self.impl, tile_m=tile_m), lhs, rhs)
        dlhs, drhs = vjp(dout)
        assert_close(dlhs, want_dlhs)
        assert_close(drhs, want_drhs)

    # --------------------------------------------------------- jit / shard_map

    def test_jit_traced_group_sizes(self):
        lhs, rhs, _, _ = _case("empty_groups")
        rhs_t = rand(7, (lhs.shape[0], N))
        f = jax.jit(
            lambda a, b, c, s: (
                gmm(a, b, s, impl=self.impl, tile_m=8),
                tgmm(a, c, s, impl=self.impl, tile_m=8),
            )
        )
        for sizes in ([5, 0, 0, 11, 0, 8], [0, 0, 24, 0, 0, 0], [1, 2, 3, 0, 0, 0]):
            out, out_t = f(lhs, rhs, rhs_t, jnp.asarray(sizes, jnp.int32))
            assert_close(out, ref.gmm(lhs, rhs, sizes))
            assert_close(out_t, ref.tgmm(lhs, rhs_t, sizes))
            np.testing.assert_array_equal(np.asarray(out)[sum(sizes) :], 0.0)

    @pytest.mark.parametrize("tile_m", [3, 8])
    def test_random_group_sizes(self, tile_m):
        # One compile (traced sizes), many layouts: zeros, tiles spanning
        # several groups, sums below, at and above M (truncated at M).
        m, g = 37, 5
        lhs, rhs, rhs_t = rand(0, (m, K)), rand(1, (g, K, N)), rand(2, (m, N))
        f = jax.jit(
            lambda s: (
                gmm(lhs, rhs, s, impl=self.impl, tile_m=tile_m),
                tgmm(lhs, rhs_t, s, impl=self.impl, tile_m=tile_m),
            )
        )
        rng = np.random.default_rng(tile_m)
        for _ in range(20):
            sizes = rng.integers(0, 13, g) * (rng.random(g) < 0.7)
            out, out_t = f(jnp.asarray(sizes, jnp.int32))
            assert_close(out, ref.gmm(lhs, rhs, sizes))
            assert_close(out_t, ref.tgmm(lhs, rhs_t, sizes))
            np.testing.assert_array_equal(np.asarray(out)[_padding_start(sizes, m) :], 0.0)

    def test_shard_map_per_device_group_sizes(self):
        mesh = jax.make_mesh((8,), ("x",))
        m, g = 16, 3
        sizes_dg = np.array([[d % 4, 7 - d % 5, 2 * d % 9] for d in range(8)], np.int32)
        lhs = rand(0, (8 * m, K))
        w_gkn = rand(1, (g, K, N))  # replicated: its gradient is summed over devices
        dout = rand(2, (8 * m, N))
        dout_t = rand(3, (g, K, N))  # replicated cotangent of the per-device tgmm
        put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("x")))
        kw = dict(impl=self.impl, tile_m=4)

        def body(x_mk, w, sizes, dout_mn, dout_gkn):
            def loss(a, b, c):
                return jnp.sum(gmm(a, b, sizes, **kw) * dout_mn) + jnp.sum(
                    tgmm(a, c, sizes, **kw) * dout_gkn
                )

            out = gmm(x_mk, w, sizes, **kw)
            out_t = tgmm(x_mk, dout_mn, sizes, **kw)
            return (out, out_t[None], *jax.grad(loss, argnums=(0, 1, 2))(x_mk, w, dout_mn))

        p, r = jax.P("x"), jax.P()
        f = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(p, r, p, p, r), out_specs=(p, p, p, r, p))
        )
        with jax.set_mesh(mesh):
            outs = f(put(lhs), w_gkn, put(sizes_dg.reshape(-1)), put(dout), dout_t)
        out, out_t, dlhs, dw, ddout = map(np.asarray, outs)
        want_dw = 0
        for d in range(8):
            rows = slice(d * m, (d + 1) * m)
            x, dy, sizes = lhs[rows], dout[rows], sizes_dg[d]
            assert_close(out[rows], ref.gmm(x, w_gkn, sizes))
            assert_close(out_t[d], ref.tgmm(x, dy, sizes))
            gx, gw = ref.gmm_grads(x, w_gkn, sizes, dy)
            tx, ty = ref.tgmm_grads(x, dy, sizes, dout_t)
            assert_close(dlhs[rows], gx + tx)
            assert_close(ddout[rows], ty)
            want_dw = want_dw + gw
        assert_close(dw, want_dw)


class TestXla(_GmmTests):
    impl = "xla"


class TestRaggedDot(_GmmTests):
    # On CPU ragged_dot also meets the NaN-padding guarantees (XLA selects, it
    # does not multiply by a mask), so no case is marked as expected to fail.
    impl = "ragged_dot"


def test_work_items_layout():
    # M=20, tm=8: tiles [0, 8), [8, 16), [12, 20) (last one shifted back).
    # Groups: g0 rows [0, 5), g1 empty, g2 [5, 15), g3 [15, 18), rows 18, 19 padding.
    items = work_items(jnp.asarray([5, 0, 10, 3], jnp.int32), 20, 8)
    count = int(items.count)
    assert len(items.group_i) == 3 + 4 - 1  # static bound cdiv(M, tm) + G - 1
    assert count == 5
    pairs = list(
        zip(np.asarray(items.group_i)[:count].tolist(), np.asarray(items.tile_i)[:count].tolist())
    )
    assert pairs == [(0, 0), (2, 0), (2, 1), (3, 1), (3, 2)]


def _gpu(kind, capability=None):
    """A stand-in for a mesh whose (abstract) devices are GPUs of `kind`: what `resolve_impl`
    reads (an abstract mesh's device; a real GPU also says its compute capability)."""
    dev = SimpleNamespace(platform="gpu", device_kind=kind)
    if capability is not None:
        dev.compute_capability = capability
    return SimpleNamespace(abstract_device=dev)


@pytest.mark.parametrize(
    "mesh, hopper",
    [
        (_gpu("NVIDIA H100 80GB HBM3"), True),
        (_gpu("NVIDIA H200"), True),
        (_gpu("NVIDIA GH200 480GB"), True),
        (_gpu("NVIDIA H100 PCIe", "9.0"), True),
        (_gpu("NVIDIA A100-SXM4-80GB"), False),
        (_gpu("NVIDIA A100-SXM4-80GB", "8.0"), False),
        (_gpu("NVIDIA B200", "10.0"), False),
        (_gpu("NVIDIA L40S", "8.9"), False),
        (_gpu("NVIDIA H100 80GB HBM3", "8.0"), False),  # the capability decides
    ],
)
def test_auto_is_mosaic_on_hopper_for_16_bit_operands_else_pallas_on_gpus(mesh, hopper):
    """On a GPU, "auto" is our Mosaic GPU kernel (wgmma: Hopper only) where an operand is 16-bit,
    and the Triton kernel on other GPUs and for float32 x float32 (which "mosaic" refuses); a
    device's compute capability outranks its name."""
    bf, f32 = jnp.bfloat16, jnp.float32
    want = "mosaic" if hopper else "pallas"
    assert resolve_impl("auto", mesh=mesh, dtypes=(bf, bf)) == want
    assert resolve_impl("auto", mesh=mesh, dtypes=(f32, bf)) == want  # multiplied in bf16
    assert resolve_impl("auto", mesh=mesh, dtypes=(jnp.float16, f32)) == want
    assert resolve_impl("auto", mesh=mesh, dtypes=(f32, f32)) == "pallas"
    assert resolve_impl("auto", mesh=mesh, interpret=True, dtypes=(bf, bf)) == "pallas"
    assert resolve_impl("mosaic", mesh=mesh, dtypes=(f32, f32)) == "mosaic"  # asked: as asked


def test_describe_impl_names_what_auto_resolves_to():
    """The benchmark headers' names: "auto" with what it resolves to, a kernel with its backend."""
    h100 = _gpu("NVIDIA H100 80GB HBM3")
    assert describe_impl("auto", mesh=h100) == "'auto' = 'mosaic' (our Mosaic GPU kernel)"
    assert describe_impl("pallas", mesh=h100) == "'pallas' (the Pallas Triton kernel)"
    assert describe_impl("auto", mesh=_gpu("NVIDIA A100-SXM4-80GB")) == (
        "'auto' = 'pallas' (the Pallas Triton kernel)"
    )
    assert describe_impl("auto", mesh=h100, dtype=jnp.float32) == (
        "'auto' = 'pallas' (the Pallas Triton kernel)"
    )
    assert describe_impl("auto") == "'auto' = 'xla'"  # the CPU
    assert describe_impl("xla", mesh=h100) == "'xla'"


def test_auto_is_xla_on_cpu_and_pallas_when_interpreting():
    assert jax.default_backend() == "cpu"
    assert resolve_impl("auto") == "xla"
    assert resolve_impl("auto", interpret=True) == "pallas"
    lhs, rhs, sizes, tile_m = _case("empty_groups")
    np.testing.assert_array_equal(
        np.asarray(gmm(lhs, rhs, sizes, tile_m=tile_m)),
        np.asarray(gmm(lhs, rhs, sizes, impl="xla", tile_m=tile_m)),
    )


# ------------------------------------------------------------------ bad input


def _ok():
    """Holds valid gmm args (lhs [8, 4], rhs [2, 4, 3], sizes [2]); None slots use them."""
    return jnp.zeros((8, 4)), jnp.zeros((2, 4, 3)), jnp.array([3, 5], jnp.int32)


def _ok_t():
    """Holds valid tgmm args (lhs [8, 4], rhs [8, 3], sizes [2])."""
    return jnp.zeros((8, 4)), jnp.zeros((8, 3)), jnp.array([3, 5], jnp.int32)


@pytest.mark.parametrize(
    "kwargs, args, match",
    [
        ({}, (jnp.zeros((8,)), None, None), "lhs must be 2-D"),
        ({}, (None, jnp.zeros((4, 3)), None), "rhs must be 3-D"),
        ({}, (None, jnp.zeros((2, 5, 3)), None), r"rhs.shape\[1\] must equal K"),
        ({"transpose_rhs": True}, (None, None, None), r"rhs.shape\[2\] must equal K"),
        ({}, (None, None, jnp.array([8], jnp.int32)), "group_sizes must have length G=2"),
        ({}, (None, None, jnp.array([[3, 5]], jnp.int32)), "group_sizes must be 1-D"),
        ({}, (None, None, jnp.array([3.0, 5.0])), "group_sizes must have an integer dtype"),
        ({"impl": "cuda"}, (None, None, None), "impl must be one of"),
        ({"tile_m": 0}, (None, None, None), "tile_m must be a positive int"),
        ({"tile_m": 2.5}, (None, None, None), "tile_m must be a positive int"),
    ],
)
def test_gmm_bad_input(kwargs, args, match):
    args = [a if a is not None else d for a, d in zip(args, _ok())]
    with pytest.raises(ValueError, match=match):
        gmm(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs, args, match",
    [
        ({}, (jnp.zeros((8, 4, 1)), None, None), "lhs must be 2-D"),
        ({}, (None, jnp.zeros((8,)), None), "rhs must be 2-D"),
        ({}, (None, jnp.zeros((7, 3)), None), r"rhs must have M=.* rows like lhs"),
        ({"num_groups": 3}, (None, None, None), "group_sizes must have length G=3"),
        ({}, (None, None, jnp.array([3.0, 5.0])), "group_sizes must have an integer dtype"),
        ({"impl": "cuda"}, (None, None, None), "impl must be one of"),
        ({"tile_m": -1}, (None, None, None), "tile_m must be a positive int"),
    ],
)
def test_tgmm_bad_input(kwargs, args, match):
    args = [a if a is not None else d for a, d in zip(args, _ok_t())]
    with pytest.raises(ValueError, match=match):
        tgmm(*args, **kwargs)


def test_interpret_applies_to_the_kernels_only():
    with pytest.raises(ValueError, match=r"interpret=True runs a Pallas kernel \(\('mosaic', "):
        gmm(*_ok(), impl="xla", interpret=True)
    with pytest.raises(ValueError, match="does not apply to impl='ragged_dot'"):
        tgmm(*_ok_t(), impl="ragged_dot", interpret=True)


# --------------------------------------------------------------------- memory

MEM_M, MEM_K, MEM_N, MEM_G, MEM_TM = 4096, 256, 512, 16, 128


def _temp_bytes(fn, *shapes):
    """Holds XLA's temp buffer bytes for jit(fn) compiled for `shapes` (no run)."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _gmm_temp_bytes(impl, with_grad):
    """Holds temp bytes of gmm (or of its fwd + vjp) at the MEM_* shapes, f32."""

    def fwd(x, w, s):
        return gmm(x, w, s, impl=impl, tile_m=MEM_TM)

    def fwd_bwd(x, w, s, dout):
        out, vjp = jax.vjp(lambda a, b: fwd(a, b, s), x, w)
        return out, *vjp(dout)

    m, k, n, g = MEM_M, MEM_K, MEM_N, MEM_G
    shapes = [((m, k), jnp.float32), ((g, k, n), jnp.float32), ((g,), jnp.int32)]
    if with_grad:
        return _temp_bytes(fwd_bwd, *shapes, ((m, n), jnp.float32))
    return _temp_bytes(fwd, *shapes)


@pytest.mark.parametrize("with_grad", [False, True])
def test_xla_memory_is_tiles_not_groups(with_grad):
    # Live temps per loop step are a few row tiles: gmm holds the lhs tile
    # [tm, K] and the dot result, current and merged output tiles [tm, N];
    # tgmm the masked lhs and rhs tiles and one [K, N] update. Allow 4 f32
    # sets of [tm, K + N] (1.5 MiB here) plus 64 KiB for the work-item index
    # arrays. Outputs are not temps; for fwd+bwd the f32 tgmm accumulator is
    # the f32 drhs output buffer itself.
    bound = 4 * MEM_TM * (MEM_K + MEM_N) * 4 + 64 * 1024
    dense = MEM_G * MEM_M * MEM_K * 4  # one masked [G, M, K] f32 copy
    xla = _gmm_temp_bytes("xla", with_grad)
    ragged = _gmm_temp_bytes("ragged_dot", with_grad)
    print(
        f"temp bytes with_grad={with_grad}: xla={xla} ragged_dot={ragged} "
        f"bound={bound} dense={dense}"
    )
    assert xla <= bound < dense // 4
    # Documents why "auto" is not ragged_dot on CPU: XLA builds a G x copy.
    # If this starts failing, XLA's CPU ragged_dot improved; revisit "auto".
    assert ragged >= dense


def test_api_routes_pallas_interpret_to_the_kernel():
    """gmm/tgmm(impl="pallas", interpret=True) through the public API: values and gradients."""
    m, g = 40, 3
    lhs, rhs, rhs_t = rand(0, (m, K)), rand(1, (g, K, N)), rand(2, (m, N))
    sizes = np.array([9, 0, 20], np.int32)
    kw = dict(impl="pallas", interpret=True)
    assert_close(gmm(lhs, rhs, sizes, **kw), ref.gmm(lhs, rhs, sizes))
    assert_close(tgmm(lhs, rhs_t, sizes, **kw), ref.tgmm(lhs, rhs_t, sizes))
    gx, gw = jax.grad(lambda a, b: jnp.sum(gmm(a, b, sizes, **kw) * rhs_t), argnums=(0, 1))(
        lhs, rhs
    )
    want_x, want_w = ref.gmm_grads(lhs, rhs, sizes, rhs_t)
    assert_close(gx, want_x)
    assert_close(gw, want_w)
