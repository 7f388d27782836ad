"""`--profile-steps A:B`: steps A to B traced with `jax.profiler` into `OUT/profile/` (XProf's
trace viewer reads it: `tensorboard --logdir OUT/profile` with the profile plugin, or
`xprof OUT/profile`). The program's named scopes name what runs in it: `ring_fwd_hop` /
`ring_bwd_hop` (each hop of the ring), `attention`, `lm_loss`, `optimizer` (AdamW's update),
`a2a_*` (the all-to-all's stages), `router`, `experts`."""

import argparse
from pathlib import Path

import jax


def step_range(text: str) -> tuple[int, int]:
    """argparse type of A:B (1 <= A <= B)."""
    a, sep, b = text.partition(":")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        lo = hi = 0
    if not sep or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(
            f"expected A:B, the first and last step to trace (1 <= A <= B), got {text!r}"
        )
    return lo, hi


def check_range(steps: tuple[int, int] | None, total: int) -> tuple[int, int] | None:
    """The range, refused (ValueError) when it ends past --steps."""
    if steps is not None and steps[1] > total:
        raise ValueError(
            f"--profile-steps {steps[0]}:{steps[1]} ends past --steps {total}: nothing would "
            f"trace steps {max(steps[0], total + 1)} to {steps[1]}"
        )
    return steps


class Profiler:
    """Starts the trace before step A and stops it after step B (each step has finished when its
    metrics are read); a run that stops inside the range stops the trace on exit."""

    def __init__(self, out: Path, steps: tuple[int, int] | None, log=print):
        self.dir, self.steps, self.log = Path(out) / "profile", steps, log
        self.on = False

    def before(self, step: int) -> None:
        if self.steps and not self.on and self.steps[0] <= step <= self.steps[1]:
            jax.profiler.start_trace(str(self.dir))
            self.on = True

    def after(self, step: int) -> None:
        if self.on and step >= self.steps[1]:
            self._stop(step)

    def _stop(self, step: int) -> None:
        jax.profiler.stop_trace()
        self.on = False
        self.log(f"profile of steps {self.steps[0]}-{step}: {self.dir}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.on:
            jax.profiler.stop_trace()
            self.on = False
        return False
