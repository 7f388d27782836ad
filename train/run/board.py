"""TensorBoard event files of a run: the metrics line's scalars under `--out/tensorboard/`, read
with `tensorboard --logdir OUT/tensorboard`. Written with tensorboardX (the `train` extra; no
TensorFlow), by process 0 only, one event per step and tag.

Tags: each number of the metrics.jsonl line under its own key (`loss`, `lm_loss`, `grad_norm`,
`lr`, `tokens_per_s`, `model_tflops_per_device`, `mfu` where known, `eval_loss` at the steps that
evaluate, ...), and each per-layer list as one tag per MoE layer, `expert_overload/layer_3`."""

import math
import os
from pathlib import Path

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
    elsewhere). Use as a context manager: the events are flushed and the file closed at exit.
    `start`: the step a resumed run continues from; the events an interrupted run wrote past it
    are purged (TensorBoard hides them), as metrics.jsonl's lines are truncated."""

    def __init__(self, out: Path, start: int = 0):
        self.logdir = Path(out) / "tensorboard"
        self.writer = None
        if distributed.is_main():
            from tensorboardX import SummaryWriter  # the train extra

            purge = start + 1 if start else None
            # tensorboardX names a file by the second it opens it: two runs into one directory
            # within a second (a short run, then its resume) would share the name, the second
            # truncating the first's events, but for this suffix
            suffix = f".{os.getpid()}.from{start}"
            self.writer = SummaryWriter(
                logdir=str(self.logdir), flush_secs=30, purge_step=purge, filename_suffix=suffix
            )

    def write(self, rec: dict) -> None:
        if self.writer is None:
            return
        for tag, value in scalars(rec).items():
            self.writer.add_scalar(tag, value, global_step=rec["step"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.writer is not None:
            self.writer.close()
        return False
