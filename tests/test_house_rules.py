"""The house rules of docs/development.md that ruff does not check, over the tracked sources.

- no formatter skip markers: the formatter's layout is the layout (restructure what it formats
  badly);
- no module of the library or the trainer over 400 lines (`relaymoe_jax/kernels/` 600);
- `jax._src` is read in `relaymoe_jax/util/tracing.py` only, in the library and the trainer (jax
  has no public API for what it reads there; a benchmark that must, says why in a comment);
- no private name imported from another module (`from m import _x`, `import m._x`), anywhere:
  what another module uses is public, named without the underscore;
- no import circle among the modules of the library and the trainer (imports inside functions
  count too), and the trainer's packages import one way, down its floors (`TRAIN_FLOORS`, which
  `train/__init__.py` describes); the library imports nothing of the trainer.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FMT_SKIP = "# fmt: " + "skip"  # spelled apart so this file does not match itself
LIMIT, KERNEL_LIMIT = 400, 600
JAX_SRC = re.compile(r"^\s*(from|import)\s+jax\._src\b", re.M)
# The floors of the library and the trainer, lowest first: a module imports only from its own
# floor and those below it (train/__init__.py says what each package owns).
TRAIN_FLOORS = (
    ("relaymoe_jax",),
    ("train.errors", "train.settings"),
    ("train.data",),
    ("train.step",),
    ("train.state",),
    ("train.planner",),
    ("train.hf",),
    ("train.run",),
    # the commands at the root, one by one (a new root module must be placed)
    (
        "train",
        "train.__main__",
        "train.cli",
        "train.cli_help",
        "train.plot",
        "train.export",
        "train.prepare",
    ),
)
SOURCES = ("relaymoe_jax/*.py", "train/*.py")  # the modules of the import graph


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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_is_imported():
    found = []
    for p in _tracked("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Import):  # `import m._x` (jax._src: the rule above)
                names = [
                    a.name
                    for a in node.names
                    if any(map(_private, a.name.split("."))) and not a.name.startswith("jax._src")
                ]
            else:
                continue
            found += [f"{p.relative_to(ROOT)}:{node.lineno}: {n}" for n in names]
    assert not found, f"private names imported from another module (make them public): {found}"


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """{module: the modules of the library and the trainer it imports}, anywhere in it (inside
    functions too). `from pkg import name` is an edge to the submodule `pkg.name` when there is
    one, else to `pkg`; a relative import is resolved against the module's package."""
    files = {_module_name(p.relative_to(ROOT).as_posix()): p for p in _tracked(*SOURCES)}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, p in files.items():
        package = mod if p.name == "__init__.py" else mod.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets += [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
        graph[mod] = {t for t in map(known, targets) if t and t != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    circles = _circles(_import_graph())
    assert not circles, f"modules that import one another, in a circle: {circles}"


def _floor(mod: str) -> int | None:
    """The index in TRAIN_FLOORS of the entry `mod` is, or is inside (the longest wins; the
    package `train` holds only itself: its root modules are named one by one)."""
    best = None
    for i, floor in enumerate(TRAIN_FLOORS):
        for entry in floor:
            inside = mod.startswith(entry + ".") and entry != "train"
            if (mod == entry or inside) and (best is None or len(entry) > best[1]):
                best = (i, len(entry))
    return None if best is None else best[0]


def test_imports_go_down_the_floors():
    graph = _import_graph()
    unplaced = sorted(m for m in graph if _floor(m) is None)
    assert not unplaced, f"modules in no floor of TRAIN_FLOORS: {unplaced}"
    up = [
        f"{mod} (floor {_floor(mod)}) imports {dep} (floor {_floor(dep)})"
        for mod, deps in sorted(graph.items())
        for dep in sorted(deps)
        if _floor(dep) > _floor(mod)
    ]
    assert not up, f"imports from a higher floor (TRAIN_FLOORS): {up}"
