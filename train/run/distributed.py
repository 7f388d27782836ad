"""Multi-process (multi-host) runs on JAX's own runtime, `jax.distributed.initialize`.

Two ways to start, chosen by flags (see `add_arguments`):
- explicit: `--coordinator-address HOST:PORT --num-processes N --process-id I` on every process
  (all three or none); jax's cluster auto-detection is then switched off, so a SLURM or MPI
  environment cannot change the values (JAX_LOCAL_DEVICE_IDS is still honoured by jax).
- `--distributed`: `jax.distributed.initialize()` reads them from the environment (SLURM, Open MPI,
  Kubernetes indexed Jobs/JobSets, Cloud TPU; see docs/multinode.md).
Without either, nothing is initialised and the run is single-process.

`initialize` must run before anything touches the jax backend (`jax.devices()`, any computation).
Every process runs the same program on the same global mesh and data; only the main process
(`is_main`) writes the metrics log and prints (`print_on_main`).
"""

import argparse
import os
from pathlib import Path

import jax

DEFAULT_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 100  # jax's default; lowered to the run's timeout when that is less


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The distributed flags of `python -m train`."""
    g = p.add_argument_group("multi-process (jax.distributed)")
    g.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordinator, the same on every process",
    )
    g.add_argument("--num-processes", type=int, default=None, help="number of processes")
    g.add_argument("--process-id", type=int, default=None, help="this process, 0..N-1")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="let jax.distributed.initialize() detect the cluster from the environment "
        "(SLURM, Open MPI, Kubernetes, Cloud TPU)",
    )
    g.add_argument(
        "--distributed-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help=f"bound on connecting, on shutdown and on the heartbeat (default {DEFAULT_TIMEOUT_S})",
    )


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator-address must be HOST:PORT, got {address!r}")


def mode(args) -> str:
    """The run mode the flags ask for: "explicit", "auto" or "off"; ValueError for inconsistent
    flags. Touches no jax state."""
    explicit = {
        "--coordinator-address": args.coordinator_address,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    given = [k for k, v in explicit.items() if v is not None]
    if args.distributed and given:
        raise ValueError(
            f"--distributed detects the cluster from the environment; "
            f"do not combine it with {', '.join(given)}"
        )
    if given and len(given) < len(explicit):
        missing = [k for k in explicit if k not in given]
        raise ValueError(
            f"{', '.join(given)} also needs {', '.join(missing)} (give all three, or none)"
        )
    if given:
        _check_address(args.coordinator_address)
        if args.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(
                f"--process-id must be in 0..{args.num_processes - 1} "
                f"(--num-processes {args.num_processes}), got {args.process_id}"
            )
    run = "explicit" if given else "auto" if args.distributed else "off"
    if args.distributed_timeout is not None:
        if run == "off":
            raise ValueError(
                "--distributed-timeout needs --distributed or --coordinator-address "
                "--num-processes --process-id"
            )
        if args.distributed_timeout < 1:
            raise ValueError(f"--distributed-timeout must be >= 1, got {args.distributed_timeout}")
    return run


def initialize(args) -> bool:
    """Start jax's distributed runtime as the flags say (see the module docstring); True if it is
    running. Validates the flags first (ValueError), so bad flags never reach jax."""
    run = mode(args)
    if run == "off":
        return False
    if jax.distributed.is_initialized():  # a second in-process run: already connected
        return True
    timeout = args.distributed_timeout or DEFAULT_TIMEOUT_S
    kw = dict(
        initialization_timeout=timeout,
        shutdown_timeout_seconds=timeout,
        heartbeat_timeout_seconds=min(HEARTBEAT_TIMEOUT_S, timeout),
    )
    if run == "explicit":
        jax.distributed.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            cluster_detection_method="deactivate",
            **kw,
        )
    else:
        jax.distributed.initialize(**kw)
    return True


def is_main() -> bool:
    """True on process 0 (and in a single-process run): the one that logs and prints."""
    return jax.process_index() == 0


def print_on_main(msg: str) -> None:
    """`msg` on stdout (flushed), from the main process only."""
    if is_main():
        print(msg, flush=True)


def open_on_main(path: Path, mode: str = "a"):
    """`path` opened on the main process; /dev/null on the others, so that they can run the same
    code without writing."""
    return Path(path).open(mode) if is_main() else open(os.devnull, mode)
