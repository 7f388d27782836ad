"""Crash safety of the trainer: `python -m train` run as a subprocess and SIGKILLed.

Every scenario restarts the same command and must log exactly (bitwise, on CPU) the metrics of
one uninterrupted run, shared by the tests (and by pytest-xdist workers, under a file lock):

* killed mid-training;
* killed during a checkpoint write (`RELAYMOE_TRAIN_FAULT=kill-during-save:9`, the hook in
  `train.checkpoint`): the temporary directory of step 9 is left behind and never restored;
* the newest finalized checkpoint damaged on disk: the restart falls back to the previous step.

SIGINT and SIGTERM stop a run after its current step with that step checkpointed (exit status
130 / 143, one line; a second SIGTERM during that save lets it finish), and the restart again
logs the uninterrupted run's metrics. A file that cannot grow (RLIMIT_FSIZE: EFBIG, as a full
disk gives ENOSPC) during a checkpoint save or a metrics write is one line and exit status 1.

The in-process tests check `train.checkpoint.restore` on a toy state: silent bit flips are
caught by the checksums, a wrong structure is refused, and all-corrupt runs fail clearly.
"""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 10, 3
ARGS = [
    "--config",
    "configs/tiny.yaml",
    "seq_len=32",
    "batch_size=8",
    "--save-every",
    str(SAVE_EVERY),
    "--steps",
    str(STEPS),
]
TIMING = {"tokens_per_s", "step_time", "data_time"}
TIMEOUT_S = 300  # one trainer process (compiles in ~10-20 s)


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "train", *ARGS, "--out", str(out)]


# every trainer process compiles the same step: a persistent compilation cache shared by the
# session's processes (set by the `reference` fixture, which every scenario uses) halves each one
_CACHE: dict[str, str] = {}


def _env(fault: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ckpt.FAULT_ENV}
    env.update(_CACHE)
    if fault:
        env[ckpt.FAULT_ENV] = fault
    return env


def _run(out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """The trainer on `out` to the end (or its fault), stdout and stderr together."""
    return subprocess.run(
        _cmd(out),
        cwd=ROOT,
        env=_env(fault),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )


def _run_ok(out: Path) -> str:
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _values(out: Path) -> list[dict]:
    """Every metric of every step except the timing ones."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in _metrics(out)]


def _resumed_step(log: str) -> int:
    found = re.findall(r"resumed from \S+ step (\d+)", log)
    assert len(found) == 1, log[-3000:]
    return int(found[0])


def _listing(out: Path) -> list[str]:
    return sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: (len(n), n))


def _assert_checkpoints_intact(out: Path, steps: list[int]) -> None:
    """The run's finalized steps are `steps`, no temporary directory is left, and every step
    restores (without a target) to leaves matching the checksums saved with it."""
    assert _listing(out) == [str(s) for s in steps]
    opts = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(out / "checkpoints", options=opts) as mngr:
        assert list(mngr.all_steps()) == steps
        for s in steps:
            got = mngr.restore(
                s,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()
                ),
            )
            leaves = [got["state"][k] for k in sorted(got["state"])]
            assert got["meta"]["step"] == s
            assert ckpt.checksums(leaves) == got["meta"]["checksums"], s


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One uninterrupted run (its directory, which tests must not modify, and its metrics),
    made once per session even across xdist workers."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "kill_reference"
    _CACHE.update(
        JAX_COMPILATION_CACHE_DIR=str(root / "kill_jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    with open(root / "kill_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "kill_reference.done").exists():
            shutil.rmtree(out, ignore_errors=True)
            _run_ok(out)
            (root / "kill_reference.done").touch()
    values = _values(out)
    assert [r["step"] for r in values] == list(range(1, STEPS + 1))
    return out, values


def _wait_until(ready, proc: subprocess.Popen, deadline_s: float) -> None:
    """Poll `ready()` until true; fails if the process ends first or time runs out."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if ready():
            return
        assert proc.poll() is None, "the trainer ended before it could be killed"
        time.sleep(0.01)
    pytest.fail(f"the trainer did not get there in {deadline_s} s")


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def test_sigkill_mid_training_then_restart_matches(tmp_path, reference):
    """Killed once step 3 is committed and at least 5 steps are logged: resumes from 3 or 6."""
    out = tmp_path / "run"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            _cmd(out), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            _wait_until(
                lambda: _lines(out / "metrics.jsonl") >= 5 and (out / "checkpoints" / "3").is_dir(),
                proc,
                TIMEOUT_S,
            )
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    logged = len(_metrics(out))
    assert 5 <= logged < STEPS
    log = _run_ok(out)
    start = _resumed_step(log)
    assert start in (3, 6) and start <= logged
    assert _values(out) == reference[1]


def test_sigkill_during_checkpoint_write_is_never_restored(tmp_path, reference):
    out = tmp_path / "run"
    proc = _run(out, fault="kill-during-save:9")
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:]
    names = _listing(out)
    tmp = [n for n in names if n.startswith("9" + ckpt.TMP_MARK)]
    assert [n for n in names if n not in tmp] == ["3", "6"] and len(tmp) == 1, names
    written = [p for p in (out / "checkpoints" / tmp[0]).rglob("*") if p.is_file()]
    assert any(p.parent.name == "d" for p in written), written  # array data was written
    logged = [r["step"] for r in _metrics(out)]  # step 10 runs while 9 is written
    assert logged in (list(range(1, 10)), list(range(1, 11))), logged

    log = _run_ok(out)
    assert _resumed_step(log) == 6
    assert _values(out) == reference[1]
    _assert_checkpoints_intact(out, [9, 10])


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def test_damaged_latest_checkpoint_falls_back_to_previous(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    victim = _largest_data_file(out / "checkpoints" / "10")
    os.truncate(victim, victim.stat().st_size // 2)

    log = _run_ok(out)
    assert "checkpoint step 10" in log and "cannot be restored" in log, log[-3000:]
    assert _resumed_step(log) == 9
    assert _values(out) == reference[1]
    assert (out / "corrupt_checkpoints" / "10").is_dir()
    _assert_checkpoints_intact(out, [9, 10])


# --- SIGINT / SIGTERM: checkpoint the last completed step, exit 130 / 143 -------------------


def _tmp_dirs(out: Path, min_step: int = 0) -> list[Path]:
    """The temporary directories of saves in progress (of steps >= min_step)."""
    d = out / "checkpoints"
    names = [p for p in d.iterdir() if ckpt.TMP_MARK in p.name] if d.is_dir() else []
    return [p for p in names if int(p.name.split(".")[0]) >= min_step]


def _interrupt(tmp_path: Path, signum: int, again_while_saving: bool = False):
    """Run the trainer, send `signum` once 4 steps are logged (and, with `again_while_saving`,
    again as soon as the temporary directory of a checkpoint of step 4 or later appears: the
    stop's save, not step 3's periodic one that may still be running); (out, returncode, stdout,
    stderr, whether the second signal was sent while the process ran)."""
    out = tmp_path / "run"
    with open(tmp_path / "out.log", "w") as so, open(tmp_path / "err.log", "w") as se:
        proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=so, stderr=se)
        try:
            _wait_until(lambda: _lines(out / "metrics.jsonl") >= 4, proc, TIMEOUT_S)
            proc.send_signal(signum)
            sent_again = False
            if again_while_saving:
                end = time.monotonic() + 60
                while proc.poll() is None and time.monotonic() < end:
                    if _tmp_dirs(out, min_step=4):
                        proc.send_signal(signum)
                        sent_again = proc.poll() is None
                        break
                    time.sleep(0.002)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return (
        out,
        code,
        (tmp_path / "out.log").read_text(),
        (tmp_path / "err.log").read_text(),
        sent_again,
    )


def _check_stopped(out: Path, err: str, name: str) -> int:
    """The stop line names the step it saved, which is the last logged one, finalized."""
    lines = [ln for ln in err.splitlines() if not ln.startswith(f"{name} again: ")]
    assert len(lines) == 1, err
    m = re.fullmatch(
        rf"interrupted by {name} after step (\d+): checkpoint step (\d+) saved in "
        rf"(\S+); rerun the same command to resume",
        lines[0],
    )
    assert m and m[1] == m[2] and Path(m[3]) == (out / "checkpoints").resolve(), lines[0]
    step = int(m[1])
    assert 4 <= step < STEPS
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 1))
    assert step in [int(n) for n in _listing(out)] and not _tmp_dirs(out), _listing(out)
    return step


def test_sigint_checkpoints_the_current_step_and_resumes_bitwise(tmp_path, reference):
    out, code, stdout, err, _ = _interrupt(tmp_path, signal.SIGINT)
    assert code == 130, (stdout[-2000:], err)
    assert "Traceback" not in stdout + err
    head = stdout.splitlines()
    assert (
        head[0].startswith("data: 1 document(s), 8,152 tokens in ")
        and head[1].startswith("building configs/tiny.yaml: ")
        and head[2].startswith("compiling the train step (")
        and head[3].startswith("train step ready in ")
    ), head[:4]
    step = _check_stopped(out, err, "SIGINT")
    assert _resumed_step(_run_ok(out)) == step
    assert _values(out) == reference[1]


def test_sigterm_twice_lets_the_save_finish_and_resumes_bitwise(tmp_path, reference):
    """The second SIGTERM lands while the checkpoint of the stop is being written: a note, the
    save completes, the run exits 143 and resumes from that step."""
    out, code, stdout, err, sent_again = _interrupt(
        tmp_path, signal.SIGTERM, again_while_saving=True
    )
    assert code == 143, (stdout[-2000:], err)
    assert "Traceback" not in stdout + err
    step = _check_stopped(out, err, "SIGTERM")
    assert sent_again, "the save ended before the second signal could be sent"
    assert "SIGTERM again: still finishing the step in progress and its checkpoint" in err
    assert _resumed_step(_run_ok(out)) == step
    assert _values(out) == reference[1]


def test_sigint_during_the_first_compile_stops_at_once(tmp_path):
    """Ctrl-C while the first step compiles: nothing ran, so nothing is saved, and the run does
    not wait for the compile to end (it runs in a helper thread, `interrupt.unless_stopped`).
    A shape of its own and no compilation cache: a cold compile, which takes seconds; the
    signal goes as soon as the compile starts. A repeated Ctrl-C never speaks of a step or a
    checkpoint to finish."""
    out = tmp_path / "run"
    cmd = ["seq_len=24" if a == "seq_len=32" else a for a in _cmd(out)]
    env = {k: v for k, v in _env().items() if k not in _CACHE}
    with open(tmp_path / "out.log", "w") as so, open(tmp_path / "err.log", "w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se)
        try:
            log = tmp_path / "out.log"
            _wait_until(lambda: "compiling the train step" in log.read_text(), proc, TIMEOUT_S)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    stdout, err = log.read_text(), (tmp_path / "err.log").read_text()
    assert code == 130, (stdout, err)
    assert "train step ready" not in stdout, stdout  # stopped before the compile ended
    lines = [ln for ln in err.splitlines() if ln != "SIGINT again: " + STOPPING_NOTE]
    assert lines == [
        "interrupted by SIGINT before the first step; nothing new to save (no checkpoint yet)"
    ], err
    assert not (out / "metrics.jsonl").exists() or not _lines(out / "metrics.jsonl")


STOPPING_NOTE = "stopping before the first step; nothing to finish or save"


# --- disk full (RLIMIT_FSIZE: writes past the size fail with EFBIG) -----------------------

# a fresh interpreter sets the limit and execs the trainer (a preexec_fn would run Python in a
# fork of this multithreaded process); SIGXFSZ ignored, kept across exec: EFBIG, not a kill
_LIMITED = (
    "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def _with_file_size_limit(nbytes: int, cmd: list[str]) -> list[str]:
    assert cmd[0] == sys.executable
    return [sys.executable, "-c", _LIMITED, str(nbytes), *cmd[1:]]


@pytest.mark.parametrize(
    "limit, extra, said",
    [
        (
            100_000,
            [],
            r"error: saving a checkpoint in (\S+) failed: File too large \(EFBIG\): "
            r"\S+/3\.orbax-checkpoint-tmp\S* \(the newest complete checkpoint: none\)",
        ),
        (1_500, ["--save-every", "100"], r"error: writing (\S+) failed: File too large \(EFBIG\)"),
    ],
    ids=["checkpoint", "metrics"],
)
def test_disk_full_is_one_line(tmp_path, reference, limit, extra, said):
    """A checkpoint file or the metrics log cannot grow: one line naming the path and the
    operating system's message (no orbax or asyncio tracebacks), exit status 1."""
    out = tmp_path / "run"
    proc = subprocess.run(
        _with_file_size_limit(limit, [*_cmd(out), *extra]),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert re.fullmatch(said, proc.stderr.strip()), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout


# --- in-process: restore() on a toy state ---------------------------------------------------


def _toy_state(seed: int):
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    rng = np.random.default_rng(seed)
    w = jax.device_put(rng.standard_normal((64, 256), np.float32), NamedSharding(mesh, P("x")))
    b = jax.device_put(rng.standard_normal((256,), np.float32), NamedSharding(mesh, P()))
    n = jax.device_put(np.int32(seed), NamedSharding(mesh, P()))
    return {"w": w, "b": b, "n": n}


def _save_toy(tmp_path) -> tuple[Path, dict]:
    """A run directory with toy checkpoints at steps 1 and 2; the states saved."""
    states = {s: _toy_state(s) for s in (1, 2)}
    mngr = ckpt.manager(tmp_path)
    for s, st in states.items():
        ckpt.save(mngr, s, st, {})
    mngr.wait_until_finished()
    mngr.close()
    return tmp_path / "checkpoints", states


def _restore_toy(run: Path, like):
    mngr = ckpt.manager(run)
    try:
        return ckpt.restore(mngr, like)
    finally:
        mngr.close()


def _equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_bit_flips_never_restore_wrong_values(tmp_path):
    """Orbax restores some single-bit flips in a compressed data file as wrong values without
    an error; restore() must then fall back to step 1, never return wrong values of step 2."""
    ckdir, states = _save_toy(tmp_path / "src")
    victim = _largest_data_file(ckdir / "2")
    rng = np.random.default_rng(0)
    outcomes = []
    for trial in range(6):
        run = tmp_path / f"t{trial}"
        shutil.copytree(tmp_path / "src", run)
        f = run / victim.relative_to(tmp_path / "src")
        data = bytearray(f.read_bytes())
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        f.write_bytes(bytes(data))
        step, state, _ = _restore_toy(run, states[1])
        assert _equal(state, states[step]), (trial, step)
        outcomes.append(step)
    assert 1 in outcomes, outcomes  # random floats compress badly: flips change values


def test_checksum_mismatch_falls_back(tmp_path, capfd):
    ckdir, states = _save_toy(tmp_path)
    _break_checksum(ckdir / "2", leaf=0)  # leaf 0 in jax.tree order: "b"
    step, state, _ = _restore_toy(tmp_path, states[1])
    assert step == 1 and _equal(state, states[1])
    err = capfd.readouterr().err
    assert "checkpoint step 2" in err and "checksum mismatch" in err and "['b']" in err, err
    assert (tmp_path / "corrupt_checkpoints" / "2").is_dir()
    assert sorted(p.name for p in ckdir.iterdir()) == ["1"]


def _break_checksum(step_dir: Path, leaf: int = 0) -> None:
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["checksums"][leaf][0] ^= 1
    meta_file.write_text(json.dumps(meta))


def test_all_checkpoints_corrupt_or_mismatched_raise(tmp_path):
    """(A file that fails to read is covered by the subprocess test above: in-process, orbax's
    abandoned read coroutines would warn during whichever test runs next.)"""
    ckdir, states = _save_toy(tmp_path)
    other = {**states[1], "extra": states[1]["b"]}
    with pytest.raises(ckpt.StateMismatchError, match="different state structure"):
        _restore_toy(tmp_path, other)
    for s in (1, 2):
        _break_checksum(ckdir / str(s))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"steps \[2, 1\] all failed"):
        _restore_toy(tmp_path, states[1])
    assert sorted(p.name for p in ckdir.iterdir()) == ["1", "2"]  # nothing moved
