"""TensorBoard event files of a run: the metrics line's scalars under `--out/tensorboard/`, read
with `tensorboard --logdir OUT/tensorboard`. Written in tensorboardX's event format (the `train`
extra; no TensorFlow), by process 0 only, one event per step.

Tags: each number of the metrics.jsonl line under its own key (`loss`, `lm_loss`, `grad_norm`,
`lr`, `tokens_per_s`, `model_tflops_per_device`, `mfu` where known, `eval_loss` at the steps that
evaluate, ...), and each per-layer list as one tag per MoE layer, `expert_overload/layer_3`."""

import contextlib
import math
import os
import socket
import time
from pathlib import Path

from ..errors import WriteError, describe_write_error
from . import distributed

SKIP = frozenset({"step"})  # the x axis, not a scalar


def scalars(rec: dict) -> dict[str, float]:
    """The tags and values of one metrics record: its finite numbers, and its lists of numbers
    per entry (`key/layer_i`); strings, None, booleans and nested records are left out."""
    out = {}
    for key, value in rec.items():
        if key in SKIP or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
        elif isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            out.update({f"{key}/layer_{i}": float(v) for i, v in enumerate(value)})
    return out


class Board:
    """Writes metrics records as TensorBoard scalars into `out/tensorboard` (process 0; a no-op
    elsewhere), one event file per run, each step's events written and flushed with the step's
    metrics line (synchronously: no writer thread, nothing left to flush at exit); an OSError is
    a WriteError naming the file, as for metrics.jsonl. `start`: the step a resumed run continues
    from; the events an interrupted run wrote past it are purged (TensorBoard hides them), as
    metrics.jsonl's lines are truncated."""

    def __init__(self, out: Path, start: int = 0):
        self.path = None
        self.rec = None
        if not distributed.is_main():
            return
        # tensorboardX's wire format (its protos and record framing), TensorBoard's file naming;
        # the pid and start keep two runs into one directory within a second apart. Imported
        # here, when a run starts its steps: a run stopped before them (a signal during the
        # compile) exits without protobuf's runtime loaded, as before
        from tensorboardX.proto import event_pb2
        from tensorboardX.record_writer import RecordWriter  # the train extra

        logdir = Path(out) / "tensorboard"
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
        self.path = logdir / f"{name}.{os.getpid()}.from{start}"
        with self._errors():
            logdir.mkdir(parents=True, exist_ok=True)
            self.rec = RecordWriter(str(self.path))
            self._event(event_pb2.Event(step=start + 1, file_version="brain.Event:2"))
            if start:  # TensorBoard drops the earlier files' events from this step on
                start_log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
                self._event(event_pb2.Event(step=start + 1, session_log=start_log))
            self.rec.flush()

    def write(self, rec: dict) -> None:
        if self.rec is None:
            return
        from tensorboardX.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in scalars(rec).items()]
        with self._errors():
            self._event(
                event_pb2.Event(step=rec["step"], summary=summary_pb2.Summary(value=values))
            )
            self.rec.flush()

    def _event(self, event) -> None:
        event.wall_time = time.time()
        self.rec.write(event.SerializeToString())

    @contextlib.contextmanager
    def _errors(self):
        try:
            yield
        except OSError as e:
            raise WriteError(f"writing {self.path} failed: {describe_write_error(e)}") from e

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self.rec is not None:
            rec, self.rec = self.rec, None
            try:
                with self._errors():
                    rec.close()
            except WriteError:
                if exc_type is None:  # a failure of its own; else the run's error comes first
                    raise
        return False
