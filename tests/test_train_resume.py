"""Resume identity and the learning-rate schedule of the trainer (`train/state/identity.py`).

One 2-step run (module fixture, copied per test) is resumed with changed settings: a math change
is refused naming each key old -> new; `--allow-changes` resumes anyway; a same-math change
(ring -> dropless all-to-all) is allowed, logged, recorded in metrics.jsonl and marked on the
plot; a data change is refused; a checkpoint without the identity warns. The schedule follows
--steps, is kept on resume, and its lr is logged per step. Checkpoints keep the tree earlier
trainers saved (the train state as a dict), so their runs resume.

Every run trains the tiny config cut to one decoder layer (what is checked here is the trainer's
bookkeeping; a second layer only lengthens each compile). The in-process runs share their
compiled steps (`train_step.step_key`): the tests resume with changes that keep the step's
program where the program is not what they check, so the file compiles three train steps (the
shipped text; the documents with the schedule of the schedule test; the same-math change).
"""

import json
import logging
import math
import re
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from corpora import word_corpus

from relaymoe_jax.models.config import ModelConfig
from train import cli
from train.data.format import sha256_file
from train.run import guards, plot, progress
from train.settings import TrainConfig
from train.state import checkpoint as ckpt
from train.state import identity
from train.step import mesh as tm
from train.step import optimizer, train_step

SMALL = ["--config", "configs/tiny.yaml", "seq_len=32", "batch_size=8", "num_hidden_layers=1"]
BASE = [*SMALL, "schedule_steps=20"]  # a fixed horizon: resuming to more steps keeps it


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    assert cli.main([*BASE, "--quiet", "--steps", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(base, tmp_path):
    """A copy of the 2-step base run."""
    out = tmp_path / "run"
    shutil.copytree(base, out)
    return out


def test_checkpoint_records_the_identity(base):
    meta = json.loads((base / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["model_config"]["num_experts_per_tok"] == 2
    assert meta["model_config"]["rope_theta"] == 10000.0
    assert meta["train_config"]["schedule_steps"] == 20 and meta["train_config"]["seq_len"] == 32
    (f,) = meta["data"]["files"]
    assert Path(f["path"]).name == "declaration.txt" and len(f["sha256"]) == 64
    assert meta["data"]["tokenizer"] is None


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ["num_experts_per_tok=4", "lr=0.001"],
            r"num_experts_per_tok 2 -> 4, lr 0\.003 -> 0\.001 would change the math.*"
            r"--allow-changes num_experts_per_tok,lr",
        ),
        (
            ["dispatcher=alltoall", "capacity_factor=1.0"],
            r"dispatcher ring -> alltoall, capacity_factor null -> 1\.0 would change",
        ),
        (
            ["rope_theta=500.0", "compute_dtype=bfloat16"],
            r"rope_theta 10000\.0 -> 500\.0, compute_dtype float32 -> bfloat16 would",
        ),
        (["--data", "OTHER"], r"data declaration\.txt \(sha256 \w+\) -> other\.txt \(sha256 \w+\)"),
        (
            ["scan_layers=true", "--allow-changes", "scan_layers"],
            r"scan_layers false -> true changes the parameter layout",
        ),
        (  # the probe's case: it suggested --allow-changes, which could never restore it
            ["num_experts=16", "--allow-changes", "num_experts"],
            r"num_experts 8 -> 16 changes the parameters' shapes, so the checkpoint cannot be "
            r"restored with it \(no --allow-changes can\); keep num_experts=8 or use a new --out$",
        ),
    ],
)
def test_math_change_is_refused(run, tmp_path, extra, match):
    other = tmp_path / "other.txt"
    other.write_text("another text, long enough to fill a few sequences of 32 bytes. " * 20)
    extra = [str(other) if a == "OTHER" else a for a in extra]
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(identity.ResumeRefusedError, match=match):
        cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(run), *extra])
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]


def test_refusal_is_one_line_on_the_command_line(run, monkeypatch, capsys):
    """`python -m train` (train/__main__.py) is `cli.entry()`: called here in-process with that
    command line (a subprocess paid jax's start-up for a refusal that comes before any compile):
    one `error:` line on stderr and exit status 1 (an escaping exception, which would print a
    traceback, fails the test). `entry` leaves its filters of orbax's background errors
    installed, as a command does until it exits: they are removed after it here."""
    argv = ["train", *BASE, "--steps", "3", "--out", str(run), "num_experts_per_tok=4"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.entry()
    finally:
        for name in ("absl", "asyncio"):
            logging.getLogger(name).removeFilter(guards._FILTER)
    err = capsys.readouterr().err
    assert exit_.value.code == 1, err[-2000:]
    assert err.splitlines() == [
        f"error: cannot resume {run} at step 2: num_experts_per_tok 2 -> 4 would "
        "change the math; rerun with --allow-changes num_experts_per_tok to resume "
        "anyway, or use a new --out"
    ], err[-2000:]


def test_allow_changes_resumes_and_records(run, tmp_path, capsys):
    """Two math changes, each allowed by its own --allow-changes: a trainer key (seed) and the
    data (another text file). Neither changes the compiled step (which
    test_same_math_change_is_allowed_logged_recorded_and_plotted resumes into a new one), so
    the resume reuses the base run's program; the keys were num_experts_per_tok and lr, which
    compiled a step of their own for the same bookkeeping."""
    other = tmp_path / "other.txt"
    other.write_text("another text, long enough to fill a few sequences of 32 bytes. " * 20)
    argv = [*BASE, "--quiet", "--out", str(run), "seed=7", "--data", str(other)]
    assert (
        cli.main([*argv, "--steps", "3", "--allow-changes", "seed", "--allow-changes", "data"]) == 0
    )
    out = capsys.readouterr().out
    data = r"declaration\.txt \(sha256 \w+\) -> other\.txt \(sha256 \w+\)"
    assert re.search(
        r"resuming from step 2 with changed settings: seed 0 -> 7 \(allowed by "
        rf"--allow-changes\); data {data} \(allowed by --allow-changes\)",
        out,
    ), out
    recs = _metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert "resume_changes" not in recs[1]
    seed, changed = recs[2]["resume_changes"]
    assert seed == {"key": "seed", "old": 0, "new": 7, "same_math": False}
    assert (changed["key"], changed["same_math"]) == ("data", False)
    assert re.fullmatch(data, f"{changed['old']} -> {changed['new']}"), changed
    # the new checkpoint holds the new identity: continuing needs no flag
    assert cli.main([*argv, "--steps", "4"]) == 0
    assert "changed settings" not in capsys.readouterr().out
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"--allow-changes: unknown key\(s\) \['nope'\]"):
        cli.main([*argv, "--steps", "5", "--allow-changes", "lr,nope"])


def test_same_math_change_is_allowed_logged_recorded_and_plotted(run, tmp_path, capsys):
    assert (
        cli.main(
            [
                *BASE,
                "--quiet",
                "--steps",
                "3",
                "--out",
                str(run),
                "dispatcher=alltoall",
                "moe_remat=true",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "resuming from step 2 with changed settings: dispatcher ring -> alltoall (same "
        "math); moe_remat false -> true (same math)"
    ) in out
    recs = _metrics(run)
    assert recs[2]["resume_changes"] == [
        {"key": "dispatcher", "old": "ring", "new": "alltoall", "same_math": True},
        {"key": "moe_remat", "old": False, "new": True, "same_math": True},
    ]
    # the same math: step 3 as an uninterrupted ring run's, to float rounding
    straight = tmp_path / "straight"
    assert cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(straight)]) == 0
    ref = _metrics(straight)
    assert [r["loss"] for r in recs[:2]] == [r["loss"] for r in ref[:2]]
    assert abs(recs[2]["loss"] - ref[2]["loss"]) / ref[2]["loss"] < 1e-5
    # the plot: labelled by the dispatcher's history, a labelled line before step 3
    label = plot.dispatcher_label(run, "alltoall")
    assert label == "ring -> alltoall (from step 3)"
    assert plot.dispatcher_label(straight, "ring") == "ring"
    assert f"loss curve: {run / 'loss.png'}" in out
    ax = plot.make_figure({label: run}).axes[0]
    curve, vline = ax.get_lines()
    assert curve.get_label() == label and ax.get_legend().get_texts()[0].get_text() == label
    assert list(vline.get_xdata()) == [2.5, 2.5]
    assert [t.get_text() for t in ax.texts] == [
        "step 3: dispatcher ring -> alltoall, moe_remat false -> true"
    ]
    assert plot.curves({"x": run})["x"][0].tolist() == [1, 2, 3]  # readers still work


def test_old_checkpoint_without_identity_warns(run, capsys):
    meta_file = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    for k in ("model_config", "data"):
        meta.pop(k)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(identity.ResumeRefusedError, match=r"lr 0\.003 -> 0\.001"):
        cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(run), "lr=0.001"])
    capsys.readouterr()
    assert cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(run)]) == 0
    warn = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warn == [
        "warning: checkpoint step 2 was written by an older trainer that did not "
        "record its model config and data: those cannot be checked (its trainer "
        "settings are)"
    ]


def test_checkpoints_keep_the_dict_state_of_earlier_trainers(run, tmp_path):
    """The train state is a record (`train_step.TrainState`), but a checkpoint holds the dict
    `{"params", "opt_state", "rest", "rng"}` that earlier trainers saved: the same leaf paths, in
    the same order. A checkpoint written from that dict, as they wrote it (`ckpt.save` of the
    dict), resumes to the very numbers of the one this trainer wrote."""
    settings = cli.parse([*BASE, "--steps", "3", "--out", str(run)])
    mesh = tm.make_mesh(settings.train.mesh)
    _, state, _, _ = train_step.init_state(settings.model, settings.train, mesh)
    old = {"params": state.params, "opt_state": state.opt_state, "rest": state.rest}
    old["rng"] = state.rng
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(old)[0]]
    meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["leaf_paths"] == paths and paths[0].startswith("['opt_state']")
    assert [
        jax.tree_util.keystr(k)
        for k, _ in jax.tree_util.tree_flatten_with_path(state.as_saved())[0]
    ] == paths

    earlier = tmp_path / "earlier"  # the same run, its step 2 saved from the dict
    shutil.copytree(run, earlier)
    shutil.rmtree(earlier / "checkpoints")
    mngr = ckpt.manager(run)
    step, tree, _ = ckpt.restore(mngr, old)
    mngr.close()
    assert step == 2 and isinstance(tree, dict)
    added = ("step", "leaf_paths", "leaf_types", "checksums")  # ckpt.save adds these
    mngr = ckpt.manager(earlier)
    ckpt.save(mngr, 2, tree, {k: v for k, v in meta.items() if k not in added})
    mngr.wait_until_finished()
    mngr.close()
    assert json.loads((earlier / "checkpoints" / "2" / "meta" / "metadata").read_text()) == meta

    for out in (run, earlier):
        assert cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(out)]) == 0
    drop = ("tokens_per_s", "step_time", "data_time", "model_tflops_per_device", "mfu")
    last = [{k: v for k, v in _metrics(out)[-1].items() if k not in drop} for out in (run, earlier)]
    assert last[0]["step"] == 3 and last[0] == last[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus of 300 documents (rows of 32 hold several: segment ids)."""
    return word_corpus(tmp_path_factory.mktemp("data") / "corpus_a", 300, seed=0, max_words=60)


# the schedule of test_schedule_follows_steps_and_is_kept_on_resume's runs (warmup 1, horizon 3)
SCHEDULE = ["warmup_steps=1", "schedule_steps=3"]


def test_schedule_follows_steps_and_is_kept_on_resume(tmp_path, corpus, capsys):
    """On the prepared documents of test_prepared_dataset_resumes_exactly_and_refuses_another,
    whose runs have this test's schedule: the two tests share one compiled step (the schedule
    is a constant of the step's program, so they share it only with the same schedule)."""
    out = tmp_path / "run"
    argv = [*SMALL, "--quiet", "--out", str(out), "warmup_steps=1", "--data", str(corpus)]
    assert cli.main([*argv, "--steps", "3"]) == 0
    lr = [r["lr"] for r in _metrics(out)]
    # warmup 1 step from 0, then cosine over the 2 steps left (horizon = --steps = 3)
    np.testing.assert_allclose(lr, [0.0, 3e-3, 3e-3 * (0.1 + 0.9 * 0.5)], rtol=1e-6)
    sched = optimizer.make_schedule(TrainConfig(warmup_steps=1, schedule_steps=3))
    assert lr == [float(np.float32(sched(s))) for s in range(3)]
    meta = json.loads((out / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta["train_config"]["schedule_steps"] == 3

    with pytest.raises(
        identity.ResumeRefusedError,
        match=r"schedule_steps 3 -> 5 would change the math \(the cosine horizon "
        r"follows --steps unless schedule_steps is set: add "
        r"schedule_steps=3 to keep the checkpoint's schedule\)",
    ):
        cli.main([*argv, "--steps", "5"])
    capsys.readouterr()
    assert cli.main([*argv, "--steps", "5", "schedule_steps=3"]) == 0  # kept: at the floor
    assert (
        "warning: schedule_steps=3 < --steps 5: the lr reaches its floor 0.0003 (lr * "
        "min_lr_ratio) at step 4 and stays there for the last 2 steps"
    ) in capsys.readouterr().out
    recs = _metrics(out)
    assert [r["lr"] for r in recs[:3]] == lr
    np.testing.assert_allclose([r["lr"] for r in recs[3:]], [3e-4, 3e-4], rtol=1e-6)
    assert not any("resume_changes" in r for r in recs)


def test_schedule_steps_is_checked_and_unset_by_default(tmp_path):
    assert TrainConfig().schedule_steps is None
    assert optimizer.schedule_horizon(TrainConfig(), 3000) == 3000
    assert optimizer.schedule_horizon(TrainConfig(schedule_steps=500), 3000) == 500
    assert optimizer.schedule_horizon(TrainConfig(warmup_steps=10), 3) == 11
    tc = cli.parse([*SMALL, "--steps", "1", "--out", "x", "--schedule-steps", "7"]).train
    assert tc.schedule_steps == 7
    for bad in (["schedule_steps=fast"], ["schedule_steps=true"]):
        with pytest.raises(ValueError, match="schedule_steps"):
            cli.parse([*SMALL, "--steps", "1", "--out", "x", *bad])
    with pytest.raises(ValueError, match=r"schedule_steps=0: expected an int >= 1"):
        cli.main([*SMALL, "--steps", "1", "--out", str(tmp_path), "schedule_steps=0"])


def _progress_record(**extra):
    base = dict(step=2, loss=1.0, lm_loss=1.0, aux_loss=0.0, z_loss=0.0, grad_norm=0.5)
    return {**base, "tokens_per_s": 100.0, "step_time": 0.1, **extra}


def test_progress_line_shows_lr():
    rec = _progress_record(lr=0.00125)
    assert " gnorm 0.500 lr 0.00125 100 tok/s " in progress.StepProgress(0, 4).line(rec)
    del rec["lr"]  # a record of an older run
    assert " gnorm 0.500 100 tok/s " in progress.StepProgress(0, 4).line(rec)


def test_progress_line_shows_throughput_and_the_worst_layer():
    """The model TFLOP/s per device and MFU (train.step.flops), the most overloaded layer and
    the most idle experts (train.step.expert_load; tests/test_step_metrics.py checks both)."""
    rec = _progress_record(
        model_tflops_per_device=12.25,
        mfu=0.3125,
        expert_overload=[1.5, 2.25],
        expert_min_load=[0.5, 0.0],
        experts_idle=[0, 3],
    )
    line = progress.StepProgress(0, 4).line(rec)
    assert " load max/mean 2.25 (layer 1), idle 3 12.2 TFLOP/s/dev MFU 31.2% 100 tok/s " in line
    rec["mfu"] = None  # CPU
    assert " 12.2 TFLOP/s/dev 100 tok/s " in progress.StepProgress(0, 4).line(rec)


def test_ring_change_is_same_math_and_an_old_checkpoint_reads_auto():
    """`ring` (flat / hierarchical / auto) computes the same pairs in another transfer order:
    a same-math change, like `routing`. A checkpoint written before the key existed reads as
    the default "auto", so resuming it with the default is no change."""
    old = identity.json_value(ModelConfig().as_dict())
    (c,) = identity.compare({"model_config": old}, dict(old, ring="hierarchical"), {}, {})
    assert (c.key, c.old, c.new, c.same_math) == ("ring", "auto", "hierarchical", True)
    before = {k: v for k, v in old.items() if k != "ring"}
    assert identity.compare({"model_config": before}, old, {}, {}) == []


def test_prepared_dataset_resumes_exactly_and_refuses_another(tmp_path, corpus):
    """--data DIR (documents packed with segment ids): stopped at step 3 and resumed to 6, the
    losses are bitwise those of an uninterrupted run, the checkpoint holds grain's loader state
    at the step, and a resume on a re-prepared, different corpus is refused naming both. With
    the schedule of test_schedule_follows_steps_and_is_kept_on_resume (warmup 1, horizon 3),
    whose compiled step these runs reuse."""
    ds = corpus
    args = [*SMALL, *SCHEDULE, "--quiet", "--data", str(ds), "--save-every", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main([*args, "--steps", "3", "--out", str(a)]) == 0
    meta = json.loads((a / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta["data_state"] == {"next_index": 3}
    assert meta["data"]["dataset"]["manifest_sha256"] == sha256_file(ds / "manifest.json")
    assert cli.main([*args, "--steps", "6", "--out", str(a)]) == 0
    assert cli.main([*args, "--steps", "6", "--out", str(b)]) == 0
    resumed, straight = _metrics(a), _metrics(b)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # bitwise on CPU
    assert all(math.isfinite(r["data_time"]) for r in resumed)

    other = word_corpus(tmp_path / "corpus_b", 300, seed=1, max_words=60)
    with pytest.raises(
        identity.ResumeRefusedError,
        match=r"data .*corpus_a/ds \(manifest sha256 \w+\) -> .*corpus_b/ds \(manifest sha256 \w+",
    ):
        cli.main(
            [*SMALL, *SCHEDULE, "--quiet", "--data", str(other), "--steps", "9", "--out", str(a)]
        )


def test_a_checkpoint_of_the_earlier_text_packing_is_a_data_change(run, capsys):
    """A checkpoint written before the packed loader (no "loader" in its data, no loader
    state) read other rows: resuming is a data change, allowed by --allow-changes data, then
    continues by position."""
    meta_file = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["data"].pop("loader")
    meta.pop("data_state")
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(
        identity.ResumeRefusedError,
        match=r"data declaration\.txt \(sha256 \w+\) \(the earlier text packing\) -> declaration",
    ):
        cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(run)])
    assert (
        cli.main([*BASE, "--quiet", "--steps", "3", "--out", str(run), "--allow-changes", "data"])
        == 0
    )
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
