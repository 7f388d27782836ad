"""Hugging Face checkpoints (tests/fixtures/hf/*/, written by make_fixtures.py with transformers)
loaded into the Flax model on 8 emulated CPU devices: logits, router logits and losses against
the torch reference, with the ring (both routings) and all-to-all; export round trip."""

import functools
import glob
import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from relaymoe_jax.models import from_pretrained, save_pretrained
from relaymoe_jax.models.config import KEYS
from relaymoe_jax.models.hf_config import config_from_hf

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


# --------------------------------------------------------------------------- missing config keys

DEFAULTS = os.path.join(HERE, "fixtures", "hf", "transformers_defaults.json")
# a key removed with others where transformers' default alone would not fit the fixture's sizes
# (16 KV heads for 4 query heads): removed with num_attention_heads, both take the defaults
TOGETHER = {"num_key_value_heads": ("num_attention_heads",)}
ALIASES = {"num_experts": ("num_local_experts",), "rope_theta": ("rope_parameters",)}


def transformers_defaults() -> dict:
    """{model_type: {key: default}} of transformers' Qwen3MoeConfig() / Qwen2MoeConfig(), as
    recorded by fixtures/hf/make_transformers_defaults.py; where transformers is installed, the
    installed classes must hold the same values."""
    with open(DEFAULTS) as f:
        recorded = json.load(f)
    try:
        import transformers
    except ImportError:
        return recorded
    spec = importlib.util.spec_from_file_location(
        "make_transformers_defaults",
        os.path.join(HERE, "fixtures", "hf", "make_transformers_defaults.py"),
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for arch, cls in (
        ("qwen3_moe", transformers.Qwen3MoeConfig),
        ("qwen2_moe", transformers.Qwen2MoeConfig),
    ):
        live = mod.defaults(cls)
        assert {k: live.get(k) for k in KEYS if k in recorded[arch]} == {
            k: v for k, v in recorded[arch].items() if k in KEYS
        }, arch
    return recorded


@pytest.mark.parametrize("name", ["qwen3_moe_topk_norm", "qwen2_moe_shared"])
def test_missing_keys_take_transformers_defaults(name):
    """A config.json without a key (num_experts_per_tok, norm_topk_prob, rope_theta, ...) gives
    the value transformers' config class gives it, one key removed at a time from a fixture's
    config.json, and every key removed at once (before: ModelConfig's defaults, e.g. top-k 2
    and norm_topk_prob=True where transformers builds Qwen3-MoE with 8 and False)."""
    with open(os.path.join(HERE, "fixtures", "hf", name, "config.json")) as f:
        full = json.load(f)
    theirs = transformers_defaults()[full["model_type"]]
    keys = [k for k in KEYS if k in theirs]
    assert {"num_experts_per_tok", "norm_topk_prob", "rope_theta", "num_experts"} <= set(keys)
    for key in keys:
        drop = {key, *ALIASES.get(key, ()), *TOGETHER.get(key, ())}
        cfg = config_from_hf({k: v for k, v in full.items() if k not in drop}).as_dict()
        for k in drop & set(keys):
            ours = list(cfg[k]) if isinstance(cfg[k], tuple) else cfg[k]
            assert ours == theirs[k], (key, k, ours, theirs[k])
    bare = config_from_hf({"architectures": full["architectures"]}).as_dict()
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in bare.items() if k in keys} == {
        k: theirs[k] for k in keys
    }


def _damage(path, case):
    single = path / "model.safetensors"
    if case == "truncated":
        single.write_bytes(single.read_bytes()[:-1024])
    elif case == "padded":
        single.write_bytes(single.read_bytes() + bytes(8))
    elif case == "not_safetensors":
        single.write_bytes((16).to_bytes(8, "little") + b"<html>not found!")
    elif case == "int_router":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(single)
        tensors["model.layers.0.mlp.gate.weight"] = np.ones((8, 64), np.int32)
        save_file(tensors, single)
    elif case == "index":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        wmap = index["weight_map"]
        wmap["model.norm.weight"] = next(f for f in wmap.values() if f != wmap["model.norm.weight"])
        (path / "model.safetensors.index.json").write_text(json.dumps(index))


DAMAGED = [
    ("truncated", r"model.safetensors: truncated: its header lists \d+ bytes of tensor data, "),
    ("padded", r"model.safetensors: damaged: its header lists \d+ bytes of tensor data, the "),
    ("not_safetensors", r"model.safetensors: not a safetensors file \(its header: "),
    (
        "int_router",
        r"model.safetensors: tensor 'model.layers.0.mlp.gate.weight' is stored as I32 \(int32\), "
        r"expected a floating-point weight \(F32, BF16, F16, F64\)$",
    ),
    ("index", r"model-0000\d-of-00006.safetensors: does not hold \['model.norm.weight'\], which "),
]


@pytest.mark.parametrize("case, match", DAMAGED, ids=[c for c, _ in DAMAGED])
def test_damaged_weight_files_are_one_line(tmp_path, case, match):
    """`from_pretrained` checks every weights file's header before reading a tensor: a file cut
    short or padded (before: safetensors' `SafetensorError: ... incomplete metadata, file not
    fully covered`, naming no file), a header that is not safetensors', a tensor stored as an
    integer (before: cast to float and loaded) and an index that puts a tensor in a file that
    does not hold it are one ValueError line naming the file (and the tensor)."""
    name = "qwen3_moe_dense_layers_sharded" if case == "index" else "qwen3_moe_topk_norm"
    path = tmp_path / name
    shutil.copytree(os.path.join(HERE, "fixtures", "hf", name), path)
    _damage(path, case)
    with pytest.raises(ValueError, match=f"^{path}/" + match) as e:
        from_pretrained(str(path), mesh=mesh())
    assert "\n" not in str(e.value)
