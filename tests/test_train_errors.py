"""Expected failures of the command-line tools: one line, a non-zero exit, early.

The trainer (`python -m train`): a bad `--out`, a config too big for this machine, unknown or
misplaced keys, an empty config file fail before the model is built (the `no_build` fixture
fails the test if the run gets that far); `--help` documents every flag and every key=value
setting with its default; the start-up lines come before the first compile; a signal handler
only records the signal, and a second signal's answer (at once, or after the checkpoint being
written) names the newest committed checkpoint. The planner's "nothing fits" is exit status 1
and bad sizes are argument errors; the benchmarks refuse bad arguments in argparse. Disk-full
during a run and the SIGINT / SIGTERM stops are subprocess tests in tests/test_train_kill.py.
"""

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from relaymoe_jax.models.config_files import load_config
from scripts import load_script
from train import cli, errors
from train.planner import fit
from train.planner import plan as planner
from train.run import guards, interrupt
from train.run import io as run_io
from train.settings import TrainConfig
from train.step import mesh as tm
from train.step import optimizer, train_step

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "seq_len=32", "batch_size=8", "--steps", "1"]


class _Built(Exception):
    """The run got as far as building or compiling the model."""


@pytest.fixture
def no_build(monkeypatch):
    def refuse(*args, **kwargs):
        raise _Built("got as far as building the model")

    monkeypatch.setattr(train_step, "init_state", refuse)
    monkeypatch.setattr(train_step, "compile_step", refuse)


# --------------------------------------------------------------------------- --out


def test_out_is_a_file(tmp_path, no_build):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(guards.RunDirError, match=r"--out .*afile: exists and is not a directory"):
        cli.main([*TINY, "--out", str(f)])
    with pytest.raises(guards.RunDirError, match=r"afile is a file, not a directory"):
        cli.main([*TINY, "--out", str(f / "sub" / "run")])


def _without_root_powers() -> list[str] | None:
    """A command prefix under which permission bits apply (root ignores them), or None."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]


def test_out_read_only_directory_one_line(tmp_path):
    """The real command: one line on stderr, exit status 1, nothing built."""
    prefix = _without_root_powers()
    if prefix is None:
        pytest.skip("running as root without setpriv: permission bits do not apply")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", "train", *TINY, "--out", str(ro)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        ro.chmod(0o755)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: --out {ro}: the run directory is not writable: Permission denied"
    ]
    assert proc.stdout == "" and list(ro.iterdir()) == []


# --------------------------------------------------------------------------- memory


def test_paper_config_refused_before_building(tmp_path, no_build):
    """Qwen3-30B-A3B's train state on this machine's emulated devices: refused in seconds
    (abstract shapes only), naming both sizes and --force."""
    if (fit.host_available() or 0) > 600 * 2**30:
        pytest.skip("this host could hold Qwen3-30B-A3B's train state on 8 devices")
    t0 = time.perf_counter()
    with pytest.raises(
        fit.DoesNotFitError,
        match=r"the train state alone needs [\d,.]+ GiB \([\d,.]+ GiB per device x "
        r"8 cpu devices: 30\.53B parameters.*more than the [\d,.]+ GiB of "
        r"available host RAM.*--force to try anyway",
    ):
        cli.main(
            [
                "--config",
                "configs/qwen3-30b-a3b.yaml",
                "--steps",
                "1",
                "--out",
                str(tmp_path / "big"),
            ]
        )
    assert time.perf_counter() - t0 < 60


def test_fit_check_host_ram_and_force(tmp_path, no_build, monkeypatch):
    monkeypatch.setattr(fit, "host_available", lambda: 2**20)
    with pytest.raises(
        fit.DoesNotFitError,
        match=r"more than the 1\.0 MiB of available host "
        r"RAM",
    ):
        cli.main([*TINY, "--out", str(tmp_path / "a")])
    with pytest.raises(_Built):  # --force: past the check, on to building
        cli.main([*TINY, "--out", str(tmp_path / "b"), "--force"])


class _FakeGPU:
    platform, device_kind = "gpu", "FakeGPU 1MB"

    def memory_stats(self):
        return {"bytes_limit": 10**6}


def test_fit_check_uses_an_accelerators_bytes_limit():
    tc = TrainConfig(seq_len=32)
    cfg, mesh = load_config("configs/tiny.yaml"), tm.make_mesh(tc.mesh)
    est = fit.estimate(cfg, tc, mesh)
    assert est.params == 255_360 and est.grads < est.state < 4 * est.grads
    with pytest.raises(
        fit.DoesNotFitError,
        match=r"needs 1\.\d MiB \(per device: .*more than the 1\.0 MiB of memory "
        r"of one FakeGPU 1MB \(bytes_limit\)",
    ):
        fit.check_fits(cfg, tc, mesh, devices=[_FakeGPU()])
    assert fit.check_fits(cfg, tc, mesh, devices=[_FakeGPU()], force=True) == est


# --------------------------------------------------------------------------- keys and files


def test_unknown_command_line_key_lists_both_and_suggests(tmp_path, no_build):
    with pytest.raises(ValueError) as e:
        cli.main([*TINY, "--out", str(tmp_path), "batch_sze=8"])
    msg = str(e.value)
    assert msg.startswith(
        "command line batch_sze=8: unknown key(s) ['batch_sze']; did you mean 'batch_size'"
    ), msg
    assert "trainer keys: ['b1', 'b2', 'batch_size'" in msg and "model config keys: [" in msg
    assert "tiny.yaml" not in msg  # the file is not to blame


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["expot", "runs/x", "--out", "y"],
            "unknown command 'expot': did you mean relaymoe-train export",
        ),
        (["--quiet", "export", "runs/x", "--out", "y"], "'export' is a command and comes first: "),
        (
            [*TINY, "--out", "o", "prepar"],
            "unknown command 'prepar': did you mean relaymoe-train prep",
        ),
    ],
)
def test_a_misplaced_or_misspelt_command_is_one_line(argv, said, no_build):
    """The probe's `relaymoe-train expot ...` and a misplaced `export` asked only for --steps and
    --out (argparse); each now names the command it resembles and where it goes. An option's
    value that happens to be such a word is a value (`--out export` trains into ./export)."""
    with pytest.raises(ValueError, match="^" + re.escape(said)):
        cli.main(argv)
    assert cli.subcommand_error([*TINY, "--out", "export"], cli.build_parser()) is None
    assert "Other commands, given first: relaymoe-train prepare" in cli.build_parser().format_help()


def test_trainer_key_in_the_yaml_file(tmp_path, no_build):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((ROOT / "configs" / "tiny.yaml").read_text() + "batch_size: 8\n")
    with pytest.raises(
        ValueError,
        match=r"cfg\.yaml:\d+: batch_size is a trainer setting, not a "
        r"model config key",
    ):
        cli.main(["--config", str(cfg), "--steps", "1", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize(
    "given, said",
    [
        ("nope", "no config file 'nope' here ({cwd}) and no shipped config configs/nope.yaml; "),
        (
            "nope.yaml",
            "no config file 'nope.yaml' here ({cwd}) and no shipped config configs/nope.yaml; ",
        ),
        (
            "configs/tiny.yaml",  # the README's path, run from another directory
            "no config file configs/tiny.yaml (relative to {cwd}); a shipped config has that "
            "name: pass 'tiny'; ",
        ),
        ("/no/such/dir/x.yaml", "no config file /no/such/dir/x.yaml; "),
    ],
)
def test_missing_config_says_what_was_looked_for(tmp_path, monkeypatch, given, said):
    """Each name or path once, as given (no configs/configs/tiny.yaml.yaml), then the shipped
    configs; a shipped name (`tiny`, `tiny.yaml`) works from anywhere."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        load_config(given)
    assert str(e.value).startswith(said.format(cwd=tmp_path) + "available: ['moe-e128'"), e.value
    assert load_config("tiny.yaml") == load_config("tiny")


def test_empty_config_file_is_an_error(tmp_path, no_build):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match=r"empty\.yaml: the config file is empty"):
        cli.main(["--config", str(cfg), "--steps", "1", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize(
    "extra, said",
    [  # a flag the run would ignore
        (["--synthetic", "--data", "x.txt"], "--data with --synthetic: the synthetic stream "),
        (["synthetic=true", "--tokenizer", "t.json"], "--tokenizer with --synthetic: "),
        (
            ["--synthetic", "--data", "x.txt", "--tokenizer", "t.json"],
            "--data and --tokenizer with --synthetic: the synthetic stream reads no text file "
            "and no tokenizer; drop --data and --tokenizer or --synthetic",
        ),
        # a setting given twice (the flag used to win silently)
        (["lr=0.1", "--lr", "0.2"], "lr is given twice, as lr=0.1 and as --lr: give it once"),
        (["--seed", "1", "seed=1"], "seed is given twice, as seed=1 and as --seed"),
        # an op option the trained dispatcher ignores
        (
            ["capacity_factor=1.0"],
            "capacity_factor=1.0 applies to dispatcher='alltoall' only, and this run trains "
            "dispatcher='ring': it would be ignored; drop it or add dispatcher=alltoall",
        ),
        (
            ["dispatcher=alltoall", "routing=token", "--memory-table", "capacity_factor=2.0"],
            None,  # the memory table's ring row uses routing; the all-to-all uses the capacity
        ),
        (["dispatcher=alltoall", "chunk_size=64"], "chunk_size=64 applies to dispatcher='ring'"),
        (  # trained without a word before: the dense reference has no grouped matmul
            ["dispatcher=reference", "gmm_impl=ragged_dot"],
            "gmm_impl='ragged_dot' applies to dispatcher='ring' or dispatcher='alltoall' only, "
            "and this run trains dispatcher='reference': it would be ignored; drop it or add "
            "dispatcher=ring",
        ),
        (["dispatcher=reference", "routing=token", "--memory-table"], None),  # the ring row's
        (
            ["capacity_factor=0.5", "--memory-table"],  # the table's all-to-all rows set theirs
            "capacity_factor=0.5 applies to dispatcher='alltoall' only, and this run trains "
            "dispatcher='ring'",
        ),
        # a value outside its range (warmup_steps=-1 was clamped to 0)
        (["warmup_steps=-1"], "trainer option warmup_steps=-1: expected >= 0"),
        (["lr=-0.001"], "trainer option lr=-0.001: expected a finite number >= 0"),
        (["lr=.nan"], "trainer option lr=nan: expected a finite number >= 0"),
        (["b2=1.0"], "trainer option b2=1.0: expected in [0, 1)"),
        (["min_lr_ratio=2"], "trainer option min_lr_ratio=2.0: expected in [0, 1]"),
        (["clip_norm=0"], "trainer option clip_norm=0.0: expected a finite number > 0"),
        (["--seed", "-1"], "trainer option seed=-1: expected >= 0"),
        (["save_every=0"], "trainer option save_every=0: expected >= 1"),
        (["loss_chunk=0"], "trainer option loss_chunk=0: expected >= 1"),
        # a profile range past the run
        (
            ["--profile-steps", "1:3"],
            "--profile-steps 1:3 ends past --steps 1: nothing would trace steps 2 to 3",
        ),
    ],
)
def test_contradictory_or_ignored_settings_are_refused(tmp_path, extra, said):
    """Before anything is read, built or compiled: one sentence naming the setting."""
    argv = [*TINY, "--out", str(tmp_path / "x"), *extra]
    if said is None:
        assert cli.parse(argv).model.moe.options.routing == "token"
        return
    with pytest.raises(ValueError) as e:
        cli.parse(argv)
    assert str(e.value).startswith(said), str(e.value)


@pytest.mark.parametrize("given", ["0:2", "3:2", "2", "a:b"])
def test_a_bad_profile_range_is_an_argument_error(given, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse([*TINY, "--out", "x", "--profile-steps", given])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "expected A:B, the first and last step to trace" in err, err
    assert repr(given) in err


@pytest.mark.parametrize("warmup, warned", [(10, True), (0, False)])
def test_one_step_at_learning_rate_0_is_said(tmp_path, no_build, capsys, warmup, warned):
    """`--steps 1` with a warmup (which starts at lr 0, optax's schedule at count 0) would
    leave the weights as initialised: a warning names warmup_steps=0, said before building."""
    with pytest.raises(_Built):
        cli.main([*TINY, "--out", str(tmp_path), f"warmup_steps={warmup}"])
    tc = TrainConfig(warmup_steps=warmup, schedule_steps=11)
    assert (float(optimizer.make_schedule(tc)(0)) == 0) is warned
    out = capsys.readouterr().out
    line = (
        "warning: --steps 1 with warmup_steps=10: the warmup starts at lr 0, so the only step's "
        "optimizer update is zero and the weights stay as initialised; add warmup_steps=0 to "
        "train it at lr=0.003"
    )
    assert (line in out.splitlines()) is warned, out


# --------------------------------------------------------------------------- --help, start-up


def test_help_documents_every_flag_and_setting():
    p = cli.build_parser()
    text = p.format_help()
    fmt = cli.HelpFormatter("x")
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            said = fmt._get_help_string(action)
            assert "default" in said or action.required, action.option_strings
    for f in TrainConfig.__dataclass_fields__.values():
        default = "unset" if f.default is None else f.default
        assert f"  {f.name}={default} " in text, f.name
        assert f"--{f.name.replace('_', '-')}" in text
    assert "130 / 143" in text and "--force" in text


def test_start_up_lines_come_before_the_compile(tmp_path, capsys, monkeypatch):
    def stop(*args, **kwargs):
        raise _Built("compiling")

    monkeypatch.setattr(train_step, "compile_step", stop)
    with pytest.raises(_Built):
        cli.main([*TINY, "--out", str(tmp_path), "warmup_steps=0"])  # no lr-0 warning first
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0] == "data: 1 document(s), 8,152 tokens in 254 rows of 32 (the last 24 tokens in none)"
    )
    assert out[1].startswith(
        "building configs/tiny.yaml: 255,360 parameters, train state and gradients "
    ), out
    assert out[-1].startswith("compiling the train step (dispatcher=ring"), out


# --------------------------------------------------------------------------- signals, errors


def _waited(ready, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < end, f"{what} not within {timeout_s} s"
        time.sleep(0.01)


class _Stderr:
    """fd 2 into a pipe for the block, read as lines while another thread writes them. Not
    capfd: its `readouterr` reads its file, then truncates it, and drops a line the watcher
    thread writes in between (a test polling for that line then waits in vain)."""

    def __enter__(self) -> "_Stderr":
        self._read, write = os.pipe()
        os.set_blocking(self._read, False)
        self._saved = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        self.lines: list[str] = []
        self._partial = b""
        return self

    def __exit__(self, *exc) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self.read()
        os.close(self._read)

    def read(self) -> list[str]:
        """Every complete line written so far."""
        try:
            while chunk := os.read(self._read, 1 << 16):
                self._partial += chunk
        except BlockingIOError:
            pass
        *done, self._partial = self._partial.split(b"\n")
        self.lines += [line.decode() for line in done]
        return self.lines


# a second signal's note while a checkpoint is written
WAITING = (
    "waiting for it, then exiting (SIGKILL stops at once; an unfinished save is never restored)"
)


def test_stop_records_the_first_signal_and_restores_handlers():
    """The first signal is the one the run stops on; the handler only records it. On exit the
    handlers and the wakeup fd are the previous ones again and the watcher thread ends."""
    before = signal.getsignal(signal.SIGTERM)
    exits = queue.Queue()
    with interrupt.Stop(exit_now=exits.put) as stop:
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM
        _waited(lambda: stop.count == 1, "the watcher seeing the signal")
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(-1) == -1  # none was set before
    watcher = "relaymoe-train-signals"
    _waited(lambda: watcher not in {t.name for t in threading.enumerate()}, "the watcher's end")
    assert exits.empty() and stop.signum == signal.SIGTERM
    assert interrupt.Interrupted(signal.SIGINT, "x").exit_code == 130
    assert interrupt.Interrupted(signal.SIGTERM, "x").exit_code == 143


def test_a_second_signal_stops_at_once_unless_a_checkpoint_is_being_written(tmp_path):
    """The watcher thread's answer to a second (third, ...) signal (the process's end,
    `exit_now`, recorded here instead): before the first step, during a step, or after a step
    saved, at once, with a line naming the newest committed checkpoint (not a temporary
    directory); while a checkpoint is written in the background, a note, then the same once it is
    committed; while the trainer saves the step it stops after, a note only (the trainer exits
    with its own line)."""
    ckdir = tmp_path / "checkpoints"
    (ckdir / "3").mkdir(parents=True)
    tmp6 = ckdir / "6.orbax-checkpoint-tmp-1"
    tmp6.mkdir()
    background = threading.Event()  # the manager writing a checkpoint
    exits = queue.Queue()

    def said(line: str) -> None:
        _waited(lambda: line in err.read(), line)

    def again(sig, code: int) -> None:
        os.kill(os.getpid(), sig)
        assert exits.get(timeout=10) == code

    with _Stderr() as err, interrupt.Stop(exit_now=exits.put, poll_s=0.01) as stop:
        stop.watch(run_io.saves(tmp_path, SimpleNamespace(is_saving_in_progress=background.is_set)))
        os.kill(os.getpid(), signal.SIGTERM)  # the first: recorded
        assert stop.requested() == signal.SIGTERM
        again(signal.SIGINT, 130)
        stop.step = 7
        again(signal.SIGTERM, 143)
        with stop.saving(6):  # then written in the background
            pass
        background.set()
        os.kill(os.getpid(), signal.SIGTERM)
        said(f"SIGTERM again while checkpoint step 6 is being written: {WAITING}")
        assert exits.empty()
        tmp6.rename(ckdir / "6")  # committed
        background.clear()
        assert exits.get(timeout=10) == 143
        stop.step = 6
        again(signal.SIGTERM, 143)
        stop.step = 8
        assert stop.requested() == signal.SIGTERM  # the trainer stops after step 8
        with stop.saving(8):
            os.kill(os.getpid(), signal.SIGINT)
            said(f"SIGINT again while checkpoint step 8 is being written: {WAITING}")
        assert exits.empty()
    resume = f"a rerun resumes from checkpoint step {{}} in {ckdir.resolve()}"
    assert err.lines == [
        "SIGINT again before the first step: stopping now; " + resume.format(3),
        "SIGTERM again during step 7: stopping now without saving it; " + resume.format(3),
        f"SIGTERM again while checkpoint step 6 is being written: {WAITING}",
        "SIGTERM again during step 7: stopping now without saving it; " + resume.format(6),
        "SIGTERM again after step 6: stopping now; " + resume.format(6),
        f"SIGINT again while checkpoint step 8 is being written: {WAITING}",
    ]


@pytest.mark.parametrize("saves", ["none", "empty"])
def test_a_second_signal_names_what_a_rerun_starts_from(tmp_path, capfd, saves):
    """Without a committed checkpoint (none yet, or the run directory not known yet)."""
    exits = queue.Queue()
    capfd.readouterr()
    with interrupt.Stop(exit_now=exits.put) as stop:
        if saves == "empty":
            stop.watch(run_io.saves(tmp_path))
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
        assert exits.get(timeout=10) == 143
    resume = {
        "none": "a rerun starts where this run did",
        "empty": "no checkpoint yet: a rerun starts from step 0",
    }[saves]
    assert capfd.readouterr().err.splitlines() == [
        f"SIGTERM again before the first step: stopping now; {resume}"
    ]


def test_signal_before_the_first_step_saves_nothing(tmp_path, monkeypatch):
    """A signal during the compile: no step ran, so nothing new is saved; the handlers are
    restored afterwards."""

    class Compiled:
        def memory_analysis(self):
            return None

    def compile_and_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return Compiled()

    monkeypatch.setattr(train_step, "compile_step", compile_and_signal)
    with pytest.raises(
        interrupt.Interrupted,
        match=r"interrupted by SIGTERM before the first "
        r"step; nothing new to save \(no checkpoint "
        r"yet\)",
    ) as e:
        cli.main([*TINY, "--out", str(tmp_path)])
    assert e.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


def test_unless_stopped_returns_at_a_signal_and_raises_what_fn_raises():
    """The compile's helper thread: its value or its exception; None as soon as a signal is
    recorded, the helper left running (the trainer then exits without waiting for it)."""
    release = threading.Event()
    with interrupt.Stop() as stop:
        assert interrupt.unless_stopped(lambda: 7, stop) == 7
        with pytest.raises(ZeroDivisionError):
            interrupt.unless_stopped(lambda: 1 / 0, stop)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.perf_counter()
        assert interrupt.unless_stopped(lambda: release.wait(30), stop) is None
        assert time.perf_counter() - t0 < 10 and stop.signum == signal.SIGINT
        assert interrupt.left_running()
    release.set()
    not_installed = interrupt.Stop()  # no handlers: just a call, in this thread
    assert interrupt.unless_stopped(threading.current_thread, not_installed) is (
        threading.current_thread()
    )


def test_describe_write_error():
    ts = ValueError(
        'OUT_OF_RANGE: Error writing "000001/0.0" in OCDBT database at local file '
        '"/run/checkpoints/1.orbax-checkpoint-tmp/state/": Failed writing: '
        '"/run/checkpoints/1.orbax-checkpoint-tmp/state/d/ab12": Failed to write '
        "310345 bytes to file 6: No space left on device [os_error_code='28']"
    )
    assert errors.describe_write_error(ts) == (
        "No space left on device (ENOSPC): /run/checkpoints/1.orbax-checkpoint-tmp/state/d/ab12"
    )
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = PermissionError(13, "Permission denied", "/ro/x")
    assert errors.describe_write_error(wrapped) == "Permission denied (EACCES): /ro/x"
    assert errors.os_error_text(TypeError("a bug")) is None


# --------------------------------------------------------------------------- planner, benchmarks


@pytest.mark.parametrize(
    "argv",
    [
        ["--batch", "0", "--seq", "32"],
        ["--batch", "8", "--seq", "x"],
        ["--batch", "8", "--seq", "32", "--max-seq", "-5"],
    ],
)
def test_planner_bad_sizes_are_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(["--config", "configs/tiny.yaml", "--memory", "1GiB", *argv])
    assert e.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_planner_nothing_fits_exits_1(capsys):
    code = planner.main(
        [
            "--config",
            "configs/tiny.yaml",
            "--memory",
            "64KiB",
            "--batch",
            "8",
            "--seq",
            "32",
            "--dispatchers",
            "ring",
        ]
    )
    assert code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(
        "error: nothing fits in 0.1 MiB per device (0.9 x 64KiB) at batch 8 x seq 32"
    ), err


@pytest.fixture(scope="module")
def moe_layer():
    return load_script("benchmarks/moe_layer.py", "moe_layer_bench_errors")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["-E", "0"], "argument --experts/-E: expected a positive integer, got 0"),
        (["-E", "6"], "--top-k 8 is more than --experts 6"),
        (["-E", "12"], "--experts 12 does not split over --ep 8 devices"),
        (["--ep", "0"], "argument --ep: expected a positive integer"),
        (["--runs", "0"], "argument --runs"),
        (["--chunk", "-1"], "argument --chunk"),
        (["-T", "many"], "expected a positive integer, got 'many'"),
        (["--gmm-impl", "pallas"], "--gmm-impl pallas is a GPU kernel; without --target"),
        (["--gmm-impl", "mosaic", "--paper"], "--gmm-impl mosaic is a GPU kernel"),
        (["--gmm-impl", "ragged_dot", "--time"], "lax.ragged_dot on CPU is a dense G-times"),
        (["--gmm-impl", "triton"], "argument --gmm-impl: invalid choice: 'triton'"),
    ],
)
def test_moe_layer_bad_arguments(moe_layer, capsys, argv, said):
    with pytest.raises(SystemExit) as e:
        moe_layer.parse_args(argv)
    assert e.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, call",
    [
        ("benchmarks/capacity.py", lambda m: m.main(["--batch", "0"])),
        ("benchmarks/compile_time.py", lambda m: m.main(["--layers", "0"])),
        ("benchmarks/gpu.py", lambda m: m.parse_args(["--runs", "0"])),
        ("benchmarks/gpu.py", lambda m: m.parse_args(["--budget-min", "-1"])),
        ("benchmarks/train_parity.py", lambda m: m.main(["--steps", "0"])),
        ("benchmarks/train_fp8.py", lambda m: m.main(["--steps", "0"])),
    ],
)
def test_benchmark_bad_sizes(script, call, capsys):
    module = load_script(script, "bench_" + Path(script).stem + "_errors")
    with pytest.raises(SystemExit) as e:
        call(module)
    assert e.value.code == 2 and "expected a positive" in capsys.readouterr().err
