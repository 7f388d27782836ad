"""`moe_ffn(expert_fp8=True)`: the expert matrices rounded to e4m3 with 128 x 128 block scales,
gradients straight through to the full-precision weights, and the ring relaying them as e4m3.

Every dispatcher (the ring in both routings, the all-to-all, the dense reference) against the
dense reference run on weights quantised here by numpy (`test_fp8`'s float64 reference
quantiser, not the library's): y and the gradients of x, the router weights and the three
matrices (the matrices' through the identity: the gradient at the rounded weights). The same run
differs from the unquantised one, so a path that skipped the rounding fails. The compiled ring
(XLA:CPU) sends e4m3 values and block scales per hop: at most 0.52 x the bf16 relay's bytes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_cases import ref_dequantize, ref_quantize

import moe_cases as mc
from relaymoe_jax.analysis import hlo
from relaymoe_jax.models.config_files import load_config, parse_overrides

E, H, F, K, T = 16, 256, 192, 4, 64  # F: one whole and one partial 128-column block


@functools.cache
def _inputs():
    ids = mc.uniform_ids(3, T, E, K)
    return mc.make_inputs(ids, E, h=H, f=F, seed=4)


def _numpy_rounded(w):
    """w's values as e4m3 with 128 x 128 block scales, by the float64 reference."""
    q, scale = ref_quantize(np.asarray(w, np.float32), (128, 128))
    return jnp.asarray(ref_dequantize(q, scale, (128, 128)), jnp.float32)


@functools.cache
def _reference_on_rounded_weights():
    """The dense reference on the rounded matrices, their gradient passed to the given ones."""
    rounded = {n: _numpy_rounded(_inputs()[n]) for n in ("wg", "wu", "wd")}
    ref = mc.moe_fn("reference", mc.mesh("ep8"))

    def fn(x, ids, wts, wg, wu, wd):
        ste = lambda w, n: rounded[n] + (w - jax.lax.stop_gradient(w))  # value rounded, grad 1
        return ref(x, ids, wts, ste(wg, "wg"), ste(wu, "wu"), ste(wd, "wd"))

    return fn


@pytest.mark.parametrize(
    "dispatcher, kw",
    [
        ("ring", dict(routing="expert")),
        ("ring", dict(routing="token")),
        ("alltoall", {}),
        ("reference", {}),
    ],
    ids=["ring-expert", "ring-token", "alltoall", "reference"],
)
def test_every_dispatcher_computes_the_rounded_experts(dispatcher, kw):
    inp, mesh = _inputs(), mc.mesh("ep8")
    got, _ = mc.check_parity(
        dispatcher, inp, mesh, ref=_reference_on_rounded_weights(), expert_fp8=True, **kw
    )
    plain, _, _ = mc.run("reference", inp, mesh)
    gap = float(jnp.max(jnp.abs(got.y - plain))) / float(jnp.max(jnp.abs(plain)))
    assert gap > 1e-3  # e4m3's rounding shows: nothing skipped it


def _relay_bytes(fp8: bool) -> tuple[int, int]:
    """(forward, backward) bytes one device sends per hop of the compiled expert ring, bf16."""
    mesh = mc.mesh("ep8")
    inp = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, _inputs())
    fn = mc.moe_fn("ring", mesh, routing="expert", expert_fp8=fp8)

    def loss(x, wts, wg, wu, wd):
        y, _ = fn(x, inp["ids"], wts, wg, wu, wd)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    args = (inp["x"], inp["wts"], inp["wg"], inp["wu"], inp["wd"])
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower()
        text = text.compile().as_text()
    fwd, bwd = sorted(hlo.loop_permute_bytes(text))
    return fwd, bwd


def test_the_ring_relays_e4m3_weights_and_block_scales():
    """Per hop, the forward sends one partition's three matrices: E/8 = 2 experts' e4m3 values
    and float32 scales (one per 128 x 128 block, partial blocks included): half the bf16 bytes
    plus the scales; the backward sends the same payload beside the float32 dW accumulator.
    XLA:CPU widens both payloads alike (bf16 travels as f32, e4m3 as 16 bits), so the ratio is
    the GPU's; tests/test_gpu_compile.py reads the H100 program's own bytes."""
    fwd16, bwd16 = _relay_bytes(False)
    fwd8, bwd8 = _relay_bytes(True)
    e_l, blocks = E // 8, 2 * (2 * 2) + 2 * 2  # gate, up [256, 192]: 2 x 2; down [192, 256]
    assert fwd8 == fwd16 // 2 + e_l * blocks * 4
    assert fwd8 <= 0.52 * fwd16
    assert bwd16 - bwd8 == fwd16 - fwd8  # the dW accumulator travels as before


def test_expert_tensor_slices_round_as_the_whole_matrix():
    """With the ffn dimension split over `expert_tensor_axis` (ETP 2), each device rounds its
    256 / 2 = 128-column slice: whole blocks of the matrix, so the ring equals the reference on
    the matrix rounded whole."""
    ids = mc.uniform_ids(5, 32, 8, 2)
    inp = mc.make_inputs(ids, 8, h=128, f=256, seed=6)
    mesh = mc.mesh("ep4_etp2")
    rounded = {n: _numpy_rounded(inp[n]) for n in ("wg", "wu", "wd")}
    ref = mc.moe_fn("reference", mesh)

    def ref_fn(x, ids, wts, wg, wu, wd):
        ste = lambda w, n: rounded[n] + (w - jax.lax.stop_gradient(w))
        return ref(x, ids, wts, ste(wg, "wg"), ste(wu, "wu"), ste(wd, "wd"))

    placed = mc.place(inp, mesh, ("expert", "expert_tensor"), etp="expert_tensor")
    mc.check_parity(
        "ring",
        placed,
        mesh,
        ref=ref_fn,
        expert_fp8=True,
        routing="expert",
        expert_tensor_axis="expert_tensor",
    )


def test_a_slice_that_splits_a_block_is_refused():
    """ffn 192 over ETP 2: 96-column slices would quantise blocks the whole matrix does not have
    (the reference would round other values): refused before tracing, naming the sizes."""
    inp = mc.make_inputs(mc.uniform_ids(5, 32, 8, 2), 8, h=128, f=192)
    with pytest.raises(
        ValueError, match=r"ffn slice \(96 = ffn / 2\) must be a multiple of the 128"
    ):
        mc.moe_fn("ring", mc.mesh("ep4_etp2"), expert_fp8=True, expert_tensor_axis="expert_tensor")(
            *mc.args(inp)
        )


def test_the_model_config_and_the_trainer_keys_reach_the_option():
    """`expert_fp8` is a `MoEOptions` field: the YAML / `key=value` form sets the model's
    `moe.options`, and a non-bool is refused naming the key."""
    cfg = load_config("configs/tiny.yaml", **parse_overrides(["expert_fp8=true"]))
    assert cfg.moe.options.expert_fp8 is True
    assert load_config("configs/tiny.yaml").moe.options.expert_fp8 is False
    with pytest.raises(ValueError, match="expert_fp8"):
        load_config("configs/tiny.yaml", expert_fp8="yes")
