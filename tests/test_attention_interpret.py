"""Where jax's Mosaic GPU interpreter runs the attention kernel ("pallas-interpret",
`relaymoe_jax/kernels/attention/interpret.py`), and the attention's edges a user meets there:

- the trainer completes with it on one device on a machine of two CPUs (it waited forever in
  its first step when XLA:CPU had two threads for the step and the kernel's two warpgroups),
  its losses the chunked attention's;
- on a mesh of several devices, or with too few XLA:CPU threads, it is refused in one line before
  anything is built: by the trainer, at the model's entry and by the attention op;
- (the model differentiates it under its own attention remat, with nothing allowing the
  interpreter's io effect before: tests/test_attention_impls.py);
- a batch of one, typed on a mesh axis of one device (`[1@expert, ...]`), differentiates through
  the chunked attention's custom VJP and through the model, against the dense references.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpora import word_corpus
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_attention_impls import dense_reference

from relaymoe_jax.kernels.attention import interpret
from relaymoe_jax.models import QwenMoe
from relaymoe_jax.models.attention import blockwise_attention
from relaymoe_jax.models.config_files import load_config
from train import cli

ROOT = Path(__file__).resolve().parents[1]
BF16 = jnp.bfloat16
TRAIN = ["--config", "configs/tiny.yaml", "--steps", "1", "seq_len=128", "batch_size=2"]
TRAIN += ["num_experts=4", "compute_dtype=bfloat16", "head_dim=64", "num_hidden_layers=1"]
TIMEOUT_S = 300  # an interpreted step takes about 8 s on 2 CPUs; a hang fails here


# `python -m train` on two CPUs (what CI has), whatever this machine has
TWO_CPUS = (
    "import os, runpy, sys; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2]); "
    "sys.argv[0] = 'train'; runpy.run_module('train', run_name='__main__', alter_sys=True)"
)


def _train(tmp_path, data, name, *extra):
    """The trainer on `data`, one CPU device and two CPUs, NPROC unset: its metrics' rows."""
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    out = tmp_path / name
    cmd = [sys.executable, "-c", TWO_CPUS, *TRAIN, "mesh=expert=1", *extra, "--out", str(out)]
    cmd += ["--data", str(data)]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_runs_the_interpreter_on_one_device_with_two_cpus(tmp_path):
    """A step with attention_impl=pallas-interpret on one device, two CPUs and no NPROC (the
    trainer reserves XLA:CPU's threads): its loss (the kernel's forward) and gradient norm (its
    backward) equal the chunked attention's to bf16 rounding. One decoder layer (`TRAIN`): every
    layer runs the same kernels, and the hang this guards against (two XLA:CPU threads for the
    step and the kernel's warpgroups) comes in the first kernel call."""
    data = word_corpus(tmp_path / "data", 60)
    got = _train(tmp_path, data, "kernel", "attention_impl=pallas-interpret")
    want = _train(tmp_path, data, "chunked", "attention_impl=chunked", "attention_block_k=64")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1]
    for key, tol in (("loss", 2e-3), ("grad_norm", 2e-2)):
        assert abs(got[0][key] - want[0][key]) <= tol * abs(want[0][key]), (key, got, want)


def test_the_trainer_refuses_it_on_several_devices_before_building():
    """The default mesh (batch over the 8 devices): one line naming the mesh and what works."""
    argv = ["--config", "configs/tiny.yaml", "--steps", "3", "--out", "unused", "seq_len=128"]
    argv += ["batch_size=2", "head_dim=64", "compute_dtype=bfloat16"]
    argv += ["attention_impl=pallas-interpret"]
    with pytest.raises(ValueError) as e:
        cli.parse(argv)
    msg = str(e.value)
    assert msg.startswith("attention_impl='pallas-interpret' on mesh='expert=-1' of 8 devices:")
    assert "use 'chunked'" in msg and "\n" not in msg


def test_the_model_and_the_op_refuse_it_on_several_devices():
    """At the model's entry (a mesh of 8) and in the op (q on an Auto mesh of 8 in context,
    which jit may partition the kernel's calls over), before anything is traced."""
    cfg = load_config("configs/tiny.yaml", head_dim=64, attention_impl="pallas-interpret")
    mesh = jax.make_mesh((8,), ("expert",))
    with pytest.raises(ValueError, match=r"on mesh \{'expert': 8\} of 8 devices: jax 0.12's"):
        QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0), dtype=BF16)
    q = jnp.zeros((1, 128, 2, 64), BF16)
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(auto), pytest.raises(ValueError, match="on a mesh of 8 devices"):
        blockwise_attention(
            q, q, q, block_k=64, scale=None, seg_bs=None, seg_kv=None, kernel="pallas-interpret"
        )


def test_too_few_xla_threads_are_refused_and_reserved(monkeypatch):
    """NPROC below what the interpreter needs: the model's entry says so in one line, naming
    the value to set; before jax starts, `reserve_threads` raises it (and never lowers it)."""
    monkeypatch.setenv("NPROC", "2")
    cfg = load_config("configs/tiny.yaml", head_dim=64, attention_impl="pallas-interpret")
    with pytest.raises(ValueError) as e:
        QwenMoe(cfg, mesh=jax.make_mesh((1,), ("expert",)), rngs=nnx.Rngs(0), dtype=BF16)
    assert str(e.value) == (
        f"attention_impl='pallas-interpret' needs {interpret.THREADS} XLA:CPU threads (the "
        f"caller and up to {interpret.THREADS - 1} warpgroups of a kernel, which wait on each "
        "other) and this process has 2 (NPROC or its CPUs): a step would wait forever; set "
        f"NPROC={interpret.THREADS} in the environment before jax starts, or use 'chunked'"
    )
    monkeypatch.setattr(interpret, "backends_started", lambda: False)
    interpret.reserve_threads()
    assert os.environ["NPROC"] == str(interpret.THREADS)
    monkeypatch.setenv("NPROC", "64")
    interpret.reserve_threads()
    assert os.environ["NPROC"] == "64"


def _model_grads(impl, ids_bs, **overrides):
    """Loss and gradients of the tiny bf16 model (head_dim 64, one decoder layer: every layer
    runs the same attention) on a mesh of one device."""
    cfg = load_config(
        "configs/tiny.yaml", head_dim=64, attention_impl=impl, num_hidden_layers=1, **overrides
    )
    model = QwenMoe(cfg, mesh=jax.make_mesh((1,), ("expert",)), rngs=nnx.Rngs(0), dtype=BF16)

    def loss(model, ids):
        logits, aux = model(ids)
        x = logits.astype(jnp.float32)
        targets = jnp.roll(ids, -1, axis=1)
        nll = -jnp.sum(jax.nn.log_softmax(x) * jax.nn.one_hot(targets, x.shape[-1]), -1)
        return jnp.mean(nll[:, :-1]) + aux.router_loss

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model, ids_bs)
    return float(value), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]


def _close(got, want, tol):
    (v_g, g_g), (v_w, g_w) = got, want
    assert abs(v_g - v_w) <= 2e-3 * abs(v_w), (v_g, v_w)
    assert len(g_g) == len(g_w)
    for a, b in zip(g_g, g_w):
        assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-12)


def test_a_batch_of_one_differentiates_in_the_model():
    """A [1, 64] batch on a mesh of one device: the chunked model's loss and gradients equal
    the dense attention's ("xla")."""
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(1, 64)), jnp.int32)
    _close(_model_grads("chunked", ids, attention_block_k=32), _model_grads("xla", ids), 3e-2)


def test_a_batch_of_one_typed_on_a_mesh_axis_differentiates_in_the_op():
    """q, k, v typed [1@expert, ...] on an Explicit mesh of one device: the custom VJP's
    cotangents keep that type, and o, dq, dk, dv equal the dense reference's (float32)."""
    mesh = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.normal(size=(1, 64, h, 32)).astype(np.float32) for h in (4, 2, 2, 4))
    idx = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (1, 64))
    seg = jnp.ones((1, 64), jnp.int32)
    want, vjp = jax.vjp(lambda *a: dense_reference(*a, idx, idx, seg, seg), q, k, v)
    want = (want, *vjp(jnp.asarray(do)))
    with jax.set_mesh(mesh):
        put = lambda x: jax.device_put(jnp.asarray(x, BF16), NamedSharding(mesh, P("expert")))

        def attend(q, k, v):
            kw = dict(block_k=32, scale=None, seg_bs=None, seg_kv=None)
            return blockwise_attention(q, k, v, **kw)

        o, vjp = jax.vjp(attend, put(q), put(k), put(v))
        got = (o, *vjp(put(do)))
        for x in got:
            assert jax.typeof(x).sharding.spec[0] == "expert", jax.typeof(x)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= 2e-2 * np.abs(w).max(), name
