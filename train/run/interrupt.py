"""SIGINT and SIGTERM during a run: finish the step in progress, checkpoint it, exit 130 / 143.

`Stop` installs handlers for SIGINT (Ctrl-C) and SIGTERM (what schedulers send before a kill)
that only record the signal; the trainer asks `Stop.requested()` between steps (and at a few
points before the first one). Nothing is ever saved from inside a handler, so a signal never cuts
a step or a save short: the trainer saves the last completed step (unless that step was just
saved), waits for the save to be written, prints one line saying where, and exits with
128 + the signal number (`Interrupted.exit_code`: 130 for SIGINT, 143 for SIGTERM).

A second (third, ...) signal while the run is stopping changes nothing: the step in progress and
the save still finish (a note on stderr says so), since an interrupted save would only leave a
temporary directory that is never restored. To abort at once, send SIGKILL: the run then resumes
from its previous checkpoint (orbax commits a step by renaming a complete temporary directory).
Before the first step (`Stop.training` still False) there is neither a step nor a save to finish,
and the note says so; the compile, the longest wait there, runs in a helper thread
(`unless_stopped`), so a signal stops the run at once instead of after it.

In a multi-process run each process asks the others at every step (`requested()`, one small
all-gather), so all of them stop after the same step and save it together, whichever of them got
the signal. The trainer installs the handlers after `jax.distributed.initialize`, whose
preemption notifier would otherwise take SIGTERM (it only records it, and the run goes on).
"""

import os
import signal
import threading

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


class Stop:
    """Context manager: SIGINT/SIGTERM handlers that record the first signal (`signum`); the
    previous handlers come back on exit. Outside the main thread (where Python cannot install
    handlers) it installs nothing and never requests a stop."""

    def __init__(self):
        self.signum: int | None = None
        self.count = 0
        self.training = False  # set by the trainer at its first step: there is a step to finish
        self._old: dict = {}

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.release()
        return False

    def install(self) -> "Stop":
        """Install the handlers (again: after `jax.distributed.initialize`, whose preemption
        notifier takes SIGTERM for itself in C++ and does not stop the process)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                old = signal.signal(s, self._handle)
                self._old.setdefault(s, old)
        return self

    @property
    def installed(self) -> bool:
        return bool(self._old)

    def release(self) -> None:
        """Put the previous handlers back (from now on a signal acts as it did before; one
        installed outside Python, which Python cannot reinstall, becomes the default action)."""
        for s, old in self._old.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)
        self._old = {}

    def _handle(self, signum, frame):
        self.count += 1
        if self.signum is None:
            self.signum = signum
            return
        if self.training:
            doing = (
                "still finishing the step in progress and its checkpoint, then exiting (SIGKILL "
                "stops at once; an unfinished save is never restored)"
            )
        else:
            doing = "stopping before the first step; nothing to finish or save"
        # os.write, not print: the main thread may be inside a print to the same stream
        os.write(2, f"{signal_name(signum)} again: {doing}\n".encode())

    def requested(self) -> int | None:
        """The signal to stop on, or None. In a multi-process run, an all-gather of every
        process's flag (every process must call this at the same points)."""
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
