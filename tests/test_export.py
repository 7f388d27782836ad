"""`relaymoe-train export RUN_DIR --out HF_DIR` (train/hf/export.py): a trained run's checkpoint as
a Hugging Face checkpoint.

Two short runs (module fixtures): tiny-qwen2 (Qwen2-MoE: q/k/v biases, a shared expert, a dense
layer, tied embeddings) with 2 of its 3 layers (layer 0 MoE, layer 1 its dense one: its third
layer is a second MoE layer, the same program and the same tensor names with another index, so
one MoE layer shows what it did while the run, the export and the forward compile a third less)
on the default mesh, and tiny (Qwen3-MoE) with `scan_layers=true` on
`mesh=fsdp=2,expert=4`. Their exports are checked against independent references: the logits of
the HF fixtures' numpy forward (`tests/fixtures/hf/numpy_reference.py`, validated against
transformers 5.24 to <= 7e-6; no torch here) on the exported directory equal our model's on the
checkpoint's params (restored whole by orbax, here only); `from_pretrained` gives the params back
bitwise; the index and file sizes; the host never holds more than one saved leaf (orbax's restore
is spied on); bad input is one line, exit status 1, nothing left behind.

Our model's forward is jitted once (`_FORWARD`: one compile per model, shared by its float32 and
bfloat16 checks), and each checkpoint's params are restored once (`checkpoint_params`, cached).
"""

import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import stat
import sys
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.tree_util import keystr
from safetensors import safe_open

from relaymoe_jax.models import QwenMoe, from_pretrained
from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.hf_files import size_bytes
from relaymoe_jax.models.hf_mapping import mapping
from train import cli
from train.hf import export as ex
from train.run import guards

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["seq_len=32", "batch_size=8", "warmup_steps=0", "save_every=1", "--quiet", "--steps", "2"]
RUNS = {
    "qwen2": ["--config", "configs/tiny-qwen2.yaml", "num_hidden_layers=2"],
    "qwen3_scan_fsdp": [
        "--config",
        "configs/tiny.yaml",
        "scan_layers=true",
        "mesh=fsdp=2,expert=4",
    ],
}
LIMIT = "200KB"
TOL = 1e-4


def _numpy_reference():
    path = ROOT / "tests" / "fixtures" / "hf" / "numpy_reference.py"
    spec = importlib.util.spec_from_file_location("hf_numpy_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REF = _numpy_reference()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, args in RUNS.items():
        run = tmp_path_factory.mktemp("runs") / name
        assert cli.main([*args, *SMALL, "--out", str(run)]) == 0
        out[name] = run
    return out


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """{(run, dtype): export dir}: float32 in files of <= LIMIT, bfloat16 in one file."""
    out = {}
    for name, run in runs.items():
        for dtype, extra in (("float32", ["--max-shard-size", LIMIT]), ("bfloat16", [])):
            hf = tmp_path_factory.mktemp("hf") / f"{name}-{dtype}"
            assert ex.main([str(run), "--out", str(hf), "--dtype", dtype, *extra]) == 0
            out[name, dtype] = hf
    return out


def _meta(run, step=2):
    return json.loads((run / "checkpoints" / str(step) / "meta" / "metadata").read_text())


_RESTORED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_restored():
    yield
    _RESTORED.clear()


def checkpoint_params(run, step=2) -> dict:
    """{saved leaf path: array} of every params leaf, the whole tree restored by orbax (once per
    run and step: the arrays are only read)."""
    if (run, step) not in _RESTORED:
        _RESTORED[run, step] = _restore_params(run, step)
    return _RESTORED[run, step]


def _restore_params(run, step) -> dict:
    meta = _meta(run, step)
    keys = [f"{i:06d}" for i in range(len(meta["leaf_paths"]))]
    args = ocp.args.PyTreeRestore(
        restore_args={k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys}
    )
    with ocp.PyTreeCheckpointer() as c:
        tree = c.restore(run / "checkpoints" / str(step) / "state", args=args)
    return {p: tree[k] for p, k in zip(meta["leaf_paths"], keys) if p.startswith("['params']")}


_FORWARD = nnx.jit(lambda m, x: m(x)[0])  # one program per model config (nnx's static graph)


def our_logits(cfg, params, ids, cast=None):
    """Our model's logits with the checkpoint's params (rounded through `cast` if given)."""
    model = QwenMoe(cfg, mesh=jax.make_mesh((8,), ("expert",)), rngs=nnx.Rngs(0))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    assert sorted("['params']" + keystr(k) for k, _ in flat) == sorted(params)
    leaves = []
    for k, x in flat:
        a = params["['params']" + keystr(k)]
        a = a if cast is None else a.astype(cast).astype(np.float32)
        leaves.append(jax.device_put(a, x.sharding))
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)
    return np.asarray(_FORWARD(model, jnp.asarray(ids)))


def _ids():
    return np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_reference_logits_equal_ours(runs, exports, name, dtype):
    """The numpy forward of the HF architecture on the export = our model on the checkpoint's
    params (bfloat16: rounded to bfloat16, which the numpy reader widens exactly)."""
    cfg = ModelConfig.from_dict(_meta(runs[name])["model_config"])
    hf_cfg, weights = REF.load_checkpoint(str(exports[name, dtype]))
    ref, _, _ = REF.forward(hf_cfg, weights, _ids())
    cast = None if dtype == "float32" else jnp.bfloat16
    ours = our_logits(cfg, checkpoint_params(runs[name]), _ids(), cast)
    assert np.max(np.abs(ref - ours)) <= TOL
    if dtype == "bfloat16":  # the weights were rounded: the float32 logits are further off
        f32 = our_logits(cfg, checkpoint_params(runs[name]), _ids())
        assert np.max(np.abs(ref - f32)) > 10 * np.max(np.abs(ref - ours))


@pytest.mark.parametrize("name", RUNS)
def test_config_json_has_the_keys_transformers_4_and_5_read(exports, name):
    """The keys and spellings of the fixtures' transformers-written config.json, plus 4.x's
    `torch_dtype` and top-level `rope_theta` (transformers itself is not installed here)."""
    for dtype in ("float32", "bfloat16"):
        c = json.loads((exports[name, dtype] / "config.json").read_text())
        arch = "Qwen3MoeForCausalLM" if name.startswith("qwen3") else "Qwen2MoeForCausalLM"
        assert c["architectures"] == [arch] and c["model_type"] == arch[:5].lower() + "_moe"
        assert c["dtype"] == c["torch_dtype"] == dtype
        assert c["num_experts"] == 8 and c["hidden_act"] == "silu"
        assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": c["rope_theta"]}
        assert not {"scan_layers", "dispatcher", "arch", "router"} & set(c)


@pytest.mark.parametrize("name", RUNS)
def test_from_pretrained_gives_the_params_back_bitwise(runs, exports, name):
    cfg = ModelConfig.from_dict(_meta(runs[name])["model_config"])
    model = from_pretrained(
        str(exports[name, "float32"]),
        mesh=jax.make_mesh((8,), ("expert",)),
        scan_layers=cfg.scan_layers,
    )
    saved = checkpoint_params(runs[name])
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    assert len(flat) == len(saved)
    for k, x in flat:
        np.testing.assert_array_equal(np.asarray(x), saved["['params']" + keystr(k)])


def _headers(path: Path) -> dict:
    """{tensor name: (file, dtype, nbytes)} from every safetensors file's header."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        n = int.from_bytes(f.read_bytes()[:8], "little")
        header = json.loads(f.read_bytes()[8 : 8 + n])
        for name, h in header.items():
            if name != "__metadata__":
                out[name] = (f.name, h["dtype"], h["data_offsets"][1] - h["data_offsets"][0])
    return out


@pytest.mark.parametrize("name", RUNS)
def test_index_lists_every_tensor_and_files_keep_the_limit(runs, exports, name):
    """The index of a sharded export lists every tensor; no file is larger than the limit, its
    header included (before: the tensors' bytes were kept under it and the header went past);
    a single-file export has no index, as transformers writes it (the docs said one was
    written)."""
    cfg = ModelConfig.from_dict(_meta(runs[name])["model_config"])
    names = set()
    for e in mapping(cfg):
        per_expert = [f"{e.name}.{i}.{e.which}_proj.weight" for i in range(cfg.moe.num_experts)]
        names.update(per_expert if e.kind == "expert" else [e.name])
    hf = exports[name, "float32"]
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    headers = _headers(hf)
    assert set(index["weight_map"]) == set(headers) == names
    assert all(index["weight_map"][t] == f for t, (f, _, _) in headers.items())
    assert index["metadata"]["total_size"] == sum(n for _, _, n in headers.values())
    files = sorted(hf.glob("*.safetensors"))
    assert len(files) > 2 and {f.name for f in files} == set(index["weight_map"].values())
    for f in files:
        sizes = [n for fn, _, n in headers.values() if fn == f.name]
        assert f.stat().st_size <= size_bytes(LIMIT) or len(sizes) == 1
    one = exports[name, "bfloat16"]
    assert [p.name for p in one.glob("*.safetensors")] == ["model.safetensors"]
    assert not (one / "model.safetensors.index.json").exists()
    assert {d for _, d, _ in _headers(one).values()} == {"BF16"}


def _snapshot(path: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*")}


def test_reads_one_saved_leaf_at_a_time_and_only_params(runs, tmp_path, monkeypatch):
    """Spies on orbax's restore: each call reads one leaf, only params leaves are read, each once,
    and no leaf read before is still alive when the next is read; the pending file never holds
    more than the limit (unless one tensor). The checkpoint directory is left untouched."""
    run = runs["qwen3_scan_fsdp"]
    calls, refs, alive, flushed = [], [], [], []
    orig = ocp.PyTreeCheckpointer.restore

    def spy(self, directory, *args, **kwargs):
        alive.append(sum(r().nbytes for r in refs if r() is not None))
        out = orig(self, directory, *args, **kwargs)
        calls.append(sorted(out))
        refs.extend(weakref.ref(v) for v in out.values())
        return out

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", spy)
    monkeypatch.setattr(ex, "COLLECT_BYTES", 0)  # collect after every leaf, however small
    before = _snapshot(run)
    ex.export(
        run,
        tmp_path / "hf",
        max_shard_size=LIMIT,
        on_flush=lambda t: flushed.append([a.nbytes for a in t.values()]),
    )
    assert _snapshot(run) == before
    meta = _meta(run)
    params = {f"{i:06d}" for i, p in enumerate(meta["leaf_paths"]) if p.startswith("['params']")}
    assert all(len(c) == 1 for c in calls) and sorted(k for (k,) in calls) == sorted(params)
    assert max(alive) == 0
    assert all(sum(f) <= size_bytes(LIMIT) or len(f) == 1 for f in flushed) and len(flushed) > 2


def test_step_exports_that_step(runs, tmp_path):
    run = runs["qwen2"]
    assert ex.main([str(run), "--out", str(tmp_path / "s1"), "--step", "1"]) == 0
    with safe_open(str(tmp_path / "s1" / "model.safetensors"), framework="numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    one, two = checkpoint_params(run, 1), checkpoint_params(run, 2)
    key = "['params']['embed_tokens'].value"
    np.testing.assert_array_equal(embed, one[key])
    assert not np.array_equal(one[key], two[key])


def _edited_run(runs, tmp_path, edit):
    """A copy of the qwen2 run with `edit(meta)` applied to step 2's checkpoint metadata."""
    run = tmp_path / "edited"
    shutil.copytree(runs["qwen2"], run)
    path = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    return run


def _damage_last_param(meta):
    """The checksum of the last params leaf off by one: read after the first files are written."""
    i = max(i for i, p in enumerate(meta["leaf_paths"]) if p.startswith("['params']"))
    meta["checksums"][i][0] = (meta["checksums"][i][0] + 1) % 2**32


BAD = [
    ("no_checkpoint", [], r"RUN: no checkpoint to export \(RUN/checkpoints holds no saved step\)"),
    ("missing_run", [], r"RUN: no such run directory"),
    ("step", ["--step", "7"], r"RUN: no checkpoint of step 7; saved steps: 1, 2"),
    ("out_not_empty", [], r"--out OUT: directory is not empty; give a new or empty directory"),
    ("out_file", [], r"--out OUT: is a file; give a new or empty directory"),
    ("dtype", ["--dtype", "int8"], r"--dtype int8: expected one of float32, bfloat16, float16"),
    (
        "shard",
        ["--max-shard-size", "5XB"],
        r"--max-shard-size 5XB: expected a positive number of bytes or e\.g\. 200KB, 5GB, 2GiB",
    ),
    (
        "expert_bias",
        [],
        r"RUN step 2: cannot export to Hugging Face: expert_bias=True: the Hugging Face "
        r"Qwen2MoeForCausalLM has no such option \(expected False\)",
    ),
    (
        "our_router",
        [],
        r"RUN step 2: cannot export to Hugging Face: router='sigmoid_group': the Hugging "
        r"Face Qwen2MoeForCausalLM has no such option \(expected 'softmax_topk'\)",
    ),
    (
        "checksum",
        ["--max-shard-size", "100KB"],
        r"RUN step 2: \['params'\]\['norm'\]\['weight'\]\.value fails its checksum \(the "
        r"checkpoint is damaged\); export another --step",
    ),
]


@pytest.mark.parametrize("case, extra, line", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_leaves_nothing(runs, tmp_path, capsys, case, extra, line):
    run, out = runs["qwen2"], tmp_path / "out" / "hf"
    out.parent.mkdir()
    if case == "no_checkpoint":
        run = tmp_path / "fresh"
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
    elif case == "missing_run":
        run = tmp_path / "nowhere"
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "out_file":
        out.write_text("mine")
    elif case == "expert_bias":
        run = _edited_run(runs, tmp_path, lambda m: m["model_config"].update(expert_bias=True))
    elif case == "our_router":
        run = _edited_run(
            runs, tmp_path, lambda m: m["model_config"].update(router="sigmoid_group")
        )
    elif case == "checksum":
        run = _edited_run(runs, tmp_path, _damage_last_param)
    before = sorted(p.name for p in out.parent.iterdir())
    assert ex.main([str(run), "--out", str(out), *extra]) == 1
    err = capsys.readouterr().err.strip()
    want = line.replace("RUN", re.escape(str(run))).replace("OUT", re.escape(str(out)))
    assert re.fullmatch("error: " + want, err), err
    assert sorted(p.name for p in out.parent.iterdir()) == before  # no temporary left


@pytest.fixture
def entry_hooks(monkeypatch):
    """`cli.entry` leaves its filters of orbax's background errors installed, as a command does
    until it exits (`guards.quiet_background_errors(keep=True)`): removed after the test."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    yield
    for name in ("absl", "asyncio"):
        logging.getLogger(name).removeFilter(guards._FILTER)


@pytest.mark.usefixtures("entry_hooks")
def test_the_console_command_dispatches_export(runs, tmp_path, monkeypatch, capsys):
    """`relaymoe-train export ...` (cli.entry): 0 and the export; bad input exits 1, one line."""
    out = tmp_path / "hf"
    monkeypatch.setattr(
        sys, "argv", ["relaymoe-train", "export", str(runs["qwen2"]), "--out", str(out)]
    )
    with pytest.raises(SystemExit) as e:
        cli.entry()
    assert e.value.code == 0 and (out / "model.safetensors").is_file()
    assert re.match(
        r"exported step 2 of .* to .*: 52 tensors, 0.8 MB of float32 in 1 file",
        capsys.readouterr().out,
    )
    with pytest.raises(SystemExit) as e:
        cli.entry()  # the same --out again: not empty
    assert e.value.code == 1
    assert (
        capsys.readouterr().err.strip()
        == f"error: --out {out}: directory is not empty; give a new or empty directory"
    )


def test_the_export_takes_the_users_umask(runs, tmp_path):
    """The export directory and its files are made with the umask, as `mkdir` and `open` make
    them (before: the directory was tempfile.mkdtemp's 0700 whatever the umask); an empty --out
    that exists keeps its mode."""
    (tmp_path / "mine").mkdir(mode=0o750)
    old = os.umask(0o002)
    try:
        ex.export(runs["qwen2"], tmp_path / "hf")
        ex.export(runs["qwen2"], tmp_path / "mine")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o775
    assert {stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "hf").iterdir()} == {0o664}
    assert stat.S_IMODE((tmp_path / "mine").stat().st_mode) == 0o750


def _tokenizer_dir(path: Path) -> Path:
    """A Hugging Face checkpoint's tokenizer files (a word-level tokenizer.json made with the
    `tokenizers` library, its tokenizer_config.json) and generation_config.json, plus files
    that are not copied."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path.mkdir()
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (path / "README.md").write_text("not copied")
    (path / "model.safetensors").write_bytes(b"not copied")
    return path


TEXT = "the quick brown fox jumps over the lazy dog"


def _token_ids(path: Path, text: str) -> list[int]:
    """`text` tokenized by the tokenizer of `path`: transformers' AutoTokenizer where it is
    installed, else the `tokenizers` library on its tokenizer.json."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    return AutoTokenizer.from_pretrained(str(path))(text)["input_ids"]


def test_the_tokenizer_travels_with_the_export(runs, tmp_path, capsys):
    """A run started with --init-from-hf DIR (its checkpoint's `init`): the export carries DIR's
    tokenizer and generation files, byte for byte, and tokenizes a text as DIR does (before: no
    tokenizer file; AutoTokenizer could not read the export). DIR's tokenizer.json not the one
    the run's data was tokenized with, or DIR gone: the export is written without them, with one
    warning line."""
    src = _tokenizer_dir(tmp_path / "ck")
    run = _edited_run(runs, tmp_path, lambda m: m.update(init={"path": str(src), "sha256": "0"}))
    assert ex.main([str(run), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    copied = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert out.rstrip().endswith(f"; {', '.join(copied)} from {src}")
    hf = tmp_path / "hf"
    assert sorted(p.name for p in hf.iterdir()) == sorted(
        [*copied, "config.json", "model.safetensors"]
    )
    assert all((hf / n).read_bytes() == (src / n).read_bytes() for n in copied)
    assert _token_ids(hf, TEXT) == _token_ids(src, TEXT) and len(set(_token_ids(hf, TEXT))) == 8

    path = run / "checkpoints" / "2" / "meta" / "metadata"  # data tokenized with another one
    meta = json.loads(path.read_text())
    meta["data"]["tokenizer"] = {"path": "/elsewhere/tokenizer.json", "sha256": "0" * 64}
    path.write_text(json.dumps(meta))
    assert ex.main([str(run), "--out", str(tmp_path / "hf2")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"warning: {src}/tokenizer.json is not the tokenizer the run's data was tokenized with "
        "(another sha256; the data's: /elsewhere/tokenizer.json): no tokenizer file copied"
    )
    shutil.rmtree(src)
    assert ex.main([str(run), "--out", str(tmp_path / "hf3")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"warning: the run's --init-from-hf {src} is gone: the export has no tokenizer; copy "
        "its tokenizer.json, tokenizer_config.json (and the like) into --out"
    )
    for hf in (tmp_path / "hf2", tmp_path / "hf3"):
        assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]


def test_a_run_from_a_config_exports_the_tokenizer_of_its_data(tmp_path, capsys):
    """A run from a config (no --init-from-hf) whose text was tokenized with `--tokenizer FILE`
    (here not named tokenizer.json): the export carries FILE as tokenizer.json, byte for byte,
    and tokenizes a text as FILE does (before: no tokenizer file; the run's own record of its
    data says which file, `data.tokenizer`). FILE changed since the run (another sha256) or
    gone: the export is written without it, with one warning line."""
    from tokenizers import Tokenizer

    mine = tmp_path / "words.json"
    shutil.copyfile(_tokenizer_dir(tmp_path / "ck") / "tokenizer.json", mine)
    text = tmp_path / "text.txt"
    text.write_text((TEXT + "\n") * 64)
    run, hf = tmp_path / "run", tmp_path / "hf"
    tiny = ["--config", "configs/tiny.yaml", "num_hidden_layers=1", *SMALL[:2], "--quiet"]
    data = ["--data", str(text), "--tokenizer", str(mine), "--steps", "1", "--out", str(run)]
    assert cli.main([*tiny, *data]) == 0
    capsys.readouterr()
    assert ex.main([str(run), "--out", str(hf)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"; tokenizer.json from {mine}")
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (hf / "tokenizer.json").read_bytes() == mine.read_bytes()
    ids = lambda path: Tokenizer.from_file(str(path)).encode(TEXT).ids
    assert ids(hf / "tokenizer.json") == ids(mine) and len(set(ids(mine))) == 8

    mine.write_text(mine.read_text() + "\n")  # the same tokenizer, but not the same file
    assert ex.main([str(run), "--out", str(tmp_path / "hf2")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"warning: {mine} changed since the run's data was tokenized with it (another sha256): "
        "no tokenizer file copied"
    )
    mine.unlink()
    assert ex.main([str(run), "--out", str(tmp_path / "hf3")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"warning: the run's --tokenizer {mine} is gone: the export has no tokenizer; copy that "
        "file into --out as tokenizer.json"
    )
    for out in (tmp_path / "hf2", tmp_path / "hf3"):
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.usefixtures("entry_hooks")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_export_is_one_line(runs, tmp_path, monkeypatch, capsys, signum):
    """Ctrl-C (SIGINT) or SIGTERM while the files are written: one line, exit status 130 / 143,
    nothing left beside --out (before: a 20-line KeyboardInterrupt traceback and exit status
    -2, or SIGTERM's death leaving the hidden temporary directory), the handlers restored. The
    signal is real, sent to this process once the first tensor is written; SIGTERM through
    `relaymoe-train export` (cli.entry). The real command signalled from its start to its end
    (the import, the reads, the exit): by hand, docs/robustness.md."""
    orig, sent = ex._hf_tensors, []

    def interrupted(*args):
        for pair in orig(*args):
            yield pair
            if not sent:
                sent.append(signum)
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(ex, "_hf_tensors", interrupted)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "out" / "hf"
    out.parent.mkdir()
    argv = [str(runs["qwen2"]), "--out", str(out)]
    if signum == signal.SIGINT:
        code = ex.main(argv)
    else:
        monkeypatch.setattr(sys, "argv", ["relaymoe-train", "export", *argv])
        with pytest.raises(SystemExit) as e:
            cli.entry()
        code = e.value.code
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    name = signal.Signals(signum).name
    assert sent and code == 128 + signum
    assert capsys.readouterr().err == f"export interrupted by {name}: nothing written to {out}\n"
    assert list(out.parent.iterdir()) == []


def test_a_second_signal_stops_the_export_at_once():
    """`Signals`: the first signal is recorded and stops the export at its next tensor
    (`check()`: not raised inside jax's or orbax's callbacks, which print or swallow it); a
    second one raises at once (a long read or write), naming the first."""
    with pytest.raises(ex.Stopped) as e, ex.Signals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert signals.received == signal.SIGINT
        with pytest.raises(ex.Stopped):
            signals.check()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert e.value.signum == signal.SIGINT
