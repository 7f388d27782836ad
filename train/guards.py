"""Checks before a run starts, and the errors a run reports in one line (a diverged loss, a failed
write).

* `prepare_run_dir`: `--out` must be (or become) a writable directory: a file, a path under a
  file or a read-only directory is a `RunDirError` (a ValueError) before anything is built.
* `check_fits`: before anything is allocated or compiled, the bytes the train state needs per
  device (parameters, AdamW's two moments and the gradients, all float32 master copies, plus
  with `grad_accum` > 1 the float32 gradient accumulator (`train.accumulate`), from
  `train_step.abstract_state`: shapes and shardings only, nothing allocated) against what the
  machine has: on a GPU or TPU its `memory_stats()["bytes_limit"]`; on CPU the host's available RAM
  (`MemAvailable` of /proc/meminfo, else physical pages), shared by the emulated devices. It is
  a lower bound (activations and temporaries come on top), so a config it refuses cannot fit;
  `DoesNotFitError` names both numbers and `--force`.
* `NonFiniteLossError`: the loss became NaN or Inf (the run stops; the last good checkpoint is
  kept).
* `WriteError`: a checkpoint save or a metrics write that failed (disk full, read-only, ...),
  said in one line with the path and the operating system's message (tensorstore reports an
  OS error as text, `[os_error_code=28]`; `describe_write_error` reads it back).
* `quiet_background_errors`: orbax logs a failed background save with tracebacks from its
  threads (and asyncio its abandoned write tasks) before the main thread gets the error; the
  trainer reports that error itself, in one line, so the command hides those log records (and
  the "Event loop is closed" tracebacks of writes that finish after orbax gave up on the save).
"""

import contextlib
import dataclasses
import errno as errno_mod
import functools
import logging
import math
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import jax

from relaymoe_jax.models.param_count import param_count


class RunDirError(ValueError):
    """`--out` cannot be used as the run directory."""


class DoesNotFitError(ValueError):
    """The train state alone needs more memory than the machine has."""


class WriteError(Exception):
    """Saving a checkpoint or writing the metrics failed (an OS-level error, e.g. disk full)."""


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


# --------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class Estimate:
    params: int  # parameters of the model (`param_count`)
    state: int  # bytes per device of the train state in device memory (params, moments, rest)
    grads: int  # bytes per device of the gradients (the parameters' shards; + accumulator)
    host: int = 0  # bytes per device of the train state in pinned host memory (offload_optimizer)

    @property
    def per_device(self) -> int:
        return self.state + self.grads


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def estimate(cfg, tc, mesh) -> Estimate:
    """Per-device bytes of the train state and gradients, from shapes and shardings only."""
    from . import train_step  # the train extra (optax); this module itself needs only jax

    _, state, _, _ = train_step.abstract_state(cfg, tc, mesh)
    leaves = jax.tree.leaves(state)
    host = sum(_shard_bytes(x) for x in leaves if x.sharding.memory_kind == "pinned_host")
    device = sum(_shard_bytes(x) for x in leaves) - host
    grads = sum(_shard_bytes(x) for x in jax.tree.leaves(state.params))
    if tc.offload_optimizer:  # the gradients (and the fetched weights) in the compute dtype
        itemsize = 2 if tc.compute_dtype == "bfloat16" else 4
        grads = 2 * grads * itemsize // 4
    if tc.grad_accum > 1:  # the float32 accumulator of train.accumulate, like the gradients
        grads += sum(_shard_bytes(x) for x in jax.tree.leaves(state.params))  # f32 params
    return Estimate(param_count(cfg)["total"], device, grads, host)


def host_available() -> int | None:
    """Bytes of RAM available to a new allocation: MemAvailable (Linux), else physical RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def capacity(devices) -> tuple[int, int, str] | None:
    """(bytes, devices sharing them, what they are) for this process's `devices`, or None when
    unknown: an accelerator's own limit, or the host's available RAM for CPU devices."""
    if not devices:
        return None
    d = devices[0]
    try:
        stats = d.memory_stats() or {}
    except Exception:  # backends without memory stats raise
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), 1, f"memory of one {d.device_kind} (bytes_limit)"
    if d.platform == "cpu":
        avail = host_available()
        return (avail, len(devices), "available host RAM") if avail else None
    return None


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,}"


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_fits(cfg, tc, mesh, force: bool = False, devices=None) -> Estimate:
    """The `Estimate`; `DoesNotFitError` if it exceeds `capacity` (unless `force`)."""
    est = estimate(cfg, tc, mesh)
    if devices is None:
        devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    cap = capacity(devices)
    if cap is None or force:
        return est
    limit, sharing, what = cap
    # CPU devices' memory is the host's RAM: the state offloaded to pinned host memory counts too
    need = (est.per_device + (est.host if devices[0].platform == "cpu" else 0)) * sharing
    if need > limit:
        per = (
            f"{fmt_bytes(est.per_device)} per device x {sharing} {devices[0].platform} devices"
            if sharing > 1
            else "per device"
        )
        raise DoesNotFitError(
            f"the train state alone needs {fmt_bytes(need)} ({per}: {_fmt_count(est.params)} "
            f"parameters, AdamW moments and gradients in float32, before any activation), more "
            f"than the {fmt_bytes(limit)} of {what}; use a smaller config, more devices or an "
            f"fsdp axis (mesh=fsdp=N,...), or --force to try anyway"
        )
    return est


# --------------------------------------------------------------------------- write errors

_QUOTED_PATH = re.compile(r'"(/[^"]+)"')
_OS_CODE = re.compile(r"os_error_code='?(\d+)")


def describe_write_error(e: BaseException) -> str:
    """`os_error_text(e)`, else the error's type and first line."""
    text = os_error_text(e)
    if text is not None:
        return text
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def os_error_text(e: BaseException) -> str | None:
    """`<OS message> (ERRNAME): <path>` for an OSError with an errno anywhere in `e`'s cause
    chain, or for a tensorstore error that carries `os_error_code` (its last quoted absolute
    path); None if there is none (not an operating-system error)."""
    seen, err = set(), e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno:
            return (
                f"{err.strerror or os.strerror(err.errno)} "
                f"({errno_mod.errorcode.get(err.errno, err.errno)})"
                + (f": {err.filename}" if err.filename else "")
            )
        text = str(err)
        code = _OS_CODE.search(text)
        if code:
            n = int(code[1])
            paths = _QUOTED_PATH.findall(text)
            return f"{os.strerror(n)} ({errno_mod.errorcode.get(n, n)})" + (
                f": {paths[-1]}" if paths else ""
            )
        err = err.__cause__ or err.__context__
    return None


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
