"""The trainer's mesh option (`train.step.mesh`) and FSDP storage. (bf16 compute against float32,
with float32 master weights: tests/test_offload.py, whose bf16 run and float32 baseline are
trained anyway.)

References: the loss of step 1 against float64 numpy cross-entropy of the initial model's logits,
and every other mesh against the EP=8 mesh (the model itself is checked against Hugging Face in
test_hf_import.py).

Every run trains the tiny config cut to one decoder layer for 2 steps: one MoE layer routes every
(token, expert) pair of the step (a dropped, duplicated or misweighted pair moves the loss of
step 1 and, through the update, step 2), and each run's cost is mostly its compile, which a
second layer makes longer. One run per distinct code path: meshes that took the same path share
a run (each test's docstring says which).
"""

import json

import jax
import numpy as np
import pytest
from corpora import word_corpus
from flax import nnx

from relaymoe_jax.models.config_files import load_config
from train import cli
from train.data import make_source
from train.settings import TrainConfig
from train.step import mesh as tm
from train.step import train_step

ONE_LAYER = "num_hidden_layers=1"
ARGS = ["--config", "configs/tiny.yaml", "seq_len=32", "batch_size=8", ONE_LAYER]
ARGS += ["--quiet", "--steps", "2"]
KEYS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")


def _run(tmp_path, *extra):
    out = tmp_path / "_".join(e.replace("=", "").replace(",", "-") for e in extra)[:120]
    assert cli.main([*ARGS, "--out", str(out), *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _numpy_first_loss(mesh_spec):
    """lm_loss of step 1, from the initial model's logits in float64 numpy."""
    tc = TrainConfig(batch_size=8, seq_len=32, mesh=mesh_spec)
    cfg = load_config("configs/tiny.yaml", num_hidden_layers=1)
    mesh = tm.make_mesh(tc.mesh)
    graphdef, state, _, _ = train_step.init_state(cfg, tc, mesh)
    first = next(
        make_source(None, synthetic=False, seq_len=32, batch_size=8, seed=0, vocab_size=256)
    )
    assert first.segment_ids is None  # the shipped text is one document: no boundary in a row
    ids = first.tokens
    model = nnx.merge(graphdef, jax.tree.map(train_step.gather_stored, state.params), state.rest)
    logits = np.asarray(jax.jit(lambda x: model(x)[0])(jax.numpy.asarray(ids)), np.float64)
    logits = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, ids[:, 1:, None], -1).mean()


def _assert_match(recs, ref, rtol, what):
    assert [r["step"] for r in recs] == [r["step"] for r in ref] == [1, 2]
    for a, b in zip(recs, ref, strict=True):
        for k in KEYS:
            np.testing.assert_allclose(
                a[k], b[k], rtol=rtol, err_msg=f"{what} step {a['step']} {k}"
            )


@pytest.fixture(scope="module")
def ep8(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ep8"), "mesh=expert=8")


def test_first_loss_matches_numpy(ep8):
    np.testing.assert_allclose(ep8[0]["lm_loss"], _numpy_first_loss("expert=8"), rtol=1e-6)


@pytest.mark.parametrize(
    "spec",
    [
        "mesh=context=8",
        "mesh=fsdp=2,expert=2,expert_tensor=2",
    ],
)
def test_meshes_match_ep8(tmp_path, ep8, spec):
    """context=8: the sequence sharded over `context` with no segment ids (the shipped text's
    rows) and the train state stored over context (parallel folding); also covers
    what the case mesh=data=2,context=4 did (the context-sharded step on the shipped text; the
    data axis beside context: test_packed_documents_under_context_parallelism_match_ep8).
    fsdp=2,expert=2,expert_tensor=2: FSDP storage (gathered in the step) and expert tensor
    parallelism (each expert's FFN split over `expert_tensor`) in one step; it covers what the
    cases mesh=fsdp=2,expert=4 and mesh=expert=4,expert_tensor=2 did. The case
    mesh=data=2,context=4 attention_impl=chunked attention_block_k=12 (a padded last block under
    context parallelism) is covered by the chunked case of the packed-documents test."""
    _assert_match(_run(tmp_path, *spec.split()), ep8, 2e-6, spec)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A prepared corpus of 300 short documents: rows of 32 hold several (segment ids)."""
    return word_corpus(tmp_path_factory.mktemp("docs"), 300, max_words=9)


@pytest.fixture(scope="module")
def ep8_documents(tmp_path_factory, documents):
    """The EP=8 mesh on the documents, with the XLA attention: both impls' reference."""
    return _run(tmp_path_factory.mktemp("ep8docs"), "mesh=expert=8", "--data", str(documents))


@pytest.mark.parametrize("attention", ["xla", "chunked"])
def test_packed_documents_under_context_parallelism_match_ep8(
    tmp_path, documents, ep8_documents, attention
):
    """Packed rows (segment ids, positions) with the sequence sharded over `context` (and the
    batch over `data`): the keys' segment ids are gathered like the keys (they failed to shard
    before), and the losses equal the EP=8 mesh's on the same batches. Both impls against the
    EP=8 run with the XLA attention (the chunked one: another summation order in the softmax,
    so rtol 1e-5; it was an EP=8 chunked run before). chunked with attention_block_k=12: 8 keys
    per device, so the last block is padded (also covers what the case
    mesh=data=2,context=4 attention_impl=chunked attention_block_k=12 of test_meshes_match_ep8
    did, with segment ids here)."""
    extra = ["--data", str(documents), f"attention_impl={attention}"]
    extra += ["attention_block_k=12"] if attention == "chunked" else []
    cp = _run(tmp_path, "mesh=data=2,context=4", *extra)
    _assert_match(cp, ep8_documents, 1e-5, f"data=2,context=4 {attention}")


def test_fsdp_stores_params_and_moments_sharded():
    """On the fsdp mesh of test_meshes_match_ep8 (and its one-layer model, whose parameters'
    initialisation it has run on that mesh already)."""
    tc = TrainConfig(mesh="fsdp=2,expert=2,expert_tensor=2")
    mesh = tm.make_mesh(tc.mesh)
    _, state, _, _ = train_step.init_state(
        load_config("configs/tiny.yaml", num_hidden_layers=1), tc, mesh
    )
    params = jax.tree.leaves(state.params)
    mu = jax.tree.leaves(state.opt_state[1][0].mu)
    big = [p for p in params if p.ndim >= 2]
    assert big and all("fsdp" in str(p.sharding.spec) for p in big)
    assert [str(m.sharding.spec) for m in mu] == [str(p.sharding.spec) for p in params]
    # each device stores half of an fsdp-sharded matrix that has no other sharding
    emb = state.params["embed_tokens"]
    assert emb.addressable_shards[0].data.size * 2 == emb.size


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("expert=4", "has 4 devices but 8"),
        ("expert=3,data=-1", "do not divide by 3"),
        ("data=-1,expert=-1", "at most one axis may be -1"),
        ("tensor=8", "axis=size with axis one of"),
        ("expert=two", "must be an integer"),
        ("expert=8,expert=8", "given twice"),
        ("expert=0,data=8", "must be >= 1 or -1"),
    ],
)
def test_bad_mesh(spec, msg):
    with pytest.raises(ValueError, match=msg):
        tm.parse_mesh(spec, 8)


@pytest.mark.parametrize(
    "over, msg",
    [
        (["mesh=expert=16"], "16 devices but 8"),
        (["mesh=expert=4,expert_tensor=2", "moe_intermediate_size=63"], "does not split over"),
        (["mesh=data=2,context=4", "seq_len=30"], "seq_len=30 does not split over context=4"),
        (  # the compiled kernel on CPU (jax's "Only interpret mode is supported" before)
            ["attention_impl=pallas", "head_dim=64", "compute_dtype=bfloat16"],
            r"attention_impl='pallas' compiles a Mosaic GPU kernel, but this run compiles for "
            r"'cpu': use attention_impl='pallas-interpret'",
        ),
        (  # the probe's case: silently replicated over fsdp before
            ["mesh=fsdp=2,expert=4", "batch_size=3", "grad_accum=2"],
            r"batch_size=3 does not split over fsdp=2 .* use a multiple of 2$",
        ),
        (["compute_dtype=float16"], "compute_dtype='float16'"),
    ],
)
def test_bad_mesh_fails_before_compiling(tmp_path, over, msg):
    with pytest.raises(ValueError, match=msg):
        cli.parse(["--config", "configs/tiny.yaml", "--steps", "1", "--out", str(tmp_path), *over])


@pytest.mark.parametrize("spec", ["fsdp=2,context=4", "fsdp=8"])
def test_fsdp_gather_keeps_folded_experts_sharded(spec):
    """Parallel folding with an fsdp axis: the experts are sharded over every axis, fsdp
    included. The step's gather restores each parameter's model sharding (its out_sharding
    metadata): fsdp comes off the parameters it was added to for storage and stays on the
    experts (stripping it from them gathered every expert weight onto every device)."""
    tc = TrainConfig(mesh=spec)
    mesh = tm.make_mesh(tc.mesh)
    _, state, _, _ = train_step.abstract_state(load_config("configs/tiny.yaml"), tc, mesh)
    params = state.params
    gathered = jax.jit(
        lambda p: jax.tree.map(train_step.gather_stored, p, is_leaf=train_step.is_variable)
    )
    with jax.set_mesh(mesh):
        out = gathered.trace(params).out_info
    got = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    variables = jax.tree.leaves(params, is_leaf=train_step.is_variable)
    assert len(got) == len(variables)
    experts = 0
    for v, o in zip(variables, got):
        model_spec = tuple(v.get_metadata()["out_sharding"])
        assert tuple(o.sharding.spec) == model_spec, (v.get_metadata()["logical_axes"], o)
        if "experts" in v.get_metadata()["logical_axes"]:
            experts += 1
            assert "fsdp" in str(model_spec)
    assert experts == 3 * load_config("configs/tiny.yaml").num_hidden_layers
    stored = [v.get_value().sharding.spec for v in variables]
    assert any(
        "fsdp" in str(s)
        for s, v in zip(stored, variables)
        if "experts" not in v.get_metadata()["logical_axes"]
    )  # storage added fsdp
