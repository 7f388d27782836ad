"""`python -m train` on JAX's own multi-process runtime: two processes with 4 CPU devices each,
joined by `jax.distributed` over localhost (gloo collectives), train the same steps as one
process with 8 devices, with the same losses (up to float32 reduction order: relative 1e-6),
with gradient accumulation on (`grad_accum=2`: the accumulated step's scan over micro-batches
runs the same collectives as the plain step, once per micro-batch). Each process reads only the
rows of the global batch its devices hold (half of every micro-batch each, its INFO line says
which). Only process 0 writes metrics.jsonl and prints; both take part in the orbax
checkpoint. The mesh is
`node=2,expert=4`: over the two processes `ring="auto"` picks the hierarchical ring (one process
per `node` index; said in its INFO log line), in one process the flat ring, so the losses also
compare the two rings across real processes. A SIGTERM to one of the two processes stops both
after the same step, checkpointed.

The two processes run as subprocesses of 4 devices each (every process pays jax's start-up and
a compile), then the one process of 8 devices runs in this one (pytest's 8 devices, as the
trainer's: `cli.main`, its INFO lines through `caplog`). Inconsistent distributed flags are
checked in-process: a ValueError before jax is touched.
"""

import json
import logging
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


def free_port() -> int:
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


def start_process(name: str, logs: Path, devices: int, argv: list[str], log_info: bool = False):
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


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def row_set(ranges: str) -> set[int]:
    """ "0-3, 6" -> {0, 1, 2, 3, 6} (`train.data.loader.row_ranges`)."""
    out = set()
    for part in ranges.split(", "):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _wait_for_steps(procs, metrics: Path, steps: int, logs: Path) -> None:
    """Until `metrics` holds `steps` lines; fails if a process ends first or time runs out."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            (logs / f"{p.name}.err").read_text()[-2000:] for p in procs
        ]
        time.sleep(0.01)


def _stop_line(err: str) -> str:
    (line,) = [ln for ln in err.splitlines() if ln.startswith("interrupted by ")]
    return line


def _check_rows_and_rings(logs: Path) -> None:
    """The hierarchical ring over the two processes, the flat one in one; each of the two
    reads only the rows of the batch its devices hold: half each, disjoint, and of each of the
    two micro-batches of 8 rows the same half."""
    for name in ("p0", "p1"):
        assert HIERARCHICAL in (logs / f"{name}.err").read_text(), name
    # the one process's INFO lines (`caplog`: the data line below shows they were captured; the
    # op's own lines are its trace's, and an earlier test of this process may have traced the
    # same step, memoised): no hierarchical ring
    assert "hierarchical ring" not in (logs / "single.err").read_text()
    read = {}
    for name in ("p0", "p1", "single"):
        found = re.findall(
            r"data: process (\d) of (\d) reads (\d+) of the 16 rows of each batch: ([\d, -]+)",
            (logs / f"{name}.err").read_text(),
        )
        assert len(found) == 1, name
        read[name] = row_set(found[0][3])
    assert len(read["p0"]) == len(read["p1"]) == 8 and read["p0"] | read["p1"] == read["single"]
    assert read["single"] == set(range(16))
    for name in ("p0", "p1"):  # 4 rows of each micro-batch of 8, the same ones in both
        first = {r for r in read[name] if r < 8}
        assert len(first) == 4 and read[name] == first | {r + 8 for r in first}


_GLOO_WORDS = re.compile(
    r"\[Gloo\]|\b(?:Rank|is|connected|to|peer|ranks|Expected|number|of)\b|[.:]|\d+|\s+"
)


def test_two_processes_match_one(tmp_path, caplog, capsys):
    """On a prepared dataset of many documents: the batches carry segment ids, and each process
    puts only its rows (tokens, segment ids, positions) into the global batch. The two
    processes run towards step 60 (the same cosine horizon as the one process's 5 steps:
    schedule_steps=60) and get a SIGTERM, to process 1 only, once 5 steps are logged; their
    first 5 losses are compared (the model with one decoder layer: every layer runs the same
    ring, and one drops or misweights a (token, expert) pair visibly; it shortens each
    process's tracing and compiles). Also covers what
    test_sigterm_to_one_process_stops_both_after_the_same_step did in two processes of its own:
    SIGTERM to process 1 only (jax.distributed's preemption notifier would swallow it: the
    trainer's handler is installed after it), both processes stop after the same step, save it
    together and exit 143. Also covers what
    test_grad_accum.py::test_two_processes_read_their_rows_of_every_micro_batch did with two
    processes of its own (grad_accum=2, 2 steps, against that file's one-process run): each
    process reads, of every micro-batch, the rows its devices hold, and the two train as one."""
    multi, single = tmp_path / "multi", tmp_path / "single"
    args = ["--data", str(word_corpus(tmp_path, 400)), "mesh=node=2,expert=4", "schedule_steps=60"]
    args += ["num_hidden_layers=1"]  # each layer is the same ring: one compares the two rings
    args += ["grad_accum=2"]  # 16 rows per step: 2 micro-batches of batch_size=8
    dist = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    dist += ["--steps", "60", "--save-every", "50", "--out", str(multi)]
    procs = [
        start_process(f"p{i}", tmp_path, 4, [*dist, "--process-id", str(i), *args], log_info=True)
        for i in range(2)
    ]
    try:
        _wait_for_steps(procs, multi / "metrics.jsonl", 5, tmp_path)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # the one process, in this one, after the two (alongside, it would hold up their SIGTERM:
    # they could reach step 60 first)
    caplog.set_level(logging.INFO)
    capsys.readouterr()
    assert cli.main([*ARGS, "--out", str(single), *args]) == 0
    (tmp_path / "single.err").write_text("\n".join(caplog.messages))
    (tmp_path / "single.out").write_text(capsys.readouterr().out)
    errs = [(tmp_path / f"p{i}.err").read_text() for i in range(2)]
    assert codes == [143, 143], [e[-2000:] for e in errs]
    lines = [_stop_line(e) for e in errs]
    assert lines[0] == lines[1] and lines[0].startswith("interrupted by SIGTERM after step "), lines
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert 5 <= step < 60 and [p.name for p in (multi / "checkpoints").iterdir()] == [str(step)]
    assert (single / "checkpoints" / "5").is_dir(), sorted((single / "checkpoints").iterdir())

    _check_rows_and_rings(tmp_path)
    assert sorted(p.name for p in multi.rglob("metrics*")) == ["metrics.jsonl"]
    got, want = _losses(multi), _losses(single)
    assert [s for s, _ in got] == list(range(1, step + 1))
    assert [s for s, _ in want] == [1, 2, 3, 4, 5]
    for (s, a), (_, b) in zip(got[:5], want, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6), (s, a, b)
    assert "data: 400 document(s)" in (tmp_path / "p0.out").read_text()
    assert "done: step 5" in (tmp_path / "single.out").read_text()
    # Only process 0 prints: process 1's stdout holds gloo's connection lines and nothing else.
    # Gloo's threads write them piece by piece and interleave ("[Gloo] Rank [Gloo] Rank 7 is ..."),
    # so strip gloo's words wherever they fall and check nothing (no trainer's word) is left.
    printed = (tmp_path / "p1.out").read_text()
    assert not _GLOO_WORDS.sub("", printed).strip(), printed


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
