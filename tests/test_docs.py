"""The docs run as written: README.md and every docs/*.md page.

What each kind of block gets (docs/development.md, "The docs are tested"):
- `python` blocks run in this process (8 emulated CPU devices); the blocks of one `##` section run
  in order in one fresh namespace;
- `bash` blocks are checked: a command that runs a script of this repository must name an
  existing module or script, its `--flag`s must appear in that script's `--help` (run in-process),
  its `key=value` items must be trainer settings or model config keys, `pip install` must name
  extras of pyproject.toml; blocks marked `run` are run for real;
- `text` blocks are output or listings; a fence without a language is an error;
- relative links and their anchors resolve.

HTML comments right before a fence change that, each with its reason: `not run`, `run`,
`gpu_compile`, `test with` (substitutions), `output` (lines the section must print), `headline`
and `ci` (the README's headline command and its test command). Nothing is skipped silently: a
block is run, checked or marked.
"""

import contextlib
import dataclasses
import functools
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from relaymoe_jax import gpu_mesh
from relaymoe_jax.models.config import KEYS as MODEL_KEYS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = ("python", "bash", "text")
MARKS = ("not run", "run", "gpu_compile", "test with", "output", "headline", "ci")
README_MAX_LINES = 200
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*([a-z_ ]+?)\s*:\s*(.*?)\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    section: str  # the `## ` heading above it ("" before the first)
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    marks: tuple[tuple[str, str], ...]  # (mark, reason) from the comments right before it

    def mark(self, name):
        return dict(self.marks).get(name)

    @property
    def where(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@functools.cache
def blocks(page: Path) -> tuple[Block, ...]:
    out, section, lines, i = [], "", page.read_text().splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), i
        body = []
        i += 1
        while not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        marks, j = [], start - 1
        while j >= 0 and (c := MARK.match(lines[j].strip())):
            marks.insert(0, (c.group(1), c.group(2)))
            j -= 1
        out.append(Block(page, section, lang, "\n".join(body) + "\n", start + 1, tuple(marks)))
        i += 1
    return tuple(out)


ALL = [b for p in PAGES for b in blocks(p)]


def test_every_block_is_run_checked_or_marked():
    """A language from LANGS, known marks with a reason, marks that fit the block's language."""
    for b in ALL:
        assert b.lang in LANGS, f"{b.where}: fence language {b.lang!r}; use one of {LANGS}"
        for name, reason in b.marks:
            assert name in MARKS, f"{b.where}: unknown mark {name!r}"
            assert reason, f"{b.where}: mark {name!r} without a reason"
        if b.mark("output"):
            assert b.lang == "text", f"{b.where}: an output block is a text block"
        if b.mark("gpu_compile"):
            assert b.lang == "python", f"{b.where}: only python blocks take that mark"
        if b.mark("test with"):
            ok = b.lang == "python" or (b.lang == "bash" and b.mark("run"))
            assert ok, f"{b.where}: `test with` is for python blocks and bash `run` blocks"
        if b.mark("run"):
            assert b.lang == "bash", f"{b.where}: `run` is for bash blocks"
    skipped = [f"{b.where}: {b.mark('not run')}" for b in ALL if b.mark("not run")]
    print("not run:", *skipped, sep="\n  ")


# ------------------------------------------------------------------------------ python blocks


def _sections(gpu: bool):
    """{(page, section): [python blocks]} for the sections whose code runs in this tier: the CPU
    tier runs the unmarked blocks; the gpu_compile tier a section's unmarked blocks, then its
    gpu_compile ones."""
    out = {}
    for b in ALL:
        if b.lang == "python" and not b.mark("not run"):
            out.setdefault((b.page, b.section), []).append(b)
    if gpu:
        return {k: v for k, v in out.items() if any(b.mark("gpu_compile") for b in v)}
    return {
        k: [b for b in v if not b.mark("gpu_compile")]
        for k, v in out.items()
        if any(not b.mark("gpu_compile") for b in v)
    }


def _hf_tiny(tmp: Path) -> Path:
    """A tiny Hugging Face checkpoint with a tokenizer.json: the Qwen3-MoE fixture of
    tests/fixtures/hf/ and a word-level tokenizer of 256 tokens over the shipped text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out = tmp / "hf_tiny"
    if not out.exists():
        src = ROOT / "tests" / "fixtures" / "hf" / "qwen3_moe_topk_norm"
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (out / name).write_bytes((src / name).read_bytes())
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        text = (ROOT / "train" / "data" / "declaration.txt").read_text()
        special = ["[UNK]", "<|endoftext|>"]
        tok.train_from_iterator(
            [text], trainers.WordLevelTrainer(vocab_size=256, special_tokens=special)
        )
        tok.save(str(out / "tokenizer.json"))
    return out


def _substituted(b: Block, tmp: Path) -> str:
    """The block's code with its `test with` substitutions ({root}, {tmp}, and {hf_tiny}: a tiny
    Hugging Face checkpoint with a tokenizer, made in tmp)."""
    code = b.code
    for pair in filter(None, (p.strip() for p in (b.mark("test with") or "").split(";"))):
        old, new = (s.strip().strip('"') for s in pair.split("=>"))
        assert old in code, f"{b.where}: `test with` names {old!r}, which the block lacks"
        hf_tiny = _hf_tiny(tmp) if "{hf_tiny}" in new else None
        code = code.replace(old, new.format(root=ROOT, tmp=tmp, hf_tiny=hf_tiny))
    return code


def _run_section(page, section, code_blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": f"docs_{page.stem}"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for b in code_blocks:
            exec(compile(_substituted(b, tmp_path), b.where, "exec"), namespace)
    sys.stdout.write(printed.getvalue())
    for b in ALL:
        if b.page == page and b.section == section and b.mark("output"):
            want = [ln for ln in b.code.splitlines() if ln.strip()]
            got = printed.getvalue().splitlines()
            missing = [ln for ln in want if ln not in got]
            assert not missing, f"{b.where}: the section did not print {missing}"


def _id(key):
    return f"{key[0].relative_to(ROOT)}::{key[1] or '(top)'}"


CPU_SECTIONS = _sections(gpu=False)
GPU_SECTIONS = _sections(gpu=True)


@pytest.mark.parametrize("key", list(CPU_SECTIONS), ids=_id)
def test_python_section_runs(key, tmp_path, monkeypatch):
    _run_section(*key, CPU_SECTIONS[key], tmp_path, monkeypatch)


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra")
@pytest.mark.parametrize("key", list(GPU_SECTIONS), ids=_id)
def test_gpu_compile_section_runs(key, tmp_path, monkeypatch):
    _run_section(*key, GPU_SECTIONS[key], tmp_path, monkeypatch)


def test_swap_in_has_the_two_swaps_and_the_chex_section_and_each_checks_parity():
    doc = ROOT / "docs" / "swap-in.md"
    titles = [s for p, s in CPU_SECTIONS if p == doc]
    assert titles == [
        "Swap 1: an existing shard_map expert step",
        "Swap 2: an NNX MoE layer",
        "Test your integration with chex",
    ]
    for t in titles:  # every section checks something
        assert any("assert_moe_parity" in b.code for b in CPU_SECTIONS[(doc, t)])


# -------------------------------------------------------------------------------- bash blocks

PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
KEY_VALUE = re.compile(r"^([a-z_][a-z0-9_]*)=")
REPO_PATH = re.compile(r"^(configs|benchmarks|train|relaymoe_jax)/\S+\.(yaml|py)$")
OK_MODULES = ("venv", "pytest")  # not this repository's, but what the setup commands run
SUBCOMMANDS = {"prepare": "train.data.prepare", "export": "train.hf.export"}  # `relaymoe-train X`


def commands(code: str) -> list[list[str]]:
    """Each simple command of a bash block as tokens (continuations joined, one command line per
    line, comments dropped, split at `&&` and `;`)."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        cmd = []
        for t in shlex.split(line, comments=True):
            if t in ("&&", ";", "||"):
                out.append(cmd)
                cmd = []
            else:
                cmd.append(t)
        out.append(cmd)
    return [c for c in out if c]


@functools.cache
def extras() -> frozenset:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return frozenset(tomllib.load(f)["project"]["optional-dependencies"])


def _is_repo_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return name.split(".")[0] == "relaymoe_train" or (
        name.split(".")[0] in ("train", "relaymoe_jax")
        and (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file())
    )


def target_of(cmd: list[str], where: str) -> tuple[str | None, list[str]]:
    """(what `cmd` runs of this repository, `-m MODULE` or a script path, or None; its arguments).
    Raises AssertionError for a command that runs nothing of this repository, or a pip extra,
    module or script that does not exist."""
    py = next((i for i, t in enumerate(cmd) if PYTHON.search(t)), None)
    if py is None:
        prog = Path(cmd[0]).name
        if prog == "relaymoe-train":
            return _subcommand("-m train", cmd[1:])
        if prog == "pip" and cmd[1:2] == ["install"]:
            for t in cmd[2:]:
                for extra in re.findall(r"\[([^\]]*)\]", t)[:1]:
                    unknown = set(extra.split(",")) - extras()
                    assert not unknown, f"{where}: no extra(s) {sorted(unknown)} in pyproject"
            return None, []
        if prog == "ruff":
            assert cmd[1] in ("check", "format"), f"{where}: ruff {cmd[1]}?"
            return None, []
        raise AssertionError(
            f"{where}: `{shlex.join(cmd)}` runs nothing of this repository; "
            "mark the block `<!-- not run: why -->`"
        )
    args = cmd[py + 1 :]
    if args[:1] == ["-m"]:
        module = args[1]
        if module in OK_MODULES:
            return None, []
        assert _is_repo_module(module), f"{where}: no module {module} in this repository"
        return _subcommand("-m " + ("train" if module == "relaymoe_train" else module), args[2:])
    assert (ROOT / args[0]).is_file(), f"{where}: no script {args[0]}"
    return args[0], args[1:]


def _subcommand(target: str, args: list[str]) -> tuple[str, list[str]]:
    """`-m train prepare|export ...` runs that subcommand's module (`cli.entry` dispatches)."""
    if target == "-m train" and args[:1] and args[0] in SUBCOMMANDS:
        return "-m " + SUBCOMMANDS[args[0]], args[1:]
    return target, args


HELP_RUNNER = """
import contextlib, io, json, runpy, sys, warnings
out = {}
for target in sys.argv[1:]:
    buf, code = io.StringIO(), None
    sys.argv = [target.removeprefix("-m "), "--help"]
    try:
        with contextlib.redirect_stdout(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if target.startswith("-m "):
                runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except Exception as e:
        code = f"{type(e).__name__}: {e}"
    out[target] = [code, buf.getvalue()]
print(json.dumps(out))
"""


@functools.cache
def help_texts() -> dict[str, str]:
    """{target: its `--help`} for every target the bash blocks name, from one fresh process
    (the commands install process-wide hooks that must not leak into this one)."""
    targets = {"-m train"}  # the trainer's settings, for every key=value check
    for b in BASH:
        for cmd in commands(b.code):
            with contextlib.suppress(AssertionError):  # reported by the block's own test
                targets.add(target_of(cmd, b.where)[0])
    targets.discard(None)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, *sorted(targets)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return {t: (code, text) for t, (code, text) in json.loads(r.stdout.splitlines()[-1]).items()}


def help_text(target: str, where: str) -> str:
    code, text = help_texts()[target]
    assert code in (0, None), f"{where}: {target} --help exits with {code!r}"
    return text


def check_command(cmd: list[str], where: str) -> None:
    """Raise AssertionError when `cmd` names a script, flag, key or extra that does not exist."""
    target, args = target_of(cmd, where)
    if target is None:
        return
    text = help_text(target, where)
    for t in args:
        if t.startswith("-") and not re.fullmatch(r"-\d.*", t):
            flag = t.split("=")[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
                f"{where}: {target} has no {flag} (not in its --help)"
            )
        elif m := KEY_VALUE.match(t):
            key = m.group(1)
            trainer = re.search(rf"(?<![\w-]){key}=", help_text("-m train", where))
            assert key in MODEL_KEYS or trainer, (
                f"{where}: {key}= is neither a trainer setting nor a model config key"
            )
        elif REPO_PATH.match(t):
            assert (ROOT / t).exists(), f"{where}: no file {t}"


BASH = [b for b in ALL if b.lang == "bash" and not b.mark("not run")]


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.where)
def test_bash_block_names_what_exists(block):
    for cmd in commands(block.code):
        check_command(cmd, block.where)


@pytest.mark.parametrize("block", [b for b in BASH if b.mark("run")], ids=lambda b: b.where)
def test_bash_block_runs(block, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for cmd in commands(_substituted(block, tmp_path)):
        while ENV_ASSIGN.match(cmd[0]):
            name, _, value = cmd.pop(0).partition("=")
            env[name] = value
        if PYTHON.search(cmd[0]):
            cmd[0] = sys.executable
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{block.where}: {shlex.join(cmd)}\n{r.stdout}\n{r.stderr}"


# ---------------------------------------------------------------------------- links, README


def slugs(page: Path) -> set[str]:
    """GitHub's anchors for the headings of `page` (outside code blocks)."""
    out, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced or not (m := re.match(r"^#{1,6} (.*)$", line)):
            continue
        s = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _prose(page: Path) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no {dest}"
        if anchor:
            assert anchor in slugs(dest), f"{page.name}: link to {target}: no such heading"


def test_readme_fits_on_a_screen_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"


def test_readme_test_command_is_what_ci_runs():
    (ci,) = [b for b in blocks(ROOT / "README.md") if b.mark("ci")]
    run = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.startswith(("#", "set ", "cd "))
    ]
    assert [ci.code.strip()] == run


def test_readme_headline_figure_is_in_benchmarks_under_its_command():
    readme = ROOT / "README.md"
    (head,) = [b for b in blocks(readme) if b.mark("headline")]
    (figure,) = re.findall(r"\*\*([\d.,]+)\*\*", readme.read_text())
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    start = lines.index(f"# reproduce: {head.code.strip()}")
    table = lines[start : lines.index("", start)]
    assert any(f"| {figure} |" in ln for ln in table), (figure, head.code)


DOTTED = re.compile(r"`(?:[^`]*?[\s(=])?((?:relaymoe_jax|train)(?:\.\w+)+)")
REPO_FILE = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|yaml|txtpb|json))(?:::[^`]*)?`")
FILE_ROOTS = (ROOT, ROOT / "relaymoe_jax", ROOT / "tests")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        try:
            for attr in parts[n:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_named_modules_and_files_exist(page):
    """Every `relaymoe_jax.x.y` / `train.x` a page names imports (or is an attribute), and every
    repository path it names in backticks exists (under the checkout, relaymoe_jax/ or tests/)."""
    text = page.read_text()
    missing = sorted({d for d in DOTTED.findall(text) if not _resolves(d)})
    assert not missing, f"{page.name}: no such module or attribute: {missing}"
    files = {f for f in REPO_FILE.findall(text) if not f.startswith(("jax/", "runs/", "/"))}
    absent = sorted(f for f in files if not any((r / f).exists() for r in FILE_ROOTS))
    assert not absent, f"{page.name}: no such file: {absent}"
