"""One rule for "used or refused" (issue 35): every op option and every `MoEConfig` field knows
what uses it (`op.options.USED_BY`, `models.moe_config.USED_WHEN`), and the op, the options
record, the layer, the model's config and the trainer's memory table apply it. Everything here is
refused before tracing, or compiles nothing (the memory table's compiles are stubbed)."""

import inspect

import jax
import numpy as np
import pytest
from flax import nnx

from moe_cases import make_inputs, mesh, uniform_ids
from relaymoe_jax import MoEOptions, moe_ffn, moe_ffn_local
from relaymoe_jax.models import ModelConfig, MoEConfig, MoELayer, routers
from relaymoe_jax.models.config_files import load_config
from relaymoe_jax.op.options import USED_BY

# which dispatcher uses which option, written from the dispatchers' code (op/global_call.py:
# the reference branch returns before `resolve`, which alone reads routing, ring, chunk_size,
# capacity_factor and gmm_impl; `dispatch/alltoall.py` reads no chunk; expert_fp8 is read by the
# reference branch and by `dispatch/local.py`, which every other dispatcher runs through)
EXPECTED_USERS = {
    "dispatcher": {"ring", "alltoall", "reference"},
    "routing": {"ring"},
    "ring": {"ring"},
    "capacity_factor": {"alltoall"},
    "chunk_size": {"ring"},
    "gmm_impl": {"ring", "alltoall"},
    "expert_fp8": {"ring", "alltoall", "reference"},
}
SET = {  # a value away from each option's default
    "routing": "token",
    "ring": "flat",
    "capacity_factor": 0.25,
    "chunk_size": 3,
    "gmm_impl": "xla",
    "expert_fp8": True,
}
# (dispatcher, option) pairs the dispatcher ignores
IGNORED = [
    (d, name)
    for name, users in EXPECTED_USERS.items()
    if name != "dispatcher"
    for d in ("ring", "alltoall", "reference")
    if d not in users
]


def test_the_table_is_what_the_dispatchers_read():
    assert {k: set(v) for k, v in USED_BY.items()} == EXPECTED_USERS


@pytest.fixture(scope="module")
def inp():
    return make_inputs(uniform_ids(np.random.default_rng(0), 64, 16, 4), 16)


def _args(inp):
    return [inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")]


@pytest.mark.parametrize("dispatcher, name", IGNORED)
def test_an_option_the_dispatcher_ignores_is_refused_everywhere(inp, dispatcher, name):
    """chunk_size with the all-to-all or the reference, gmm_impl with the reference, ...: the
    record's check, `moe_ffn` and `moe_ffn_local` refuse it (they passed, bitwise the call
    without it); `applicable()` strips exactly those."""
    said = rf"^{name}={SET[name]!r} applies to dispatcher=.* only \(got dispatcher='{dispatcher}'\)"
    opts = MoEOptions(dispatcher=dispatcher, **{name: SET[name]})
    with pytest.raises(ValueError, match=said):
        opts.check_combination()
    with pytest.raises(ValueError, match=said):
        moe_ffn(*_args(inp), mesh=mesh("ep8"), dispatcher=dispatcher, **{name: SET[name]})
    with pytest.raises(ValueError, match=said):
        moe_ffn_local(*_args(inp), expert_axis="expert", options=opts)
    assert opts.applicable() == MoEOptions(dispatcher=dispatcher)


def test_applicable_keeps_what_each_dispatcher_uses():
    every = MoEOptions(**SET)
    for d in ("ring", "alltoall", "reference"):
        kept = every.replace(dispatcher=d).applicable().as_dict()
        for name, value in SET.items():
            assert (kept[name] == value) == (d in EXPECTED_USERS[name]), (d, name)


@pytest.mark.parametrize(
    "keyword",
    [
        {"dispatcher": "ring"},  # each at its default value: compared with the default, it
        {"gmm_impl": "auto"},  # passed, and the all-to-all ran at capacity 0.25
        {"capacity_factor": None},
        {"chunk_size": None},
    ],
)
def test_a_keyword_passed_with_options_is_refused_whatever_its_value(inp, keyword):
    opts = MoEOptions(dispatcher="alltoall", capacity_factor=0.25)
    (name,) = keyword
    said = rf"^options= is given, and so are \['{name}'\] \({name}={keyword[name]!r}\)"
    with pytest.raises(ValueError, match=said):
        moe_ffn(*_args(inp), mesh=mesh("ep8"), options=opts, **keyword)
    with pytest.raises(ValueError, match=said):
        moe_ffn_local(*_args(inp), expert_axis="expert", options=opts, **keyword)


def test_the_keywords_defaults_say_not_given():
    """The signature says what a default means: not given (the record's default)."""
    for fn in (moe_ffn, moe_ffn_local):
        params = inspect.signature(fn).parameters
        for name in EXPECTED_USERS:
            assert repr(params[name].default) == "UNSET", (fn.__name__, name)


# --------------------------------------------------------------------------- the MoE block


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid_group"])
def test_a_router_field_is_used_exactly_by_the_routers_that_take_it(router):
    """`MoEConfig(router="topk_softmax", norm_topk_prob=False)` was accepted and changed
    nothing: topk_softmax takes no norm_topk_prob."""
    takes = set(inspect.signature(getattr(routers, router)).parameters)
    sizes = dict(num_experts=8, num_experts_per_tok=2)
    group = dict(n_group=2, topk_group=2) if router == "sigmoid_group" else {}
    for name, value in (
        ("norm_topk_prob", False),
        ("routed_scaling_factor", 2.5),
        ("n_group", 2),
        ("topk_group", 2),
    ):
        kw = {**sizes, **group, "router": router, name: value}
        if name in takes:
            assert getattr(MoEConfig(**kw), name) == value
        else:
            with pytest.raises(ValueError, match=rf"^{name}={value!r} applies to router="):
                MoEConfig(**kw)


def test_norm_topk_prob_with_topk_softmax_is_refused_in_the_model_config():
    said = (
        "norm_topk_prob=False applies to router='softmax_topk' or router='sigmoid_group' only "
        "(got router='topk_softmax'): it would be ignored; leave it at True"
    )
    with pytest.raises(ValueError) as e:
        MoEConfig(router="topk_softmax", norm_topk_prob=False)
    assert str(e.value) == said
    with pytest.raises(ValueError, match="norm_topk_prob=False applies to router="):
        ModelConfig.from_dict({"router": "topk_softmax", "norm_topk_prob": False})
    with pytest.raises(ValueError, match="norm_topk_prob=False applies to router="):
        load_config("configs/tiny.yaml", router="topk_softmax", norm_topk_prob=False)


def test_expert_bias_rate_without_the_expert_bias_is_refused():
    with pytest.raises(
        ValueError, match=r"^expert_bias_rate=0.01 applies to expert_bias=True only"
    ):
        MoEConfig(expert_bias_rate=0.01)
    assert MoEConfig(expert_bias=True, expert_bias_rate=0.01).expert_bias_rate == 0.01


@pytest.mark.parametrize(
    "options, said",
    [
        (MoEOptions(dispatcher="alltoall", chunk_size=8), "chunk_size=8 applies to "),
        (MoEOptions(dispatcher="reference", gmm_impl="xla"), "gmm_impl='xla' applies to "),
        (MoEOptions(capacity_factor=0.01), "capacity_factor=0.01 applies to "),
    ],
)
def test_the_layer_refuses_what_its_dispatcher_ignores(options, said):
    """`MoELayer` runs one dispatcher: what the op refuses, it refuses. A config (YAML, the
    model's) may hold several dispatchers' options; the Qwen model runs `applicable()`."""
    cfg = MoEConfig(num_experts=8, options=options)
    with pytest.raises(ValueError, match="^" + said):
        MoELayer(cfg, hidden_size=16, mesh=jax.make_mesh((8,), ("expert",)), rngs=nnx.Rngs(0))
    model = ModelConfig(moe=cfg)  # the model's config holds it
    assert model.moe.options.applicable() == MoEOptions(dispatcher=options.dispatcher)


# --------------------------------------------------------------------------- the memory table


class _Compiled:
    def __init__(self, name):
        self.name = name

    def memory_analysis(self):
        return self.name


ROWS = ["ring", "alltoall (dropless)", "alltoall (capacity 1.0)"]


@pytest.mark.parametrize(
    "over, labels",
    [
        ({}, ["ring*", *ROWS[1:]]),
        ({"dispatcher": "alltoall", "capacity_factor": 0.5}, [*ROWS, "alltoall (capacity 0.5)*"]),
        ({"dispatcher": "alltoall", "capacity_factor": 1}, [*ROWS[:2], ROWS[2] + "*"]),
        ({"dispatcher": "reference"}, [*ROWS, "reference*"]),
        ({"expert_fp8": True}, [*ROWS, "ring, FP8 experts*"]),
        ({"dispatcher": "alltoall", "expert_fp8": True}, [*ROWS, ROWS[1] + ", FP8 experts*"]),
    ],
)
def test_the_memory_table_has_the_trained_runs_row(monkeypatch, over, labels):
    """An all-to-all run at capacity 0.5 (or the reference, or a run with FP8 experts) had no
    row of its own; * marks the trained step's row, the others are compiled (stubbed here) from
    the rows' configs, in 16 bits (each row's expert_fp8 its own)."""
    from train.planner import memory
    from train.settings import TrainConfig
    from train.step import train_step

    compiled = []

    def compile_abstract(cfg, tc, mesh, packed=False):
        compiled.append(cfg.moe.options.applicable())
        return _Compiled("compiled")

    monkeypatch.setattr(train_step, "compile_abstract", compile_abstract)
    cfg = load_config("configs/tiny.yaml", **over)
    rows = memory.memory_rows(cfg, TrainConfig(), None, _Compiled("trained"), log=lambda m: None)
    assert [lbl + ("*" if how == "trained" else "") for lbl, _, how in rows] == labels
    assert all((m == "trained") == (how == "trained") for _, m, how in rows)
    assert cfg.moe.options.applicable() not in compiled and len(compiled) == len(rows) - 1


@pytest.mark.parametrize(
    "kw, said",
    [
        (
            dict(arch="qwen2_moe", attention_bias=True),
            "attention_bias=True applies to arch='qwen3_moe' only (got arch='qwen2_moe'): it "
            "would be ignored; leave it at False",
        ),
        (dict(qkv_bias=False), "qkv_bias=False applies to arch='qwen2_moe' only"),
    ],
)
def test_an_attention_bias_the_architecture_ignores_is_refused(kw, said):
    """qwen2_moe's q/k/v biases are `qkv_bias`, qwen3_moe's `attention_bias` (`decoder.py`)."""
    with pytest.raises(ValueError) as e:
        ModelConfig(**kw)
    assert str(e.value).startswith(said), str(e.value)
    other = "qwen3_moe" if kw.get("arch") == "qwen2_moe" else "qwen2_moe"
    assert ModelConfig(**{**kw, "arch": other}).arch == other


def test_a_key_block_without_the_chunked_attention_is_refused():
    """`attention_block_k` sizes the chunked attention's key blocks; "xla" attends in one
    [S, S] block, so a block size with it would be ignored."""
    with pytest.raises(ValueError) as e:
        load_config("configs/tiny.yaml", attention_block_k=64)
    said = "attention_block_k=64 applies to attention_impl='chunked' or attention_impl='auto' "
    assert said + "only (got attention_impl='xla')" in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:  # the Pallas kernel has its own blocks
        load_config("configs/tiny.yaml", attention_impl="pallas", head_dim=64, attention_block_k=64)
    assert said + "only (got attention_impl='pallas')" in str(e.value), str(e.value)
    for impl in ("chunked", "auto"):  # "auto" is "chunked" off GPUs
        cfg = load_config("configs/tiny.yaml", attention_impl=impl, attention_block_k=64)
        assert cfg.attention_block_k == 64


@pytest.mark.parametrize("impl", ["pallas", "pallas-interpret"])
def test_a_head_dim_the_attention_kernel_cannot_take_is_refused(impl):
    """The Pallas attention kernel takes head_dim 64 or 128: any other is refused when the
    config is made, naming head_dim; "auto" falls back to the chunked path instead."""
    with pytest.raises(ValueError) as e:
        load_config("configs/tiny.yaml", attention_impl=impl)
    said = f"head_dim=16: expected one of (64, 128) with attention_impl={impl!r}"
    assert said in str(e.value), str(e.value)
    assert load_config("configs/tiny.yaml", attention_impl=impl, head_dim=64).head_size == 64
    assert load_config("configs/tiny.yaml", attention_impl="auto").head_size == 16
