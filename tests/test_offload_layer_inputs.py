"""`offload_layer_inputs` (model config): the input of each fully recomputed decoder layer, the one
residual its checkpoint keeps, goes to pinned host memory in the forward and comes back for that
layer's backward (`models/qwen.py`, `remat.options.layer_policy`).

- The same loss and gradients, bitwise, as without it: the trainer's step (`train.step.train_step`'s
  `make_step` on `init_state`'s state) on 8 CPU devices, on the trainer's mesh
  `fsdp=2,context=4`: the tiny MoE model scanned, its dense variant unscanned. XLA:CPU compiles
  the move to nothing: jax lowers `device_put` between memory kinds inside a jit to XLA's
  placement annotation for TPU and GPU only (on CPU it is the identity, and `memory_analysis()`
  reports no host bytes), so these compare the transformed step (the host round trip is in its
  jaxpr), not XLA's copies.
- What jax keeps for the backward (`print_saved_residuals`): the layer inputs in host memory (one
  [L, B, S, H] array stacked by the layer scan, or one [B, S, H] per layer) and no layer input on
  the device any more (only the last layer's output, the final norm's input, stays).
- XLA:GPU (deviceless, 8 abstract H100s): the step's host temporaries are L x the per-device layer
  input, the device footprint falls by at least most of that, and the scan's stacked inputs are a
  host-memory buffer (`S(5)`) only: no device copy of them is kept as well (in
  tests/test_offload_gpu.py, with the other offloaded GPU programs: its module doc says why).
- The refusal without `moe_remat` or with an attention option other than `full`.
"""

import contextlib
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from relaymoe_jax.models import ModelConfig, QwenMoe
from relaymoe_jax.models.config_files import load_config
from train.data.source import Batch
from train.settings import TrainConfig
from train.step import mesh as train_mesh
from train.step import train_step

ROOT = Path(__file__).resolve().parents[1]

FULL = dict(attention_remat="full", moe_remat=True)  # each layer one checkpoint


def _keep_gradients():
    """An optimizer whose state after a step is that step's gradients, exactly (and that leaves
    the parameters as they are): the gradients of `make_step`'s own loss, read from its state."""
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return optax.GradientTransformation(lambda p: zeros(p), lambda g, s, p=None: (zeros(g), g))


def _host_moves(jaxpr) -> int:
    """The `device_put`s to host memory in a jaxpr and the jaxprs inside it."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            n += sum(d == jax.memory.Space.Host for d in eqn.params["devices"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)
                n += _host_moves(sub) if hasattr(sub, "eqns") else 0
    return n


def _step_results(spec, scan, num_experts):
    """(metrics, gradients) of one train step without and with offload_layer_inputs, same
    parameters and batch, on the trainer's mesh `spec`."""
    tc = TrainConfig(batch_size=8, seq_len=32, mesh=spec)
    mesh = train_mesh.make_mesh(tc.mesh)
    cfg = load_config("configs/tiny.yaml", scan_layers=scan, num_experts=num_experts, **FULL)
    graphdef, state, _, rules = train_step.init_state(cfg, tc, mesh)
    keep = _keep_gradients()
    state = state.replace(opt_state=jax.tree.map(jnp.zeros_like, state.params))
    shape = (tc.batch_size, tc.seq_len)
    ids = jax.random.randint(jax.random.key(1), shape, 0, cfg.vocab_size, dtype=jnp.int32)
    batch = Batch(jax.device_put(ids, NamedSharding(mesh, rules.fit(shape, "batch", "seq"))))
    out = []
    for offload in (False, True):
        cfg_off = cfg.replace(offload_layer_inputs=offload)
        graph = train_step.abstract_state(cfg_off, tc, mesh)[0] if offload else graphdef
        with jax.set_mesh(mesh):
            traced = jax.jit(train_step.make_step(graph, keep)).trace(state, batch)
            moves = _host_moves(traced.jaxpr.jaxpr)
            assert moves == offload * (1 if scan else cfg.num_hidden_layers), moves
            new, metrics = traced.lower().compile()(state, batch)
        out.append((metrics, new.opt_state))
    return out


@pytest.mark.parametrize(
    "spec, scan, num_experts",
    [("fsdp=2,context=4", True, 8), ("fsdp=2,context=4", False, 0)],
)
def test_same_loss_and_gradients(spec, scan, num_experts):
    """Every metric of the step and every parameter's gradient equal bitwise: the values are
    moved, not changed (and on XLA:CPU the move compiles to nothing). The tiny MoE model (the
    ring's custom_vjp inside each layer's checkpoint) on one mesh; its dense variant (moe_remat
    recomputes the dense MLP block), which compiles in half the time, on the other and unscanned:
    where the layer inputs are sharded and how many there are does not depend on the block.

    The MoE model runs scanned on fsdp=2,context=4, which covers the former cases
    [context=8-True-8] (the MoE model scanned: the same ring inside the same checkpoint; the
    layer inputs sharded along context as there, and along fsdp too) and
    [fsdp=2,context=4-True-0] (scanned on this mesh: the stacked layer input moves the same way
    whichever block the layer recomputes); each was one more init, trace and compile of the
    step twice."""
    (m0, g0), (m1, g1) = _step_results(spec, scan, num_experts)
    for name, a, b in zip(m0._fields, m0, m1, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    grads = jax.tree_util.tree_leaves_with_path(g0)
    assert len(grads) > 10
    for (path, a), b in zip(grads, jax.tree.leaves(g1), strict=True):
        assert np.abs(np.asarray(a)).max() > 0, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _saved(cfg, b, s):
    """{"host"/"device": [shape, ...]} of the f32 residuals of shape [B, S, H] or [L, B, S, H]
    that jax keeps for the backward of the whole model (on one device), the arguments and the
    final norm's own (its input times rsqrt, ...) left out."""
    mesh = jax.make_mesh((1,), ("expert",))
    model = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.zeros((b, s), jnp.int32)
    out = io.StringIO()
    with jax.set_mesh(mesh), contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: jnp.sum(nnx.merge(graphdef, p, rest).hidden(ids)[0]), params
        )
    found = {"host": [], "device": []}
    layer_input = [(b, s, cfg.hidden_size), (cfg.num_hidden_layers, b, s, cfg.hidden_size)]
    for line in out.getvalue().splitlines():
        m = re.match(r"f32(<host>)?\[([^\]]*)\]", line)
        if m and "from the argument" not in line and "RMSNorm" not in line:
            shape = tuple(int(d.split("@")[0]) for d in m.group(2).split(","))
            if shape in layer_input:
                found["host" if m.group(1) else "device"].append(shape)
    return found


@pytest.mark.parametrize("scan", [True, False])
def test_layer_inputs_are_kept_in_host_memory_only(scan):
    b, s = 2, 16
    cfg = load_config("configs/tiny.yaml", scan_layers=scan, num_hidden_layers=3, **FULL)
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    inputs = [(L, b, s, h)] if scan else [(b, s, h)] * L
    final = [(b, s, h)]  # the last layer's output: the final norm's input
    assert _saved(cfg, b, s) == {"host": [], "device": sorted(final + inputs)}
    offloaded = _saved(cfg.replace(offload_layer_inputs=True), b, s)
    assert offloaded == {"host": inputs, "device": final}


@pytest.mark.parametrize(
    "over, got",
    [
        (dict(moe_remat=False), r"got moe_remat=False$"),
        (
            dict(attention_remat="save_all"),
            r"got attention_remat='save_all' \(not full in layers \[0, 1\]\)",
        ),
        (
            dict(attention_remat=("full", "save_qkv")),
            r"attention_remat=\('full', 'save_qkv'\) \(not full in layers \[1\]\)",
        ),
        (dict(num_experts=0, moe_remat=False), r"got moe_remat=False$"),  # dense too
        (
            dict(moe_remat=False, attention_remat="save_all"),
            r"got moe_remat=False and attention_remat='save_all'",
        ),
    ],
)
def test_refused_unless_each_layer_is_one_checkpoint(over, got):
    """A value given against the whole-layer checkpoint is refused, naming it (what is not given
    is implied: the next test)."""
    want = r"offload_layer_inputs=True: expected moe_remat=true and attention_remat='full' for "
    with pytest.raises(ValueError, match=want + r"every layer .*" + got):
        load_config("configs/tiny.yaml", offload_layer_inputs=True, **over)
    with pytest.raises(ValueError, match=want):  # a Python config states everything itself
        ModelConfig.from_dict({"offload_layer_inputs": True, **over})


def test_a_config_file_implies_the_whole_layer_checkpoint(tmp_path):
    """`offload_layer_inputs: true` in a file or override, without `attention_remat` or
    `moe_remat`: they take the only values it works with (the planner's and the trainer's
    commands need not spell them out); given, they are kept (and checked above)."""
    cfg = load_config("configs/tiny.yaml", offload_layer_inputs=True)
    assert (cfg.attention_remat, cfg.moe_remat, cfg.offload_layer_inputs) == ("full", True, True)
    f = tmp_path / "c.yaml"
    f.write_text((ROOT / "configs/tiny.yaml").read_text() + "offload_layer_inputs: true\n")
    assert load_config(f).attention_remat == "full" and load_config(f).moe_remat
    assert load_config("configs/tiny.yaml").attention_remat == "save_all"  # nothing implied
