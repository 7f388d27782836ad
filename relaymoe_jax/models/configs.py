"""The model configurations in `configs/*.yaml`: loading, overrides and parameter counts.

`load_config("qwen3-30b-a3b")` (a name in the repository's `configs/` directory) or
`load_config("path/to/file.yaml")` gives a checked `ModelConfig`. The YAML keys are exactly the
`ModelConfig` field names; an omitted key takes the field's default. Every problem is a ValueError
that names the file, the line where it can, and the key: YAML syntax, an empty file (`{}` means
all the defaults), a duplicate key, an unknown key (with the close matches), a wrong type,
inconsistent sizes (`config.check`), and, when `expert_size` is given, experts that do not split
over the expert axis (`config.check_mesh`).

`parse_overrides(["num_experts=16", "routing=token"])` turns command-line `key=value` items into
keyword overrides; the values are parsed as YAML (so `16` is an int, `1e-5` a float, `null` None,
`[0, 3]` a list).

`param_count(cfg)` counts parameters from the architecture formula; see its docstring for exactly
what is counted. `python -m relaymoe_jax.models.configs [names or paths...]` prints a markdown
table of every config (or the ones named) with total and active counts, next to the "Params"
column of the paper's Table 3 where the config is one of its rows.
"""

import argparse
import dataclasses
import difflib
import importlib.resources
import re
import sys
import types
import typing
from pathlib import Path

import yaml

from relaymoe_jax.models.config import ModelConfig, check_mesh, from_dict


def _config_dir() -> Path:
    """The shipped configs: `relaymoe_jax/configs/` in an installed wheel (the package data that
    pyproject maps from the checkout's `configs/`), else the checkout's (editable install, or
    run from the checkout)."""
    shipped = Path(str(importlib.resources.files("relaymoe_jax") / "configs"))
    return shipped if shipped.is_dir() else Path(__file__).resolve().parents[2] / "configs"


CONFIG_DIR = _config_dir()

# The paper's Table 3 "Params" column (RelayMoE paper, Table 3: "Model configurations used in
# evaluation"), keyed by our config name: (the paper's row name, its Params value). For the three
# production rows the value is the model's nominal size from its name. The scaling rows are
# approximate and not consistent among themselves: MoE-K4 (7.5B) and MoE-K8 (7.6B) have the same
# shapes (top-k adds no parameters). See tests/test_configs.py for what they match.
PAPER_PARAMS: dict[str, tuple[str, float]] = {
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", 30e9),
    "qwen3.5-35b-a3b": ("Qwen3.5-35B-A3B", 35e9),
    "qwen2-57b-a14b": ("Qwen2-57B-A14B", 57e9),
    "moe-e64": ("MoE-E64", 7.8e9),
    "moe-e128": ("MoE-E128", 7.6e9),
    "moe-e384": ("MoE-E384", 7.5e9),
    "moe-k4": ("MoE-K4", 7.5e9),
    "moe-k8": ("MoE-K8", 7.6e9),
    "moe-k12": ("MoE-K12", 7.6e9),
    "moe-k16": ("MoE-K16", 7.6e9),
    "moe-h512": ("MoE-H512", 7.72e9),
    "moe-h768": ("MoE-H768", 7.6e9),
    "moe-h2048": ("MoE-H2048", 8.2e9),
}


# ---------------------------------------------------------------------------------------------
# YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a float (YAML 1.2; PyYAML's 1.1 rules make it a string)
    and rejects duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key_node.value!r}",
                        key_node.start_mark,
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
                   |[-+]?\.[0-9_]+[eE][-+]?[0-9]+)$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_error(e: yaml.YAMLError) -> str:
    """`line L, column C: problem` from a PyYAML error (its own text names "<unicode string>")."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(e).split())
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{where}: {problem}" + (f" ({context})" if context else "")


def available_configs() -> list[str]:
    """The names of the configs in the repository's `configs/` directory, sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(path_or_name: str | Path) -> Path:
    """An existing file path as given, else `configs/<name>.yaml`."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    name = str(path_or_name)
    if "/" not in name and "\\" not in name:
        cand = CONFIG_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"no config file {name!r} and no configs/{name}.yaml; available: {available_configs()}"
    )


# ---------------------------------------------------------------------------------------------
# loading

_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _accepts_float(hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return float in typing.get_args(hint)
    return hint is float


def _key_in(msg: str) -> str | None:
    """The config key a `config.check`/`from_dict` message starts with (`key=value: ...`)."""
    head = msg.split("=", 1)[0]
    return head if head in _FIELDS else None


def _read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    """The file's mapping and the 1-based line of each top-level key."""
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: YAML error: {_yaml_error(e)}") from None
    if data is None:
        raise ValueError(
            f"{path}: the config file is empty (no ModelConfig fields); write the "
            "fields (see configs/tiny.yaml), or `{}` for all the defaults"
        )
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a mapping of ModelConfig fields at the top level, "
            f"got {type(data).__name__}"
        )
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            lines[str(key_node.value)] = key_node.start_mark.line + 1
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{path}:{lines.get(str(bad[0]), '?')}: key {bad[0]!r} is not a string")
    return data, lines


def unknown_keys(unknown, known: dict[str, typing.Iterable[str]], what: str = "key") -> str:
    """`unknown {what}(s) [...]` with a did-you-mean for each (difflib, over every group of
    `known`) and every group's keys: `known` maps a label ("model config", "trainer") to its
    keys. A key that belongs to a group is said to be one (e.g. a trainer key in a YAML file)."""
    unknown = sorted(unknown)
    groups = {label: sorted(keys) for label, keys in known.items()}
    everything = sorted({k for keys in groups.values() for k in keys})
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, everything, n=3, cutoff=0.6)
        if close:
            hints.append(f"did you mean {' or '.join(repr(c) for c in close)} for {key!r}?")
    listing = "; ".join(f"{label} keys: {keys}" for label, keys in groups.items())
    return f"unknown {what}(s) {unknown}; " + " ".join(hints) + (" " if hints else "") + listing


def load_config(
    path_or_name: str | Path,
    *,
    expert_size: int | None = None,
    other_keys: dict[str, typing.Iterable[str]] | None = None,
    **overrides,
) -> ModelConfig:
    """A checked ModelConfig from a YAML file (a path, or a name in `configs/`), with overrides.

    `overrides` are field values that replace the file's (use `parse_overrides` for `key=value`
    strings). `expert_size`, if given, also checks that the experts split evenly over an expert
    axis of that size. Integers given for float fields become floats. Raises FileNotFoundError if
    there is no such file and ValueError, naming the file and the key, for anything wrong in it
    (an empty file too: write `{}` for all the defaults). An unknown key's error suggests close
    matches; `other_keys` ({"trainer": names, ...}) are keys the caller takes elsewhere, listed
    and matched in that error (a trainer key in the YAML file is said to be one).
    """
    path = resolve_config_path(path_or_name)
    data, lines = _read_yaml(path)
    merged = {**data, **overrides}
    hints = typing.get_type_hints(ModelConfig)
    for k, v in merged.items():
        if (
            k in hints
            and _accepts_float(hints[k])
            and isinstance(v, int)
            and not isinstance(v, bool)
        ):
            merged[k] = float(v)

    def where(key):
        if key is not None and key in overrides:
            return f"{path} (override {key}={overrides[key]!r})"
        if key is not None and key in lines:
            return f"{path}:{lines[key]}"
        return str(path)

    unknown = sorted(set(merged) - _FIELDS)
    if unknown:
        other = dict(other_keys or {})
        elsewhere = [
            f"{k} is a {label} setting, not a model config key"
            for k in unknown
            for label, keys in other.items()
            if k in keys
        ]
        known = {"model config": _FIELDS, **other}
        raise ValueError(
            f"{where(unknown[0])}: "
            + "; ".join([*elsewhere, unknown_keys(unknown, known, "config key")])
        )
    try:
        cfg = from_dict(merged)
        if expert_size is not None:
            check_mesh(cfg, expert_size)
    except ValueError as e:
        raise ValueError(f"{where(_key_in(str(e)))}: {e}") from None
    except TypeError as e:  # defensive: a value the checks could not even compare
        raise ValueError(f"{path}: {e}") from None
    return cfg


def parse_overrides(items) -> dict:
    """`["num_experts=16", "routing=token"]` -> `{"num_experts": 16, "routing": "token"}`.

    Each item is `key=value` with `key` an identifier and a non-empty `value` parsed as YAML
    (`null` for None). Keys are not checked against ModelConfig here; `load_config` does that.
    """
    out = {}
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key.isidentifier():
            raise ValueError(f"override {item!r}: {key!r} is not a valid key")
        if not text.strip():
            raise ValueError(f"override {item!r}: empty value (write {key}=null for None)")
        if key in out:
            raise ValueError(f"override {item!r}: {key} given twice")
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as e:
            raise ValueError(
                f"override {item!r}: cannot parse the value: {_yaml_error(e)}"
            ) from None
        if isinstance(value, dict):
            raise ValueError(
                f"override {item!r}: a mapping is not a config value (quote it if it is a string)"
            )
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# parameter counts


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the architecture formula, by component, with the totals.

    With d = head size, nq = num_attention_heads·d, nkv = num_key_value_heads·d, V = vocab,
    H = hidden, F = moe_intermediate, Fs = shared_expert_intermediate, I = intermediate:

    - `embedding`: V·H; `lm_head`: V·H, or 0 when `tie_word_embeddings`;
    - `attention` (every layer): q H·nq, k and v H·nkv each, o nq·H; biases: q/k/v (nq + 2·nkv)
      for qwen2_moe when `qkv_bias`, q/k/v/o (nq + 2·nkv + H) for qwen3_moe when
      `attention_bias`; qwen3_moe also has the q and k RMSNorm weights (2·d);
    - `norms`: 2 RMSNorms of H per layer plus the final norm H;
    - `router` (MoE layers): E·H, no bias;
    - `experts` (MoE layers): E·3·H·F (SwiGLU gate/up/down, no bias);
    - `shared_expert` (MoE layers, qwen2_moe with Fs > 0): 3·H·Fs plus its sigmoid gate H·1;
    - `dense_mlp` (the non-MoE layers, `ModelConfig.is_moe_layer`): 3·H·I.

    `total` is the sum: the number of elements in a Hugging Face `Qwen3MoeForCausalLM` /
    `Qwen2MoeForCausalLM` state dict of the same config (no buffers: RoPE frequencies and the
    aux-loss-free `expert_bias`, which is not trained by the optimizer, are not counted).
    `active` is what one token uses: `total` minus the (E - k) unchosen experts of each MoE layer
    (so it includes the embedding row, the LM head, attention, norms, router and shared expert).
    `active_experts` is the k chosen experts' part and `non_embedding` is `total` minus
    `embedding` and `lm_head`.
    """
    H, V, d = cfg.hidden_size, cfg.vocab_size, cfg.head_size
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    L = cfg.num_hidden_layers
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    n_dense = L - n_moe
    E, k, F = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    Fs = cfg.shared_expert_intermediate_size

    attn = H * nq + 2 * H * nkv + nq * H
    if cfg.arch == "qwen2_moe":
        attn += (nq + 2 * nkv) if cfg.qkv_bias else 0
    else:
        attn += 2 * d
        if cfg.attention_bias:
            attn += nq + 2 * nkv + H
    counts = {
        "embedding": V * H,
        "lm_head": 0 if cfg.tie_word_embeddings else V * H,
        "attention": L * attn,
        "norms": L * 2 * H + H,
        "router": n_moe * E * H,
        "experts": n_moe * E * 3 * H * F,
        "shared_expert": n_moe * (3 * H * Fs + H) if Fs else 0,
        "dense_mlp": n_dense * 3 * H * cfg.intermediate_size,
    }
    total = sum(counts.values())
    active_experts = n_moe * k * 3 * H * F
    counts.update(
        total=total,
        active=total - counts["experts"] + active_experts,
        active_experts=active_experts,
        non_embedding=total - counts["embedding"] - counts["lm_head"],
    )
    return counts


# ---------------------------------------------------------------------------------------------
# CLI


def _fmt(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}" if unit == "B" else f"{n / scale:.2f}{unit}"
    return str(int(n))


def _config_key(name) -> str:
    """`configs/qwen3.5-35b-a3b.yaml` or `qwen3.5-35b-a3b` -> `qwen3.5-35b-a3b`."""
    base = Path(name).name
    for suffix in (".yaml", ".yml"):
        base = base.removesuffix(suffix)
    return base


def table(names=None, **overrides) -> str:
    """The markdown table the CLI prints: the named configs, or every config in `configs/` (Table
    3's rows first, in the paper's order)."""
    if not names:
        have = available_configs()
        names = [n for n in PAPER_PARAMS if n in have] + [n for n in have if n not in PAPER_PARAMS]
    head = [
        "config",
        "arch",
        "L",
        "H",
        "F",
        "E",
        "k",
        "total",
        "active",
        "non-emb",
        "paper (Table 3)",
        "total/paper",
    ]
    rows = [head, ["---"] * len(head)]
    for name in names:
        cfg = load_config(name, **overrides)
        c = param_count(cfg)
        key = _config_key(name)
        paper = PAPER_PARAMS.get(key)
        rows.append(
            [
                key,
                cfg.arch,
                str(cfg.num_hidden_layers),
                str(cfg.hidden_size),
                str(cfg.moe_intermediate_size),
                str(cfg.num_experts),
                str(cfg.num_experts_per_tok),
                _fmt(c["total"]),
                _fmt(c["active"]),
                _fmt(c["non_embedding"]),
                f"{paper[0]} {paper[1] / 1e9:g}B" if paper else "",
                f"{c['total'] / paper[1]:.3f}" if paper else "",
            ]
        )
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m relaymoe_jax.models.configs",
        description="Parameter counts of the model configs (markdown table).",
    )
    ap.add_argument(
        "names",
        nargs="*",
        help="config names in configs/ or YAML paths (default: every config in configs/)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field in every config (repeatable)",
    )
    args = ap.parse_args(argv)
    try:
        print(table(args.names, **parse_overrides(args.overrides)))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
