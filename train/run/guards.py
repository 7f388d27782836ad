"""Checks before a run starts, and the one-line errors of a run itself.

* `prepare_run_dir`: `--out` must be (or become) a writable directory: a file, a path under a
  file or a read-only directory is a `RunDirError` (a ValueError) before anything is built.
* `NonFiniteLossError`: the loss became NaN or Inf (the run stops; the last good checkpoint is
  kept).
* `quiet_background_errors`: orbax logs a failed background save with tracebacks from its
  threads (and asyncio its abandoned write tasks) before the main thread gets the error; the
  trainer reports that error itself, in one line, so the command hides those log records (and
  the "Event loop is closed" tracebacks of writes that finish after orbax gave up on the save).

Whether the train state fits the machine is `train.planner.fit.check_fits`; a failed write is a
`train.errors.WriteError`.
"""

import contextlib
import functools
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path


class RunDirError(ValueError):
    """`--out` cannot be used as the run directory."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


# --------------------------------------------------------------------------- --out


def prepare_run_dir(out: Path) -> Path:
    """Create `out` (and its parents) if needed and check that files can be created in it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out}: exists and is not a directory")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise RunDirError(f"--out {out}: {blocker} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(
            f"--out {out}: cannot create the run directory: {_os_message(e)}"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".relaymoe-write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunDirError(
            f"--out {out}: the run directory is not writable: {e.strerror or e}"
        ) from None
    for sub in ("checkpoints", "metrics.jsonl"):
        p = out / sub
        if sub == "checkpoints" and p.exists() and not p.is_dir():
            raise RunDirError(f"--out {out}: {p} exists and is not a directory")
        if sub == "metrics.jsonl" and p.is_dir():
            raise RunDirError(f"--out {out}: {p} is a directory")
    return out


def _os_message(e: OSError) -> str:
    text = e.strerror or str(e)
    return f"{text} ({e.filename})" if e.filename else text


# --------------------------------------------------------------------------- logging


class _DropBackgroundSaveErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.name == "asyncio":
            return "orbax" not in record.getMessage()
        return not (record.exc_info and "orbax" in record.pathname)


_FILTER = _DropBackgroundSaveErrors()


def _closed_loop_callback(exc_type, exc, tb) -> bool:
    """A tensorstore write finishing after orbax closed the event loop of a failed save: its
    completion callback (asyncio's `call_soon_threadsafe`) raises "Event loop is closed", which
    tensorstore reports with `PyErr_WriteUnraisable` (`sys.unraisablehook`) from its thread."""
    if not (exc_type is RuntimeError and str(exc) == "Event loop is closed"):
        return False
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_name in (
        "_check_closed",
        "call_soon_threadsafe",
    )


def _unraisablehook(unraisable, _previous=sys.unraisablehook):
    if not _closed_loop_callback(
        unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback
    ):
        _previous(unraisable)


@contextlib.contextmanager
def quiet_background_errors(keep: bool = False):
    """Hide orbax's ERROR records with tracebacks (its background save threads; the error
    reaches the main thread, which reports it) and asyncio's "Task exception was never
    retrieved" for orbax's write tasks. `keep=True` leaves the filter installed (the command:
    abandoned tasks are logged when they are garbage collected, up to the interpreter's exit)."""
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    for lg in loggers:
        lg.addFilter(_FILTER)
    # the abandoned write tasks' coroutines, garbage collected unawaited (up to the exit)
    warnings.filterwarnings(
        "ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning
    )
    hook, sys.unraisablehook = (
        sys.unraisablehook,
        functools.partial(_unraisablehook, _previous=sys.unraisablehook),
    )
    try:
        yield
    finally:
        if not keep:
            for lg in loggers:
                lg.removeFilter(_FILTER)
            sys.unraisablehook = hook
