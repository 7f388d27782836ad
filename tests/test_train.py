"""The trainer (`python -m train`), run in-process through `train.cli.main` on the tiny config.

Steps are numbered from 1 in metrics.jsonl. Resume is checked bitwise on CPU: a 6-step run
continued to 9 steps logs exactly the losses of an uninterrupted 9-step run.

The model is the tiny config with one layer and the aux-loss-free expert bias on (`SMALL`): the
runs that differ only in their data source or length (the resume, the dropped metrics, the
memory table's trained step, x64's reference run) share one compiled step.
"""

import json
import math
import re
import struct

import numpy as np
import pytest

from train import cli
from train.data import DEFAULT_TEXT, make_source
from train.data.synthetic import SyntheticSource
from train.data.tokenizers import byte_tokenize
from train.run import guards

BIAS = ["expert_bias=true", "expert_bias_rate=0.01"]
SMALL = [
    "--config",
    "configs/tiny.yaml",
    "seq_len=32",
    "batch_size=8",
    "num_hidden_layers=1",
    *BIAS,
    "--quiet",
]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _events(out):
    """{tag: [(step, value)]} of the run's TensorBoard event files, read by TensorBoard's own
    reader (which hides what a later writer purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_train_resume_matches_uninterrupted(tmp_path):
    """Also covers what test_expert_bias_is_checkpointed did: the runs move the expert bias
    (`SMALL`), so the resumed run logs the uninterrupted one's losses only if the bias was
    saved and restored."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main([*SMALL, "--steps", "6", "--out", str(a), "--save-every", "4"]) == 0
    first = _metrics(a)
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
    for r in first:
        for k in ("loss", "lm_loss", "aux_loss", "z_loss", "tokens_per_s", "step_time"):
            assert math.isfinite(r[k]), (k, r)
    assert first[-1]["loss"] < first[0]["loss"]
    assert sorted(p.name for p in (a / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "6"]

    assert cli.main([*SMALL, "--steps", "9", "--out", str(a), "--save-every", "4"]) == 0
    resumed = _metrics(a)
    assert [r["step"] for r in resumed] == list(range(1, 10))
    assert resumed[:6] == first

    assert cli.main([*SMALL, "--steps", "9", "--out", str(b), "--save-every", "4"]) == 0
    straight = _metrics(b)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # bitwise on CPU
    # the throughput and load fields (tests/test_step_metrics.py checks their values)
    for r in resumed:
        assert r["model_tflops_per_device"] > 0 and r["mfu"] is None  # CPU: no known peak
        assert len(r["expert_overload"]) == 1 and r["expert_overload"][0] >= 1.0
    # the TensorBoard events of both runs into one directory: every step once, as logged
    events = _events(a)
    assert [s for s, _ in events["loss"]] == list(range(1, 10))
    np.testing.assert_allclose([v for _, v in events["loss"]], [r["loss"] for r in resumed], 1e-6)
    overload = [v for _, v in events["expert_overload/layer_0"]]
    np.testing.assert_allclose(overload, [r["expert_overload"][0] for r in resumed], 1e-6)
    assert "model_tflops_per_device" in events and "mfu" not in events
    assert (a / "expert_load.png").read_bytes()[:4] == b"\x89PNG"

    # a rerun at the same step count does nothing and keeps the log
    assert cli.main([*SMALL, "--steps", "9", "--out", str(a)]) == 0
    assert _metrics(a) == resumed


def test_metrics_past_checkpoint_are_dropped_on_resume(tmp_path):
    out = tmp_path / "run"
    assert cli.main([*SMALL, "--steps", "2", "--out", str(out), "--synthetic"]) == 0
    log = out / "metrics.jsonl"
    lines = log.read_text().splitlines()
    fake = json.dumps({**json.loads(lines[-1]), "step": 3, "loss": -1.0})
    log.write_text("\n".join([*lines, fake, '{"step": 4, "lo']) + "\n")  # crash after save
    # and its TensorBoard event of step 3, appended to the run's event file as the run would have
    from tensorboardX.proto import event_pb2, summary_pb2
    from tensorboardX.record_writer import masked_crc32c

    value = summary_pb2.Summary.Value(tag="loss", simple_value=-1.0)
    data = event_pb2.Event(step=3, summary=summary_pb2.Summary(value=[value])).SerializeToString()
    head = struct.pack("Q", len(data))
    (events,) = (out / "tensorboard").glob("events.*")
    with open(events, "ab") as f:
        f.write(head + struct.pack("I", masked_crc32c(head)) + data)
        f.write(struct.pack("I", masked_crc32c(data)))
    prof = ["--profile-steps", "3:3"]  # also: a resumed run traces its step 3
    assert cli.main([*SMALL, "--steps", "3", "--out", str(out), "--synthetic", *prof]) == 0
    recs = _metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3]
    (xplane,) = (out / "profile").rglob("*.xplane.pb")  # XProf's format
    names = (b"ring_fwd_hop", b"ring_bwd_hop", b"attention", b"lm_loss", b"optimizer")
    assert all(n in xplane.read_bytes() for n in names)  # the program's named scopes
    assert recs[2]["loss"] > 0
    events = _events(out)["loss"]  # the fake step 3 purged by the resumed run's writer
    assert [s for s, _ in events] == [1, 2, 3]
    assert events[2][1] == pytest.approx(recs[2]["loss"], rel=1e-6)


def test_nonfinite_loss_stops_and_keeps_checkpoint(tmp_path):
    out = tmp_path / "nan"
    with pytest.raises(guards.NonFiniteLossError, match="last good checkpoint is step") as e:
        cli.main(
            [
                *SMALL,
                "--steps",
                "6",
                "--out",
                str(out),
                "--save-every",
                "1",
                "--synthetic",
                "lr=1e30",
                "warmup_steps=0",
                "clip_norm=1e30",
            ]
        )
    bad = int(re.search(r"at step (\d+)", str(e.value))[1])
    assert 2 <= bad <= 6
    assert f"checkpoint is step {bad - 1} " in str(e.value)
    kept = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-1] == bad - 1
    assert [r["step"] for r in _metrics(out)] == list(range(1, bad))


def test_text_data_is_deterministic_and_cycles():
    """The shipped text through the trainer's path (prepared into the cache, then the packed
    loader): fixed by the seed, each epoch's rows are the text cut into rows of seq_len, every
    row once, and the next epoch is another permutation."""
    kw = dict(synthetic=False, seq_len=32, batch_size=8, vocab_size=256)
    d, again = make_source(None, seed=3, **kw), make_source(None, seed=3, **kw)
    stream = np.append(byte_tokenize(DEFAULT_TEXT.read_text()), np.int32(10))  # 1 doc, EOD
    n = len(stream) // 32
    steps_per_epoch = n // 8
    batches = [next(d) for _ in range(steps_per_epoch + 3)]
    for b in batches:
        assert b.tokens.shape == (8, 32) and b.tokens.dtype == np.int32
        np.testing.assert_array_equal(b.tokens, next(again).tokens)
    epoch0 = np.concatenate([b.tokens for b in batches[:steps_per_epoch]])
    grid = stream[: n * 32].reshape(n, 32)
    assert {r.tobytes() for r in epoch0} <= {r.tobytes() for r in grid}
    assert len({r.tobytes() for r in epoch0}) == len(epoch0)  # no repeats within an epoch
    other = make_source(None, seed=4, **kw)
    assert not np.array_equal(batches[0].tokens, next(other).tokens)
    syn = SyntheticSource(16, 4, 0, 256)
    np.testing.assert_array_equal(syn.batch(7), SyntheticSource(16, 4, 0, 256).batch(7))


@pytest.mark.parametrize(
    "extra, err, match",
    [
        (["--data", "/nonexistent/x.txt"], FileNotFoundError, "data file not found"),
        (["seq_len=100000"], ValueError, "max_position_embeddings"),
        (["seq_len=9000", "max_position_embeddings=16384"], ValueError, "no row can be filled"),
        (["num_experts=6"], ValueError, "num_experts"),
        (["lr=fast"], ValueError, "lr"),
    ],
)
def test_bad_input_fails_before_compiling(tmp_path, extra, err, match):
    argv = ["--config", "configs/tiny.yaml", "--steps", "1", "--out", str(tmp_path / "x"), *extra]
    if not any(a.startswith("seq_len=") for a in extra):
        argv.append("seq_len=32")
    with pytest.raises(err, match=match):
        cli.main(argv)


@pytest.mark.parametrize(
    "text, match",
    [
        ("hidden_size: 64\nhiden_layers: 2\n", r"bad\.yaml:2.*hiden_layers"),
        ("hidden_size: [64\n", r"bad\.yaml"),
    ],
)
def test_bad_config_file_fails_before_compiling(tmp_path, text, match):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=match):
        cli.main(["--config", str(bad), "--steps", "1", "--out", str(tmp_path / "x")])


def test_memory_table_compares_dispatchers(tmp_path, capsys):
    from relaymoe_jax.models.config_files import load_config
    from train.planner import memory
    from train.settings import TrainConfig
    from train.step import mesh as tm
    from train.step import train_step

    assert (
        cli.main([*SMALL, "--steps", "1", "--out", str(tmp_path), "--synthetic", "--memory-table"])
        == 0
    )
    out = capsys.readouterr().out
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in out.splitlines()
        if line.startswith("| ring") or line.startswith("| alltoall")
    }
    assert list(rows) == [label for label, _ in memory.MEMORY_TABLE_ROWS]
    assert rows["ring"][0].strip() == "trained"
    assert {r[0].strip() for lbl, r in rows.items() if lbl != "ring"} == {"compile-only"}
    total = {lbl: float(r[3]) for lbl, r in rows.items()}
    assert total["alltoall (dropless)"] > total["ring"]
    # the trained step (real state) and the abstract compile agree on the ring's memory
    tc = TrainConfig(seq_len=32, batch_size=8, synthetic=True)
    cfg = load_config("configs/tiny.yaml").replace(
        num_hidden_layers=1, expert_bias=True, expert_bias_rate=0.01
    )
    abstract = train_step.compile_abstract(cfg, tc, tm.make_mesh(tc.mesh), memo=False)
    assert f"{memory.footprint(abstract.memory_analysis()) / 2**20:,.2f}" == rows["ring"][3].strip()
    assert out.rstrip().splitlines()[-1] == f"loss curve: {tmp_path / 'loss.png'}"


def test_the_trainer_runs_under_x64(tmp_path):
    """jax_enable_x64=True (int64 indices everywhere by default): the same losses as without."""
    import jax

    args = [*SMALL, "--steps", "2", "--synthetic"]
    assert cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    with jax.enable_x64(True):
        assert cli.main([*args, "--out", str(tmp_path / "b")]) == 0
    want, got = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
