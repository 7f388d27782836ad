"""Bad input to moe_ffn: a clear ValueError naming the argument, raised before tracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_cases import make_inputs, mesh, uniform_ids
from relaymoe_jax import moe_ffn, routing_volumes
from relaymoe_jax.dispatch.experts import check_experts_divide


@pytest.fixture
def inp():
    return make_inputs(uniform_ids(np.random.default_rng(0), 64, 16, 4), 16)


def call(inp, **kw):
    args = {n: inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")}
    for n in list(kw):
        if n in args:
            args[n] = kw.pop(n)
    kw.setdefault("mesh", mesh("ep8"))
    return moe_ffn(args["x"], args["ids"], args["wts"], args["wg"], args["wu"], args["wd"], **kw)


@pytest.mark.parametrize(
    "change,match",
    [
        (
            lambda i: dict(wg=i["wg"][:12], wu=i["wu"][:12], wd=i["wd"][:12]),
            r"num_experts=12 is not divisible by the size 8 of expert_axis",
        ),
        (
            lambda i: dict(ids=jnp.zeros((64, 20), jnp.int32), wts=jnp.zeros((64, 20))),
            r"top_k=20 .* exceeds num_experts=16",
        ),
        (lambda i: dict(ids=i["ids"][:32]), r"expert_ids: 32 tokens, but x has 64"),
        (lambda i: dict(wts=i["wts"][:, :3]), r"expert_weights: shape \(64, 3\)"),
        (lambda i: dict(wg=i["wg"][:, :8]), r"w_gate: hidden size 8"),
        (lambda i: dict(wu=i["wu"][..., :5]), r"w_up: shape \(16, 16, 5\)"),
        (lambda i: dict(wd=jnp.swapaxes(i["wd"], 1, 2)), r"w_down: shape \(16, 16, 24\)"),
        (
            lambda i: dict(x=i["x"][0]),
            r"x: expected an array \[\.\.\., hidden\] with at least one "
            "token dimension",
        ),
        (
            lambda i: dict(x=i["x"][:0], ids=i["ids"][:0], wts=i["wts"][:0]),
            r"x: shape \(0, 16\) has "
            "no tokens",
        ),
        (
            lambda i: dict(x=i["x"].reshape(8, 8, 16)),
            r"expert_ids: shape \(64, 4\), expected \[\.\.\., "
            r"top_k\] with x's leading shape \(8, 8\)",
        ),
        (
            lambda i: dict(out_sharding="expert"),
            r"out_sharding: expected a NamedSharding or a "
            "PartitionSpec, got str",
        ),
        (lambda i: dict(chunk_size=2**31), r"chunk_size=2147483648: expected at most 2147483647"),
        (lambda i: dict(wts=jnp.ones((64, 4), jnp.int32)), r"expert_weights: expected a floating"),
        (lambda i: dict(ids=i["ids"].astype(jnp.float32)), r"expert_ids: expected an integer"),
        (
            lambda i: dict(mesh=jax.make_mesh((8,), ("data",))),
            r"expert_axis='expert': expected an axis of the mesh",
        ),
        (
            lambda i: dict(expert_axis=("expert", "expert")),
            r"expert_axis=\('expert', 'expert'\): "
            "expected an axis of the mesh, or a tuple of distinct axes",
        ),
        (lambda i: dict(expert_axis=()), r"expert_axis=\(\): expected an axis"),
        (
            lambda i: dict(expert_tensor_axis="tensor"),
            r"expert_tensor_axis='tensor': expected None "
            "or a mesh axis",
        ),
        (
            lambda i: dict(expert_tensor_axis="expert"),
            r"expert_tensor_axis='expert': expected None "
            "or a mesh axis other than the expert axes",
        ),
        (
            lambda i: dict(dispatcher="alltoall", routing="token"),
            r"routing='token' applies to dispatcher='ring' only",
        ),
        (lambda i: dict(mesh="not a mesh"), r"mesh: expected a jax.sharding.Mesh"),
        (lambda i: dict(dispatcher="a2a"), r"dispatcher='a2a': expected one of"),
        (lambda i: dict(routing="experts"), r"routing='experts': expected one of"),
        (lambda i: dict(chunk_size=0), r"chunk_size=0: expected an int >= 1"),
        (lambda i: dict(chunk_size=2.5), r"chunk_size=2.5: expected an int >= 1"),
        (
            lambda i: dict(capacity_factor=1.0),
            r"capacity_factor=1.0 applies to dispatcher='alltoall'",
        ),
        (
            lambda i: dict(dispatcher="alltoall", capacity_factor=0.0),
            r"capacity_factor=0.0: expected > 0",
        ),
        (lambda i: dict(token_axes=("data",)), r"token_axes: 'data' is not an axis"),
    ],
)
def test_bad_input_raises_value_error(inp, change, match):
    with pytest.raises(ValueError, match=match):
        call(inp, **change(inp))


def test_ffn_must_divide_over_the_expert_tensor_axis():
    ids = uniform_ids(np.random.default_rng(0), 64, 16, 2)
    inp = make_inputs(ids, 16, f=25)
    with pytest.raises(
        ValueError,
        match=r"w_gate: ffn size 25 is not divisible by the size 2 of "
        "expert_tensor_axis 'expert_tensor'",
    ):
        call(inp, mesh=mesh("ep4_etp2"), expert_tensor_axis="expert_tensor")


def test_gmm_impl_is_checked_and_interpret_mode_excludes_etp(inp):
    with pytest.raises(ValueError, match=r"gmm_impl='triton': expected one of \("):
        call(inp, gmm_impl="triton")
    with pytest.raises(
        ValueError,
        match=r"expert_tensor_axis='expert_tensor' with "
        "gmm_impl='pallas-interpret'",
    ):
        call(
            inp,
            mesh=mesh("ep4_etp2"),
            expert_tensor_axis="expert_tensor",
            gmm_impl="pallas-interpret",
        )


def test_routing_plan_checks_like_moe_ffn(inp):
    """routing_plan runs moe_ffn's static checks (one shared function): a bad token axis."""
    from relaymoe_jax import routing_plan

    args = [inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")]
    with pytest.raises(ValueError, match=r"token_axes: 'data' is not an axis"):
        routing_plan(*args, mesh=mesh("ep8"), token_axes=("data",))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(capacity_factor="1.0"), r"capacity_factor='1.0': expected > 0, a number"),
        (dict(capacity_factor=float("inf")), r"capacity_factor=inf: expected > 0 and finite"),
        (dict(capacity_factor=True), r"capacity_factor=True: expected > 0, a number"),
        (dict(ring="ring"), r"ring='ring': expected one of \('auto', 'flat', 'hierarchical'\)"),
        (dict(chunk_size=True), r"chunk_size=True: expected an int >= 1"),
    ],
)
def test_the_options_record_names_the_field_and_what_it_accepts(inp, change, match):
    """One validator per option, the same for the keywords, the record and the model's config."""
    from relaymoe_jax import MoEOptions

    with pytest.raises(ValueError, match=match):
        MoEOptions(**{"dispatcher": "alltoall", **change})
    with pytest.raises(ValueError, match=match):
        call(inp, dispatcher="alltoall", **change)


def test_options_record_or_keywords_not_both(inp):
    from relaymoe_jax import MoEOptions

    with pytest.raises(ValueError, match=r"options= is given, and so are \['dispatcher'\]"):
        call(inp, options=MoEOptions(), dispatcher="alltoall")
    with pytest.raises(ValueError, match=r"options: expected a relaymoe_jax.MoEOptions, got dict"):
        call(inp, options={"dispatcher": "alltoall"})
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 applies to dispatcher='alltoall'"):
        call(inp, options=MoEOptions(capacity_factor=1.0))  # the combination is checked too


def test_experts_divide_the_expert_axis_is_one_check():
    """The op, `routing_volumes` and the model's config share one rule and one error text."""
    check_experts_divide(16, 8)
    with pytest.raises(ValueError, match=r"^num_experts=12 is not divisible by the size 8 of "):
        check_experts_divide(12, 8)
    with pytest.raises(ValueError, match=r"^experts=12 is not divisible by the size 8 of the exp"):
        routing_volumes(experts=12, top_k=2, hidden=8, ffn=8, ep=8, tokens_per_device=4)
