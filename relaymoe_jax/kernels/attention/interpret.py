"""Where jax 0.12's Mosaic GPU interpreter (`interpret=True`: the "pallas-interpret" attention on
CPU) can run the attention kernels, checked before anything is traced.

- **One device only.** It checks each kernel's barriers across devices, so one kernel run on
  several devices at once waits forever in a rendezvous (XLA:CPU aborts after about 80 s): a
  mesh of more than one device is refused (`check_devices`).
- **Enough XLA:CPU threads.** It runs each kernel's warpgroups (up to
  `MosaicConfig.heads_per_program` for the attention, 3 for the grouped matmul's
  gmm_impl="mosaic-interpret") as XLA:CPU computations on threads of their own, which meet
  at the kernel's barriers, while the computation that called the kernel waits for them.
  XLA:CPU runs computations on a pool of `NPROC` threads (the environment variable, read when
  jax starts; else the CPUs this process may use): the pool must hold the caller and every
  warpgroup at once, else a warpgroup never starts and the others wait for it forever (found:
  a train step on a 2-CPU machine, 2 threads for a caller and 2 warpgroups; small programs ran
  because XLA:CPU ran their caller inline). `check_threads` refuses a smaller pool;
  `reserve_threads` (entry points, before jax starts) raises NPROC to what it needs.
"""

import os

from relaymoe_jax.kernels.attention.common import MosaicConfig
from relaymoe_jax.kernels.gmm.mosaic_common import WARPGROUPS as GMM_WARPGROUPS
from relaymoe_jax.util.tracing import backends_started

# the caller and the most warpgroups of a kernel the interpreter may run: the attention's
# `heads_per_program`, the grouped matmul's producer and two consumers ("mosaic-interpret")
THREADS = 1 + max(MosaicConfig().heads_per_program, GMM_WARPGROUPS)
IMPL = "pallas-interpret"


def execute_threads() -> int:
    """XLA:CPU's computation threads in this process: NPROC if it is a number (what XLA reads),
    else the CPUs this process may run on."""
    try:
        return int(os.environ["NPROC"])
    except (KeyError, ValueError):
        return len(os.sched_getaffinity(0))


def reserve_threads() -> None:
    """Before jax starts: NPROC raised to `THREADS` where XLA:CPU would get fewer (a machine of
    fewer CPUs); it changes only the size of XLA:CPU's thread pools, never a result."""
    if not backends_started() and execute_threads() < THREADS:
        os.environ["NPROC"] = str(THREADS)


def check_devices(devices: int, where: str) -> None:
    """A ValueError unless the interpreter runs on one device (`where` names the mesh)."""
    if devices > 1:
        raise ValueError(
            f"attention_impl={IMPL!r} on {where} of {devices} devices: jax 0.12's Mosaic GPU "
            "interpreter runs one device only (it would wait forever in a rendezvous); run it "
            "on a mesh of one device, or use 'chunked' ('pallas' on GPUs)"
        )


def check_threads(what: str = f"attention_impl={IMPL!r}", instead: str = "'chunked'") -> None:
    """A ValueError unless XLA:CPU has the threads the interpreter needs (`execute_threads`);
    `what` names the option that asked for the interpreter, `instead` what runs without it."""
    have = execute_threads()
    if have < THREADS:
        raise ValueError(
            f"{what} needs {THREADS} XLA:CPU threads (the caller and up to {THREADS - 1} "
            f"warpgroups of a kernel, which wait on each other) and this process has {have} "
            f"(NPROC or its CPUs): a step would wait forever; set NPROC={THREADS} in the "
            f"environment before jax starts, or use {instead}"
        )
