"""The planner's arguments (`build_parser`, `parse`: checked before anything compiles) and
what is more than argparse's types: `--memory`'s and `--host-memory`'s sizes (`parse_memory`: a
device name or a number with a unit; `host_memory`: `--host-memory` or its default, the per-GPU
share of the target node's RAM) and the dispatchers it plans (`planned_dispatchers`:
`--dispatchers`, or `dispatcher=` like any other key, and the op options on the command line that
those dispatchers use, by `MoEOptions`' one table); the trainer settings that cannot change a
step's memory are refused (`refuse_run_only`)."""

import argparse
import re

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.cli.argtypes import positive_int
from relaymoe_jax.op.options import DISPATCHERS
from relaymoe_jax.util.checks import one_of

from ..settings import RUN_ONLY_FIELDS, check_options_used

# device memory of each target, from its shipped XLA GPU target config (relaymoe_jax.gpu_mesh)
DEVICES = {t.upper(): gpu_mesh.device_memory(t) for t in gpu_mesh.TARGETS}
_UNITS = {"": 1, "B": 1} | {
    f"{p}{i}B": (2**10 if i else 10**3) ** n for n, p in enumerate("KMGT", 1) for i in ("", "I")
}


# Host RAM per GPU of an 8-GPU node of each target: NVIDIA's DGX H100 and DGX H200 carry 2 TB of
# system memory (DIMMs come in GiB: 2 TiB), 256 GiB per GPU; HGX systems are built alike. Pinned
# host memory (where offloaded state and residuals live) cannot be paged out, and the OS, the
# input pipeline, the Python process and the CUDA driver need the rest: the planner checks
# against `--usable` of it, as for the device (train.planner).
NODE_RAM = {t.upper(): 2 * 2**40 for t in gpu_mesh.TARGETS}
HOST_MEMORY = {t: ram // gpu_mesh.GPUS_PER_HOST for t, ram in NODE_RAM.items()}
DEFAULT_HOST_TARGET = "H100"  # whose figure --host-memory defaults to without --target


def parse_memory(text: str, flag: str = "--memory", names: dict | None = None) -> int:
    """Bytes of `flag` (`--memory`): a name (`names`, default DEVICES: the device's memory) or a
    number with an optional unit (80GiB, 12.5MB, 1e9); ValueError naming `flag` otherwise."""
    names = DEVICES if names is None else names
    if text.upper() in names:
        return names[text.upper()]
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].upper() not in _UNITS:
        raise ValueError(
            f"{flag} {text!r}: expected one of {sorted(names)} or a size like 80GiB, 12.5MB, 1e9"
        )
    try:
        value = float(m[1]) * _UNITS[m[2].upper()]
    except ValueError:  # "1e", "1.2.3": the pattern's characters, not a number
        value = None
    if value is None or not value < float("inf"):
        raise ValueError(f"{flag} {text!r}: expected a size like 80GiB, 12.5MB, 1e9")
    if value <= 0:
        raise ValueError(f"{flag} {text!r}: must be > 0")
    return int(value)


def host_memory(text: str | None, target: str | None) -> tuple[int, str]:
    """(bytes, where they come from) of `--host-memory` (`text`: a size, or a target name for
    that node's per-GPU share, HOST_MEMORY), or, when None, its default: the per-GPU share of
    `target`'s 8-GPU node RAM, the H100 node's without a target."""
    if text is not None and text.upper() not in HOST_MEMORY:
        return parse_memory(text, "--host-memory", HOST_MEMORY), text
    name = (text or target or DEFAULT_HOST_TARGET).upper()
    gib, tib = HOST_MEMORY[name] / 2**30, NODE_RAM[name] / 2**40
    why = f"{gib:g} GiB: an 8-GPU {name} node's {tib:g} TiB of RAM per GPU"
    if text is None:
        why += f", --host-memory's default{'' if target else ' without --target'}"
    return HOST_MEMORY[name], why


def refuse_run_only(over: dict) -> None:
    """ValueError naming the key=value items (`over`) that are trainer settings the compiled step
    never reads (`settings.RUN_ONLY_FIELDS`: seed, save_every, ...): the planner measures the
    step's memory, which they cannot change, so it would ignore them."""
    given = [k for k in over if k in RUN_ONLY_FIELDS]
    if given:
        what = "trainer settings that do" if len(given) > 1 else "a trainer setting that does"
        raise ValueError(
            f"{', '.join(given)}: {what} not change a step's memory; the planner takes model "
            "keys and the trainer settings the step compiles with (mesh, compute_dtype, "
            "grad_accum, loss_chunk, offload_optimizer, lr, ...): drop "
            + ("them" if len(given) > 1 else "it")
        )


def planned_dispatchers(flag: str | None, over: dict) -> tuple[str, ...]:
    """The dispatchers to plan: --dispatchers (`flag`), or `dispatcher=` (taken out of `over`)
    alone, else ring and all-to-all; ValueError for both given and different, a name that is
    not a dispatcher, or an op option on the command line that none of them uses."""
    given = (over.pop("dispatcher"),) if "dispatcher" in over else None
    listed = None if flag is None else tuple(flag.split(","))
    if given is not None and listed is not None and listed != given:
        raise ValueError(
            f"dispatcher={given[0]!r} and --dispatchers {flag}: give the dispatchers once "
            "(dispatcher=X plans X alone, --dispatchers X,Y several)"
        )
    dispatchers = listed or given or ("ring", "alltoall")
    for d in dispatchers:
        one_of("dispatcher" if given else "--dispatchers", d, DISPATCHERS)
    check_options_used(
        over,
        {d: () for d in dispatchers},
        f"the planner plans {' and '.join(dispatchers)} only",
        "plan {0} too (--dispatchers " + ",".join(dispatchers) + ",{0})",
    )
    return dispatchers


SEQ_STEP = 128  # --seq-step's default


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=description)
    p.add_argument("--config", required=True)
    p.add_argument(
        "--memory",
        default=None,
        help="H100, H200, or a size (80GiB, 1e9, ...); default: --target's",
    )
    p.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="pinned host RAM per device for offloaded state and residuals (offload_optimizer, "
        "offload_layer_inputs): a size (256GiB, 1e9, ...) or H100, H200 (that node's share); "
        f"default: the per-GPU share of an 8-GPU --target node's RAM, 2 TiB / 8 = 256 GiB for "
        f"both (the {DEFAULT_HOST_TARGET} node's without --target); checked at --usable of it",
    )
    p.add_argument(
        "--target",
        choices=[t for t in gpu_mesh.TARGETS],
        default=None,
        help="compile for abstract GPUs of this kind with XLA:GPU (no GPU needed; "
        "the gpu-compile extra) instead of the emulated CPU devices",
    )
    p.add_argument(
        "--hosts",
        type=positive_int,
        default=1,
        help=f"with --target: hosts of {gpu_mesh.GPUS_PER_HOST} GPUs (default 1)",
    )
    p.add_argument(
        "--usable",
        type=float,
        default=0.9,
        help="fraction of --memory and of --host-memory the step may use (default 0.9)",
    )
    p.add_argument(
        "--batch", type=positive_int, required=True, help="global micro-batch (sequences)"
    )
    p.add_argument("--seq", type=positive_int, required=True, help="sequence length")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        metavar="LIMIT",
        help="also find the largest micro-batch <= LIMIT at --seq",
    )
    p.add_argument(
        "--max-seq",
        type=positive_int,
        default=None,
        metavar="LIMIT",
        help="also find the largest sequence length <= LIMIT at --batch",
    )
    p.add_argument(
        "--seq-step",
        type=positive_int,
        default=None,
        help=f"with --max-seq: the sequence lengths searched are multiples of this (default "
        f"{SEQ_STEP})",
    )
    p.add_argument(
        "--dispatchers",
        default=None,
        help="comma-separated, default ring,alltoall (dispatcher=X alone: X)",
    )
    p.add_argument("overrides", nargs="*", help="mesh=..., compute_dtype=..., model fields")
    return p


def parse(argv, description: str) -> argparse.Namespace:
    """The checked arguments: `memory` defaults to the target's, `capacity` and `host_capacity`
    are the usable bytes per device (`--usable` of `--memory` and of `--host-memory`), and
    `host_from` says where the host figure comes from."""
    args = build_parser(description).parse_intermixed_args(argv)
    if not 0 < args.usable <= 1:
        raise ValueError(f"--usable {args.usable}: expected a fraction in (0, 1]")
    if args.memory is None and args.target is None:
        raise ValueError("--memory is required without --target (H100, H200 or a size)")
    if args.hosts < 1 or (args.hosts != 1 and args.target is None):
        raise ValueError(f"--hosts {args.hosts}: expected >= 1, and only with --target")
    if args.seq_step is not None and args.max_seq is None:
        raise ValueError(
            f"--seq-step {args.seq_step} only sets the lengths --max-seq searches: add "
            "--max-seq LIMIT, or drop --seq-step"
        )
    args.memory = args.memory or args.target.upper()
    args.seq_step = args.seq_step or SEQ_STEP
    args.capacity = int(parse_memory(args.memory) * args.usable)
    host, args.host_from = host_memory(args.host_memory, args.target)
    args.host_capacity = int(host * args.usable)
    return args
