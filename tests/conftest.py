"""Test setup: 8 emulated CPU devices (jax's jax_num_cpu_devices, not XLA_FLAGS), set before jax
runs anything; the CPU platform unless JAX_PLATFORMS says otherwise; x64 off.

Compile time is most of the suite's time, so these settings cut it without changing a program:
- one persistent compilation cache for the whole run (a fresh temporary directory, removed at the
  end), shared by the pytest workers and the trainer subprocesses the tests start (through the
  environment), every program kept however small, so a program compiled once is not compiled
  again: the same test model in many trainer runs, and the small programs (eager operations,
  initialisers, orbax's slices, the optimizer's schedule) that every test file compiles anew
  after `_release_compiled_programs` dropped the previous file's. Few big programs repeat (31
  hits among the 508 compiles over 0.5 s of one run); the small ones do: on five trainer-heavy
  files run in one process, 7.6% less CPU with the cache than without;
- after each test file, the programs it compiled are released (`_release_compiled_programs`:
  jax's caches and the trainer's memoised steps). Every XLA:CPU executable holds a few memory
  mappings of JIT code; a worker that kept all of them grew towards Linux's `vm.max_map_count`
  (65,530), and late in runs XLA aborted whole workers in whatever it was mapping (CI twice,
  2026-12-02 and -03, and twice here: a cache write, a compile; that limit is the likely cause).
  Measured on one worker over five test files: 24,285 mappings and growing without the release,
  at most 12,382 with it;
- XLA's LLVM backend at -O0 (`--xla_backend_optimization_level=0`, appended to XLA_FLAGS). The HLO
  passes, the buffer assignment (`memory_analysis()`) and the schedule are unchanged, and so are
  the numbers: XLA:CPU does not reassociate floating point (no fast math), whatever LLVM's level.
  Deviceless GPU compiles read HLO-level facts and Triton's operand types, which LLVM's level does
  not touch;
- deviceless XLA:GPU compiles without autotuning (`--xla_gpu_autotune_level=0`, appended to
  XLA_FLAGS). With no GPU there is nothing to time, yet at XLA's default level its config pass
  still compiles candidate Triton tilings to find the first that compiles, about half of each
  deviceless compile. Checked on the 30 GPU programs of tests/test_gpu_compile.py,
  test_attention_gpu_compile.py, test_multinode_gpu.py and (then) test_offload_layer_inputs.py
  (XLA_FLAGS's --xla_dump_to at levels 0 and 4): the same optimized HLO in the same order (the
  schedule), the same Triton tilings and the same buffer bytes; tests/test_gpu_compile.py alone
  fell from 223 s to 122 s (one pytest process, nothing else running);
- each test file runs on one xdist worker (pyproject's `--dist loadfile`), so a module-scoped
  fixture (one benchmark run, one trained model) runs once, and a program the file's tests share
  is traced and compiled once, in one process. (xdist's `loadgroup` cannot group under pytest 9.2:
  it rewrites `item._nodeid`, which pytest no longer reads.)

Python's cyclic garbage collector runs less often (`pytest_collection_finish`): what is alive
once the tests are collected (jax, the modules, the test items) is frozen out of every later
collection, and the youngest generation is collected every 20,000 net allocations instead of 700.
Tracing allocates millions of short-lived objects, and each collection walked the whole young
heap: about 4% of a tracing-heavy file's time, 70 s of the whole suite's wall time on 2 cores.
Memory does not grow: reference counting frees nearly everything, and `_release_compiled_programs`
still collects everything after each file.

Every test has a hard time limit (pyproject's `faulthandler_timeout` with
`faulthandler_exit_on_timeout`): past it the process prints every thread's stack and exits, so a
test that hangs (jax's Mosaic GPU interpreter can wait forever on its barriers:
`relaymoe_jax/kernels/attention/interpret.py`) fails, named by xdist as the test its worker
crashed in, instead of holding CI until its own limit. XLA:CPU gets at least the threads that
interpreter needs (NPROC, `interpret.reserve_threads`).

`RELAYMOE_TEST_COMPILE_LOG=DIR` writes, per pytest process, `DIR/<worker>.json`: for each test,
the seconds jax spent tracing, lowering and compiling in that process (jax.monitoring's events)
and how many programs it compiled (docs/development.md shows how to read them).

Python writes the checkout's bytecode (`__pycache__/`, git-ignored) even where the environment
says not to (PYTHONDONTWRITEBYTECODE, set on these machines): every trainer and script subprocess
the tests start imports the library and the trainer, and compiled them from source each time
(0.27 s a process for relaymoe_jax and train; pip already compiled the installed packages).

The trainer's cache of prepared text (`train.data.prepared.cache_dir`) is a directory of the run's
cache, not the user's ~/.cache.
"""

import gc
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = False  # module doc; before the imports below, for them too
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE_ENV = "RELAYMOE_TEST_JAX_CACHE"
if _CACHE_ENV not in os.environ:  # the first process (pytest, or xdist's controller) makes it
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="relaymoe-jax-test-cache-")
    _OWNS_CACHE = True
else:
    _OWNS_CACHE = False
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_CACHE_ENV])
os.environ.setdefault("RELAYMOE_DATA_CACHE", os.path.join(os.environ[_CACHE_ENV], "datasets"))
# every program, the small ones too (a trainer process compiles ~100 programs of 30-800 ms
# besides its step: its model initialisers, schedule, checksums): a test's later trainer
# processes read them back in milliseconds (test_train_kill.py: 7% less CPU than at 0.5 s)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
for _flag in ("xla_backend_optimization_level=0", "xla_gpu_autotune_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --" + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from relaymoe_jax.cli.devices import use_cpu_devices  # noqa: E402
from relaymoe_jax.kernels.attention import interpret  # noqa: E402

interpret.reserve_threads()
use_cpu_devices(8)
jax.config.update("jax_enable_x64", False)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test file: drop the programs it compiled (jax's caches and the trainer's
    memoised steps), so that a worker's XLA:CPU executables (each a few memory mappings of JIT
    code) do not pile up over the run."""
    yield
    train_step = sys.modules.get("train.step.train_step")
    if train_step is not None:
        train_step.clear_compiled()
    jax.clear_caches()
    gc.collect()


def pytest_collection_finish(session):
    """The garbage collector's settings for the tests (module doc)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)


if os.environ.get("RELAYMOE_TEST_COMPILE_LOG"):
    import collections
    import json

    from jax import monitoring

    _COMPILE_LOG = collections.defaultdict(collections.Counter)

    def _log_compile_event(event, seconds, **_):
        if event.startswith("/jax/core/compile/"):
            test = os.environ.get("PYTEST_CURRENT_TEST", "(collection)").rsplit(" ", 1)[0]
            name = event.rsplit("/", 1)[1].removesuffix("_duration")
            _COMPILE_LOG[test][name + "_s"] += seconds
            _COMPILE_LOG[test][name + "_n"] += 1

    monitoring.register_event_duration_secs_listener(_log_compile_event)

    def pytest_sessionfinish(session):
        out = os.path.join(
            os.environ["RELAYMOE_TEST_COMPILE_LOG"],
            os.environ.get("PYTEST_XDIST_WORKER", "main") + ".json",
        )
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(_COMPILE_LOG, f, indent=0)


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)
