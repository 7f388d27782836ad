"""Held-out evaluation (`--eval-data DIR`, `eval_every`, `eval_batches`; `train/step/evaluate.py`).

Against independent references: the logged eval_loss equals a float64 numpy cross-entropy of the
checkpointed model's plain-forward logits over the evaluation rows, rebuilt from the corpus's
JSONL (packed documents: the masks matter); a run with evaluation trains bitwise as one without
(metrics and the final parameters); a stopped and resumed run logs bitwise what an uninterrupted
one does; loss.png draws the eval points; each bad input is one line before anything is built.

The model is the tiny config with one layer (`num_hidden_layers=1`: each layer is the same
program, and the reference's float64 loss over one layer already fails on a dropped or
misweighted pair); the two module runs (`runs`) compile the step and the evaluation once, and the
tests that run more reuse them where their settings match.
"""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from corpora import word_corpus
from flax import nnx

from train import cli
from train.data import loader
from train.run import plot
from train.state import checkpoint as ckpt
from train.step import evaluate, train_step
from train.step import mesh as tm

SMALL = [
    "--config",
    "configs/tiny.yaml",
    "seq_len=32",
    "batch_size=8",
    "schedule_steps=20",
    "num_hidden_layers=1",
]
EVAL = ["eval_every=2", "eval_batches=2"]
TIMING = ("tokens_per_s", "step_time", "data_time", "model_tflops_per_device", "mfu")


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _math(recs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in recs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 4-step runs on a packed word corpus, without and with evaluation (every 2 steps, 2
    batches of 8 rows of a second corpus), checkpointed at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("eval")
    train_ds = word_corpus(tmp / "train", 200, seed=0)
    eval_ds = word_corpus(tmp / "held", 60, seed=1)
    common = [*SMALL, "--quiet", "--steps", "4", "--save-every", "2", "--data", str(train_ds)]
    plain, evaled = tmp / "plain", tmp / "evaled"
    assert cli.main([*common, "--out", str(plain)]) == 0
    assert cli.main([*common, "--out", str(evaled), "--eval-data", str(eval_ds), *EVAL]) == 0
    return dict(tmp=tmp, train=train_ds, eval=eval_ds, plain=plain, evaled=evaled, common=common)


def _rows_from_jsonl(eval_ds, seq_len, n):
    """The first `n` evaluation rows rebuilt from the corpus's JSONL: the byte-level stream
    (each document's UTF-8 bytes then "\\n"), its document index and positions, cut into rows,
    taken in the loader's documented order (the shuffle of `EVAL_SEED`)."""
    docs = [json.loads(line)["text"] for line in (eval_ds.parent / "corpus.jsonl").open()]
    toks = [np.frombuffer(d.encode() + b"\n", np.uint8).astype(np.int64) for d in docs]
    stream = np.concatenate(toks)
    doc = np.repeat(np.arange(1, len(toks) + 1), [len(t) for t in toks])
    order = loader.PackedRows(eval_ds, seq_len=seq_len, global_batch=8, seed=evaluate.EVAL_SEED)
    assert order.num_rows == len(stream) // seq_len
    rows = [int(order._order[i]) for i in range(n)]
    ids = np.stack([stream[r * seq_len : (r + 1) * seq_len] for r in rows])
    seg = np.stack([doc[r * seq_len : (r + 1) * seq_len] for r in rows])
    pos = np.zeros_like(ids)
    for i in range(1, seq_len):
        pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
    return ids, seg, pos


def _restored(run_dir):
    """(graphdef, train state) of the run's newest checkpoint (step 4)."""
    cfg = cli.parse([*SMALL, "--steps", "4", "--out", str(run_dir)])
    mesh = tm.make_mesh(cfg.train.mesh)
    graphdef, state, _, _ = train_step.init_state(cfg.model, cfg.train, mesh)
    mngr = ckpt.manager(run_dir)
    step, saved, _ = ckpt.restore(mngr, state.as_saved())
    mngr.close()
    assert step == 4
    return graphdef, train_step.TrainState.from_saved(saved)


def _reference_eval_loss(run_dir, eval_ds):
    """float64 numpy: the token-weighted mean next-token loss of the newest checkpoint's model
    (its plain forward's f32 logits) over the 16 evaluation rows, within documents."""
    graphdef, state = _restored(run_dir)
    model = nnx.merge(graphdef, state.params, state.rest)
    ids, seg, pos = _rows_from_jsonl(eval_ds, 32, 16)
    forward = nnx.jit(lambda m, i, s, p: m(i, segment_ids=s, positions=p)[0])
    logits = np.asarray(forward(model, *(np.asarray(x, np.int32) for x in (ids, seg, pos))))
    logits = logits.astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
    keep = seg[:, :-1] == seg[:, 1:]  # the next token is in the same document
    assert 0 < keep.sum() < keep.size  # packed: the masks matter
    return float(nll[keep].sum() / keep.sum()), float(nll.mean())


def test_eval_loss_matches_a_float64_reference(runs):
    recs = _metrics(runs["evaled"])
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 4]
    got = recs[-1]
    want, unmasked = _reference_eval_loss(runs["evaled"], runs["eval"])
    assert got["eval_loss"] == pytest.approx(want, rel=1e-5)
    # a control: counting the targets across documents moves the mean far past the tolerance
    assert abs(unmasked - want) > 50 * 1e-5 * want
    assert got["eval_perplexity"] == pytest.approx(math.exp(got["eval_loss"]), rel=1e-12)
    assert recs[1]["eval_loss"] != recs[3]["eval_loss"]  # the weights moved in between


def test_evaluation_never_changes_training(runs):
    plain, evaled = _metrics(runs["plain"]), _metrics(runs["evaled"])
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("eval_")}
    assert _math(plain) == [strip(r) for r in _math(evaled)]  # bitwise: floats compared equal
    states = [_restored(out)[1] for out in (runs["plain"], runs["evaled"])]
    for a, b in zip(*(jax.tree.leaves(s.as_saved()) for s in states), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    meta = json.loads((runs["evaled"] / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["eval_data"]["manifest_sha256"] and meta["train_config"]["eval_every"] == 2


def test_stop_and_resume_with_evaluation_is_bitwise(runs, tmp_path):
    out = tmp_path / "resumed"
    argv = [*runs["common"], "--out", str(out), "--eval-data", str(runs["eval"]), *EVAL]
    argv[argv.index("--steps") + 1] = "2"
    assert cli.main(argv) == 0
    argv[argv.index("--steps") + 1] = "4"
    assert cli.main(argv) == 0
    assert _math(_metrics(out)) == _math(_metrics(runs["evaled"]))


def test_loss_png_draws_the_eval_points(runs):
    assert (runs["evaled"] / "loss.png").stat().st_size > 0
    fig = plot.make_figure({"ring": runs["evaled"] / "metrics.jsonl"})
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    held = lines["ring: held-out"]
    recs = _metrics(runs["evaled"])
    np.testing.assert_array_equal(held.get_xdata(), [2, 4])
    np.testing.assert_array_equal(held.get_ydata(), [recs[1]["eval_loss"], recs[3]["eval_loss"]])
    assert held.get_marker() == "o"
    np.testing.assert_array_equal(lines["ring"].get_xdata(), [1, 2, 3, 4])
    fig = plot.make_figure({"ring": runs["plain"] / "metrics.jsonl"})  # no eval: no series
    assert [ln.get_label() for ln in fig.axes[0].get_lines()] == ["ring"]


def test_loss_png_does_not_join_two_eval_sets(tmp_path):
    """A resume that changed the held-out data (or `eval_batches`) evaluates another set: its
    points start a line of their own (the probe's loss.png joined them), one legend entry for
    the run's held-out points; a resume that changed only `eval_every` keeps one line."""
    change = lambda key: [{"key": key, "old": "a", "new": "b", "same_math": True}]
    recs = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5, "eval_loss": 2.8},
        {"step": 3, "loss": 2.2, "resume_changes": change("eval_data")},
        {"step": 4, "loss": 2.0, "eval_loss": 2.1},
        {"step": 5, "loss": 1.9, "resume_changes": change("eval_every")},
        {"step": 6, "loss": 1.8, "eval_loss": 2.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines = plot.make_figure({"ring": path}).axes[0].get_lines()
    held = [ln for ln in lines if ln.get_marker() == "o"]
    assert [list(ln.get_xdata()) for ln in held] == [[2], [4, 6]]
    assert [list(ln.get_ydata()) for ln in held] == [[2.8], [2.1, 2.0]]
    assert held[0].get_label() == "ring: held-out"
    assert not any(ln.get_label() == "ring: held-out" for ln in held[1:])


def _tokenizer_json(path, text):
    """A WordLevel tokenizer.json of the words of `text` (another text: another sha256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return path


@pytest.fixture
def no_build(monkeypatch):
    """Anything past the checks fails the test: the model must not be built."""

    def refuse(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(train_step, "init_state", refuse)


def test_bad_eval_inputs_fail_in_one_line_before_building(runs, tmp_path, no_build):
    from train.data import prepare

    corpus = runs["eval"].parent / "corpus.jsonl"
    hf, hf2 = tmp_path / "hf", tmp_path / "hf2"
    tok = _tokenizer_json(tmp_path / "tok.json", "the cat sat on the mat")
    tok2 = _tokenizer_json(tmp_path / "tok2.json", "a dog ran far away home")
    prepare.prepare([str(corpus)], hf, tokenizer=tok, workers=1, progress=False)
    prepare.prepare([str(corpus)], hf2, tokenizer=tok2, workers=1, progress=False)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("just a few words\n")
    tiny = tmp_path / "tiny_ds"
    prepare.prepare([str(tmp_path / "tiny" / "a.txt")], tiny, workers=1, progress=False)
    base = [*SMALL, "--steps", "1", "--out", str(tmp_path / "x"), "--data", str(runs["train"])]
    cases = [
        (
            ["--eval-data", str(hf)],
            r"--eval-data .*hf was prepared with tokenizer .*tok\.json "
            r"\(sha256 \w+\), the training data with the byte-level tokenizer",
        ),
        (["--eval-data", str(corpus)], r"--eval-data .*corpus\.jsonl: not a directory"),
        (["--eval-data", str(tmp_path)], r"--eval-data: .*no manifest\.json \(not a prepared"),
        (["--eval-data", str(runs["eval"]), "eval_every=0"], r"eval_every=0: expected >= 1"),
        (["--eval-data", str(runs["eval"]), "eval_batches=0"], r"eval_batches=0: expected >= 1"),
        (["eval_every=5"], r"eval_every=5 without --eval-data: nothing to evaluate"),
        (["--eval-batches", "4"], r"eval_batches=4 without --eval-data"),
        (["--eval-data", str(tiny)], r"seq_len=32 is longer than the whole corpus"),
        (
            ["--eval-data", str(runs["eval"]), "eval_batches=500"],
            r"--eval-data .* has 129 rows of seq_len=32 \(4,149 tokens\); eval_batches=500 x "
            r"batch_size=8 needs 4,000",
        ),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            cli.main([*base, *extra])
        assert "\n" not in str(e.value), extra
    hf_train = [*SMALL, "--steps", "1", "--out", str(tmp_path / "y"), "--data", str(hf)]
    for eval_ds, match in [
        (runs["eval"], r"with the byte-level tokenizer, the training data with tokenizer "),
        (
            hf2,
            r"hf2 was prepared with tokenizer .*tok2\.json \(sha256 \w+\), the training data "
            r"with tokenizer .*tok\.json \(sha256 \w+\)",
        ),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            cli.main([*hf_train, "--eval-data", str(eval_ds)])
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"--eval-data with --synthetic"):
        cli.main(
            [
                *SMALL,
                "--steps",
                "1",
                "--out",
                str(tmp_path / "z"),
                "--synthetic",
                "--eval-data",
                str(runs["eval"]),
            ]
        )


def test_eval_with_offload_optimizer_and_grad_accum(runs, tmp_path):
    """offload_optimizer=true (scanned layers, weights in pinned host memory) with grad_accum=2
    of batch_size=4 and eval_batches=4: the evaluation fetches the host weights as the step does,
    and its 4 batches of 4 rows are the 16 rows of eval_batches=2 of 8; float32 compute, so the
    same losses and held-out loss as `runs`' evaluated run (unscanned, not offloaded, batch_size=8,
    eval_batches=2: 1e-6 relative, the layer scan's and the micro-batches' rounding), far closer
    than one step moves the held-out loss.

    One run for what were two tests (`test_eval_with_offload_optimizer_fetches_the_host_weights`,
    `test_eval_batches_are_micro_batches_under_grad_accum`: a run each, compared to the same run
    with the same tolerance or a looser one): the evaluation reads the weights the same way at
    every batch size, and splits its rows by batch_size whatever the weights' memory, so each
    property is shown as before. The run without offload it was compared to bitwise before
    (scanned as well) is `runs`' unscanned one now: that run compiled both programs already."""
    out = tmp_path / "offloaded"
    argv = [*runs["common"], "--out", str(out), "--eval-data", str(runs["eval"]), "eval_batches=4"]
    argv[argv.index("--steps") + 1] = "2"
    argv[argv.index("batch_size=8")] = "batch_size=4"
    assert cli.main([*argv, "grad_accum=2", "scan_layers=true", "offload_optimizer=true"]) == 0
    got, want = _math(_metrics(out)), _math(_metrics(runs["evaled"]))[:2]
    assert [r["step"] for r in got] == [1, 2]  # one line per optimizer step
    assert [r["step"] for r in got if "eval_loss" in r] == [2]  # unset eval_every: the end
    for a, b in zip(got, want, strict=True):
        for k in ("loss", "lm_loss", "eval_loss"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-6), k
    assert abs(want[1]["eval_loss"] - _metrics(runs["evaled"])[3]["eval_loss"]) > 1e-3


def test_a_resume_may_change_the_evaluation_logged(runs, tmp_path, capsys):
    """eval_every, eval_batches and --eval-data never change training: a resume may change
    them (same math), logged and recorded on the first new metrics line."""
    out = tmp_path / "run"
    shutil.copytree(runs["evaled"], out)
    argv = [*runs["common"], "--out", str(out), "--eval-data", str(runs["train"])]
    argv[argv.index("--steps") + 1] = "6"
    assert cli.main([*argv, "eval_every=3", "eval_batches=1"]) == 0
    recs = _metrics(out)
    changed = {c["key"]: c for c in recs[4]["resume_changes"]}
    assert set(changed) == {"eval_every", "eval_batches", "eval_data"}
    assert all(c["same_math"] for c in changed.values())
    assert (changed["eval_every"]["old"], changed["eval_every"]["new"]) == (2, 3)
    assert "eval_data" in capsys.readouterr().out
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 4, 6]
