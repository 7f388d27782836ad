"""A run's writes and stops: checkpoint saves and waits (a failed save is a `WriteError`
naming the directory and the newest complete checkpoint), metrics.jsonl opened for appending, and
the `interrupt.Interrupted` a signal becomes before or during training, and the checkpoints a
second signal names (`saves`; `train.run.loop`)."""

import contextlib
from pathlib import Path

from ..errors import WriteError, describe_write_error, os_error_text
from ..state import checkpoint as ckpt
from ..step import train_step
from . import distributed, interrupt

# --------------------------------------------------------------------------- checkpoints


def committed_steps(directory) -> list[int]:
    """The checkpoint steps on disk (finalized step directories), sorted."""
    try:
        return sorted(int(p.name) for p in Path(str(directory)).iterdir() if p.name.isdigit())
    except OSError:
        return []


def saves(out: Path, mngr=None) -> interrupt.Saves:
    """The checkpoints of the run directory `out` as a second signal sees them: the committed
    steps on disk and, with the manager `mngr`, whether it is writing one in the background."""
    directory = Path(out).resolve() / "checkpoints"  # as `ckpt.manager` places them
    writing = (lambda: False) if mngr is None else mngr.is_saving_in_progress
    return interrupt.Saves(directory, lambda: committed_steps(directory), writing)


def write_error(e: BaseException, mngr) -> WriteError | None:
    """A WriteError for an operating-system failure of a checkpoint save (disk full, read-only
    directory; orbax reports a failed asynchronous save at the next save or wait), else None."""
    why = os_error_text(e)
    if why is None:
        return None
    steps = committed_steps(mngr.directory)
    last = f"step {steps[-1]}" if steps else "none"
    return WriteError(
        f"saving a checkpoint in {mngr.directory} failed: {why} (the newest "
        f"complete checkpoint: {last})"
    )


def save(mngr, step: int, state: train_step.TrainState, meta: dict) -> None:
    try:
        ckpt.save(mngr, step, state.as_saved(), meta)
    except Exception as e:
        err = write_error(e, mngr)
        if err is None:
            raise
        raise err from e


def wait(mngr) -> None:
    try:
        mngr.wait_until_finished()
    except Exception as e:
        err = write_error(e, mngr)
        if err is None:
            raise
        raise err from e


def close(mngr, failing: bool) -> None:
    """Wait for the last save and close the manager; while another error is on its way out,
    one of these (the same failed save, reported again) is not raised over it."""
    try:
        wait(mngr)
        mngr.close()
    except Exception:
        if not failing:
            raise


@contextlib.contextmanager
def metrics_file(path: Path):
    """metrics.jsonl opened for appending (process 0); an OSError while it is open (a write, the
    flush, the close: disk full, ...) is a WriteError naming it. Checkpoint failures arrive as
    WriteErrors already."""
    try:
        with distributed.open_on_main(path, "a") as f:
            yield f
    except OSError as e:
        raise WriteError(f"writing {path} failed: {describe_write_error(e)}") from e


# --------------------------------------------------------------------------- signals


def stop_before_training(stop: interrupt.Stop, mngr) -> None:
    """`interrupt.Interrupted` if a signal came before the first step (nothing new to save)."""
    sig = stop.requested()
    if sig is not None:
        steps = committed_steps(mngr.directory)
        where = (
            f"the newest checkpoint is step {steps[-1]} in {mngr.directory}"
            if steps
            else "no checkpoint yet"
        )
        raise interrupt.Interrupted(
            sig,
            f"interrupted by {interrupt.signal_name(sig)} before "
            f"the first step; nothing new to save ({where})",
        )


def interrupted(sig: int, mngr, step: int) -> interrupt.Interrupted:
    """After step `step`'s checkpoint was started: wait for it to be written."""
    wait(mngr)
    return interrupt.Interrupted(
        sig,
        f"interrupted by {interrupt.signal_name(sig)} after step "
        f"{step}: checkpoint step {step} saved in {mngr.directory}; "
        f"rerun the same command to resume",
    )
