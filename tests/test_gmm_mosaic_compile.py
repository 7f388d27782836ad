"""The Mosaic GPU grouped matmul compiled by XLA:GPU for abstract H100s (deviceless,
`relaymoe_jax.gpu_mesh`; nothing runs): its three kernels and the e4m3 gmm (`gmm_fp8`) at
Qwen3-30B-A3B's expert shapes and moe_ffn's ring fwd+bwd on 8 H100s with gmm_impl="mosaic"
(Qwen3-30B-A3B's train step with them: test_attention_gpu_compile.py). Read from what the CUDA
plugin's Mosaic GPU compile dumps (`MOSAIC_GPU_DUMP_TO`, read at each Mosaic GPU compile: one
subprocess compiles both programs, so that no kernel compiled earlier in a test process goes
undumped): every kernel's PTX issues wgmma on bf16 operands (the e4m3
kernel: on e4m3) accumulating in f32 and no other wgmma, ptxas spills nothing, and each kernel's
registers and shared memory are printed (`-s` shows them). The HLO: every Mosaic GPU call
multiplies 16-bit operands only (a float32 cotangent is cast down before it), the e4m3 kernel
e4m3 ones. The kernels' values are tested in the interpreter (test_gmm_mosaic.py,
test_gmm_fp8.py)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from relaymoe_jax.analysis import gpu_mesh, triton_calls
from scripts import ROOT

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(
        not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
    ),
]

# Qwen3-30B-A3B's experts on one device of EP=8 (16 local experts, H=2048, F=768), a ring chunk
# of 8,192 rows gathered from 4,096 tokens: the gate projection and its VJP (dx: the transposed
# kernel; dW: tgmm) with a float32 output and cotangent, the down projection's forward, and tgmm
# accumulating into a float32 sum.
SCRIPT = """
import json, pathlib, sys, warnings
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from relaymoe_jax import XLA_OPTIONS, gpu_mesh
from relaymoe_jax.kernels.gmm import gmm, gmm_fp8, tgmm
from relaymoe_jax.op import moe_ffn

G, H, F, M, T = 16, 2048, 768, 8192, 4096
bf, f32 = jnp.bfloat16, jnp.float32


def kernels(x, w_gate, w_down, rows, gs, dout, acc):
    # a float32 output: its float32 cotangent meets the bf16 operands
    mm = lambda x, w: gmm(x, w, gs, impl="mosaic", lhs_rows=rows, preferred_element_type=f32)
    gate, vjp = jax.vjp(mm, x, w_gate)
    gate = gate.astype(bf)
    down = gmm(gate, w_down, gs, impl="mosaic")
    dw = tgmm(gate, down, gs, impl="mosaic", preferred_element_type=jnp.float32, acc=acc)
    # the e4m3 kernel (expert_fp8): the gate projection and its VJP (dx: e4m3; dW: tgmm)
    mm8 = lambda x, w: gmm_fp8(x, w, gs, lhs_rows=rows, preferred_element_type=f32)
    gate8, vjp8 = jax.vjp(mm8, x, w_gate)
    return down, dw, *vjp(dout.astype(jnp.float32)), gate8, *vjp8(dout.astype(f32))


def layer(mesh):
    def loss(x, ids, wts, wg, wu, wd):
        y = moe_ffn(x, ids, wts, wg, wu, wd, mesh=mesh, gmm_impl="mosaic")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 2, 3, 4, 5))


def compile(fn, mesh, *shapes):
    spec = lambda s: P("expert") if len(mesh.shape) > 1 or mesh.shape.get("expert") else P()
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in shapes]
    with jax.set_mesh(mesh):
        return jax.jit(fn).trace(*args).lower().compile(XLA_OPTIONS)


one = gpu_mesh.mesh((1,), ("x",))
r = P()
c1 = compile(kernels, one, ((T, H), bf, r), ((G, H, F), bf, r), ((G, F, H), bf, r),
             ((M,), jnp.int32, r), ((G,), jnp.int32, r), ((M, F), bf, r),
             ((G, F, H), jnp.float32, r))
ep = gpu_mesh.mesh((8,), ("expert",))
e = P("expert")
t, h, f, k, n = 8 * 1024, 256, 128, 4, 16
c2 = compile(layer(ep), ep, ((t, h), bf, e), ((t, k), jnp.int32, e), ((t, k), jnp.float32, e),
             ((n, h, f), bf, e), ((n, h, f), bf, e), ((n, f, h), bf, e))
# the ring's weight-gradient sum: tgmm(acc=) in a loop over a donated float32 [G, F, H] sum
step = lambda i, a, x, y, gs: tgmm(x, y, gs, impl="mosaic", preferred_element_type=f32, acc=a)
dw_sum = lambda x, y, gs, acc: jax.lax.fori_loop(0, 4, lambda i, a: step(i, a, x, y, gs), acc)
sum_args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(one, r))
            for s, d in (((M, F), bf), ((M, H), bf), ((G,), jnp.int32), ((G, F, H), f32))]
with jax.set_mesh(one):
    c3 = jax.jit(dw_sum, donate_argnums=3).trace(*sum_args).lower().compile(XLA_OPTIONS)
out = pathlib.Path(sys.argv[1])
sums = {"temp": c3.memory_analysis().temp_size_in_bytes, "acc": G * F * H * 4}
(out / "dw_sum.json").write_text(json.dumps(sums))
(out / "kernels.txt").write_text(c1.as_text())
(out / "layer.txt").write_text(c2.as_text())
"""


PROGRAMS = ("kernels", "layer")


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """(the Mosaic GPU dump directory, {program: HLO text}) of the subprocess above."""
    kernels, hlo = tmp_path_factory.mktemp("mosaic"), tmp_path_factory.mktemp("hlo")
    env = {
        **os.environ,
        "MOSAIC_GPU_DUMP_TO": str(kernels),
        "MOSAIC_GPU_DUMP_PTX": "1",
        "MOSAIC_GPU_DUMP_PTXAS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(hlo)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    texts = {p: (hlo / f"{p}.txt").read_text() for p in PROGRAMS}
    return kernels, texts, json.loads((hlo / "dw_sum.json").read_text())


def test_every_kernel_call_takes_16_bit_operands(dump):
    """The kernels' program: the gate's forward, dx and dW, the down projection, tgmm into a
    float32 sum (its f32 accumulator is an operand it adds, not multiplies), and the e4m3 gate
    projection with its VJP (its f32 operands are block scales, applied to float32 partial
    products; test_the_e4m3_kernel_multiplies_e4m3); the layer's fwd+bwd: the ring's forward and
    recomputing backward. No call multiplies a float32 operand.
    Qwen3-30B-A3B's train step with these kernels (gmm_impl="auto" on H100s: scanned layers,
    `moe_remat`, bf16 compute) is test_attention_gpu_compile.py's
    test_train_step_calls_the_kernel_in_every_layer[qwen3-30b-a3b-context8], which reads its
    grouped-matmul calls the same way (this module compiled it too before "auto" took them)."""
    for name, text in dump[1].items():
        calls = triton_calls.mosaic_calls(text)
        assert calls, name
        kernels = {"relaymoe_gmm", "relaymoe_tgmm", "relaymoe_gmm_fp8"}
        assert {c.kernel.split(".")[0] for c in calls} <= kernels
        assert not triton_calls.wide_float_calls(text), (name, calls)
        assert not triton_calls.triton_calls(text), name  # nothing left on the Triton backend
    assert len(triton_calls.mosaic_calls(dump[1]["kernels"])) == 5 + 3
    # the ring's forward (3) and backward (2 recomputed, 3 dx, 3 dW) in its loop bodies
    assert len(triton_calls.mosaic_calls(dump[1]["layer"])) >= 11


def _ptxas(path: pathlib.Path) -> dict:
    text = path.read_text()
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return {"registers": regs, "spill_bytes": sum(spills)}


def test_tgmm_sums_into_its_accumulator_in_place(dump):
    """The ring's weight-gradient sum, tgmm(acc=) over 4 chunks into a donated float32 [16, 768,
    2048] sum (96 MiB): the kernel writes into the sum's own buffer (an input-output alias), so
    the program's temporaries hold no second sum (before, each call wrote a new one: 96 MiB of
    temporaries here, 640 MiB more for the E384 ring in BENCHMARKS)."""
    sums = dump[2]
    assert sums["temp"] < sums["acc"] // 8, sums


def test_the_e4m3_kernel_multiplies_e4m3(dump):
    """The e4m3 gate projection (forward) and its dx: each call takes x and w as e4m3 ([M, K]
    and [G, N, K]: the forward's w transposed to K-major by XLA, dx's as it is) and their
    float32 scales; dW is the 16-bit tgmm (bf16 operands)."""
    calls = triton_calls.mosaic_calls(dump[1]["kernels"])
    fp8_calls = [c for c in calls if c.kernel.startswith("relaymoe_gmm_fp8")]
    assert len(fp8_calls) == 2, calls
    for c in fp8_calls:
        types = [t for t, _ in c.operands]
        assert types.count("f8e4m3fn") == 2 and types.count("f32") == 2, c.operands
        assert not {"bf16", "f16"} & set(types), c.operands


def test_ptx_issues_wgmma_on_bf16_and_ptxas_spills_nothing(dump):
    """Each distinct kernel compiled (gmm, dx, tgmm at each shape): wgmma `.f32.bf16.bf16` only
    (the e4m3 kernel: `.f32.e4m3.e4m3` only), no spill, at most 255 registers a thread;
    registers and shared memory printed."""
    kernels = triton_calls.mosaic_wgmma_kernels(dump[0])
    assert kernels and all(name.startswith("relaymoe_") for name in kernels), kernels
    assert any(name.startswith("relaymoe_gmm_fp8") for name in kernels), kernels
    for name, shapes in kernels.items():
        kind = ".f32.e4m3.e4m3" if name.startswith("relaymoe_gmm_fp8") else ".f32.bf16.bf16"
        assert shapes and all(s.endswith(kind) for s in shapes), (name, shapes)
        stem = name.removesuffix(".ptx")
        info = _ptxas(dump[0] / f"{stem}.ptxas")
        print(f"{stem}: {shapes}, {info['registers']} registers, no spill")
        assert info["spill_bytes"] == 0 and info["registers"] <= 255, (name, info)
    # shared memory is dumped per lowered kernel (numbered apart from the PTX files)
    smem = {
        int(m.group(1))
        for f in dump[0].glob("*.resources.txt")
        if (m := re.search(r"smem_scratch_bytes=(\d+)", f.read_text()))
    }
    print(f"shared memory of the kernels (bytes): {sorted(smem)}")
    assert smem and max(smem) <= 232_448  # what a Hopper block may use
