"""FP8 experts in training: the tiny model trained with bf16 compute, then with the same seed,
batches and settings plus `expert_fp8=true` (docs/precision.md), and with float32 compute as a
control, and the loss curves compared.

    python benchmarks/train_fp8.py [--steps 300] [--out runs/fp8] [trainer key=value ...]

Runs `python -m train` three times in-process (compute_dtype=bfloat16 with and without
expert_fp8, and compute_dtype=float32) and prints, every tenth of the steps, each run's loss and
its relative gap to bf16's, and writes the curves to OUT/loss.png. The float32 control is the
yardstick: it changes the precision too (upwards), so its gap to bf16 is how far a change of
rounding alone moves this run's loss at that step. The issue's goal: FP8 within 2% of bf16's
final loss.
"""

import sys
from pathlib import Path

import numpy as np

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's train/
if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling modules, when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import tiny_runs

from train.errors import WriteError
from train.run import guards, plot

RUNS = {
    "bf16": ["compute_dtype=bfloat16"],
    "fp8": ["compute_dtype=bfloat16", "expert_fp8=true"],
    "float32": ["compute_dtype=float32"],
}


def gaps(runs: dict[str, Path]) -> list[dict]:
    """Every tenth of the steps (and the last): each run's loss and its gap to bf16's."""
    c = plot.curves(runs)
    steps = c["bf16"][0]
    for name, (s, _) in c.items():
        if not np.array_equal(s, steps):
            raise ValueError(f"the runs logged different steps: bf16 {steps} vs {name} {s}")
    n = len(steps)
    picks = sorted({0, *range(max(1, n // 10) - 1, n, max(1, n // 10)), n - 1})
    base = c["bf16"][1]
    return [
        {"step": int(steps[i])}
        | {name: float(v[i]) for name, (_, v) in c.items()}
        | {f"{name} gap": float((v[i] - base[i]) / base[i]) for name, (_, v) in c.items()}
        for i in picks
    ]


def main(argv=None) -> list[dict]:
    args = tiny_runs.parse(
        argv, "benchmarks/train_fp8.py", __doc__.splitlines()[0], 300, "runs/fp8"
    )
    runs = tiny_runs.train(args.out, args.steps, RUNS, args.extra)
    rows = gaps(runs)
    png = plot.plot_losses(
        runs, args.out / "loss.png", title=f"tiny: bf16, expert_fp8, float32, {args.steps} steps"
    )
    print(
        "| step | bf16 | fp8 | fp8 vs bf16 | float32 | float32 vs bf16 |\n"
        "|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['step']} | {r['bf16']:.4f} | {r['fp8']:.4f} | {r['fp8 gap']:+.2%} | "
            f"{r['float32']:.4f} | {r['float32 gap']:+.2%} |"
        )
    print(f"plot: {png}")
    return rows


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError, guards.NonFiniteLossError, WriteError) as e:
        sys.exit(f"train_fp8.py: error: {e}")
