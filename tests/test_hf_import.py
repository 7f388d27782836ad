"""Hugging Face checkpoints (tests/fixtures/hf/*/, written by make_fixtures.py with transformers)
loaded into the Flax model on 8 emulated CPU devices: logits, router logits and losses against
the torch reference, with the ring (both routings) and all-to-all; export round trip."""

import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from relaymoe_jax.models import from_pretrained, save_pretrained

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(
    os.path.dirname(p) for p in glob.glob(os.path.join(HERE, "fixtures", "hf", "*", "config.json"))
)
NAMES = [os.path.basename(p) for p in FIXTURES]
TOL = 1e-4

pytestmark = pytest.mark.skipif(
    not FIXTURES,
    reason="no Hugging Face fixtures under "
    "tests/fixtures/hf/ (run tests/fixtures/hf/make_fixtures.py)",
)


@functools.cache
def mesh():
    return jax.make_mesh((8,), ("expert",))


@functools.cache
def reference(name):
    ref = np.load(os.path.join(HERE, "fixtures", "hf", name, "reference.npz"))
    return {k: ref[k] for k in ref.files}


@nnx.jit
def forward(model, ids):
    return model(ids, return_router_logits=True)


def ce_loss(logits, ids):
    """HF's causal-LM loss with labels = input_ids: mean over the shifted targets."""
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64)[:, :-1], axis=-1)
    return -np.mean(np.take_along_axis(np.asarray(logp), np.asarray(ids)[:, 1:, None], -1))


def read_all(path):
    """Every tensor of a checkpoint directory, {name: array}."""
    out = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(f, framework="numpy") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


DISPATCHERS = [("ring", "expert"), ("ring", "token"), ("alltoall", "auto")]
# Every dispatcher on the first checkpoint; each other checkpoint with one of them, in turn (so
# each architecture, qwen2_moe and qwen3_moe, meets every dispatcher).
LOGIT_CASES = [(d, r, NAMES[0]) for d, r in DISPATCHERS if NAMES] + [
    (*DISPATCHERS[i % len(DISPATCHERS)], name) for i, name in enumerate(NAMES[1:])
]


@pytest.mark.parametrize(
    "dispatcher,routing,name", LOGIT_CASES, ids=["-".join(c) for c in LOGIT_CASES]
)
def test_logits_match_transformers(name, dispatcher, routing):
    """Logits, router logits and losses of the loaded checkpoint against transformers'.

    Each checkpoint meets one dispatcher, the first all three (LOGIT_CASES), instead of every
    checkpoint all three: what differs between the checkpoints (shared expert, norm_topk_prob,
    dense layers, tied embeddings, sharded files) is the import and the code around the MoE op,
    the same whichever dispatcher runs the op; the dispatchers themselves are compared with
    each other on the same weights in tests/test_models.py::test_dispatchers_agree and with
    transformers' MoE block in tests/test_hf_moe.py::test_moe_layer_matches_transformers."""
    ref = reference(name)
    model = from_pretrained(
        os.path.join(HERE, "fixtures", "hf", name),
        mesh=mesh(),
        dispatcher=dispatcher,
        routing=routing,
        dtype=jnp.float32,
    )
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    logits, aux = forward(model, ids)
    assert logits.shape == ref["logits"].shape and logits.dtype == jnp.float32
    err = float(np.max(np.abs(np.asarray(logits) - ref["logits"])))
    print(f"{name} {dispatcher}/{routing}: logits max|diff| {err:.2e}")
    assert err <= TOL, f"logits max|diff| {err:.2e}"
    moe_layers = [int(i) for i in ref["moe_layers"]]
    assert list(model.moe_layers) == moe_layers
    for n, i in enumerate(moe_layers):
        ours = np.asarray(aux.router_logits[n]).reshape(-1, model.config.moe.num_experts)
        np.testing.assert_allclose(ours, ref[f"router_logits_{i}"], atol=TOL, rtol=0)
    np.testing.assert_allclose(aux.aux_loss, ref["aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(ce_loss(logits, ids), ref["lm_loss"], atol=TOL)
    coef = float(ref["router_aux_loss_coef"])
    assert model.config.router_aux_loss_coef == pytest.approx(coef)
    np.testing.assert_allclose(
        ce_loss(logits, ids) + coef * float(aux.aux_loss), ref["loss"], atol=TOL
    )


def test_contract_eager_call():
    """The documented contract: from_pretrained(...), then model(input_ids), logits first."""
    name = NAMES[0]
    model = from_pretrained(
        os.path.join(HERE, "fixtures", "hf", name),
        mesh=mesh(),
        dispatcher="ring",
        dtype=jnp.float32,
    )
    ref = reference(name)
    out = model(jnp.asarray(ref["input_ids"]))
    assert isinstance(out, tuple)
    logits = out[0]
    assert logits.shape == ref["logits"].shape
    assert float(np.max(np.abs(np.asarray(logits) - ref["logits"]))) <= TOL
    # the experts are sharded over the expert axis, one per device
    w = model.layers[0].mlp.w_gate.get_value()
    assert w.sharding.spec[0] == "expert" and w.addressable_shards[0].data.shape[0] == 1


@pytest.mark.parametrize("name", NAMES)
def test_export_round_trip(name, tmp_path):
    src = os.path.join(HERE, "fixtures", "hf", name)
    ref = reference(name)
    model = from_pretrained(src, mesh=mesh(), dispatcher="ring", dtype=jnp.float32)
    sharded = os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    save_pretrained(model, str(tmp_path), max_shard_size="200KB" if sharded else None)
    if sharded:
        index = json.load(open(tmp_path / "model.safetensors.index.json"))
        assert len(set(index["weight_map"].values())) > 1
    theirs, ours = read_all(src), read_all(str(tmp_path))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype, k
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    reloaded = from_pretrained(str(tmp_path), mesh=mesh(), dispatcher="ring", dtype=jnp.float32)
    assert reloaded.config == model.config
    ids = jnp.asarray(ref["input_ids"])
    np.testing.assert_array_equal(forward(reloaded, ids)[0], forward(model, ids)[0])


def test_fused_expert_layout_round_trip(tmp_path):
    """The fused 3-D expert layout (transformers' in-memory one) loads to the same model."""
    name = NAMES[0]
    model = from_pretrained(
        os.path.join(HERE, "fixtures", "hf", name), mesh=mesh(), dispatcher="ring"
    )
    save_pretrained(model, str(tmp_path), expert_layout="fused")
    names = read_all(str(tmp_path)).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in k for k in names)
    ids = jnp.asarray(reference(name)["input_ids"])
    reloaded = from_pretrained(str(tmp_path), mesh=mesh(), dispatcher="ring")
    np.testing.assert_array_equal(forward(reloaded, ids)[0], forward(model, ids)[0])


def test_folded_auto_mesh():
    """A fixture on an Auto-axes (data=2, context=4) mesh: attention sharded over batch and
    sequence, the MoE ring over ("data", "context")."""
    name = next((n for n in NAMES if "sharded" in n), NAMES[0])
    auto = jax.sharding.AxisType.Auto
    m = jax.make_mesh((2, 4), ("data", "context"), axis_types=(auto, auto))
    model = from_pretrained(os.path.join(HERE, "fixtures", "hf", name), mesh=m, dispatcher="ring")
    assert model.rules.expert_axis == ("data", "context")
    ref = reference(name)
    logits, aux = forward(model, jnp.asarray(ref["input_ids"]))
    assert float(np.max(np.abs(np.asarray(logits) - ref["logits"]))) <= TOL
    np.testing.assert_allclose(aux.aux_loss, ref["aux_loss"], rtol=1e-5)
