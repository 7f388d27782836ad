"""`--init-from-hf DIR` (train/hf/init.py): a run that starts from a Hugging Face checkpoint.

The tiny checkpoints of tests/fixtures/hf/ were written by transformers; their `reference.npz`
holds transformers' loss on a batch, and `numpy_reference.py` reproduces transformers' forward
(<= 7e-6 on every fixture) for any batch. The trainer's loss at step 1 (before any update) must
equal transformers' loss on the same batch: the compiled train step on the reference batch
(Qwen2-MoE, on fsdp=2,expert=4), and the whole command on a prepared corpus against
the numpy reference of the batch the loader serves (Qwen3-MoE, on EP=8, and with scanned layers
on fsdp=2,expert=4). Then: overrides that change a weight's shape are refused naming the key,
those that do not apply; the resume identity records the checkpoint; a run from the export of a
run continues at its held-out loss; each bad input is one line.

One run from the Qwen3-MoE checkpoint (`trained`, module-scoped) serves several tests: it is the
EP=8 command, the uninterrupted run a resume must equal, and the run that is exported; a run
from the export with the same settings compiles nothing new.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import NamedSharding

from train import cli
from train.data import prepare
from train.data.loader import PackedRows
from train.data.source import Batch
from train.hf import init as hf_init
from train.settings import TrainConfig
from train.step import mesh as tm
from train.step import train_step

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
QWEN3, QWEN2 = FIXTURES / "qwen3_moe_topk_norm", FIXTURES / "qwen2_moe_shared"
TOL = 1e-4
TEXT = "the quick brown fox jumps over the lazy dog; " * 8  # 360 bytes: one document


def _numpy_reference():
    spec = importlib.util.spec_from_file_location(
        "numpy_reference", FIXTURES / "numpy_reference.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_loss(ckpt_dir, ids) -> float:
    """transformers' `loss` (labels = ids, output_router_logits=True: the next-token mean plus
    router_aux_loss_coef times the pooled aux loss) of the checkpoint on `ids`, in numpy."""
    ref = _numpy_reference()
    cfg, w = ref.load_checkpoint(str(ckpt_dir))
    logits, _, aux = ref.forward(cfg, w, ids)
    logits = logits.astype(np.float64)[:, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.mean(np.take_along_axis(logp, np.asarray(ids)[:, 1:, None], -1))
    return ce + cfg.get("router_aux_loss_coef", 0.001) * aux


def _metrics(out):
    """metrics.jsonl without the timings."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    timing = {"tokens_per_s", "step_time", "data_time", "model_tflops_per_device", "mfu"}
    return [{k: v for k, v in json.loads(ln).items() if k not in timing} for ln in lines]


@pytest.mark.parametrize("mesh", ["fsdp=2,expert=4"])
@pytest.mark.parametrize("fixture", [QWEN2], ids=["qwen2"])
def test_step_one_loss_is_transformers_loss_on_its_batch(fixture, mesh):
    """The trainer's state from the checkpoint and its compiled step on transformers' own batch
    (reference.npz): the step's loss is the one transformers printed.

    Qwen2-MoE (biases, a shared expert) only: the former [qwen3-expert=8] and
    [qwen3-fsdp=2,expert=4] cases are covered by `test_the_command_starts_at_transformers_loss`
    (the same checkpoint loaded and its step-1 loss against the numpy reference of transformers'
    forward, on both meshes). On fsdp=2,expert=4 only, the mesh that shards the weights two ways:
    also covers what [qwen2-expert=8] did, a compile of its own for the same load and loss on the
    plain expert mesh (the EP=8 load: `trained`'s Qwen3-MoE command; Qwen2-MoE's biases, shared
    expert and dense layer on EP=8 against the numpy reference of transformers' forward:
    test_export.py::test_hf_reference_logits_equal_ours[*-qwen2])."""
    ref = np.load(fixture / "reference.npz")
    ids = np.asarray(ref["input_ids"], np.int32)
    src = hf_init.open_source(fixture)
    m = tm.make_mesh(mesh)
    cfg = hf_init.model_config(src, {}, tm.expert_size(tm.parse_mesh(mesh, 8)))
    tc = TrainConfig(batch_size=ids.shape[0], seq_len=ids.shape[1], mesh=mesh, warmup_steps=0)
    model = hf_init.load_model(src, cfg, m, log=lambda *_: None)
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, m, model)
    sharding = NamedSharding(m, rules.fit(ids.shape, "batch", "seq"))
    step = train_step.make_step(graphdef, tx)
    compiled = train_step.compile_step(step, state, sharding, ids.shape)
    _, metrics = compiled(state, train_step.put_batch(Batch(ids), sharding, ids.shape[0]))
    np.testing.assert_allclose(float(metrics.loss), float(ref["loss"]), atol=TOL)
    np.testing.assert_allclose(float(metrics.lm_loss), float(ref["lm_loss"]), atol=TOL)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared byte-level dataset of one document (rows without segment ids, as
    transformers' batch has none)."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "text.txt").write_text(TEXT)
    prepare.prepare([str(d / "text.txt")], d / "ds", workers=1, progress=False)
    return d / "ds"


def _run(out, *extra, fixture=QWEN3, steps=2, warmup=0):
    argv = ["--init-from-hf", str(fixture), "--steps", str(steps), "--out", str(out), "--quiet"]
    small = ["seq_len=12", "batch_size=2", f"warmup_steps={warmup}", "schedule_steps=8"]
    return cli.main([*argv, *small, *extra])


def _shared(corpus):
    """`trained`'s settings: EP=8, warmup_steps=1 (step 1's lr is 0: its update changes nothing)
    and the held-out loss of 3 batches after every step."""
    held_out = ["--eval-data", str(corpus), "eval_batches=3", "eval_every=1"]
    return ["--data", str(corpus), "mesh=expert=8", *held_out]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """3 steps from the Qwen3-MoE checkpoint with `_shared`'s settings."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert _run(out, *_shared(corpus), steps=3, warmup=1) == 0
    return out


def _loader_rows(corpus):
    return next(iter(PackedRows(corpus, seq_len=12, global_batch=2, seed=0))).tokens


def test_the_command_starts_at_transformers_loss(trained, corpus):
    """`python -m train --init-from-hf DIR --data DIR` on EP=8: step 1's loss equals
    transformers' (the numpy reference) on the rows the loader served, and training moves the
    held-out loss (step 1's update is zero: warmup; step 2's is not)."""
    recs = _metrics(trained)
    np.testing.assert_allclose(recs[0]["loss"], hf_loss(QWEN3, _loader_rows(corpus)), atol=TOL)
    assert abs(recs[1]["eval_loss"] - recs[0]["eval_loss"]) > 1e-4


def test_scanned_layers_on_fsdp_start_at_transformers_loss(tmp_path, corpus):
    """The command on fsdp=2,expert=4 with scan_layers=true (the checkpoint's layers stacked):
    the same step-1 loss, and training moves it.

    Also covers what test_the_command_starts_at_transformers_loss[fsdp=2,expert=4] (unscanned;
    the unscanned fsdp=2,expert=4 load stays in
    test_step_one_loss_is_transformers_loss_on_its_batch[qwen2-fsdp=2,expert=4]) and
    test_scanned_layers_load_the_same_model (scanned, EP=8) did."""
    out = tmp_path / "s"
    assert _run(out, "--data", str(corpus), "mesh=fsdp=2,expert=4", "scan_layers=true") == 0
    recs = _metrics(out)
    np.testing.assert_allclose(recs[0]["loss"], hf_loss(QWEN3, _loader_rows(corpus)), atol=TOL)
    assert recs[1]["loss"] != recs[0]["loss"]


def test_resume_records_the_checkpoint(tmp_path, corpus, trained):
    """A resume continues bitwise (the weights are not read again): 2 steps resumed to 3 log
    what `trained` logged; another checkpoint (one weight changed) or a random start is refused
    naming `init`."""
    shared = _shared(corpus)
    assert _run(tmp_path / "b", *shared, steps=2, warmup=1) == 0
    meta = json.loads((tmp_path / "b" / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["init"]["path"] == str(QWEN3.resolve()) and len(meta["init"]["sha256"]) == 64
    assert _run(tmp_path / "b", *shared, steps=3, warmup=1) == 0
    assert _metrics(tmp_path / "b") == _metrics(trained)

    other = tmp_path / "other"
    shutil.copytree(QWEN3, other)
    blob = bytearray((other / "model.safetensors").read_bytes())
    blob[-4:] = bytes(4)  # the last float of the last tensor
    (other / "model.safetensors").write_bytes(blob)
    with pytest.raises(ValueError, match=r"cannot resume .* init .*qwen3_moe_topk_norm.* -> "):
        _run(tmp_path / "b", *shared, fixture=other, steps=4, warmup=1)
    cfg = ["--config", "configs/tiny.yaml", "--data", str(corpus), "--steps", "4", "--quiet"]
    with pytest.raises(ValueError, match="cannot resume"):
        cli.main([*cfg, "--out", str(tmp_path / "b"), "seq_len=12", "batch_size=2"])


def test_overrides_apply_unless_they_change_a_weight_shape(tmp_path):
    """Overrides keeping every shape apply (top-k, the layer scan); one that changes a weight's
    shape is refused naming it and config.json's value."""
    src = hf_init.open_source(QWEN3)
    cfg = hf_init.model_config(src, {"num_experts_per_tok": 3, "scan_layers": True})
    assert cfg.moe.num_experts_per_tok == 3 and cfg.scan_layers
    for key, value, was in [
        ("num_experts", 16, 8),
        ("moe_intermediate_size", 64, 32),
        ("num_hidden_layers", 3, 2),
        ("tie_word_embeddings", True, False),
    ]:
        with pytest.raises(ValueError, match=rf"^{key}={value!r} changes the shape .*{key}={was}"):
            hf_init.model_config(src, {key: value})


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(path))


def test_the_checkpoint_tokenizer_tokenizes_the_data(tmp_path, corpus):
    """A checkpoint with a tokenizer.json: --data FILE is prepared with it; data prepared with
    another tokenizer (here byte-level) is refused naming both."""
    ck = tmp_path / "ck"
    shutil.copytree(QWEN3, ck)
    _tokenizer_json(ck / "tokenizer.json")
    (tmp_path / "t.txt").write_text(TEXT)
    logged = []
    run = cli.parse(["--init-from-hf", str(ck), "--steps", "1", "--out", str(tmp_path / "r")])
    run = run.replace(data=(str(tmp_path / "t.txt"),))
    run, _ = hf_init.of_run(run, log=logged.append)
    assert run.tokenizer == ck / "tokenizer.json" and "the checkpoint's" in logged[0]
    with pytest.raises(ValueError, match=r"tokenized with the byte-level tokenizer, not the chec"):
        _run(tmp_path / "r", "--data", str(corpus), fixture=ck)


@pytest.mark.parametrize(
    "setup, match",
    [
        ("missing", r"--init-from-hf .*nowhere: not a directory"),
        ("no_config", r"no config.json"),
        ("no_weights", r"no weights \(model.safetensors or model.safetensors.index.json"),
        (
            "llama",
            r"architectures=\['LlamaForCausalLM'\].* is not built here; expected "
            r"Qwen3MoeForCausalLM or Qwen2MoeForCausalLM",
        ),
        ("both", r"give the model as --config FILE or --init-from-hf DIR .*not both"),
        (
            "truncated",
            r"^--init-from-hf .*/ck/model.safetensors: truncated: its header lists 628224 bytes "
            r"of tensor data, the file holds 627200 after the header \(a partial download",
        ),
        (
            "int_router",
            r"^--init-from-hf .*/ck/model.safetensors: tensor 'model.layers.1.mlp.gate.weight' is "
            r"stored as I32 \(int32\), expected a floating-point weight \(F32, BF16, F16, F64\)$",
        ),
    ],
)
def test_bad_checkpoint_directories_are_one_line(tmp_path, setup, match):
    """Also: a truncated model.safetensors (a 9-frame SafetensorError traceback naming no file,
    when the weights were loaded) and a tensor stored as an integer (cast to float and trained)
    are refused by `cli.parse`, from the files' headers, before anything is built."""
    ck = tmp_path / "ck"
    if setup != "missing":
        shutil.copytree(QWEN3, ck)
    extra = []
    if setup == "missing":
        ck = tmp_path / "nowhere"
    elif setup == "no_config":
        (ck / "config.json").unlink()
    elif setup == "no_weights":
        (ck / "model.safetensors").unlink()
    elif setup == "llama":
        c = json.loads((ck / "config.json").read_text())
        c.update(architectures=["LlamaForCausalLM"], model_type="llama")
        (ck / "config.json").write_text(json.dumps(c))
    elif setup == "both":
        extra = ["--config", "configs/tiny.yaml"]
    elif setup == "truncated":
        blob = (ck / "model.safetensors").read_bytes()
        (ck / "model.safetensors").write_bytes(blob[:-1024])
    elif setup == "int_router":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(ck / "model.safetensors")
        name = "model.layers.1.mlp.gate.weight"
        tensors[name] = np.round(tensors[name] * 100).astype(np.int32)
        save_file(tensors, ck / "model.safetensors")
    argv = ["--init-from-hf", str(ck), "--steps", "1", "--out", str(tmp_path / "r"), *extra]
    with pytest.raises(ValueError, match=match) as e:
        cli.parse(argv)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_a_run_from_its_export_continues_at_the_same_loss(tmp_path, corpus, trained):
    """Export `trained` (its last step, 3; float32), start a run from the export with the same
    settings (step 1's update is zero: warmup): its held-out loss is the trained run's after
    step 3, not after step 2. The export carries the files of the checkpoint the run started from
    (here its generation_config.json; the tokenizer files:
    test_export.py::test_the_tokenizer_travels_with_the_export)."""
    from train.hf import export

    assert export.main([str(trained), "--out", str(tmp_path / "hf")]) == 0
    gen = "generation_config.json"  # the checkpoint's, copied (its `init`; no tokenizer there)
    assert (tmp_path / "hf" / gen).read_bytes() == (QWEN3 / gen).read_bytes()
    again = tmp_path / "again"
    assert _run(again, *_shared(corpus), fixture=tmp_path / "hf", steps=1, warmup=1) == 0
    _, step2, step3 = (r["eval_loss"] for r in _metrics(trained))
    np.testing.assert_allclose(_metrics(again)[0]["eval_loss"], step3, rtol=1e-6)
    assert abs(step3 - step2) > 1e-3
