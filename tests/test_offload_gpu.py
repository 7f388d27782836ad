"""Offload compiled by XLA:GPU for 8 abstract H100s (deviceless, `relaymoe_jax.gpu_mesh`; nothing
runs): `offload_optimizer` lowers the device's peak, not only its arguments; the scanned step
gathers and casts one layer of weights at a time; `offload_layer_inputs` keeps the layer inputs
in host memory only. (The same math on 8 CPU devices: tests/test_offload.py and
tests/test_offload_layer_inputs.py, where these tests were.)

In suite runs one of them took 103-274 s against 13-25 s alone (2026-12-06 and -07). The cause:
XLA's dump options leak into a process's later compiles, and the worker had compiled
tests/test_gpu_compile.py's dumped programs before (134 s after them in one process, 20 s
without); those now compile in a child process.
"""

import dataclasses
import functools
import math
import warnings

import jax
import pytest

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.models.config_files import load_config
from train.planner import memory
from train.settings import TrainConfig
from train.step import mesh as train_mesh
from train.step import train_step

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(
        not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
    ),
]
FULL = dict(attention_remat="full", moe_remat=True)  # each layer one checkpoint


def _state_bytes(state) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))


@functools.cache
def _gpu_mesh():
    """8 abstract H100s over `fsdp`, made once: a mesh made again is another mesh (not equal),
    so the programs compiled for it would not be shared (`_gpu_memory`)."""
    return gpu_mesh.mesh((8,), ("fsdp",))


def _gpu_dense_scanned(**over):
    """(config, train config, mesh): a small dense scanned model (weights dominate, tiny
    activations), bf16 compute, stored over `fsdp=8` of 8 abstract H100s."""
    tc = TrainConfig(batch_size=8, seq_len=64, mesh="fsdp=8", compute_dtype="bfloat16")
    mesh = _gpu_mesh()
    sizes = dict(num_experts=0, hidden_size=512, intermediate_size=2048, num_hidden_layers=6)
    return load_config("configs/tiny.yaml", scan_layers=True, **sizes, **over), tc, mesh


def _gpu_memory(cfg, tc, mesh):
    """memory_analysis() of the step compiled by XLA:GPU, memoised (`compile_abstract`): the
    tests below share their programs."""
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        return train_step.compile_abstract(cfg, tc, mesh).memory_analysis()


def test_offloaded_optimizer_lowers_the_gpu_peak_not_only_the_arguments():
    """XLA:GPU for 8 abstract H100s, a small dense scanned model, bf16 compute: with the float32
    weights and both moments (12 bytes per stored parameter) in host memory, the device's peak
    (arguments + temporaries + outputs not aliased) falls by at least what moved (12 bytes) less
    the bf16 compute copy that the step fetches to the device (2 bytes): 10 bytes per parameter,
    taken at 3/4 for the rest of the step's noise; the host holds at least the moved bytes. (A
    naive fetch of the whole state inside the step moves it from arguments to temporaries and
    leaves the peak where it was.) Each layer one checkpoint (`FULL`), so the plain step is the
    program test_the_scanned_step_gathers_and_casts_one_layer_of_weights_at_a_time[full] reads
    (memoised: one compile less). The model had no checkpoints here before: the offloaded step
    with them took 274 s to compile in a suite run (2026-12-06), the dump options' leak of the
    module doc; 13 CPU seconds alone (2026-12-07), as without them."""
    cfg, tc, mesh = _gpu_dense_scanned(**FULL)
    _, state, _, _ = train_step.abstract_state(cfg, tc, mesh)
    params_per_device = _state_bytes(state.params) // 4 // 8
    plain = _gpu_memory(cfg, tc, mesh)
    off = _gpu_memory(cfg, dataclasses.replace(tc, offload_optimizer=True), mesh)
    assert off.host_argument_size_in_bytes >= 12 * params_per_device * 0.99
    fall = memory.footprint(plain) - memory.footprint(off)
    assert fall >= 0.75 * 10 * params_per_device, (memory.footprint(plain), memory.footprint(off))


@pytest.mark.parametrize("attention", ["full", "save_all"])
def test_the_scanned_step_gathers_and_casts_one_layer_of_weights_at_a_time(attention):
    """XLA:GPU for 8 abstract H100s, a small dense scanned model stored over `fsdp=8`, bf16
    compute, `moe_remat` (the MLP block, most of the weights, under its checkpoint), tiny
    activations: the step's temporaries stay below ONE bf16 copy of every layer's gathered
    weights (2 bytes x the stacked parameters, all 8 shards). Gathered and cast before the layer
    scan, the step held that copy through the backward plus the bf16 gradients of the same size;
    inside each block's checkpoint, a layer's copy is made (and made again for its backward) from
    its stored slice, and its gradient reduce-scattered, one layer at a time. (A block without a
    checkpoint, attention under `save_all`, still keeps its prepared weights for the backward.)"""
    cfg, tc, mesh = _gpu_dense_scanned(moe_remat=True, attention_remat=attention)
    _, state, _, _ = train_step.abstract_state(cfg, tc, mesh)
    stacked = _state_bytes(state.params["layers"]) // 4  # float32: parameters, all shards
    got = _gpu_memory(cfg, tc, mesh)
    assert got.temp_size_in_bytes < 2 * stacked, (got.temp_size_in_bytes, 2 * stacked)


def test_gpu_program_keeps_the_layer_inputs_in_host_memory():
    """The train step of a small dense scanned model (every layer one checkpoint; the MLP block
    is recomputed under moe_remat as the MoE block would be) compiled by XLA:GPU for 8 abstract
    H100s, without and with offload: host temporaries hold the L layer inputs (L x B·S·H·4 / 8
    bytes), the device footprint falls by at least 3/4 of that, and the stacked inputs
    [L, B/8, S, H] are a host buffer only. Seq 512 and H 512 make the inputs 1 MiB per layer and
    device, well above the noise of the rest of the step."""
    tc = TrainConfig(batch_size=8, seq_len=512, mesh="expert=8")
    sizes = train_mesh.parse_mesh(tc.mesh, 8)
    mesh = gpu_mesh.mesh(tuple(sizes.values()), tuple(sizes))
    cfg = load_config(
        "configs/tiny.yaml",
        num_experts=0,
        hidden_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=6,
        scan_layers=True,
        **FULL,
    )
    L, b = cfg.num_hidden_layers, tc.batch_size // 8
    per_layer = b * tc.seq_len * cfg.hidden_size * 4
    stacked = f"f32[{L},{b},{tc.seq_len},{cfg.hidden_size}]{{3,2,1,0"  # + ":S(5)" in host memory
    runs = {}
    for offload in (False, True):
        with jax.set_mesh(mesh), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
            c = train_step.compile_abstract(
                cfg.replace(offload_layer_inputs=offload), tc, mesh, memo=False
            )
        text = c.as_text()
        runs[offload] = (
            c.memory_analysis(),
            text.count(stacked + "}"),
            text.count(stacked + ":S(5)}"),
        )
    (plain, on_device, on_host), (off, off_device, off_host) = runs[False], runs[True]
    host = off.host_temp_size_in_bytes + off.host_output_size_in_bytes
    assert plain.host_temp_size_in_bytes == 0 and host >= L * per_layer, (host, L * per_layer)
    fall = memory.footprint(plain) - memory.footprint(off)
    assert fall >= 0.75 * L * per_layer, (memory.footprint(plain), memory.footprint(off))
    assert on_device and not on_host, "without offload the scan stacks the inputs on the device"
    assert off_host and not off_device, "with offload: in host memory, and not on the device too"
