"""Training-curve parity (paper Figure 18): ring and all-to-all train the same model from the same
seed on the same batches; their loss curves must agree to float tolerance.

    python benchmarks/train_parity.py [--steps 200] [--out runs/parity] [trainer key=value ...]

Runs `python -m train` twice in-process (dispatcher=ring, dispatcher=alltoall, dropless), then
prints the largest relative loss difference over the first half and over all steps and writes
both curves to OUT/parity.png. The two dispatchers sum each token's expert outputs in different
orders, so the curves are not bitwise equal; rounding differences grow slowly as training
amplifies them, hence the two windows.
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

DISPATCHERS = {"ring": ["dispatcher=ring"], "alltoall": ["dispatcher=alltoall"]}


def differences(runs: dict[str, Path]) -> dict[str, float]:
    """Largest |ring - alltoall| / |alltoall| of the loss over the first half and all steps."""
    c = plot.curves(runs)
    (s_r, ring), (s_a, a2a) = c["ring"], c["alltoall"]
    if not np.array_equal(s_r, s_a):
        raise ValueError(f"the runs logged different steps: {s_r} vs {s_a}")
    rel = np.abs(ring - a2a) / np.abs(a2a)
    half = max(1, len(rel) // 2)
    return {
        "steps": len(rel),
        "max_rel_first_half": float(rel[:half].max()),
        "max_rel_all": float(rel.max()),
        "ring_first": float(ring[0]),
        "ring_last": float(ring[-1]),
        "alltoall_last": float(a2a[-1]),
    }


def main(argv=None) -> dict:
    args = tiny_runs.parse(
        argv, "benchmarks/train_parity.py", __doc__.splitlines()[0], 200, "runs/parity"
    )
    runs = tiny_runs.train(args.out, args.steps, DISPATCHERS, args.extra)
    d = differences(runs)
    png = plot.plot_losses(
        runs, args.out / "parity.png", title=f"tiny: ring vs all-to-all, {args.steps} steps"
    )
    print(
        f"| steps | loss step 1 | ring last | alltoall last | max rel diff, first "
        f"{max(1, d['steps'] // 2)} | max rel diff, all |\n|---:|---:|---:|---:|---:|---:|\n"
        f"| {d['steps']} | {d['ring_first']:.4f} | {d['ring_last']:.4f} | "
        f"{d['alltoall_last']:.4f} | {d['max_rel_first_half']:.1e} | {d['max_rel_all']:.1e} |"
    )
    print(f"plot: {png}")
    return d


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError, guards.NonFiniteLossError, WriteError) as e:
        sys.exit(f"train_parity.py: error: {e}")
