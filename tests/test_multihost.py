"""`python -m train` on JAX's own multi-process runtime: two processes with 4 CPU devices each,
joined by `jax.distributed` over localhost (gloo collectives), train the same 5 steps as one
process with 8 devices, with the same losses (up to float32 reduction order: relative 1e-6).
Each process reads only the rows of the global batch its devices hold (half each, its INFO
line says which). Only process 0 writes metrics.jsonl and prints; both take part in the orbax
checkpoint. The mesh is
`node=2,expert=4`: over the two processes `ring="auto"` picks the hierarchical ring (one process
per `node` index; said in its INFO log line), in one process the flat ring, so the losses also
compare the two rings across real processes.

The three processes run at the same time, each as a subprocess with its own device count.
Inconsistent distributed flags are checked in-process: a ValueError before jax is touched. A
SIGTERM to one process stops both after the same step, checkpointed.
"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from corpora import word_corpus

from train import cli

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--config", "configs/tiny.yaml", "--steps", "5", "seq_len=32", "batch_size=8", "--quiet"]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `python -m train` with the "relaymoe_jax" logger's INFO lines on stderr (the ring it picks)
LOG_INFO = (
    "import logging, runpy, sys; logging.basicConfig(level=logging.INFO); "
    "sys.argv[0] = 'train'; runpy.run_module('train', run_name='__main__')"
)
HIERARCHICAL = (
    "moe_ffn(ring='auto'): hierarchical ring, inner 'expert' within each host, "
    "outer 'node' across hosts"
)


def _start(name: str, logs: Path, devices: int, argv: list[str], log_info: bool = False):
    """`python -m train ARGS argv` on `devices` CPU devices, output to logs/name.{out,err}."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices}".strip(),
    }
    out, err = (open(logs / f"{name}.{k}", "w") for k in ("out", "err"))
    run = ["-c", LOG_INFO] if log_info else ["-m", "train"]
    with out, err:
        proc = subprocess.Popen(
            [sys.executable, *run, *ARGS, *argv], cwd=ROOT, env=env, stdout=out, stderr=err
        )
    proc.name = name
    return proc


def _wait_all(procs, logs: Path, timeout: float) -> None:
    """Wait for every process; kill them all as soon as one fails or the time is up, and fail
    with each one's exit status and the end of its stderr."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    if any(p.returncode != 0 for p in procs):
        report = "\n".join(
            f"--- {p.name}: rc={p.returncode}\n{(logs / f'{p.name}.err').read_text()[-3000:]}"
            for p in procs
        )
        raise AssertionError(f"a trainer process failed or timed out ({timeout} s):\n{report}")


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _rows(ranges: str) -> set[int]:
    """ "0-3, 6" -> {0, 1, 2, 3, 6} (`train.data.loader.row_ranges`)."""
    out = set()
    for part in ranges.split(", "):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def run_two_and_one(tmp_path, args) -> tuple[Path, Path]:
    """(multi, single): the run directories of the trainer with `args` on two processes of 4
    devices and on one of 8, run side by side (logs in tmp_path/{p0,p1,single}.{out,err})."""
    multi, single = tmp_path / "multi", tmp_path / "single"
    dist = ["--coordinator-address", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    procs = [
        _start(
            f"p{i}",
            tmp_path,
            4,
            ["--out", str(multi), *dist, "--process-id", str(i), *args],
            log_info=True,
        )
        for i in range(2)
    ]
    procs.append(_start("single", tmp_path, 8, ["--out", str(single), *args], log_info=True))
    _wait_all(procs, tmp_path, TIMEOUT_S)
    return multi, single


def test_two_processes_match_one(tmp_path):
    """On a prepared dataset of many documents: the batches carry segment ids, and each process
    puts only its rows (tokens, segment ids, positions) into the global batch."""
    args = ["--data", str(word_corpus(tmp_path, 400)), "mesh=node=2,expert=4"]
    multi, single = run_two_and_one(tmp_path, args)
    for name in ("p0", "p1"):
        assert HIERARCHICAL in (tmp_path / f"{name}.err").read_text(), name
    assert "hierarchical ring" not in (tmp_path / "single.err").read_text()
    # each process reads only the rows of the batch its devices hold: half each, disjoint
    read = {}
    for name in ("p0", "p1", "single"):
        found = re.findall(
            r"data: process (\d) of (\d) reads (\d+) of the 8 rows of each batch: ([\d, -]+)",
            (tmp_path / f"{name}.err").read_text(),
        )
        assert len(found) == 1, name
        read[name] = _rows(found[0][3])
    assert len(read["p0"]) == len(read["p1"]) == 4 and read["p0"] | read["p1"] == read["single"]
    assert read["single"] == set(range(8))

    assert sorted(p.name for p in multi.rglob("metrics*")) == ["metrics.jsonl"]
    got, want = _losses(multi), _losses(single)
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4, 5]
    for (s, a), (_, b) in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-6), (s, a, b)
    for out in (multi, single):
        assert (out / "checkpoints" / "5").is_dir(), sorted((out / "checkpoints").iterdir())
    assert "done: step 5" in (tmp_path / "p0.out").read_text()
    assert "data: 400 document(s)" in (tmp_path / "p0.out").read_text()
    assert "done:" not in (tmp_path / "p1.out").read_text()  # only process 0 prints


def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
    """SIGTERM to process 1 only (jax.distributed's preemption notifier would swallow it: the
    trainer's handler is installed after it): both processes stop after the same step, save it
    together and exit 143."""
    out = tmp_path / "run"
    dist = [
        "--coordinator-address",
        f"127.0.0.1:{_free_port()}",
        "--num-processes",
        "2",
        "--steps",
        "60",
        "--save-every",
        "50",
        "--out",
        str(out),
    ]
    procs = [_start(f"p{i}", tmp_path, 4, [*dist, "--process-id", str(i)]) for i in range(2)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                (tmp_path / f"p{i}.err").read_text()[-2000:] for i in range(2)
            ]
            time.sleep(0.01)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [(tmp_path / f"p{i}.err").read_text() for i in range(2)]
    assert codes == [143, 143], errs
    lines = [e.strip().splitlines()[-1] for e in errs]
    assert lines[0] == lines[1] and lines[0].startswith("interrupted by SIGTERM after step "), lines
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert step < 60 and [p.name for p in (out / "checkpoints").iterdir()] == [str(step)]
    assert len(_losses(out)) == step


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--num-processes", "2"], "also needs --coordinator-address, --process-id"),
        (
            ["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
            r"--process-id must be in 0\.\.1",
        ),
        (
            ["--coordinator-address", "h:1", "--num-processes", "0", "--process-id", "0"],
            "--num-processes must be >= 1",
        ),
        (["--coordinator-address", "h", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
        (["--distributed", "--process-id", "0"], "do not combine it with --process-id"),
        (["--distributed-timeout", "5"], "needs --distributed"),
        (["--distributed", "--distributed-timeout", "0"], "must be >= 1"),
    ],
)
def test_inconsistent_distributed_flags_fail_before_jax(tmp_path, flags, match):
    with pytest.raises(ValueError, match=match):
        cli.main([*ARGS, "--out", str(tmp_path / "x"), *flags])
    assert not jax.distributed.is_initialized()
