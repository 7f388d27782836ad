"""The MoE block's router, activation and bias keys in the trainer (`ModelConfig.moe`, flat
keys on the command line): the tiny model trains with DeepSeek-V3's grouped sigmoid router,
GPT-OSS's top-k-softmax router with its bias, and GPT-OSS's experts with their biases; the loss
falls and a resumed run is bitwise an uninterrupted one. Checkpoints written before these keys
existed (their identity lacks them) resume, and a change of one is refused naming it.

The model is the tiny config with one layer (each layer is the same program). DeepSeek-V3's
router and GPT-OSS's experts are one run (they set disjoint keys: the router, the experts); the
two routers are two; the second also runs the experts in FP8 (`expert_fp8`, a key of the MoE
options that the routers leave alone): a resumed FP8 run is bitwise an uninterrupted one (the
roundings are recomputed from the float32 master weights every step; nothing FP8 is stored)."""

import json
import shutil
from pathlib import Path

import pytest

from relaymoe_jax.models.config import ModelConfig
from train import cli
from train.state import identity

SMALL = [
    "--config",
    "configs/tiny.yaml",
    "seq_len=32",
    "batch_size=8",
    "num_hidden_layers=1",
    "--quiet",
]
VARIANTS = {
    "deepseek_v3_router+gpt_oss_experts": [
        "router=sigmoid_group",
        "n_group=2",
        "topk_group=1",
        "activation=gpt_oss",
        "expert_biases=true",
    ],
    "gpt_oss_router": ["router=topk_softmax", "router_bias=true", "expert_fp8=true"],
}
# the tiny config's flat form before the MoE block's keys were model-config keys (and before
# offload_layer_inputs)
OLD_TINY = json.loads(
    (Path(__file__).parent / "fixtures" / "configs_before_moe_block.json").read_text()
)["tiny"]
NEW_KEYS = frozenset(ModelConfig().as_dict()) - frozenset(OLD_TINY)


def _losses(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_model_trains_and_resumes_bitwise(tmp_path, variant):
    """[deepseek_v3_router+gpt_oss_experts] covers what the former [deepseek_v3_router] and
    [gpt_oss_experts] cases did, in one run; the refusal to resume with the defaults names the
    key whose parameters the defaults drop (the math-change refusal: tests/test_train_resume.py).

    The resume is from the uninterrupted run's own step-3 checkpoint, its step-6 one removed (a
    run stopped after logging steps past its last checkpoint): two runs, not a 3-step run, its
    resume and a 6-step run."""
    args = [*SMALL, *VARIANTS[variant], "save_every=3"]
    a = tmp_path / "a"
    assert cli.main([*args, "--steps", "6", "--out", str(a)]) == 0
    straight = _losses(a)
    shutil.rmtree(a / "checkpoints" / "6")
    assert cli.main([*args, "--steps", "6", "--out", str(a)]) == 0
    resumed = _losses(a)
    assert len(resumed) == 6 and resumed == straight  # bitwise on CPU
    assert resumed[-1] < resumed[0]
    meta = json.loads((a / "checkpoints" / "6" / "meta" / "metadata").read_text())
    for item in VARIANTS[variant]:
        key, value = item.split("=")
        assert str(meta["model_config"][key]).lower() == value
    # back to the defaults: the identity names the key that drops parameters (the checkpoint
    # cannot be restored without them, whatever --allow-changes says)
    key = "expert_biases" if "expert_biases=true" in VARIANTS[variant] else "router_bias"
    with pytest.raises(identity.ResumeRefusedError, match=rf"{key} true -> false changes the par"):
        cli.main([*SMALL, "--steps", "7", "--out", str(a)])


def test_a_checkpoint_without_the_new_keys_resumes(tmp_path):
    """A checkpoint's identity written before the MoE block's keys were model-config keys has
    none of them: each reads as its default (what that run trained with), so the run resumes
    with the defaults and a run that sets one is refused, naming it."""
    a = tmp_path / "a"
    assert cli.main([*SMALL, "--steps", "2", "--out", str(a)]) == 0
    meta_file = a / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert NEW_KEYS <= set(meta["model_config"])
    meta["model_config"] = {k: v for k, v in meta["model_config"].items() if k not in NEW_KEYS}
    meta_file.write_text(json.dumps(meta))
    b = tmp_path / "b"
    shutil.copytree(a, b)
    with pytest.raises(identity.ResumeRefusedError, match=r"router_bias false -> true"):
        cli.main(
            [*SMALL, "--steps", "3", "--out", str(a), "router=topk_softmax", "router_bias=true"]
        )
    assert cli.main([*SMALL, "--steps", "3", "--out", str(b)]) == 0
    assert len(_losses(b)) == 3


def test_identity_compares_a_missing_new_key_as_its_default():
    old = OLD_TINY
    now = identity.json_value(ModelConfig.from_dict(old).as_dict())
    assert set(now) - set(old) == NEW_KEYS
    assert identity.compare({"model_config": old}, now, {}, {}) == []
    (c,) = identity.compare({"model_config": old}, dict(now, activation="geglu"), {}, {})
    assert (c.key, c.old, c.new, c.same_math) == ("activation", "swiglu", "geglu", False)
