"""What benchmarks/train_parity.py and benchmarks/train_fp8.py share: their command line (steps,
out, trainer key=value overrides; the reproduce line) and the tiny model's runs, one `python -m
train` each, in-process."""

import argparse
import shlex
from pathlib import Path

from relaymoe_jax.cli.argtypes import positive_int
from relaymoe_jax.cli.devices import use_cpu_devices
from train import cli


def parse(argv, script: str, description: str, steps: int, out: str) -> argparse.Namespace:
    """--steps, --out and the overrides of `script` (benchmarks/NAME.py), with the 8 emulated
    CPU devices set up (unless XLA_FLAGS sets a device count); prints the reproduce line."""
    use_cpu_devices(8)
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=positive_int, default=steps)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("extra", nargs="*", help="trainer key=value overrides (seq_len=32 ...)")
    args = p.parse_args(argv)
    cmd = shlex.join([f"--steps={args.steps}", f"--out={args.out}", *args.extra])
    print(f"# reproduce: python {script} {cmd}", flush=True)
    return args


def train(out: Path, steps: int, runs: dict[str, list[str]], extra: list[str]) -> dict[str, Path]:
    """Trains configs/tiny.yaml `steps` steps once per entry of `runs` (name -> its overrides,
    then `extra`) into OUT/name; returns {name: its metrics.jsonl}."""
    metrics = {}
    for name, over in runs.items():
        d = out / name
        args = ["--config", "configs/tiny.yaml", "--steps", str(steps), "--out", str(d)]
        cli.main([*args, "--quiet", *over, *extra])
        metrics[name] = d / "metrics.jsonl"
    return metrics
