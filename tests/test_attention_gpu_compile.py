"""The Pallas Mosaic GPU flash attention compiled by XLA:GPU for abstract H100s (deviceless,
`relaymoe_jax.gpu_mesh`; nothing runs): every kernel call takes 16-bit tiles, its PTX issues
Hopper wgmma on bf16 operands, the train step calls it in every layer (alone or under the
context-parallel shard_map), and its forward + backward keeps no [S, N, block] buffer: the
compiled temporaries against the chunked XLA path's at 131,072 tokens per device."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.analysis import gpu_mesh, triton_calls
from relaymoe_jax.models.attention import blockwise_attention
from relaymoe_jax.xla_options import XLA_OPTIONS

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(
        not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
    ),
]
BF16 = jnp.bfloat16
N, K, D = 32, 4, 128  # Qwen3-30B-A3B's heads
S_LONG = 131_072  # tokens per device of the memory test


def _attention_fwd_bwd(kernel, block_k=512):
    def f(q, k, v, seg, do):
        attend = lambda q, k, v: blockwise_attention(
            q, k, v, block_k=block_k, scale=None, seg_bs=seg, seg_kv=seg, kernel=kernel
        )
        o, vjp = jax.vjp(attend, q, k, v)
        return o, *vjp(do)

    return f


def _compiled_attention(kernel, s, d=D):
    """Forward + backward of one packed attention layer (q [1, s, 32, d], 4 kv heads, bf16)
    for one abstract H100, with the trainer's compiler options."""
    mesh = gpu_mesh.mesh((1,), ("x",))
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    q, kv = sds((1, s, N, d), BF16), sds((1, s, K, d), BF16)
    args = (q, kv, kv, sds((1, s), jnp.int32), q)
    with jax.set_mesh(mesh):
        return jax.jit(_attention_fwd_bwd(kernel)).trace(*args).lower().compile(XLA_OPTIONS)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """(PTX dump directory, {head_dim: compiled}): the kernel's forward + backward at head_dim
    128 and `S_LONG` tokens (the memory test's program) and at head_dim 64 and 1,024 tokens,
    compiled in this process with the Mosaic GPU compile's PTX dumped. jax 0.12 reads
    `MOSAIC_GPU_DUMP_TO` at each Mosaic GPU compile, not when the plugin starts: set for these
    two only, it dumps nothing later and slows no later compile (the tiny train step after them,
    2026-12-07). A subprocess compiled them at 1,024 tokens before: with its start-up, 7 CPU
    seconds more than this (of the file's 88). A kernel compiled earlier in the process is not
    compiled, nor dumped, again: no other test compiles these shapes for a GPU."""
    ptx = tmp_path_factory.mktemp("ptx")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOSAIC_GPU_DUMP_TO", str(ptx))
        env.setenv("MOSAIC_GPU_DUMP_PTX", "1")
        compiled = {d: _compiled_attention("pallas", s, d) for d, s in ((128, S_LONG), (64, 1024))}
    return ptx, compiled


def test_no_sequence_sized_temporaries_beyond_the_statistics(kernels):
    """At 131,072 tokens per device (Qwen3-30B-A3B's heads, head_dim 128): the kernel's forward
    + backward holds, beyond its inputs and outputs, only the float32 row statistics (lse and
    rowsum(dO * O), [1, 32, S] each, 32 MiB) and less than 1 MiB more (the block ranges, int32
    per block, and the sort behind them: 565 KiB; the [S/64, S/64] block lists before them
    took 16.5 MiB): no [S, N, block] buffer (512 MiB in bf16 at block 64), no S x S one, and no
    [S/64, S/64] one anywhere in the program. The chunked XLA path keeps its float32 dq and
    blocks of scores: far more (4.2 GiB when written)."""
    s, compiled = S_LONG, kernels[1][128]
    pallas = compiled.memory_analysis().temp_size_in_bytes
    chunked = _compiled_attention("xla", s).memory_analysis().temp_size_in_bytes
    stats = 2 * N * s * 4
    print(f"\ntemp bytes at S={s}: pallas {pallas} (stats {stats}), chunked {chunked}")
    assert pallas <= stats + 2**20, (pallas, stats)
    blocks = s // 64
    tables = re.findall(r"\b[a-z0-9]+\[(?:\d+,)*\d{4,},\d{4,}\]", compiled.as_text())
    assert not [t for t in tables if min(map(int, t.split("[")[1][:-1].split(",")[-2:])) >= blocks]
    assert chunked >= s * N * D * 4  # its float32 dq alone
    assert pallas * 20 < chunked, (pallas, chunked)


@pytest.mark.parametrize("d", [128, 64])
def test_every_kernel_call_takes_16_bit_tiles(kernels, d):
    """Forward + backward, head_dim 128 and 64: three Mosaic GPU calls (the forward, dq, dk/dv),
    each with bf16 q/k/v/o/dO tiles and only its float32 row statistics wider (the grouped
    matmul's Triton calls: none here). Read from the programs whose PTX the test below reads
    (`kernels`; this test compiled its own at 4,096 tokens before: the same kernels)."""
    text = kernels[1][d].as_text()
    calls = triton_calls.mosaic_calls(text)
    assert len(calls) == 3, [c.kernel for c in calls]
    assert not triton_calls.wide_float_calls(text), calls
    tiles = [o for c in calls for o in c.operands if len(o[1]) == 4]
    assert tiles and {t for t, _ in tiles} == {"bf16"}, tiles


def test_ptx_issues_wgmma_on_bf16_operands(kernels):
    """The CUDA plugin's Mosaic GPU compile, its PTX dumped (`kernels`): each of the 6 kernels
    (forward, dq, dk/dv at head_dim 128 and 64) issues `wgmma.mma_async` with bf16 operands
    accumulating in f32, and none any other wgmma."""
    dumped = triton_calls.mosaic_wgmma_kernels(kernels[0])
    assert len(dumped) == 6, dumped
    for name, shapes in dumped.items():
        assert shapes and all(sh.endswith(".f32.bf16.bf16") for sh in shapes), (name, shapes)


# name: (config, overrides, mesh, attention_impl, batch, seq)
TRAIN_STEPS = {
    # Qwen3-30B-A3B's attention and experts (1 of its 48 layers, a small vocabulary), every
    # device on `context`: the zigzag order, each device's queries against the gathered keys.
    # One layer (2 before): the scan compiles one layer body whatever the count (the same 3
    # attention calls and 33 grouped-matmul calls at 1 and 2 layers, a fifth less CPU time at
    # 1); the scan over several layers is [tiny-expert8-auto]'s (tiny.yaml: 2 layers)
    "qwen3-30b-a3b-context8": (
        "configs/qwen3-30b-a3b.yaml",
        dict(num_hidden_layers=1, vocab_size=4096),
        "context=8",
        "pallas",
        1,
        8192,
    ),
    # the batch over 8 devices, the sequence whole: the kernel under the shard_map all the same
    # (it takes each device's arrays); "auto" picks it on a GPU mesh
    "tiny-expert8-auto": ("configs/tiny.yaml", dict(head_dim=64), "expert=8", "auto", 8, 128),
}


@pytest.mark.parametrize("name", TRAIN_STEPS)
def test_train_step_calls_the_kernel_in_every_layer(name):
    """The whole train step (packed documents, compute_dtype=bfloat16, layer scan, moe_remat)
    compiled for 8 H100s with the trainer's options: the scanned layer calls the three Mosaic
    GPU attention kernels (forward, dq, dk/dv), all on 16-bit tiles, and the experts' grouped
    matmuls (gmm_impl="auto": our Mosaic GPU kernels on H100s, no Triton call left); no kernel
    takes a wider float it multiplies; the step takes the packed batch's three arrays (tokens,
    segment ids, positions).

    [tiny-expert8-auto] is the ring's step on packed documents with the layer scan and
    `moe_remat` (each layer's weights cast to bf16 inside the MoE block's checkpoint, its
    gradient leaving it in float32): it also covers what test_gpu_compile.py's
    test_train_step_kernels_take_16_bit_operands[ring-False-True] and [ring-True] (the ring's
    packed step with the chunked XLA attention, unscanned) checked: their kernel calls and
    batch arrays (the weights cast before unscanned layers: that test's all-to-all step)."""
    from relaymoe_jax.models.config_files import load_config
    from train.settings import TrainConfig
    from train.step import mesh as train_mesh
    from train.step import train_step

    path, overrides, mesh_name, impl, batch, seq = TRAIN_STEPS[name]
    tc = TrainConfig(batch_size=batch, seq_len=seq, compute_dtype="bfloat16", mesh=mesh_name)
    sizes = train_mesh.parse_mesh(tc.mesh, 8)
    mesh = gpu_mesh.mesh(tuple(sizes.values()), tuple(sizes))
    cfg = load_config(
        path,
        expert_size=train_mesh.expert_size(sizes),
        attention_impl=impl,
        scan_layers=True,
        moe_remat=True,
        **overrides,
    )
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        compiled = train_step.compile_abstract(cfg, tc, mesh, memo=False, packed=True)
        text = compiled.as_text()
    assert len(jax.tree.leaves(compiled.input_shardings[0][1])) == 3  # None fields: no arrays
    every = triton_calls.mosaic_calls(text)
    grouped = [c for c in every if "relaymoe_" in c.kernel]  # relaymoe_gmm, relaymoe_tgmm
    calls = [c for c in every if c not in grouped]  # the attention's
    kernels = sorted(c.kernel for c in calls)
    assert kernels == ["attention_bwd_dkv", "attention_bwd_dq", "flash_fwd"], kernels
    assert len(grouped) >= 9 * cfg.num_hidden_layers, [c.kernel for c in grouped]
    assert not triton_calls.triton_calls(text)
    assert not triton_calls.wide_float_calls(text)
    tiles = [o for c in calls for o in c.operands if len(o[1]) == 4]
    assert {t for t, _ in tiles} == {"bf16"}, tiles
