"""The data path at scale: `train.data.prepare` on a generated corpus, then the packed-row loader
(`train.data.loader.PackedRows`, what `python -m train --data DIR` reads) at the tiny config's and
Qwen3-30B-A3B's batch shapes, its time to the first batch fresh and resumed, and its resident
memory at two corpus sizes; against what one 8-GPU step of Qwen3-30B-A3B consumes.

    python benchmarks/data_loader.py --sizes-mb 256 1024 [--docs-per-shard N] [--dir DIR]

At prepare's default 10,000 documents a shard both sizes stay under the 64 shards the loader
keeps open; `--docs-per-shard 1000` puts both over it (memory then stays flat, and rows pay for
reopening shards).

The corpus: JSONL documents of English-like words, lengths log-normal around 2 KB (median
~1.6 KB), generated from a fixed seed; byte-level tokens (1 token per byte). Each loader
measurement runs in a fresh process (its peak resident memory is that process's, the
interpreter, numpy, grain and ArrayRecord included). A step's demand: the planner's micro-batch
for Qwen3-30B-A3B on 8 x H100 (batch 4 x seq 40,960 per step, BENCHMARKS "What a user runs
first") over a lower bound of its step time, 6 x active parameters x tokens / (8 x 989.4 dense
bf16 TFLOP/s): no attention FLOPs, no recomputation, 100% utilisation, so a real step is longer
and needs fewer tokens per second than this. Host-side only; timings are this machine's.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if so "
    "no will more can out up who about into time than them some could only other new these "
    "may then first any like now such over my even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "expert router token sharding memory gradient layer"
).split()
SHAPES = {  # name: (global batch, seq_len, batches to time)
    "tiny (quick start)": (16, 128, 2000),
    "Qwen3-30B-A3B": (4, 40960, 60),
}
H100_BF16 = 989.4e12


def make_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A JSONL corpus of about `megabytes` MB; returns the documents written."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    pool = " ".join(words[rng.integers(0, len(words), 4_000_000)])  # ~20 MB of text to cut
    target, written, docs = megabytes * 1_000_000, 0, 0
    with open(path, "w") as f:
        while written < target:
            lengths = np.clip(rng.lognormal(7.4, 0.7, 4096).astype(int), 16, 60_000)
            starts = rng.integers(0, len(pool) - 60_001, 4096)
            lines = [json.dumps({"text": pool[s : s + n]}) for s, n in zip(starts, lengths)]
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block)
            docs += len(lines)
    return docs


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS) or at its peak (VmHWM: unlike getrusage's
    ru_maxrss, not inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(directory: str, batch: int, seq: int, n: int, threads: int) -> None:
    """One loader measurement, printed as JSON (run in a fresh process)."""
    from train.data.loader import PackedRows

    t0 = time.perf_counter()
    loader = PackedRows(directory, seq_len=seq, global_batch=batch, seed=0, threads=threads)
    opened = time.perf_counter()
    next(loader)
    first = time.perf_counter()
    rss_first = rss_mib()
    for _ in range(n - 1):
        next(loader)
    done = time.perf_counter()
    state = loader.state()
    resumed = PackedRows(
        directory, seq_len=seq, global_batch=batch, seed=0, threads=threads, verify_hashes=False
    )
    t1 = time.perf_counter()
    resumed.restore(state)
    next(resumed)
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "open_s": opened - t0,  # manifest, sha256 of every shard, sources
                "first_batch_s": first - opened,
                "tokens_per_s": (n - 1) * batch * seq / (done - first),
                "resume_first_batch_s": t2 - t1,  # restore + first batch (hashes not re-read)
                "resumed_at": state,
                "rss_first_batch_mib": rss_first,
                "rss_mib": rss_mib(),
                "peak_rss_mib": rss_mib("VmHWM"),
            }
        )
    )


def measure(directory, batch, seq, n, threads) -> dict:
    cmd = [sys.executable, __file__, "--child", str(directory), str(batch), str(seq), str(n)]
    cmd += [str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_demand() -> tuple[int, float]:
    """(tokens per step, lower bound of the step's seconds) of Qwen3-30B-A3B on 8 x H100."""
    from relaymoe_jax.models.config_files import load_config
    from relaymoe_jax.models.param_count import param_count

    active = param_count(load_config(str(ROOT / "configs" / "qwen3-30b-a3b.yaml")))["active"]
    tokens = 4 * 40960
    return tokens, 6 * active * tokens / (8 * H100_BF16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--dir", type=Path, default=Path("/tmp/relaymoe-data-bench"))
    p.add_argument("--threads", type=int, default=2, help="the loader's read threads")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument(
        "--docs-per-shard",
        type=int,
        default=10_000,
        help="prepare's shard size (its default, 10,000); 1,000 makes both sizes span more "
        "shards than the loader keeps open (train.data.loader.Corpus.OPEN_SHARDS)",
    )
    a = p.parse_args(argv)
    from train.data import prepare

    sizes = " ".join(map(str, a.sizes_mb))
    print(
        f"# reproduce: python benchmarks/data_loader.py --sizes-mb {sizes} --docs-per-shard "
        f"{a.docs_per_shard}"
    )
    print(f"# host: {os.cpu_count()} CPUs; loader threads {a.threads}; prepare workers {a.workers}")
    a.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for mb in a.sizes_mb:
        src, ds = a.dir / f"corpus-{mb}mb.jsonl", a.dir / f"ds-{mb}mb-{a.docs_per_shard}"
        if not src.exists():
            t = time.perf_counter()
            docs = make_corpus(src, mb)
            print(
                f"generated {src} ({src.stat().st_size / 1e6:,.0f} MB, {docs:,} documents) "
                f"in {time.perf_counter() - t:.0f} s",
                flush=True,
            )
        if not (ds / "manifest.json").exists():
            import shutil

            shutil.rmtree(ds, ignore_errors=True)
            t = time.perf_counter()
            m = prepare.prepare(
                [str(src)], ds, workers=a.workers, docs_per_shard=a.docs_per_shard, progress=False
            )
            dt = time.perf_counter() - t
            print(
                f"prepare {src.name}: {m.documents:,} documents, {m.tokens:,} tokens, "
                f"{len(m.shards)} shards in {dt:.1f} s: {m.tokens / dt / 1e6:.1f} M "
                f"tokens/s, {src.stat().st_size / dt / 1e6:.0f} MB/s of JSONL "
                f"({a.workers} workers)",
                flush=True,
            )
        for name, (batch, seq, n) in SHAPES.items():
            r = measure(ds, batch, seq, n, a.threads)
            shards = len(json.loads((ds / "manifest.json").read_text())["shards"])
            rows.append((mb, shards, name, batch, seq, r))
            print(f"  {mb} MB, {name}: {json.dumps(r)}", flush=True)
    tokens, step_s = step_demand()
    need = tokens / step_s
    print(
        "\n| corpus | shards | shape (batch x seq) | open s | first batch s | tokens/s | resume: "
        "first batch s | RSS after 1st batch MiB | RSS at end MiB | peak RSS MiB |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for mb, shards, name, batch, seq, r in rows:
        print(
            f"| {mb:,} MB | {shards} | {name} ({batch} x {seq:,}) | {r['open_s']:.2f} | "
            f"{r['first_batch_s']:.3f} | {r['tokens_per_s'] / 1e6:,.2f} M | "
            f"{r['resume_first_batch_s']:.3f} | {r['rss_first_batch_mib']:,.0f} | "
            f"{r['rss_mib']:,.0f} | {r['peak_rss_mib']:,.0f} |"
        )
    qwen = [r for *_, name, _, _, r in rows if name == "Qwen3-30B-A3B"]
    print(
        f"\nQwen3-30B-A3B on 8 x H100, batch 4 x seq 40,960: {tokens:,} tokens per step; a step "
        f"takes at least {step_s:.3f} s (6 x active params x tokens at 100% of 8 x 989.4 "
        f"TFLOP/s), so it consumes at most {need / 1e3:,.0f} K tokens/s. The loader reads "
        f"{min(r['tokens_per_s'] for r in qwen) / 1e6:,.2f} M tokens/s at that shape on this "
        f"host: {min(r['tokens_per_s'] for r in qwen) / need:,.1f}x that bound."
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        d, b, s, n, th = sys.argv[2:7]
        child(d, int(b), int(s), int(n), int(th))
    else:
        sys.exit(main())
