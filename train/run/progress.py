"""Per-step feedback: one line per step with a progress bar, the losses, grad norm, learning
rate, the held-out loss and perplexity at the steps that evaluate (`step.evaluate`), the most
overloaded MoE layer's load max/mean and the most idle experts (`step.expert_load`), the model
TFLOP/s per device and MFU (`step.flops`), tokens per optimizer step (every micro-batch of
`grad_accum`), tokens/s, step time and the time left. Plain lines (no carriage returns), so a
log file reads the same as a terminal."""

import time

from ..step import expert_load


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _throughput(rec: dict) -> str:
    """`12.3 TFLOP/s/dev MFU 31.2% ` (MFU where the device's peak is known)."""
    if "model_tflops_per_device" not in rec:
        return ""
    mfu = rec.get("mfu")
    return f"{rec['model_tflops_per_device']:.3g} TFLOP/s/dev " + (
        f"MFU {mfu:.1%} " if mfu is not None else ""
    )


class StepProgress:
    """Formats the line of each step from `start + 1` to `total`. The time left is the mean step
    time so far (the first step excluded once there are others: it may include warm-up) times
    the steps left."""

    def __init__(self, start: int, total: int, tokens_per_step: int | None = None, width: int = 20):
        self.start, self.total, self.width = start, total, width
        self.tokens_per_step = tokens_per_step  # shown when given (all micro-batches of a step)
        self.times: list[float] = []
        self.t0 = time.perf_counter()

    def bar(self, step: int) -> str:
        done = self.width * step // self.total
        return "[" + "#" * done + "." * (self.width - done) + "]"

    def line(self, rec: dict) -> str:
        """The line for the metrics record `rec` (keys as in metrics.jsonl)."""
        step = rec["step"]
        self.times.append(rec["step_time"])
        recent = self.times[1:] or self.times
        left = (self.total - step) * sum(recent) / len(recent)
        return (
            f"{self.bar(step)} step {step}/{self.total} loss {rec['loss']:.4f} "
            f"(lm {rec['lm_loss']:.4f} aux {rec['aux_loss']:.4f} z {rec['z_loss']:.4f}) "
            f"gnorm {rec['grad_norm']:.3f} "
            + (f"lr {rec['lr']:.3g} " if "lr" in rec else "")
            + (
                f"eval {rec['eval_loss']:.4f} (ppl {rec['eval_perplexity']:.2f}) "
                if "eval_loss" in rec
                else ""
            )
            + expert_load.worst(rec)
            + _throughput(rec)
            + (f"{self.tokens_per_step:,} tok/step " if self.tokens_per_step else "")
            + f"{rec['tokens_per_s']:,.0f} tok/s "
            f"{rec['step_time'] * 1e3:.1f} ms/step, elapsed "
            f"{_duration(time.perf_counter() - self.t0)}, left ~{_duration(left)}"
        )
