"""The all-to-all's down projection with each row's router weight inside it, for the FP8 recipe.

    y_r = wts_r * (act_r @ w_down[e_r])          # `weighted_down(act, w_down, wts_r, gs, gemms)`

The combine then only sums (`alltoall.combine`). Why (docs/precision.md): the recipe rounds the
output's gradient dy to e4m3 once, per token (`fp8.TILE`), and every GEMM of the backward reads
the rounded one. With the weight applied after the expert, as in the 16-bit all-to-all, the down
projection's cotangent is wts * Q(dy): off e4m3's grid, so an e4m3 dgrad would round it again.
Here the custom VJP differentiates the product as the ring's hop does (`dispatch.hop`):

    d act  = wts * (dy @ w_down^T)     the dgrad on dy itself: e4m3 x e4m3, exact on the grid
    d w    = (wts * act)^T dy          the 16-bit tgmm (its contraction runs over rows)
    d wts  = <act, dy @ w_down^T>      per row, from the same dgrad

`Gemms` picks the kernels: on Hopper (`gmm_impl` resolving to "mosaic") the e4m3 grouped matmul
(`gmm_fp8`) for the forward and the dgrad, elsewhere the 16-bit product of the rounded values
(exact: the same numbers). Padding rows (past the groups) are never read by a kernel; their
weights are 0 and their outputs unwritten (`zero_padding=False`), as in the rest of the
all-to-all.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from relaymoe_jax.kernels.gmm import gmm, gmm_fp8, tgmm


@dataclasses.dataclass(frozen=True)
class Gemms:
    """The grouped matmuls of the all-to-all's expert MLP under the FP8 recipe (hashable: a
    static argument of the custom VJP)."""

    mm_kw: tuple  # `impl_kwargs(gmm_impl)` as sorted items
    e4m3: bool  # the e4m3 kernel (`gmm_fp8`): gmm_impl resolves to "mosaic"

    def mm(self, a, w, gs, transpose=False):
        """[R, N] float32: each row of `a` (on e4m3's grid) times its group's w (`.T`)."""
        kw = dict(self.mm_kw)
        if self.e4m3:
            kw = {"interpret": kw.get("interpret", False)}
        fn = gmm_fp8 if self.e4m3 else gmm
        return fn(
            a,
            w,
            gs,
            preferred_element_type=jnp.float32,
            transpose_rhs=transpose,
            zero_padding=False,
            **kw,
        )

    def tmm(self, a, b, gs, num_groups):
        """[G, A, B] float32: per group, its rows of a^T b (the weight gradient)."""
        return tgmm(
            a, b, gs, num_groups=num_groups, preferred_element_type=jnp.float32, **dict(self.mm_kw)
        )


def weighted_down(act, w_down, wts_r, gs, gemms: Gemms):
    """[R, H] float32: wts_r[r] * act[r] @ w_down[group of r] (module doc). act [R, F] on e4m3's
    grid per 1 x 128 tile, w_down [E, F, H] on its block grid, wts_r [R] float32."""
    return _weighted(act, w_down, wts_r, gs, gemms)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted(act, w_down, wts_r, gs, gemms):
    return wts_r[:, None] * gemms.mm(act, w_down, gs)


def _fwd(act, w_down, wts_r, gs, gemms):
    return _weighted(act, w_down, wts_r, gs, gemms), (act, w_down, wts_r, gs)


def _bwd(gemms, res, dy):
    act, w_down, wts_r, gs = res
    dt = act.dtype
    dy = dy.astype(dt)  # each row a copy of a token's rounded dy: exact in 16 bits
    dact0 = gemms.mm(dy, w_down, gs, transpose=True)  # dy @ w_down^T, [R, F] float32
    dwts = jnp.sum(act.astype(jnp.float32) * dact0, axis=-1)
    dw = gemms.tmm((act * wts_r[:, None]).astype(dt), dy, gs, w_down.shape[0])
    dact = (dact0 * wts_r[:, None]).astype(dt)
    return dact, dw.astype(w_down.dtype), dwts.astype(wts_r.dtype), None


_weighted.defvjp(_fwd, _bwd)
