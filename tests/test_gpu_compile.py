"""Deviceless XLA:GPU compiles for abstract H100 / H200 meshes (`relaymoe_jax.gpu_mesh`).

Compiling, not lowering: `lower(lowering_platforms=("cuda",))` never runs XLA's Triton pipeline,
and a kernel that lowered failed there. These tests run the GPU compiler end to end (Triton
included) and read its buffer assignment and schedule. They need the `gpu-compile` extra and
skip without it, except the check of the error a missing plugin gives. Nothing here runs on a
GPU: numbers come from the interpret-mode and CPU tests; this file proves the GPU path compiles
and reads what the GPU compiler decided.

Each compile costs seconds (XLA's GPU pipeline, Triton, ptxas), so each program is compiled once
for the module (`functools.cache`d builders, dropped when the module ends) and every test that
reads it (its operand types, its schedule, its memory) shares it; kernel configs that need only
to compile are compiled as the functions of one program.
"""

import concurrent.futures
import functools
import multiprocessing
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import XLA_OPTIONS, moe_ffn, moe_ffn_local
from relaymoe_jax.analysis import costmodel, gpu_mesh, hlo, memory, triton_calls
from relaymoe_jax.kernels.gmm import pallas as gp
from relaymoe_jax.kernels.gmm import resolve_impl
from scripts import load_script

needs_plugin = pytest.mark.skipif(
    not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
)
pytestmark = pytest.mark.gpu_compile
TRITON_CALL = "__gpu$xla.gpu.triton"


def _sds(mesh, spec, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(fn, mesh, *args, options=XLA_OPTIONS):
    """jit(fn) compiled for `mesh` from ShapeDtypeStructs (never run), with the options the
    trainer compiles with."""
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        return jax.jit(fn).trace(*args).lower().compile(compiler_options=options)


# ------------------------------------------------------------------------ meshes


@needs_plugin
@pytest.mark.parametrize("target", gpu_mesh.TARGETS)
def test_mesh_devices_and_hosts(target):
    mesh = gpu_mesh.mesh((2, 8), ("node", "local"), target=target)
    devs = mesh.devices
    assert devs.shape == (2, 8)
    assert {d.device_kind for d in devs.flat} == {gpu_mesh.device_kind(target)}
    # host-major: axis 0 is the host (process) index, 8 GPUs per host
    assert [[d.process_index for d in row] for row in devs] == [[0] * 8, [1] * 8]
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
    assert gpu_mesh.platform(mesh) == "gpu"
    with jax.set_mesh(mesh):
        assert gpu_mesh.platform() == "gpu"
        assert resolve_impl("auto") == "mosaic"  # Hopper (H100, H200), 16-bit (no dtypes)
        assert resolve_impl("auto", dtypes=(jnp.float32, jnp.float32)) == "pallas"
    assert gpu_mesh.platform() == jax.default_backend() == "cpu"
    assert resolve_impl("auto") == "xla"


def test_public_name_is_the_analysis_module():
    import relaymoe_jax
    import relaymoe_jax.gpu_mesh as public

    assert public is relaymoe_jax.gpu_mesh is gpu_mesh  # relaymoe_jax.analysis.gpu_mesh


def test_target_configs_ship_with_the_package():
    assert gpu_mesh.device_memory("h100") == 84_929_347_584
    assert gpu_mesh.device_memory("h200") == 143_771 * 2**20
    assert gpu_mesh.device_kind("h100") == "NVIDIA H100 80GB HBM3"
    for t in gpu_mesh.TARGETS:
        assert "cuda_compute_capability {\n    major: 9" in gpu_mesh.target_config(t)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: gpu_mesh.mesh((8,), ("x",), target="a100"), r"target must be one of .*'a100'"),
        (lambda: gpu_mesh.mesh((12,), ("x",)), r"12 devices do not fill whole hosts of 8"),
        (lambda: gpu_mesh.mesh((2, 4), ("x",)), r"differ in length"),
        (lambda: gpu_mesh.mesh((0,), ("x",)), r"positive ints"),
        (lambda: gpu_mesh.topology(8, gpus_per_host=0), r"gpus_per_host must be a positive int"),
    ],
)
def test_bad_mesh_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_missing_plugin_names_the_extra(monkeypatch):
    monkeypatch.setattr(gpu_mesh, "plugin_available", lambda: False)
    with pytest.raises(gpu_mesh.PluginMissing, match=r"pip install 'relaymoe-jax\[gpu-compile\]'"):
        gpu_mesh.mesh((8,), ("expert",))


# ------------------------------------------------------------------ the kernel

# Qwen3-30B-A3B's experts at EP=8 (16 local experts, H=2048, F=768) and paper §4.5's E384
# (48 local experts); M = grouped rows of one chunk, T = token rows the fused gather reads.
EXPERT_SHAPES = {"qwen3_30b_a3b": (16, 2048, 768), "e384": (48, 2048, 768)}
M_ROWS, T_ROWS = 8192, 1024


def _gmm_fwd_bwd(blocks, transpose):
    def f(tokens, w, sizes, rows, dout):
        mm = lambda a, b: gp.gmm(a, b, sizes, lhs_rows=rows, transpose_rhs=transpose, **blocks)
        out, vjp = jax.vjp(mm, tokens, w)
        return out, *vjp(dout)

    return f


def _tgmm_fwd_bwd(blocks):
    def f(x, y, sizes, rows, dout):
        out, vjp = jax.vjp(lambda a, b: gp.tgmm(a, b, sizes, lhs_rows=rows, **blocks), x, y)
        return out, *vjp(dout)

    return f


def _each(fns):
    """One program running every f of `fns` on its own arguments: one XLA compile (its Triton
    kernels are compiled one by one all the same) in place of one per function."""

    def f(*args):
        out, i = [], 0
        for fn, n in fns:
            out.append(fn(*args[i : i + n]))
            i += n
        return out

    return f


@functools.cache
def _one_gpu():
    return gpu_mesh.mesh((1,), ("x",))


def _up_args(mesh, shape, dtype):
    """(tokens [T, H], w [G, H, F], group sizes, gathered rows, dout [M, F]) of the gate/up
    projection of `shape`'s experts."""
    s = functools.partial(_sds, mesh, P())
    g, k, n = EXPERT_SHAPES[shape]
    return (
        s((T_ROWS, k), dtype),
        s((g, k, n), dtype),
        s((g,), jnp.int32),
        s((M_ROWS,), jnp.int32),
        s((M_ROWS, n), dtype),
    )


# blocks (m, n, k[, warps, stages]): small ones, then every config the prepared GPU run times
# (benchmarks/gpu.py PALLAS_CONFIGS), so that run cannot fail to compile.
GPU_RUN = load_script("benchmarks/gpu.py", "gpu_bench_configs")
BLOCKS = [
    (16, 16, 16),
    (32, 64, 32),
    *(tuple(GPU_RUN.pallas_cfg(c).values()) for c in GPU_RUN.PALLAS_CONFIGS if c != "default"),
]
BLOCK_NAMES = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
# the default blocks (None) and the given ones, per dtype
KERNEL_BLOCKS = {"bfloat16": [None, *BLOCKS], "float32": [None, (16, 16, 16)]}


@needs_plugin
@pytest.mark.parametrize("dtype", sorted(KERNEL_BLOCKS))
def test_kernel_compiles_with_vjp(dtype):
    """gmm (fused row gather) and its VJP (gmm on the transposed weights + tgmm): 3 kernels per
    block config. Every config of the dtype (the default blocks, then `KERNEL_BLOCKS`: what
    test_kernel_compiles_with_vjp[dtype-blocksN] compiled one program each for) is one function
    of a single program, so one XLA compile builds all their kernels."""
    mesh, configs = _one_gpu(), KERNEL_BLOCKS[dtype]
    fns = [
        (_gmm_fwd_bwd({} if b is None else dict(zip(BLOCK_NAMES, b)), False), 5) for b in configs
    ]
    args = _up_args(mesh, "qwen3_30b_a3b", jnp.dtype(dtype))
    text = _compile(_each(fns), mesh, *args * len(configs)).as_text()
    assert text.count(TRITON_CALL) == 3 * len(configs)
    assert "dot(" not in text  # every matmul is a kernel, none XLA's (its dots print "dot(")


@needs_plugin
def test_down_projection_and_tgmm_compile():
    """The down projection (w_down [G, F, H], transposed in the backward), tgmm and its VJP, for
    both `EXPERT_SHAPES` (test_down_projection_and_tgmm_compile[qwen3_30b_a3b] and [e384]) in
    one program: 3 Triton calls each (tgmm + its two gmm backward kernels for the latter)."""
    mesh, bf = _one_gpu(), jnp.bfloat16
    s = functools.partial(_sds, mesh, P())
    fns, args = [], []
    for shape in sorted(EXPERT_SHAPES):
        g, h, f = EXPERT_SHAPES[shape]
        fns += [(_gmm_fwd_bwd({}, True), 5), (_tgmm_fwd_bwd({}), 5)]
        rows = (s((g,), jnp.int32), s((M_ROWS,), jnp.int32))
        args += [s((T_ROWS, h), bf), s((g, f, h), bf), *rows, s((M_ROWS, f), bf)]
        args += [s((T_ROWS, h), bf), s((M_ROWS, f), bf), *rows, s((g, h, f), bf)]
    text = _compile(_each(fns), mesh, *args).as_text()
    assert text.count(TRITON_CALL) == 3 * len(fns)


@needs_plugin
def test_h200_mesh_compiles_the_kernel():
    mesh = gpu_mesh.mesh((1,), ("x",), target="h200")
    c = _compile(_gmm_fwd_bwd({}, False), mesh, *_up_args(mesh, "qwen3_30b_a3b", jnp.bfloat16))
    assert c.as_text().count(TRITON_CALL) == 3


# ------------------------------------------------------------------- moe_ffn

EP, T_DEV, H, F, E, K = 8, 1024, 256, 128, 16, 4
# the paper-sized hop (test_large_hops_overlap_only_with_the_xla_options)
LARGE = dict(t_dev=8192, h=2048, f=1024, e=4 * EP)


@functools.cache
def _ep8():
    return gpu_mesh.mesh((EP,), ("expert",))


def _layer_args(mesh, dtype=jnp.bfloat16, t_dev=T_DEV, h=H, f=F, e=E):
    tok = functools.partial(_sds, mesh, P("expert"))
    return (
        tok((EP * t_dev, h), dtype),
        tok((EP * t_dev, K), jnp.int32),
        tok((EP * t_dev, K), jnp.float32),
        tok((e, h, f), dtype),
        tok((e, h, f), dtype),
        tok((e, f, h), dtype),
    )


def _fwd_bwd(mesh, **kw):
    def loss(x, ids, wts, wg, wu, wd):
        y = moe_ffn(x, ids, wts, wg, wu, wd, mesh=mesh, **kw)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 2, 3, 4, 5))


@functools.cache
def _compiled_items(items, large=False, options=True):
    mesh = _ep8()
    opts = XLA_OPTIONS if options else None
    args = _layer_args(mesh, **(LARGE if large else {}))
    return _compile(_fwd_bwd(mesh, **dict(items)), mesh, *args, options=opts)


def _compiled_layer(large=False, options=True, **kw):
    """The fwd+bwd of one bf16 layer on 8 abstract H100s (at `LARGE`'s sizes if `large`, without
    `XLA_OPTIONS` if not `options`), compiled once per keyword set for the whole module."""
    return _compiled_items(tuple(sorted(kw.items())), large, options)


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_programs():
    """The programs this module's caches hold go with the module (conftest releases jax's)."""
    yield
    for cache in (_compiled_items, _compiled_biased_layer, _compiled_partial_manual):
        cache.cache_clear()


RING_EXPERT = dict(dispatcher="ring", routing="expert", gmm_impl="auto")
RING_TOKEN = dict(dispatcher="ring", routing="token", gmm_impl="auto")
# (routing, gmm_impl): the compiled layer. Token routing with the kernel is the paper-sized
# layer that test_large_hops_overlap_only_with_the_xla_options compiles with `XLA_OPTIONS` (the
# permutes are combined at either size with them: the same schedule question as at the small
# size); the small expert-routing one is the memory baseline of the tests below.
RING_LAYERS = {
    ("expert", "auto"): lambda: _compiled_layer(**RING_EXPERT),
    ("token", "auto"): lambda: _compiled_layer(large=True, **RING_TOKEN),
    ("expert", "xla"): lambda: _compiled_layer(**{**RING_EXPERT, "gmm_impl": "xla"}),
    ("token", "ragged_dot"): lambda: _compiled_layer(**{**RING_TOKEN, "gmm_impl": "ragged_dot"}),
}


@needs_plugin
@pytest.mark.parametrize("routing, gmm_impl", sorted(RING_LAYERS))
def test_ring_compiles_and_overlaps(routing, gmm_impl):
    """fwd+bwd compiles; every ring loop body (forward and backward) starts its transfer before
    the hop's chunk loop and waits for it after: the transfer hides behind the compute.

    gmm_impl="auto" must be our Mosaic GPU kernel here (bf16 on H100s) although the process's
    backend is the CPU: it is chosen from the mesh's (abstract GPU) devices.

    Each routing with the kernel, and each XLA implementation with one routing: the grouped
    matmul is the hop's (`dispatch/hop.py`, shared by both routings), so [expert-xla] also
    covers what [token-xla] did, and [token-ragged_dot] what [expert-ragged_dot] did (both
    gather the chunk's rows before an XLA matmul, where the kernel reads them in place)."""
    c = RING_LAYERS[routing, gmm_impl]()
    text = c.as_text()
    kernels = len(triton_calls.mosaic_calls(text))
    assert jax.default_backend() == "cpu" and TRITON_CALL not in text
    assert (kernels > 0) == (gmm_impl == "auto"), kernels
    bodies = hlo.loop_schedules(text)
    assert len(bodies) == 2, bodies  # the forward ring loop and the backward ring loop
    for b in bodies:
        assert b.overlapped, (
            f"{routing}/{gmm_impl}: {b.computation} sends at {b.starts}, "
            f"computes at {b.loops}, waits at {b.dones}"
        )


@needs_plugin
@pytest.mark.parametrize("routing", ["expert", "token"])
def test_large_hops_overlap_only_with_the_xla_options(routing):
    """Above XLA's 30 MiB permute-combining default a hop's arrays travel as separate permutes,
    and without `XLA_OPTIONS` XLA:GPU waits for all but one or two of them before the hop's
    compute (at the paper's shape: 1 of a forward hop's 3, 1 of a backward hop's 6). With them
    every ring loop body hides its whole transfer. Sizes: 4 experts per GPU, gate/up/down
    16 MiB each (expert routing's payload); 8,192 tokens of 4 KiB per GPU (token routing's)."""
    ring = dict(dispatcher="ring", routing=routing, gmm_impl="auto")
    for options, hidden in ((True, True), (False, False)):
        text = _compiled_layer(large=True, options=options, **ring).as_text()
        bodies = hlo.loop_schedules(text)
        assert len(bodies) == 2, bodies
        assert all(b.overlapped == hidden for b in bodies), (options, bodies)


@needs_plugin
def test_the_fp8_ring_sends_e4m3_weights():
    """expert_fp8=True on 8 abstract H100s: a forward hop sends the partition's e4m3 values (one
    byte each) and float32 block scales, half the bf16 relay's bytes plus the scales, and the
    backward hop the same beside its float32 dW accumulator (tests/test_fp8_op.py checks the
    numbers). The blocked XLA grouped matmul: what travels does not depend on the kernel. And
    XLA:GPU's buffer assignment holds less for the FP8 ring than for bf16's (5.68 against 5.79
    MiB): before 2026-12-07 it held 7.14, a rounded [T, H] copy of x kept from the forward to the
    backward and a dequantised copy of each visiting partition made only to anchor its dW zeros
    (either alone puts it above bf16; at the paper shape they were 456 MiB: BENCHMARKS)."""
    ring = {**RING_EXPERT, "gmm_impl": "xla"}
    c16, c8 = _compiled_layer(**ring), _compiled_layer(**ring, expert_fp8=True)
    fwd16, bwd16 = sorted(hlo.loop_permute_bytes(c16.as_text()))
    fwd8, bwd8 = sorted(hlo.loop_permute_bytes(c8.as_text()))
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(c8) < temp(c16), (temp(c8), temp(c16))
    e_l = E // EP
    blocks = 3 * e_l * -(-H // 128) * -(-F // 128)  # gate, up [H, F] and down [F, H] alike
    assert fwd16 == 2 * 3 * e_l * H * F
    assert fwd8 == 3 * e_l * H * F + 4 * blocks <= 0.52 * fwd16
    assert fwd8 == costmodel.fp8_payload(fwd16, H, F)  # the cost model's FP8 relay
    assert bwd16 - bwd8 == fwd16 - fwd8


@needs_plugin
def test_fp8_tokens_travel_as_e4m3():
    """expert_fp8=True, where tokens travel: the token ring relays x (forward) and x and dy
    (backward) as e4m3 values and float32 scales per 1 x 128 tile, the rest of the payload (router
    weights, pair order, float32 accumulators) as before; the all-to-all dispatches its rows the
    same way, each with its router weight, and combines in bf16 (DeepSeek-V3's choice), and
    on H100s its expert GEMMs but the weight gradients are the e4m3 kernel. Each of those
    token matrices is then 0.5 + 4 / 256 = 0.52x its bf16 bytes. tests/test_fp8_op.py checks
    the numbers. And the FP8 token ring holds less than bf16's (10.28 against 11.33 MiB): it
    held 11.52 before 2026-12-07, when each visiting partition's e4m3 x and dy were dequantised
    whole, not a chunk's rows at a time."""
    tiles = T_DEV * -(-H // 128)
    saved = T_DEV * H * 2 - (T_DEV * H + 4 * tiles)  # one [T, H] matrix: bf16 -> e4m3 + scales
    assert T_DEV * H + 4 * tiles <= 0.52 * (T_DEV * H * 2)
    ring = {**RING_TOKEN, "gmm_impl": "ragged_dot"}
    c16, c8 = _compiled_layer(**ring), _compiled_layer(**ring, expert_fp8=True)
    fwd16, bwd16 = sorted(hlo.loop_permute_bytes(c16.as_text()))
    fwd8, bwd8 = sorted(hlo.loop_permute_bytes(c8.as_text()))
    assert (fwd16 - fwd8, bwd16 - bwd8) == (saved, 2 * saved)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(c8) < temp(c16), (temp(c8), temp(c16))
    a2a16 = hlo.all_to_alls(_compiled_layer(dispatcher="alltoall", gmm_impl="pallas").as_text())
    text8 = _compiled_layer(dispatcher="alltoall", gmm_impl="auto", expert_fp8=True).as_text()
    rows = EP * T_DEV * min(K, E // EP)  # the dropless receive buffer (what is sent, padded)
    # e4m3 rows and tile scales, and each row's float32 router weight with it (applied in the
    # down projection: `dispatch.weighted_down`) and that weight's gradient back
    rows_saved = rows * H * 2 - (rows * H + 4 * rows * -(-H // 128)) - 2 * 4 * rows
    assert sum(a.bytes for a in a2a16) - sum(a.bytes for a in hlo.all_to_alls(text8)) == rows_saved
    # on H100s the all-to-all's forward and dgrads are the e4m3 kernel (gate, up, down; dx of
    # gate and up, d act of down), its weight gradients the 16-bit tgmm, and nothing else
    names = sorted(c.kernel.split(".")[0] for c in triton_calls.mosaic_calls(text8))
    assert names == ["relaymoe_gmm_fp8"] * 6 + ["relaymoe_tgmm"] * 3, names
    assert not triton_calls.wide_float_calls(text8)  # the tgmms' operands are 16-bit


@needs_plugin
def test_fp8_token_ring_holds_less_than_bf16_where_tokens_dominate():
    """The token ring's fwd+bwd with expert_fp8 and the e4m3 kernel (gmm_impl="auto") holds less
    than bf16's where the tokens outweigh the local experts (2 per GPU, 8,192 tokens of 4 KiB:
    what travels is x and dy, halved): 349.0 against 381.4 MiB (0.92x). It held 404.5 (1.06x)
    while the backward rounded x for its trip with the very op the forward had used: XLA merged
    the two and kept the forward's e4m3 x into the backward (at the paper shape 2,961.1 against
    bf16's 2,622.5 MiB; 2,415.9 since: BENCHMARKS, the E128 table's FP8 rows). Where the weights
    dominate (the paper shape at 8,192 tokens per GPU) the FP8 ring holds more: its e4m3 weights
    in both orientations (the kernel reads each operand K-major) are temporaries, bf16's are the
    arguments themselves."""
    shape = memory.LayerShape(
        experts=2 * EP,
        top_k=2,
        hidden=2048,
        ffn=768,
        tokens_per_device=8192,
        ep=EP,
        dtype="bfloat16",
    )
    mesh, temp = _ep8(), {}
    for fp8 in (False, True):
        extra = {"gmm_impl": "auto", **({"expert_fp8": True} if fp8 else {})}
        fwd_bwd = memory.layer_fns(shape, mesh, "ring-token", extra=extra)[1]
        c = _compile(fwd_bwd, mesh, *memory.abstract_args(shape, mesh))
        temp[fp8] = c.memory_analysis().temp_size_in_bytes
    assert temp[True] < 0.95 * temp[False], temp


@needs_plugin
def test_alltoall_compiles_and_ring_uses_less_memory():
    """Both all-to-alls compile with the kernel. XLA:GPU's buffer assignment, bf16: the ring's
    fwd+bwd temporaries are below the capacity-1.0 all-to-all's, and those below the dropless
    one's (at this small shape the weights weigh more than at the paper's shape, whose figures
    `benchmarks/moe_layer.py --target h100` prints)."""
    temp = {}
    for name, kw in {"cap1.0": dict(capacity_factor=1.0), "dropless": {}}.items():
        c = _compiled_layer(dispatcher="alltoall", gmm_impl="pallas", **kw)
        assert c.as_text().count(TRITON_CALL) > 0 and "all-to-all" in c.as_text()
        temp[name] = c.memory_analysis().temp_size_in_bytes
    temp["ring"] = _compiled_layer(**RING_EXPERT).memory_analysis().temp_size_in_bytes
    assert temp["ring"] < temp["cap1.0"] < temp["dropless"], temp
    # the dropless all-to-all's receive buffer alone is N*T*min(k, E/N) rows of [H] bf16
    assert temp["dropless"] >= EP * T_DEV * min(K, E // EP) * H * 2


# ------------------------------------------------------- no float32 kernel math


@functools.cache
def _compiled_biased_layer():
    """The expert-routing ring with GPT-OSS's activation and all three expert biases (bf16),
    whose gradients are taken too."""
    mesh = _ep8()
    biases = (
        _sds(mesh, P("expert"), (E, F), jnp.bfloat16),
        _sds(mesh, P("expert"), (E, F), jnp.bfloat16),
        _sds(mesh, P("expert"), (E, H), jnp.bfloat16),
    )

    def loss(x, ids, wts, wg, wu, wd, bg, bu, bd):
        kw = dict(mesh=mesh, dispatcher="ring", routing="expert", activation="gpt_oss")
        y = moe_ffn(x, ids, wts, wg, wu, wd, **kw, b_gate=bg, b_up=bu, b_down=bd)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 2, 3, 4, 5, 6, 7, 8))
    return _compile(grad, mesh, *_layer_args(mesh), *biases)


@functools.cache
def _compiled_partial_manual(dispatcher):
    """moe_ffn_local in MaxText's partial-manual shard_map (axis_names={'expert'} on an Auto
    (data=2, expert=4) mesh of 8 abstract H100s, check_vma=True) with the compiled Pallas
    kernel, fwd+bwd. The all-to-all's with GPT-OSS's activation and its three expert biases
    (their gradients too), the ring's with neither (the biased ring: `_compiled_biased_layer`)."""
    auto = jax.sharding.AxisType.Auto
    mesh = gpu_mesh.mesh((2, 4), ("data", "expert"), axis_types=(auto, auto))
    spec = P("expert")
    biased = dispatcher == "alltoall"
    kw = dict(activation="gpt_oss") if biased else {}
    body = functools.partial(
        moe_ffn_local, expert_axis="expert", dispatcher=dispatcher, gmm_impl="pallas", **kw
    )
    n_args = 9 if biased else 6

    def local(x, ids, wts, wg, wu, wd, *b):
        bias = dict(zip(("b_gate", "b_up", "b_down"), b))
        return body(x, ids, wts, wg, wu, wd, **bias)

    run = jax.shard_map(
        local, mesh=mesh, in_specs=(spec,) * n_args, out_specs=spec, axis_names={"expert"}
    )

    def loss(*a):
        return jnp.sum(run(*a).astype(jnp.float32) ** 2)

    t = 4 * 256
    sds = functools.partial(_sds, mesh, spec)
    args = (
        sds((t, H), jnp.bfloat16),
        sds((t, K), jnp.int32),
        sds((t, K), jnp.float32),
        sds((E, H, F), jnp.bfloat16),
        sds((E, H, F), jnp.bfloat16),
        sds((E, F, H), jnp.bfloat16),
    )
    biases = (sds((E, F), jnp.bfloat16), sds((E, F), jnp.bfloat16), sds((E, H), jnp.bfloat16))
    argnums = (0, 2, 3, 4, 5, 6, 7, 8) if biased else (0, 2, 3, 4, 5)
    return _compile(jax.grad(loss, argnums=argnums), mesh, *args, *(biases if biased else ()))


@needs_plugin
def test_expert_biases_keep_the_rings_memory():
    """With biases (and GPT-OSS's activation) the ring's compiled 8 x H100 peak stays within
    10% of the bias-free SwiGLU ring's (the biases' gradient reads each chunk's dy rows, which
    the kernel otherwise reads in place). Its Triton calls' 16-bit operands:
    test_every_layer_kernel_takes_16_bit_operands[ring-expert-gpt_oss-biases]; the biased
    all-to-all's (test_expert_biases_keep_16_bit_kernels_and_the_rings_memory[alltoall-auto]):
    [partial-manual-alltoall-gpt_oss-biases]."""
    got = _compiled_biased_layer().memory_analysis().temp_size_in_bytes
    want = _compiled_layer(**RING_EXPERT).memory_analysis().temp_size_in_bytes
    assert got <= 1.10 * want, (got, want)


@needs_plugin
def test_other_activations_keep_the_rings_memory():
    """The ring's backward differentiates the activation per hop (jax.vjp of an elementwise
    function): its compiled 8 x H100 fwd+bwd peak with GELU's GEGLU stays within 2% of
    SwiGLU's. One non-SwiGLU activation stands for the others (the per-hop vjp is the same code
    whatever the function): GPT-OSS's ([gpt_oss] of this test) is compiled with its biases in
    `_compiled_biased_layer`, whose peak test_expert_biases_keep_the_rings_memory bounds."""
    base = _compiled_layer(**RING_EXPERT).memory_analysis().temp_size_in_bytes
    c = _compiled_layer(**RING_EXPERT, activation="geglu_exact")
    other = c.memory_analysis().temp_size_in_bytes
    assert other <= 1.02 * base, (other, base)
    assert not triton_calls.wide_float_calls(c.as_text())


def _kernel_report(calls):
    return "\n".join(f"{c.kernel} {c.name}: {c.operands}" for c in calls)


# The layers whose every grouped matmul must be a 16-bit kernel in bf16: the programs the tests
# above compile, so the module's caches serve both. [ring-expert-gpt_oss-biases] also covers
# what [ring-expert-gpt_oss] (GPT-OSS's activation without biases) and
# test_expert_biases_keep_16_bit_kernels_and_the_rings_memory[ring-expert] checked; the
# partial-manual ones what test_partial_manual_shard_map_compiles_16_bit_kernels[ring] and
# [alltoall] checked, the latter also test_expert_biases_...[alltoall-auto]'s biased all-to-all.
BF16_LAYERS = {
    "ring-expert": lambda: _compiled_layer(**RING_EXPERT),
    "ring-token": RING_LAYERS["token", "auto"],
    "a2a-dropless": lambda: _compiled_layer(dispatcher="alltoall", gmm_impl="pallas"),
    "a2a-cap1.0": lambda: _compiled_layer(
        dispatcher="alltoall", gmm_impl="pallas", capacity_factor=1.0
    ),
    "ring-expert-gpt_oss-biases": _compiled_biased_layer,
    "partial-manual-ring": lambda: _compiled_partial_manual("ring"),
    "partial-manual-alltoall-gpt_oss-biases": lambda: _compiled_partial_manual("alltoall"),
}


@needs_plugin
@pytest.mark.parametrize("name", sorted(BF16_LAYERS))
def test_every_layer_kernel_takes_16_bit_operands(name):
    """Read from the compiled 8 x H100 fwd+bwd: every kernel call of a bf16 layer receives
    16-bit float operands only. A float32 operand would make the kernel multiply in f32 FMA
    without the tensor cores (before the fix, 6 of the all-to-all backward's 9 kernels did).
    The ring's layers (not the partial-manual one) take gmm_impl="auto", our Mosaic GPU kernel on
    H100s; the others the Triton kernel ("pallas"): both backends are read.

    [partial-manual-*]: moe_ffn_local in MaxText's partial-manual shard_map (CPU tests check
    its values with the other implementations and the interpreter)."""
    calls = triton_calls.triton_calls(BF16_LAYERS[name]().as_text(), triton_calls.KERNEL_TARGETS)
    mosaic = name.startswith("ring")
    want = triton_calls.MOSAIC_TARGET if mosaic else triton_calls.TRITON_TARGET
    assert {c.target for c in calls} == {want}, _kernel_report(calls)
    kinds = {c.kernel for c in calls}
    assert kinds == {"relaymoe_gmm", "relaymoe_tgmm"}, kinds
    assert len(calls) >= 9, _kernel_report(calls)  # 3 forward, 6 backward at least
    wide = [c for c in calls if c.wide_floats]
    assert not wide, _kernel_report(wide)
    if "ring" in name:  # the hop's dW sums into its f32 accumulator, in place
        tgmms = [c for c in calls if c.kernel == "relaymoe_tgmm"]
        assert tgmms and all(c.aliased for c in tgmms), _kernel_report(tgmms)
        acc = [c.operands[c.aliased[0]] for c in tgmms]
        assert all(a[0] == "f32" and len(a[1]) == 3 for a in acc), _kernel_report(tgmms)


@needs_plugin
def test_train_step_kernels_take_16_bit_operands():
    """The tiny model's whole train step (router, attention, experts, chunked LM loss, AdamW),
    compute_dtype=bfloat16, one layer (the layers are alike), the all-to-all on plain rows (the
    XLA attention) as `--synthetic` runs it, the weights cast before the layers (no layer scan,
    no `moe_remat`), compiled by XLA:GPU for 8 H100s with the trainer's options: every kernel
    call takes 16-bit float operands (the experts' grouped matmuls, gmm_impl="auto": our Mosaic
    GPU kernel on H100s).

    The ring's step on packed documents is test_attention_gpu_compile.py's
    test_train_step_calls_the_kernel_in_every_layer[tiny-expert8-auto] (with the layer scan and
    `moe_remat`: each layer's weights cast inside the MoE block's checkpoint), which checks its
    kernel calls the same way and its three batch arrays: it also covers what [ring-True] (the
    ring's packed step with the chunked XLA attention, whose dots are no kernel calls) and
    [ring-False-True] of this test checked; the ring's layer alone:
    test_every_layer_kernel_takes_16_bit_operands[ring-*]."""
    from relaymoe_jax.models.config_files import load_config
    from train.settings import TrainConfig
    from train.step import mesh as train_mesh
    from train.step import train_step

    tc = TrainConfig(batch_size=8, seq_len=128, compute_dtype="bfloat16")
    sizes = train_mesh.parse_mesh(tc.mesh, EP)
    mesh = gpu_mesh.mesh(tuple(sizes.values()), tuple(sizes))
    cfg = load_config(
        "configs/tiny.yaml",
        expert_size=train_mesh.expert_size(sizes),
        dispatcher="alltoall",
        num_hidden_layers=1,
    )
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        compiled = train_step.compile_abstract(cfg, tc, mesh, memo=False)
        text = compiled.as_text()
    batch_arrays = jax.tree.leaves(compiled.input_shardings[0][1])  # None fields are no arrays
    assert len(batch_arrays) == 1
    calls = triton_calls.triton_calls(text, triton_calls.KERNEL_TARGETS)
    assert {c.target for c in calls} == {triton_calls.MOSAIC_TARGET}, _kernel_report(calls)
    assert len(calls) >= 9 * cfg.num_hidden_layers, _kernel_report(calls)
    wide = [c for c in calls if c.wide_floats]
    assert not wide, _kernel_report(wide)


# XLA's debug options that dump each Triton kernel's pass pipeline (`triton_calls` module doc):
# the emitter regex "triton" dumps the Triton fusions' pipelines only (".*" would also dump
# every other fusion's MLIR passes, which nothing reads: most of the compile time).
def _dump_options(dump):
    """XLA_OPTIONS and the Triton IR dump, without source locations: one Triton kernel's dump
    (its IR before each of ~100 passes) fell from 26 to 9 MB and its compile from 13 to 9 s."""
    return {
        **XLA_OPTIONS,
        "xla_dump_to": str(dump),
        "xla_dump_emitter_re": "triton",
        "xla_dump_disable_metadata": True,
    }


def _dumped_gmm_fwd_bwd(tmp_path, x_dtype, out_dtype):
    """gmm (x [M, K] in x_dtype, bf16 weights, output out_dtype) and its VJP compiled for one H100
    with the Triton IR dumped: (the Triton calls, {dumped kernel: has wgmma})."""
    mesh, s = _one_gpu(), functools.partial(_sds, _one_gpu(), P())
    g, k, n = 4, 256, 128

    def f(x, w, sizes, dout):
        out, vjp = jax.vjp(lambda a, b: gp.gmm(a, b, sizes, preferred_element_type=out_dtype), x, w)
        return out, *vjp(dout)

    dump = tmp_path / "dump"
    c = _compile(
        f,
        mesh,
        s((1024, k), x_dtype),
        s((g, k, n), jnp.bfloat16),
        s((g,), jnp.int32),
        s((1024, n), out_dtype),
        options=_dump_options(dump),
    )
    return triton_calls.triton_calls(c.as_text()), triton_calls.tensor_core_kernels(dump)


def _dumped_gmm_f32(tmp_path):
    """f32 x f32 gmm compiled for one H100 with the Triton IR dumped: (the Triton calls,
    {dumped kernel: has wgmma})."""
    mesh, s = _one_gpu(), functools.partial(_sds, _one_gpu(), P())
    dump = tmp_path / "dump"
    f = lambda x, w, sizes: gp.gmm(x, w, sizes)
    c = _compile(
        f,
        mesh,
        s((1024, 256), jnp.float32),
        s((4, 256, 128), jnp.float32),
        s((4,), jnp.int32),
        options=_dump_options(dump),
    )
    return triton_calls.triton_calls(c.as_text()), triton_calls.tensor_core_kernels(dump)


MIXED = {
    "bf16-x-f32-out": (jnp.bfloat16, jnp.float32),
    "f32-x-bf16-out": (jnp.float32, jnp.bfloat16),
}


def _all_dumps(root: Path):
    """The three dumped compiles (a child process runs this). Without symbolized stack traces:
    the dumped Triton pipelines ask LLVM for ~90 of them, an llvm-symbolizer process each reading
    XLA's symbols, 34 of the child's 41 CPU seconds (2026-12-07), and none reaches the dump (the
    same files without them)."""
    os.environ["LLVM_DISABLE_SYMBOLIZATION"] = "1"
    out = {name: _dumped_gmm_fwd_bwd(root / name, *dtypes) for name, dtypes in MIXED.items()}
    out["f32"] = _dumped_gmm_f32(root / "f32")
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """{case: (calls, dumped kernels)} of the three compiles that dump Triton's IR, compiled in a
    child process: XLA's dump options leak into the process's later compiles (a deviceless GPU
    compile of the offloaded train step took 134 s after them in one process, 20 s without:
    tests/test_offload_gpu.py, 2026-12-07), so no worker of the suite compiles with them."""
    if not gpu_mesh.plugin_available():
        pytest.skip("needs the gpu-compile extra")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_all_dumps, tmp_path_factory.mktemp("dumps")).result(timeout=600)


@needs_plugin
@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_operands_multiply_on_the_tensor_cores(dumps, case):
    """bf16 weights with an f32 activation, or an f32 cotangent (a float32 output's): every
    kernel of the fwd+bwd gets bf16 operands, and every dumped kernel (one file each) issues
    wgmma."""
    calls, dumped = dumps[case]
    assert len(calls) == 3 and not [c for c in calls if c.wide_floats], _kernel_report(calls)
    assert len(dumped) == 3 and all(dumped.values()), dumped


@needs_plugin
def test_float32_kernels_stay_float32_and_are_seen(dumps):
    """The negative control of the two checks above: f32 x f32 stays available (IEEE f32 math),
    and the checks see it: f32 operands in every call, no wgmma in the dumped kernels."""
    calls, dumped = dumps["f32"]
    assert len(calls) == 1
    assert calls[0].wide_floats == (("f32", (1024, 256)), ("f32", (4, 256, 128)))
    assert dumped and not any(dumped.values()), dumped


def test_triton_call_parser_reads_operands_and_accumulators():
    """Two HLO lines as XLA:GPU prints them (abridged): a plain kernel, and one whose f32 operand
    4 is aliased to its output (tgmm(acc=)): that one is an accumulator, not a multiplied one."""
    head = "%pallas_call.{i} = f32[4,256,128]{{2,1,0}} custom-call(%a, %b), "
    text = "\n".join(
        [
            head.format(i=1) + f'custom_call_target="{TRITON_CALL}", operand_layout_constraints='
            "{s32[8]{0}, f32[1024,256]{1,0}, bf16[4,256,128]{2,1,0}}, "
            "api_version=API_VERSION_TYPED_FFI, "
            'metadata={op_name="jit(f)/relaymoe_gmm/pallas_call"}',
            head.format(i=2) + f'custom_call_target="{TRITON_CALL}", operand_layout_constraints='
            "{s32[4]{0}, s32[4]{0}, bf16[1024,256]{1,0}, bf16[1024,128]{1,0}, "
            "f32[4,256,128]{2,1,0}}, "
            "output_to_operand_aliasing={{}: (4, {})}, api_version=API_VERSION_TYPED_FFI, "
            'metadata={op_name="jit(f)/relaymoe_tgmm/pallas_call"}',
            "%fusion.3 = f32[8]{0} fusion(%x), kind=kLoop",
        ]
    )
    calls = triton_calls.triton_calls(text)
    assert [(c.name, c.kernel, c.aliased) for c in calls] == [
        ("pallas_call.1", "relaymoe_gmm", ()),
        ("pallas_call.2", "relaymoe_tgmm", (4,)),
    ]
    assert calls[0].wide_floats == (("f32", (1024, 256)),)
    assert calls[1].wide_floats == ()
    assert triton_calls.wide_float_calls(text) == calls[:1]


def test_mosaic_call_parser_reads_operands_and_leaves_out_row_statistics():
    """Two Mosaic GPU calls as XLA:GPU prints them (abridged): the attention's backward with
    bf16 tiles and its float32 rank-3 row statistics (lse, delta: not multiplied), and one
    handed a float32 rank-4 tile (multiplied: flagged). `triton_calls` alone skips both."""
    line = (
        "%mpmd_map.{i} = bf16[1,256,4,64]{{3,2,1,0}} custom-call(%q, %k), "
        'custom_call_target="mosaic_gpu_v2", operand_layout_constraints={{{q}[1,256,4,64]'
        "{{3,2,1,0}}, bf16[1,256,2,64]{{3,2,1,0}}, f32[1,4,256]{{2,1,0}}, s32[4,4]{{1,0}}}}, "
        'api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(f)/dq_kernel/mpmd_map"}}'
    )
    text = "\n".join([line.format(i=1, q="bf16"), line.format(i=2, q="f32")])
    assert triton_calls.triton_calls(text) == []
    calls = triton_calls.mosaic_calls(text)
    assert [(c.name, c.kernel, c.target) for c in calls] == [
        ("mpmd_map.1", "dq_kernel", triton_calls.MOSAIC_TARGET),
        ("mpmd_map.2", "dq_kernel", triton_calls.MOSAIC_TARGET),
    ]
    assert calls[0].operands[2] == ("f32", (1, 4, 256))
    assert calls[0].wide_floats == ()
    assert calls[1].wide_floats == (("f32", (1, 256, 4, 64)),)
    assert triton_calls.wide_float_calls(text) == calls[1:]


def test_mosaic_grouped_matmul_calls_flag_every_multiplied_float32_operand():
    """Our Mosaic GPU grouped matmul as XLA:GPU prints it (abridged from the compiled ring): tgmm's
    last operand, its float32 [G, K, N] accumulator, is aliased to the output (`tgmm(acc=)`
    updates it in place) and added in the epilogue (not flagged); the same operand not aliased,
    and any other float32 operand of tgmm or gmm, of any rank, is multiplied (flagged), unlike
    the attention's rank-3 statistics above."""
    call = (
        '%mosaic.{i} = {out} custom-call({args}), custom_call_target="mosaic_gpu_v2", '
        "operand_layout_constraints={{{ops}}}, {alias}api_version=API_VERSION_TYPED_FFI, "
        'metadata={{op_name="jit(f)/transpose(jvp(relaymoe_{k}))/mpmd_map"}}'
    )
    tgmm = "s32[2]{{0}}, s32[2]{{0}}, {x}[512,256]{{1,0}}, bf16[512,128]{{1,0}}, "
    tgmm += "f32[2,256,128]{{2,1,0}}"
    gmm = "s32[10]{{0}}, s32[1]{{0}}, {x}[512,128]{{1,0}}, {w}[2,256,128]{{2,1,0}}"
    in_place = "output_to_operand_aliasing={{}: (4, {})}, "
    text = "\n".join(
        call.format(i=i, out="f32[2,256,128]", args="%a", k=k, ops=ops, alias=alias)
        for i, (k, ops, alias) in enumerate(
            [
                ("tgmm", tgmm.format(x="bf16"), in_place),
                ("tgmm", tgmm.format(x="f32"), in_place),
                ("tgmm", tgmm.format(x="bf16"), ""),
                ("gmm", gmm.format(x="bf16", w="bf16"), ""),
                ("gmm", gmm.format(x="f32", w="bf16"), ""),
                ("gmm", gmm.format(x="bf16", w="f32"), ""),
            ]
        )
    )
    calls = triton_calls.mosaic_calls(text)
    kinds = ["tgmm"] * 3 + ["gmm"] * 3
    assert [c.kernel for c in calls] == [f"transpose(jvp(relaymoe_{k}))" for k in kinds]
    assert [c.aliased for c in calls] == [(4,), (4,), (), (), (), ()]
    assert [c.wide_floats for c in calls] == [
        (),
        (("f32", (512, 256)),),
        (("f32", (2, 256, 128)),),
        (),
        (("f32", (512, 128)),),
        (("f32", (2, 256, 128)),),
    ]
