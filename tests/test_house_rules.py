"""The house rules of docs/development.md that ruff does not check, over the tracked sources.

- no formatter skip markers: the formatter's layout is the layout (restructure what it formats
  badly);
- no module of the library or the trainer over 400 lines (`relaymoe_jax/kernels/` 600);
- `jax._src` is read in `relaymoe_jax/util/tracing.py` only, in the library and the trainer (jax
  has no public API for what it reads there; a benchmark that must, says why in a comment).
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FMT_SKIP = "# fmt: " + "skip"  # spelled apart so this file does not match itself
LIMIT, KERNEL_LIMIT = 400, 600
JAX_SRC = re.compile(r"^\s*(from|import)\s+jax\._src\b", re.M)


def _tracked(*patterns) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [ROOT / p for p in out.stdout.split() if (ROOT / p).is_file()]


def test_no_fmt_skip():
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _tracked("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if FMT_SKIP in line
    ]
    assert not found, f"{FMT_SKIP!r} in {found}: let ruff format it"


def test_no_module_over_the_line_limit():
    over = []
    for p in _tracked("relaymoe_jax/*.py", "train/*.py"):
        rel = p.relative_to(ROOT).as_posix()
        limit = KERNEL_LIMIT if rel.startswith("relaymoe_jax/kernels/") else LIMIT
        n = len(p.read_text().splitlines())
        if n > limit:
            over.append(f"{rel}: {n} lines (limit {limit})")
    assert not over, over


def test_jax_src_is_read_in_one_module():
    readers = [
        p.relative_to(ROOT).as_posix()
        for p in _tracked("relaymoe_jax/*.py", "train/*.py")
        if JAX_SRC.search(p.read_text())
    ]
    assert readers == ["relaymoe_jax/util/tracing.py"], readers
