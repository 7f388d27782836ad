"""SIGINT and SIGTERM during a run: finish the step in progress, checkpoint it, exit 130 / 143; a
second signal stops at once, unless a checkpoint is being written.

`Stop` installs handlers for SIGINT (Ctrl-C) and SIGTERM (what schedulers send before a kill)
that only record the first signal; the trainer asks `Stop.requested()` between steps (and at a
few points before the first one). Nothing is ever saved from inside a handler, so the first signal
never cuts a step or a save short: the trainer saves the last completed step (unless that step was
just saved), waits for the save to be written, prints one line saying where, and exits with
128 + the signal number (`Interrupted.exit_code`: 130 for SIGINT, 143 for SIGTERM).

A second (third, ...) signal is for a run that does not stop: a step that hangs (a deadlocked
kernel, a peer that never answers) would otherwise wait for SIGKILL. A watcher thread sees it at
once, wherever the main thread is blocked (Python's wakeup fd: the C-level handler writes each
signal's number to a pipe the thread reads), and:

* outside a checkpoint write, ends the process at once (`os._exit(128 + signum)`, not waiting for
  the step's threads) with one line naming the newest committed checkpoint, the one a rerun
  resumes from (`SIGTERM again during step 5: stopping now without saving it; a rerun resumes
  from checkpoint step 3 in DIR`); orbax commits a step by renaming a complete temporary
  directory, so nothing committed is lost;
* while a checkpoint is being written (the trainer's `Stop.saving` section, or the checkpoint
  manager's background write, `Saves.writing`), says so in one line and waits for the write to be
  committed, since an interrupted save would only leave a temporary directory that is never
  restored; then it ends the process as above, naming the checkpoint just committed;
* once the trainer has finished its step and stops (`requested()` returned the signal: it saves
  that step and exits with its own line), only says that the save is being waited for.

SIGKILL still stops at once; the run then resumes from its newest committed checkpoint. Before
the first step (`Stop.step` None) there is no step to finish: the compile, the longest wait
there, runs in a helper thread (`unless_stopped`), so the first signal stops the run at once
instead of after it, and a second one anywhere before the first step ends the process at once.

In a multi-process run each process asks the others at every step (`requested()`, one small
all-gather), so all of them stop after the same step and save it together, whichever of them got
the signal; a second signal ends the process that gets it. The trainer installs the handlers after
`jax.distributed.initialize`, whose preemption notifier would otherwise take SIGTERM (it only
records it, and the run goes on).
"""

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped on a signal (after saving what it could); `exit_code` is 128 + signum."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass(frozen=True)
class Saves:
    """The run's checkpoints as a second signal needs them (`train.run.io.saves`)."""

    directory: Path
    committed: Callable[[], list[int]]  # the committed (finalized) steps on disk, sorted
    writing: Callable[[], bool] = lambda: False  # a save is being written in the background


def _say(line: str) -> None:
    # os.write, not print: the main thread may be inside a print to the same stream
    os.write(2, f"{line}\n".encode())


class Stop:
    """Context manager: SIGINT/SIGTERM handlers that record the first signal (`signum`), and the
    thread that acts on a second one (`exit_now`, default `os._exit`, ends the process); the
    previous handlers come back on exit. The trainer sets `step` (the step in progress), `watch`es
    its checkpoints and marks its saves (`saving`). Outside the main thread (where Python cannot
    install handlers) it installs nothing and never requests a stop."""

    def __init__(self, exit_now: Callable[[int], object] = os._exit, poll_s: float = 0.05):
        self.signum: int | None = None
        self.count = 0  # the signals the watcher has seen
        self.step: int | None = None  # set by the trainer: the step in progress (None: before)
        self.saves: Saves | None = None  # `watch`
        self._exit_now, self._poll_s = exit_now, poll_s
        self._lock = threading.Lock()  # a second signal's decision vs the trainer's next move
        self._saving: int | None = None  # the step the trainer is saving (`saving`)
        self._last_save: int | None = None  # the last step it started saving
        self._stops_after: int | None = None  # the step after which `requested()` said stop
        self._old: dict = {}
        self._wakeup: tuple[int, int] | None = None  # (our pipe's write end, the previous fd)

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.release()
        return False

    def install(self) -> "Stop":
        """Install the handlers (again: after `jax.distributed.initialize`, whose preemption
        notifier takes SIGTERM for itself in C++ and does not stop the process) and start the
        watcher thread."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in SIGNALS:
            old = signal.signal(s, self._handle)
            self._old.setdefault(s, old)
        if self._wakeup is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._wakeup = (write, previous)
            threading.Thread(
                target=self._watch, args=(read,), name="relaymoe-train-signals", daemon=True
            ).start()
        return self

    @property
    def installed(self) -> bool:
        return bool(self._old)

    def release(self) -> None:
        """Put the previous handlers back (from now on a signal acts as it did before; one
        installed outside Python, which Python cannot reinstall, becomes the default action) and
        end the watcher thread."""
        with self._lock:  # not while a second signal is being acted on
            for s, old in self._old.items():
                signal.signal(s, signal.SIG_DFL if old is None else old)
            self._old = {}
            if self._wakeup is not None:
                write, previous = self._wakeup
                signal.set_wakeup_fd(previous)
                os.close(write)  # the watcher reads the end of the pipe and returns
                self._wakeup = None

    def watch(self, saves: Saves) -> None:
        """The run's checkpoints, which a second signal names (and waits for while written)."""
        self.saves = saves

    @contextlib.contextmanager
    def saving(self, step: int):
        """Around the trainer's save of `step` (and any wait for it): a second signal meanwhile
        waits for it."""
        with self._lock:
            self._saving = self._last_save = step
        try:
            yield
        finally:
            with self._lock:
                self._saving = None

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum

    def _watch(self, fd: int) -> None:
        """The watcher thread: each signal's number, as the C-level handler writes it."""
        try:
            while chunk := os.read(fd, 64):
                for signum in chunk:
                    if signum in SIGNALS:
                        self._received(signum)
        finally:
            os.close(fd)

    def _received(self, signum: int) -> None:
        with self._lock:
            self.count += 1
            if self.signum is None:  # the main thread may not have run the handler yet
                self.signum = signum
            if self.count == 1:
                return
        self._again(signum)

    def _again(self, signum: int) -> None:
        """A second (third, ...) signal: end the process now, unless a checkpoint is being
        written (then wait for it) or the trainer is already saving its last step and exiting."""
        name, noted = signal_name(signum), False
        while True:
            with self._lock:
                if not self.installed:
                    return  # released: the trainer is exiting with its own line
                if self._stops_after is not None:
                    if not noted:
                        _say(self._waiting(name, self._stops_after))
                    return
                if not self._writing():
                    _say(self._stopping_now(name))
                    self._exit_now(128 + signum)
                    return
                if not noted:
                    step = self._last_save if self._saving is None else self._saving
                    _say(self._waiting(name, step))
                    noted = True
            time.sleep(self._poll_s)

    def _writing(self) -> bool:
        return self._saving is not None or (self.saves is not None and self.saves.writing())

    @staticmethod
    def _waiting(name: str, step: int | None) -> str:
        what = "a checkpoint" if step is None else f"checkpoint step {step}"
        return (
            f"{name} again while {what} is being written: waiting for it, then exiting "
            "(SIGKILL stops at once; an unfinished save is never restored)"
        )

    def _stopping_now(self, name: str) -> str:
        """`SIGTERM again during step 5: stopping now without saving it; a rerun resumes from
        checkpoint step 3 in DIR`: where the run is, and the newest committed checkpoint."""
        committed = self.saves.committed() if self.saves is not None else []
        if self.step is None:
            where = "before the first step: stopping now"
        elif committed and committed[-1] >= self.step:
            where = f"after step {self.step}: stopping now"
        else:
            where = f"during step {self.step}: stopping now without saving it"
        if self.saves is None:
            resume = "a rerun starts where this run did"
        elif committed:
            resume = f"a rerun resumes from checkpoint step {committed[-1]} in "
            resume += str(self.saves.directory)
        else:
            resume = "no checkpoint yet: a rerun starts from step 0"
        return f"{name} again {where}; {resume}"

    def requested(self) -> int | None:
        """The signal to stop on, or None. In a multi-process run, an all-gather of every
        process's flag (every process must call this at the same points). While training, a
        signal returned here means the step in progress is done and is saved next."""
        sig = self._agreed()
        if sig is not None and self.step is not None:
            with self._lock:
                self._stops_after = self.step
        return sig

    def _agreed(self) -> int | None:
        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        mine = self.signum or 0  # read once: a signal landing after the all-gather waits for
        got = np.asarray(multihost_utils.process_allgather(np.int32(mine)))  # the next step,
        flags = [int(s) for s in got.ravel() if s]  # so every process decides the same way
        return (mine or max(flags)) if flags else None


_LEFT_RUNNING: list[threading.Thread] = []  # `unless_stopped` helpers a signal left behind


def unless_stopped(fn, stop: Stop, poll_s: float = 0.05):
    """`fn()` run in a helper thread while this (main) thread waits, so that a signal is seen at
    once: fn's result (its exception raised here), or None as soon as `stop` records a signal;
    the helper is then left to run (`left_running`), and the process should exit without waiting
    for it. In a multi-process run (all processes stop at the same points, `requested`), or with
    no handlers installed, just `fn()`."""
    if not stop.installed or jax.process_count() > 1:
        return fn()
    box: dict = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as e:  # raised again in the waiting thread
            box["error"] = e

    helper = threading.Thread(target=work, name="relaymoe-train-compile", daemon=True)
    helper.start()
    while helper.is_alive():
        if stop.signum is not None:
            _LEFT_RUNNING.append(helper)
            return None
        helper.join(poll_s)
    if "error" in box:
        raise box["error"]
    return box["value"]


def left_running() -> bool:
    """True while a helper that `unless_stopped` left behind still runs."""
    return any(t.is_alive() for t in _LEFT_RUNNING)
