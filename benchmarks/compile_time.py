"""Compile time of the train step, layer scan (`scan_layers=true`) against unrolled layers.

    python benchmarks/compile_time.py [--config tiny] [--layers 4 48] [--mesh expert=8]

Each row is a fresh process (no compilation cache shared between rows): the train step of
`--config` with `num_hidden_layers` set, compiled (never run) from abstract shapes on 8 emulated
CPU devices, as `train.step.train_step.compile_abstract` does. Columns: seconds to build the
abstract state, to trace and lower, to compile; the compiled HLO's size and while loops;
temporaries per device.
The first output line is the command that reproduces the table.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from relaymoe_jax.cli.argtypes import positive_int

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(config: str, layers: int, scan: bool, mesh: str) -> dict:
    """One compile, in this process: timings, HLO size and temporaries."""
    import jax

    from relaymoe_jax.models.config_files import load_config
    from train.data import Batch
    from train.settings import TrainConfig
    from train.step import mesh as tm
    from train.step import train_step

    cfg = load_config(config, num_hidden_layers=layers, scan_layers=scan)
    tc = TrainConfig(mesh=mesh)
    mesh_ = tm.make_mesh(tc.mesh)
    t0 = time.perf_counter()
    graphdef, state, tx, rules = train_step.abstract_state(cfg, tc, mesh_)
    t1 = time.perf_counter()
    shape = (tc.batch_size, tc.seq_len)
    ids = jax.NamedSharding(mesh_, rules.fit(shape, "batch", "seq"))
    step = train_step.make_step(graphdef, tx, tc.compute_dtype, tc.loss_chunk)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    jitted = jax.jit(
        step,
        in_shardings=(shardings, ids),
        out_shardings=(shardings, jax.NamedSharding(mesh_, jax.P())),
        donate_argnums=0,
    )
    batch = Batch(jax.ShapeDtypeStruct(shape, jax.numpy.int32, sharding=ids))
    lowered = jitted.trace(state, batch).lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    hlo = compiled.as_text()
    return {
        "state_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "hlo_chars": len(hlo),
        "whiles": hlo.count(" while("),
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--layers", type=positive_int, nargs="+", default=[4, 48])
    p.add_argument("--mesh", default="expert=8")
    p.add_argument("--one", nargs=2, metavar=("LAYERS", "SCAN"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(n < 1 for n in args.layers):
        raise SystemExit(f"--layers {args.layers}: expected positive layer counts")
    if args.one:  # a child process: one row, as JSON
        import jax

        if "JAX_PLATFORMS" not in os.environ:  # jax is imported already: set its option
            jax.config.update("jax_platforms", "cpu")
        from relaymoe_jax.cli.devices import use_cpu_devices

        use_cpu_devices(8)  # before jax starts, unless XLA_FLAGS sets a device count
        print(json.dumps(measure(args.config, int(args.one[0]), args.one[1] == "1", args.mesh)))
        return 0
    print(
        "# reproduce: python benchmarks/compile_time.py "
        + shlex.join(
            ["--config", args.config, "--layers", *map(str, args.layers), "--mesh", args.mesh]
        )
    )
    print(
        f"# {args.config}, mesh {args.mesh}, train step compiled from abstract shapes on 8 "
        "emulated CPU devices; one fresh process per row",
        flush=True,
    )
    print(
        "| layers | scan_layers | abstract state s | trace + lower s | compile s | total s | "
        "HLO chars | while loops | temp MiB |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for n in args.layers:
        for scan in (True, False):
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--config",
                    args.config,
                    "--mesh",
                    args.mesh,
                    "--one",
                    str(n),
                    "1" if scan else "0",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if out.returncode:
                raise SystemExit(f"layers={n} scan={scan} failed:\n{out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            total = r["state_s"] + r["lower_s"] + r["compile_s"]
            print(
                f"| {n} | {scan} | {r['state_s']:.1f} | {r['lower_s']:.1f} | "
                f"{r['compile_s']:.1f} | {total:.1f} | {r['hlo_chars']:,} | {r['whiles']} | "
                f"{r['temp_mib']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
