"""The built wheel, installed alone: configs by name, `relaymoe-train`, no `train`, no XLA_FLAGS.

One wheel build (`pip wheel --no-build-isolation`, from a copy of the sources so the checkout gets
no build/ or egg-info), one fresh venv outside the checkout with the wheel installed `--no-deps`,
and one trainer run from a directory outside the checkout. The dependencies come from this
interpreter's site-packages through a `.pth` line in the fresh venv: a plain path line is only
appended to sys.path (the `.pth` files inside it are not run), so this environment's editable
install of the checkout does not leak in; the test checks that the modules come from the venv.
No network: nothing is downloaded.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the wheel is built from (a new top-level package folder must be added here too)
SOURCES = ("pyproject.toml", "README.md", "relaymoe_jax", "train", "configs")

CHECK = r"""
import contextlib, io, json, os, sys
before = os.environ.get("XLA_FLAGS")
import relaymoe_jax, relaymoe_jax.models, relaymoe_train, relaymoe_train.cli
out = {"xla_flags_before": before, "xla_flags_after": os.environ.get("XLA_FLAGS"),
       "relaymoe_jax": relaymoe_jax.__file__, "relaymoe_train": relaymoe_train.__file__}
try:
    import train
    out["train"] = train.__file__
except ModuleNotFoundError:
    out["train"] = None
from relaymoe_jax.models.config_files import available_configs, load_config
out["tiny_experts"] = load_config("tiny").moe.num_experts
out["configs"] = available_configs()
try:
    load_config("no-such-config")
except FileNotFoundError as e:
    out["unknown"] = str(e)
sys.modules["matplotlib"] = None        # as if the `train` extra were not installed
sys.argv = ["relaymoe-train", "--config", "tiny", "--steps", "1", "--out", "unused"]
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        relaymoe_train.cli.entry()
    except SystemExit as e:
        out["no_extra_status"] = e.code
out["no_extra_stderr"] = err.getvalue()
print(json.dumps(out))
"""


def _expected_files() -> set[str]:
    """The checkout's package files by their names in the wheel."""
    want = {
        f"relaymoe_jax/{p.relative_to(ROOT / 'relaymoe_jax')}"
        for p in (ROOT / "relaymoe_jax").rglob("*")
        if p.suffix in (".py", ".txtpb") and "__pycache__" not in p.parts
    }
    want |= {
        f"relaymoe_train/{p.relative_to(ROOT / 'train')}"
        for p in (ROOT / "train").rglob("*")
        if p.suffix in (".py", ".txt", ".md") and "__pycache__" not in p.parts
    }
    want |= {f"relaymoe_jax/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    return want


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert p.returncode == 0, (
        f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    return p


def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    pytest.importorskip("setuptools", reason="the test extra's setuptools builds the wheel")
    src, dist, env_dir, work = (tmp_path / n for n in ("src", "dist", "venv", "work"))
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(src),
            "-w",
            str(dist),
        ],
        timeout=300,
    )
    (whl,) = dist.glob("relaymoe_jax-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    assert not _expected_files() - names, sorted(_expected_files() - names)
    assert not {n for n in names if n.split("/")[0] in ("train", "configs", "tests")}

    venv.create(env_dir, symlinks=True, with_pip=False)
    py = env_dir / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(whl),
        ],
        timeout=300,
    )
    site = env_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_relaymoe_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "XLA_FLAGS", "RELAYMOE_TRAIN_FAULT")
    }
    env.update(JAX_PLATFORMS="cpu", PYTHONNOUSERSITE="1")
    work.mkdir()
    got = json.loads(
        _run([py, "-c", CHECK], cwd=work, env=env, timeout=300).stdout.splitlines()[-1]
    )
    assert got["xla_flags_before"] is None and got["xla_flags_after"] is None
    for mod in ("relaymoe_jax", "relaymoe_train"):
        assert Path(got[mod]).is_relative_to(site), (mod, got[mod])
    assert got["train"] is None, f"`import train` found {got['train']}"
    assert got["tiny_experts"] == 8
    assert {"tiny", "qwen3-30b-a3b"} <= set(got["configs"])
    assert "available:" in got["unknown"] and "'tiny'" in got["unknown"]
    assert got["no_extra_status"] == 1
    assert got["no_extra_stderr"].count("\n") == 1, got["no_extra_stderr"]
    assert 'pip install "relaymoe-jax[train]"' in got["no_extra_stderr"]

    # the trainer: XLA's LLVM backend at -O0 as in every test (tests/conftest.py: the same
    # programs, compiled faster); XLA_FLAGS sets no device count, use_cpu_devices(8) does
    out = tmp_path / "run"
    p = _run(
        [
            env_dir / "bin" / "relaymoe-train",
            "--config",
            "tiny",
            "--steps",
            "2",
            "--out",
            str(out),
            "seq_len=32",
            "batch_size=8",
            "num_hidden_layers=1",  # what runs is the installed package: one layer shows it
            "--quiet",
        ],
        cwd=work,
        env={**env, "XLA_FLAGS": "--xla_backend_optimization_level=0"},
        timeout=600,
    )
    assert "on 8 cpu devices" in p.stdout, p.stdout  # use_cpu_devices(8)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (out / "checkpoints" / "2").is_dir() and (out / "loss.png").is_file()
