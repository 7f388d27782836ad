"""Crash safety of the trainer: `python -m train` run as a subprocess, interrupted and killed.

Every scenario restarts the same command and must log exactly (bitwise, on CPU) the metrics of
one uninterrupted run, shared by the tests (`reference`: run in this process by `cli.main`, on
pytest's 8 devices as the trainer's, so the same programs: the trainer processes read them back
from the compilation cache this process wrote, tests/conftest.py).

The scenarios run as one chain of trainer processes on one run directory (`chain`, a module
fixture; each process pays the interpreter's and jax's start-up, so one process per scenario),
each restart resuming where the previous process stopped, and the last one ending at the
uninterrupted run's metrics:

1. SIGINT once 4 steps are logged: stops after its current step with that step checkpointed
   (exit status 130, one line);
2. the restart resumes from that step and holds its first step until a SIGTERM comes (`_HELD`);
   a second SIGTERM during the stop's checkpoint lets the save finish (exit status 143) -- the
   restart resumes from that step;
3. killed during a checkpoint write (`RELAYMOE_TRAIN_FAULT=kill-during-save:9`, the hook in
   `train.state.checkpoint`): the temporary directory of step 9 is left behind and never
   restored;
4. the newest finalized checkpoint damaged on disk: the restart falls back to the previous
   step and trains to the end, logging the uninterrupted run's metrics.

SIGINT during the first compile stops at once. A step that never ends (blocked inside XLA, `_HELD`)
is stopped at once by a second SIGTERM, naming the newest committed checkpoint. A file that cannot
grow (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) during a checkpoint save or a metrics write
is one line and exit status 1.

The in-process tests check `train.state.checkpoint.restore` on a toy state: silent bit flips are
caught by the checksums, a wrong structure is refused, and all-corrupt runs fail clearly.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import cli
from train.state import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 10, 3
# one decoder layer: what is tested is the process (signals, saves, restores, resumes), the
# same for any model; one layer shortens each process's tracing and compiles
ONE_LAYER = "num_hidden_layers=1"
ARGS = [
    "--config",
    "configs/tiny.yaml",
    "seq_len=32",
    "batch_size=8",
    ONE_LAYER,
    "--save-every",
    str(SAVE_EVERY),
    "--steps",
    str(STEPS),
]
TIMING = {"tokens_per_s", "step_time", "data_time", "model_tflops_per_device", "mfu"}
TIMEOUT_S = 300  # one trainer process (compiles in ~10-20 s)


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "train", *ARGS, "--out", str(out)]


# the trainer with its step N held (`python -c _HELD MODE N ARGS...`; no hook in the trainer):
# "until-signal" runs it once the first signal is recorded, so the run stops after exactly step N;
# "forever" blocks it inside XLA (a host callback that never returns), as a deadlocked kernel would
_HELD = """
import sys, threading, time
import jax, numpy as np
from jax.experimental import io_callback
from train import cli
from train.run import loop

mode, held, run_step = sys.argv.pop(1), int(sys.argv.pop(1)), loop._step
never = threading.Event()
result = jax.ShapeDtypeStruct((), np.int32)
stuck = jax.jit(lambda: io_callback(lambda: np.int32(never.wait()), result))

def step(t, state, s):
    if s == held:
        print(f"step {s} held", flush=True)
        if mode == "forever":
            jax.device_get(stuck())
        while t.stop.signum is None:
            time.sleep(0.005)
    return run_step(t, state, s)

loop._step = step
cli.entry()
"""


def _held_cmd(out: Path, mode: str, step: int) -> list[str]:
    return [sys.executable, "-c", _HELD, mode, str(step), *ARGS, "--out", str(out)]


def _env(fault: str | None = None) -> dict:
    """This process's environment (with its compilation cache, tests/conftest.py: the trainer
    processes compile the same step and read it back), with `fault` as the trainer's fault
    hook."""
    env = {k: v for k, v in os.environ.items() if k != ckpt.FAULT_ENV}
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
    """One uninterrupted run (its directory, which tests must not modify, and its metrics), in
    this process: the command's run without its process start-up (the module docstring). It
    also fills the compilation cache before a trainer process with a file size limit starts
    (`test_disk_full_is_one_line`: a cache entry it wrote would fail)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert cli.main([*ARGS, "--out", str(out), "--quiet"]) == 0
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


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _tmp_dirs(out: Path, min_step: int = 0) -> list[Path]:
    """The temporary directories of saves in progress (of steps >= min_step)."""
    d = out / "checkpoints"
    names = [p for p in d.iterdir() if ckpt.TMP_MARK in p.name] if d.is_dir() else []
    return [p for p in names if int(p.name.split(".")[0]) >= min_step]


@dataclass
class Stage:
    """One trainer process of the chain: its exit status, output, and the run directory as it
    left it."""

    code: int
    stdout: str
    err: str = ""
    sent_again: bool = False  # the second signal went while the process ran
    listing: list | None = None  # the checkpoints/ directory's entries
    logged: list | None = None  # the steps in metrics.jsonl
    tmp_files: list | None = None  # the files in a temporary checkpoint directory

    @classmethod
    def left(cls, out: Path, **kw) -> "Stage":
        return cls(**kw, listing=_listing(out), logged=[r["step"] for r in _metrics(out)])


def _interrupt(out: Path, logs: Path, signum: int, after=0, held=0, again_while_saving=False):
    """Run the trainer on `out` and send `signum` once `after` steps are logged, or with `held`,
    once the trainer holds step `held` until a signal comes (`_HELD`), so that it stops after
    exactly that step; with `again_while_saving`, send it again as soon as the temporary
    directory of that step's checkpoint appears (the stop's save, not an earlier periodic one
    that may still be running)."""
    logs.mkdir()
    log = logs / "out.log"
    cmd = _held_cmd(out, "until-signal", held) if held else _cmd(out)
    with open(log, "w") as so, open(logs / "err.log", "w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=so, stderr=se)
        try:
            if held:
                _wait_until(lambda: f"step {held} held" in log.read_text(), proc, TIMEOUT_S)
            else:
                _wait_until(lambda: _lines(out / "metrics.jsonl") >= after, proc, TIMEOUT_S)
            proc.send_signal(signum)
            sent_again = False
            if again_while_saving:
                assert held, "the second signal needs the step the run stops after"
                end = time.monotonic() + 60
                while proc.poll() is None and time.monotonic() < end:
                    if _tmp_dirs(out, min_step=held):
                        proc.send_signal(signum)
                        sent_again = proc.poll() is None
                        break
                    time.sleep(0.002)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    stdout, err = log.read_text(), (logs / "err.log").read_text()
    return Stage.left(out, code=code, stdout=stdout, err=err, sent_again=sent_again)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, reference) -> dict[str, Stage]:
    """The scenarios of the module docstring, one trainer process each, on one run directory
    (`chain["out"]`): "sigint", "sigterm" (its restart resumes from the SIGINT's step), "fault"
    (killed during step 9's save), and "damaged" (the newest finalized checkpoint truncated
    before it ran: `chain["damaged_step"]`). Each test checks its stage; the last stage's
    metrics must equal the reference run's."""
    root = tmp_path_factory.mktemp("chain")
    out = root / "run"
    got: dict = {"out": out}
    got["sigint"] = _interrupt(out, root / "a", signal.SIGINT, after=4)
    assert got["sigint"].code == 130, (got["sigint"].stdout[-2000:], got["sigint"].err)
    s1 = got["sigint"].logged[-1]
    got["sigterm"] = _interrupt(
        out, root / "b", signal.SIGTERM, held=s1 + 1, again_while_saving=True
    )
    assert got["sigterm"].code == 143, (got["sigterm"].stdout[-2000:], got["sigterm"].err)

    proc = _run(out, fault="kill-during-save:9")
    tmp = [p for p in _tmp_dirs(out) if p.name.startswith("9" + ckpt.TMP_MARK)]
    got["fault"] = Stage.left(out, code=proc.returncode, stdout=proc.stdout)
    got["fault"].tmp_files = [p for t in tmp for p in t.rglob("*") if p.is_file()]

    finalized = [int(n) for n in got["fault"].listing if ckpt.TMP_MARK not in n]
    assert finalized, got["fault"].listing
    got["damaged_step"] = finalized[-1]
    victim = _largest_data_file(out / "checkpoints" / str(finalized[-1]))
    os.truncate(victim, victim.stat().st_size // 2)
    got["damaged"] = Stage(code=0, stdout=_run_ok(out))
    return got


def test_sigint_checkpoints_the_current_step_and_resumes_bitwise(chain, reference):
    """The first process of the chain: SIGINT once 4 steps are logged. The next process
    resumes from the step it saved (and the chain ends at the uninterrupted run's metrics)."""
    a = chain["sigint"]
    assert "Traceback" not in a.stdout + a.err
    head = a.stdout.splitlines()
    assert (
        head[0].startswith("data: 1 document(s), 8,152 tokens in ")
        and head[1].startswith("building configs/tiny.yaml: ")
        and head[2].startswith("compiling the train step (")
        and head[3].startswith("train step ready in ")
    ), head[:4]
    step = _check_stopped(chain["out"], a, "SIGINT")
    assert 4 <= step < STEPS
    assert _resumed_step(chain["sigterm"].stdout) == step
    assert _values(chain["out"]) == reference[1]


def test_sigterm_twice_lets_the_save_finish_and_resumes_bitwise(chain, reference):
    """The second process of the chain, resumed from the SIGINT's step, which it holds until
    the SIGTERM comes: the second SIGTERM lands while the checkpoint of that step, the stop's, is
    being written: a note naming it, the save completes, the run exits 143 with the stop's line,
    and the next process resumes from that step."""
    b = chain["sigterm"]
    assert "Traceback" not in b.stdout + b.err
    step = _check_stopped(chain["out"], b, "SIGTERM")
    assert step == chain["sigint"].logged[-1] + 1 < STEPS
    assert b.sent_again, "the save ended before the second signal could be sent"
    assert b.err.splitlines().count(f"SIGTERM again while {NOTE.format(step)}") == 1, b.err
    assert _resumed_step(chain["fault"].stdout) == step
    assert _values(chain["out"]) == reference[1]


def test_sigkill_during_checkpoint_write_is_never_restored(chain, reference):
    """The third process of the chain, resumed from the SIGTERM's step, is SIGKILLed while it
    writes step 9's checkpoint (step 10 may be running): the temporary directory is left
    behind, with array data in it, beside the two newest finalized checkpoints (step 6, or the
    SIGTERM's step if later, the newest). The restart never restores it (it falls back to a
    finalized step: see test_damaged_latest_checkpoint_falls_back_to_previous) and ends at the
    uninterrupted run's metrics. Also covers what test_sigkill_mid_training_then_restart_matches
    did, in a process of its own: a SIGKILL while training (here step 10 may be running), then
    restarts that end at the uninterrupted run's metrics."""
    c = chain["fault"]
    assert c.code == -signal.SIGKILL, c.stdout[-3000:]
    tmp = [n for n in c.listing if n.startswith("9" + ckpt.TMP_MARK)]
    finalized = [n for n in c.listing if n not in tmp]
    assert len(tmp) == 1 and len(finalized) == 2, c.listing
    assert int(finalized[-1]) == max(6, chain["sigterm"].logged[-1]), c.listing
    assert any(p.parent.name == "d" for p in c.tmp_files), c.tmp_files  # array data written
    assert c.logged in (list(range(1, 10)), list(range(1, 11))), c.logged
    assert _resumed_step(chain["damaged"].stdout) < 9
    assert _values(chain["out"]) == reference[1]


def test_damaged_latest_checkpoint_falls_back_to_previous(chain, reference):
    """The last process of the chain: the newest finalized checkpoint (left by the killed
    process) truncated on disk: it is moved aside, the run resumes from the one before and ends
    at the uninterrupted run's metrics, every checkpoint it leaves intact."""
    out, log, bad = chain["out"], chain["damaged"].stdout, chain["damaged_step"]
    assert f"checkpoint step {bad}" in log and "cannot be restored" in log, log[-3000:]
    assert log.count("cannot be restored") == 1, log[-3000:]  # step 9's temporary one: never
    finalized = [int(n) for n in chain["fault"].listing if ckpt.TMP_MARK not in n]
    assert _resumed_step(log) == finalized[-2]
    assert _values(out) == reference[1]
    assert (out / "corrupt_checkpoints" / str(bad)).is_dir()
    _assert_checkpoints_intact(out, [9, 10])


# a second signal's note while the stop's checkpoint is written (`train.run.interrupt`)
NOTE = (
    "checkpoint step {} is being written: waiting for it, then exiting (SIGKILL stops at once; "
    "an unfinished save is never restored)"
)


def _check_stopped(out: Path, stage: Stage, name: str) -> int:
    """The stop line names the step it saved, which is the last logged one, finalized, with no
    save left in progress."""
    note = rf"{name} again while " + re.escape(NOTE).replace(re.escape("{}"), r"\d+")
    lines = [ln for ln in stage.err.splitlines() if not re.fullmatch(note, ln)]
    assert len(lines) == 1, stage.err
    m = re.fullmatch(
        rf"interrupted by {name} after step (\d+): checkpoint step (\d+) saved in "
        rf"(\S+); rerun the same command to resume",
        lines[0],
    )
    assert m and m[1] == m[2] and Path(m[3]) == (out / "checkpoints").resolve(), lines[0]
    step = int(m[1])
    assert stage.logged == list(range(1, step + 1)), stage.logged
    assert str(step) in stage.listing, stage.listing
    assert not any(ckpt.TMP_MARK in n for n in stage.listing), stage.listing
    return step


def test_sigint_during_the_first_compile_stops_at_once(tmp_path):
    """Ctrl-C while the first step compiles: nothing ran, so nothing is saved, and the run does
    not wait for the compile to end (it runs in a helper thread, `interrupt.unless_stopped`).
    A shape of its own, the config's two layers and no compilation cache: a cold compile, which
    takes seconds; the signal goes as soon as the compile starts. A repeated Ctrl-C, if it lands
    before the run has stopped, stops it at once too: one line whichever way (also when it lands
    after the run gave the handlers back), never about a step or a checkpoint to finish."""
    out = tmp_path / "run"
    cmd = ["seq_len=24" if a == "seq_len=32" else a for a in _cmd(out) if a != ONE_LAYER]
    env = {k: v for k, v in _env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
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
    assert err.splitlines() in (
        ["interrupted by SIGINT before the first step; nothing new to save (no checkpoint yet)"],
        [
            "SIGINT again before the first step: stopping now; no checkpoint yet: a rerun starts "
            "from step 0"
        ],
        # the second signal, 10 ms after the first, landed once the run had stopped and given
        # the handlers back (it was reporting): Python's own KeyboardInterrupt, `entry`'s line
        ["interrupted (SIGINT)"],
    ), err
    assert not (out / "metrics.jsonl").exists() or not _lines(out / "metrics.jsonl")


def test_a_second_signal_stops_a_hung_step_at_once(tmp_path):
    """A step that never ends (blocked inside XLA by a host callback that never returns, as by a
    deadlocked kernel, `_HELD`): the first SIGTERM waits for it, as for any step; the second ends
    the process at once, exit status 143, with one line naming the newest committed checkpoint,
    which is intact (every step restores and matches its checksums) and holds no temporary
    directory."""
    out, held = tmp_path / "run", SAVE_EVERY + 2  # after one periodic checkpoint
    log = tmp_path / "out.log"
    with open(log, "w") as so, open(tmp_path / "err.log", "w") as se:
        cmd = _held_cmd(out, "forever", held)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=so, stderr=se)
        try:
            _wait_until(lambda: f"step {held} held" in log.read_text(), proc, TIMEOUT_S)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            first_waited = proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            code = proc.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    stdout, err = log.read_text(), (tmp_path / "err.log").read_text()
    assert first_waited, (stdout[-2000:], err)
    assert code == 143 and took < 10, (code, took, stdout[-2000:], err)
    saved = list(range(SAVE_EVERY, held, SAVE_EVERY))[-2:]  # max_to_keep=2
    assert err.splitlines() == [
        f"SIGTERM again during step {held}: stopping now without saving it; a rerun resumes "
        f"from checkpoint step {saved[-1]} in {(out / 'checkpoints').resolve()}"
    ], err
    assert [r["step"] for r in _metrics(out)] == list(range(1, held))
    _assert_checkpoints_intact(out, saved)


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


# `python -m train ARGS` with the signal `argv[1]` arriving while train/__main__.py imports the
# trainer: the process sends it to itself from an import hook, as `from .cli import entry` starts
_SIGNAL_IN_IMPORT = """
import builtins, os, runpy, signal, sys
real, signum = builtins.__import__, getattr(signal, sys.argv.pop(1))
def hook(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "cli" and level == 1 and (globals or {}).get("__package__") == "train":
        os.kill(os.getpid(), signum)
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = hook
sys.argv[0] = "train"
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_the_trainer_imports_is_one_line(tmp_path, name, code):
    """Ctrl-C or SIGTERM while `python -m train` imports jax and the trainer (its first second;
    a scheduler's SIGTERM can land there): one line, exit status 128 + the signal's number,
    nothing written (before: SIGTERM ended the process silently, exit status -15)."""
    out = tmp_path / "run"
    argv = [sys.executable, "-c", _SIGNAL_IN_IMPORT, name, *ARGS, "--out", str(out)]
    run = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr.strip(), run.stdout) == (code, f"interrupted ({name})", "")
    assert not out.exists()
