"""Start a run from a Hugging Face checkpoint: `--init-from-hf DIR` (Qwen3-MoE, Qwen2-MoE).

* The model config is `DIR/config.json` (`relaymoe_jax.models.hf_config`), then the command
  line's model `key=value` items; an item that changes the shape of a weight of the checkpoint
  (`num_experts`, `hidden_size`, ...) is refused naming it (`model_config`): the weights could
  not be loaded. One that keeps every shape (top-k, the router losses, the op's options,
  recomputation, the layer scan) applies.
* The weights go straight into the sharded train state (`load_model`): each parameter is made
  on its stored sharding (`train.step.storage.stored_sharding`: over `fsdp` and `context` too) by
  `relaymoe_jax.models.hf.from_pretrained`, each device reading only its slice, so the host holds
  one tensor at a time (one stacked tensor of all layers with `scan_layers`). Variables the
  checkpoint has no tensor for (the aux-loss-free expert bias) start at zero, as a fresh model's
  do. The optimizer starts fresh.
* The run identity records the source (`source_identity`: its path and a sha256 over its
  config.json, its index and, per weights file, the size, the safetensors header and 16 evenly
  spaced 64 KiB blocks of the data), so a resume with another checkpoint is refused (`init`,
  `train.state.identity`). Sampling reads about 1 MiB per file, not the whole files; a base and an
  instruct model share config, index and headers but differ in every block.
* The checkpoint's `tokenizer.json`, when it has one, is the data's: `--data FILE` without
  `--tokenizer` is prepared with it, and a prepared `--data DIR` or a `--tokenizer` of another
  tokenizer is refused (`check_tokenizer`).
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from relaymoe_jax.models import hf
from relaymoe_jax.models.config import KEYS, ModelConfig, check_mesh
from relaymoe_jax.models.config_files import IMPLIED_BY_OFFLOAD
from relaymoe_jax.models.hf_config import HF_ARCHS, OURS_ONLY, config_from_hf
from relaymoe_jax.models.qwen import QwenMoe

from ..step.storage import stored_sharding

CONFIG, INDEX, SINGLE, TOKENIZER = (
    "config.json",
    "model.safetensors.index.json",
    "model.safetensors",
    "tokenizer.json",
)
SAMPLES, SAMPLE_BYTES = 16, 1 << 16
# keys that never change a weight's shape: not compared (the shapes are computed for the rest):
# ours that Hugging Face has no key for, and these of config.json
_NO_SHAPE = (frozenset(OURS_ONLY) - {"arch"}) | {
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "router_aux_loss_coef",
    "num_experts_per_tok",
    "norm_topk_prob",
    "initializer_range",
}


@dataclasses.dataclass(frozen=True)
class HFSource:
    """A checked Hugging Face checkpoint directory."""

    path: Path
    config: dict  # config.json as read
    weights: tuple[str, ...]  # the .safetensors files
    tokenizer: Path | None  # DIR/tokenizer.json if there is one


def open_source(path) -> HFSource:
    """The checkpoint directory `path`, checked: ValueError (one line, naming the path) for a
    missing directory, config.json or weights, an unreadable config.json, an architecture that
    is not Qwen3-MoE or Qwen2-MoE, or a weights file that is truncated, not safetensors, or holds
    a tensor of an integer dtype (`relaymoe_jax.models.hf.weight_map`: the headers only)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"--init-from-hf {path}: not a directory (expected a Hugging Face "
            f"checkpoint directory with {CONFIG} and *.safetensors)"
        )
    if not (path / CONFIG).is_file():
        raise ValueError(
            f"--init-from-hf {path}: no {CONFIG} (expected a Hugging Face "
            f"checkpoint directory with {CONFIG} and *.safetensors)"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--init-from-hf {path / CONFIG}: cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--init-from-hf {path / CONFIG}: expected a JSON object")
    archs = config.get("architectures") or []
    if not any(a in HF_ARCHS.values() for a in archs) and config.get("model_type") not in HF_ARCHS:
        raise ValueError(
            f"--init-from-hf {path}: architectures={archs!r} (model_type="
            f"{config.get('model_type')!r}) is not built here; expected "
            f"{' or '.join(HF_ARCHS.values())}"
        )
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            weights = tuple(sorted(set(weight_map.values())))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"--init-from-hf {path / INDEX}: unreadable index ({e!r})") from None
        missing = [w for w in weights if not (path / w).is_file()]
        if missing:
            raise ValueError(f"--init-from-hf {path}: {INDEX} lists missing files {missing[:4]}")
    elif (path / SINGLE).is_file():
        weights = (SINGLE,)
    else:
        raise ValueError(f"--init-from-hf {path}: no weights ({SINGLE} or {INDEX} with its shards)")
    try:
        hf.weight_map(str(path))  # every file's header: truncated, integer tensors
    except ValueError as e:
        raise ValueError(f"--init-from-hf {e}") from None
    tok = path / TOKENIZER
    return HFSource(path, config, weights, tok if tok.is_file() else None)


def _param_shapes(cfg: ModelConfig) -> dict:
    """{parameter path: shape} of a `QwenMoe` of `cfg` per layer (no layer scan): abstract."""
    cfg = cfg.replace(scan_layers=False) if cfg.scan_layers else cfg
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.local_devices()[:1])
    model = nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    return {p: tuple(v.shape) for p, v in jax.tree_util.tree_leaves_with_path(params)}


def model_config(src: HFSource, overrides: dict, expert_size: int | None = None) -> ModelConfig:
    """The run's model config: `src`'s config.json, then `overrides` (flat model keys; ValueError
    naming the key for a value that changes a weight's shape, or a bad one)."""
    where = f"--init-from-hf {src.path / CONFIG}"
    merged = dict(overrides)
    if merged.get("offload_layer_inputs") is True:
        merged = {**IMPLIED_BY_OFFLOAD, **merged}
    try:
        base = config_from_hf(src.config)
        cfg = config_from_hf(src.config, **merged)
        if expert_size is not None:
            check_mesh(cfg, expert_size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    shaped = {
        k: v
        for k, v in merged.items()
        if k in KEYS and k not in _NO_SHAPE and base.as_dict().get(k) != cfg.as_dict().get(k)
    }
    if shaped:
        want = _param_shapes(base)
        for k, v in sorted(shaped.items()):
            if _param_shapes(config_from_hf(src.config, **{k: v})) != want:
                raise ValueError(
                    f"{k}={v!r} changes the shape of weights of the checkpoint {src.path} "
                    f"(its config.json: {k}={base.as_dict().get(k)!r}); drop it"
                )
    return cfg


def source_identity(src: HFSource) -> dict:
    """What the run identity records of the checkpoint: its path and a sha256 of its content
    (config.json, the index, and per weights file its size, header and sampled blocks)."""
    h = hashlib.sha256()
    for name in (CONFIG, INDEX):
        if (src.path / name).is_file():
            h.update(name.encode() + b"\0" + (src.path / name).read_bytes())
    for name in src.weights:
        f = src.path / name
        size = f.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + fh.read(min(n, size)))
            data0 = 8 + n
            span = max(size - data0 - SAMPLE_BYTES, 0)
            for i in range(SAMPLES):
                fh.seek(data0 + span * i // max(SAMPLES - 1, 1))
                h.update(fh.read(SAMPLE_BYTES))
    return {"path": str(src.path.resolve()), "sha256": h.hexdigest()}


def of_run(run, log=print):
    """(run, source): `run` unchanged and None without --init-from-hf; else the checked
    `HFSource`, and, when the run prepares text files (`--data FILE...` or the shipped text)
    with no --tokenizer, the checkpoint's tokenizer.json as the run's tokenizer (logged)."""
    if run.init_from_hf is None:
        return run, None
    src = open_source(run.init_from_hf)
    files = not run.train.synthetic and not any(Path(p).is_dir() for p in run.data or ())
    if src.tokenizer is not None and run.tokenizer is None and files:
        log(f"tokenizer: {src.tokenizer} (the checkpoint's)")
        run = run.replace(tokenizer=src.tokenizer)
    return run, src


def check_data(src: HFSource | None, run, data_identity: dict) -> dict | None:
    """The source's identity for the run identity (None without one); ValueError (one line) if
    the data was tokenized with another tokenizer than the checkpoint's tokenizer.json (when it
    has one). (A vocabulary beyond the checkpoint's `vocab_size` is refused by the data
    source.)"""
    if src is None:
        return None
    tok = data_identity.get("tokenizer")
    if src.tokenizer is not None and "synthetic" not in data_identity:
        from ..data.format import sha256_file

        if tok is None or tok.get("sha256") != sha256_file(src.tokenizer):
            used = "the byte-level tokenizer" if tok is None else tok.get("path")
            raise ValueError(
                f"the data is tokenized with {used}, not the checkpoint's {src.tokenizer} "
                f"(another vocabulary): prepare it with --tokenizer {src.tokenizer}"
            )
    return source_identity(src)


def load_model(src: HFSource, cfg: ModelConfig, mesh, log=print) -> QwenMoe:
    """The model of `cfg` with `src`'s weights, float32, each parameter on its stored sharding
    (`stored_sharding`); the non-parameter variables (the expert bias) at zero."""
    log(f"loading the weights of {src.path} ({len(src.weights)} file(s))")
    base = config_from_hf(src.config).as_dict()
    overrides = {k: v for k, v in cfg.as_dict().items() if v != base[k]}
    model = hf.from_pretrained(
        str(src.path),
        mesh=mesh,
        dtype=jnp.float32,
        storage=lambda sds: stored_sharding(sds, mesh),
        **overrides,
    )
    assert model.config == cfg, (model.config, cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    zero = lambda x: (
        x if isinstance(x, jax.Array) else jnp.zeros(x.shape, x.dtype, device=x.sharding)
    )
    rest = jax.tree.map(zero, rest)
    return nnx.merge(graphdef, params, rest)
