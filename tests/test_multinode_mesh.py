"""Expert parallelism across nodes (docs/multinode.md): the trainer's `node` mesh axis (the outer
expert axis), the sharding rules it gives (experts over ("node", "expert")), the `ring` model
option. Training with the hierarchical ring (two processes, `ring="auto"`) against the flat one
(one process): tests/test_multihost.py::test_two_processes_match_one."""

import jax
import numpy as np
import pytest

from relaymoe_jax import remat
from relaymoe_jax.models import ModelConfig, rules_for
from relaymoe_jax.models.config_files import load_config
from relaymoe_jax.op import topology
from train import cli
from train.settings import TrainConfig
from train.step import mesh as tm
from train.step import train_step


@pytest.mark.parametrize(
    "spec, n, want",
    [
        ("node=2,expert=4", 8, {"node": 2, "expert": 4}),
        ("expert=4,node=2", 8, {"node": 2, "expert": 4}),  # mesh order, whatever the spec's
        ("node=2,expert=-1", 16, {"node": 2, "expert": 8}),
        ("expert=8,data=2,node=-1", 32, {"data": 2, "node": 2, "expert": 8}),
        ("node=1,expert=8", 8, {"node": 1, "expert": 8}),
    ],
)
def test_parse_mesh_with_node(spec, n, want):
    sizes = tm.parse_mesh(spec, n)
    assert sizes == want and list(sizes) == list(want)
    assert tm.expert_size(sizes) == sizes["node"] * sizes["expert"]


@pytest.mark.parametrize("spec", ["node=8", "node=2,data=4", "node=-1,context=2"])
def test_node_needs_expert(spec):
    with pytest.raises(
        ValueError,
        match=r"axis 'node' is the outer expert axis and needs an "
        r"'expert' axis too.*node=<hosts>,expert=<GPUs per host>",
    ):
        tm.parse_mesh(spec, 8)


def test_axis_order_puts_node_outside_expert():
    assert tm.AXES == ("data", "fsdp", "node", "expert", "context", "expert_tensor")
    mesh = tm.make_mesh("expert=4,node=2")
    assert mesh.axis_names == ("node", "expert")
    # host-major layout: the outer axis takes the slow-varying (process-major) device ids
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids, np.sort(ids.ravel()).reshape(2, 4))


@pytest.mark.parametrize(
    "names, shape, batch, experts, tokens",
    [
        (("node", "expert"), (2, 4), ("node", "expert"), ("node", "expert"), ("node", "expert")),
        (
            ("data", "node", "expert"),
            (2, 2, 2),
            ("data", "node", "expert"),
            ("node", "expert"),
            ("data", "node", "expert"),
        ),
        (
            ("node", "expert", "context"),
            (2, 2, 2),
            ("node", "expert"),
            ("node", "expert"),
            ("node", "expert", "context"),
        ),
        (
            ("node", "expert", "expert_tensor"),
            (2, 2, 2),
            ("node", "expert"),
            ("node", "expert"),
            ("node", "expert"),
        ),
        (("data", "expert"), (2, 4), ("data", "expert"), ("expert",), ("data", "expert")),
    ],
)
def test_rules_for_node(names, shape, batch, experts, tokens):
    rules = rules_for(jax.make_mesh(shape, names))
    assert rules.axes("batch") == batch and rules.axes("tokens") == tokens
    assert rules.axes("experts") == experts
    assert rules.expert_axis == (experts if len(experts) > 1 else experts[0])


def test_model_params_shard_experts_over_node_and_expert():
    tc = TrainConfig(mesh="node=2,expert=4")
    mesh = tm.make_mesh(tc.mesh)
    _, state, _, rules = train_step.abstract_state(load_config("configs/tiny.yaml"), tc, mesh)
    assert rules.expert_axis == ("node", "expert")
    w = state.params["layers"][0]["mlp"]["w_gate"]
    assert w.sharding.spec[0] == ("node", "expert")
    emb = state.params["embed_tokens"]
    assert all(e is None for e in emb.sharding.spec)


def test_attention_cost_model_splits_the_batch_over_node():
    cfg = load_config("configs/tiny.yaml")
    sh = remat.AttentionShape.of(cfg, 16, 64, {"node": 2, "expert": 4}, "float32")
    assert sh.b == 2


def test_ring_option_is_validated():
    assert ModelConfig().moe.options.ring == "auto"
    for r in ("flat", "hierarchical", "auto"):
        assert ModelConfig.from_dict({"ring": r}).moe.options.ring == r
    with pytest.raises(
        ValueError,
        match=r"ring='nested': expected one of \('auto', 'flat', "
        r"'hierarchical'\)",
    ):
        ModelConfig.from_dict({"ring": "nested"})
    with pytest.raises(ValueError, match=r"tiny\.yaml \(override ring='ring'\): ring='ring'"):
        load_config("tiny", ring="ring")


def test_hierarchical_ring_needs_two_expert_axes(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"mesh='expert=8': ring='hierarchical' needs the "
        r"experts over two axes.*\('expert',\)",
    ):
        cli.parse(
            [
                "--config",
                "configs/tiny.yaml",
                "--steps",
                "1",
                "--out",
                str(tmp_path),
                "mesh=expert=8",
                "ring=hierarchical",
            ]
        )
    assert tm.expert_axes({"data": 2, "context": 4}) == ("data", "context")  # folded: two
    assert tm.expert_axes({"node": 2, "expert": 4}) == ("node", "expert")


def test_auto_ring_is_flat_on_one_process():
    """All emulated CPU devices are process 0: `node` does not reach another host."""
    mesh = tm.make_mesh("node=2,expert=4")
    assert topology.spans(mesh, ("node", "expert")) == (True, False)
    assert not topology.choose_ring("auto", mesh, ("node", "expert"))


# Two real processes (auto picks the hierarchical ring there, and its losses equal one
# process's flat ring): tests/test_multihost.py::test_two_processes_match_one.
