"""The model configuration files, `configs/*.yaml`: finding, loading and overriding them.

`load_config("qwen3-30b-a3b")` (a name in the repository's `configs/` directory) or
`load_config("path/to/file.yaml")` gives a checked `ModelConfig`. The YAML keys are the flat
form's (`config.KEYS`: the `ModelConfig` field names, with the MoE block's fields (`num_experts`,
`router`, `activation`, ...) in place of `moe`, and its options `dispatcher`, `routing`, `ring`,
`capacity_factor`, `chunk_size`, `gmm_impl`, `expert_fp8` in place of `moe.options`); an omitted
key takes the field's default. Every problem is a ValueError that names the file, the line
where it can, and the key: YAML syntax, an empty file (`{}` means all the defaults), a duplicate
key, an unknown key (with the close matches), a wrong type, inconsistent sizes (`config.check`),
and, when `expert_size` is given, experts that do not split over the expert axis
(`config.check_mesh`).

`parse_overrides(["num_experts=16", "routing=token"])` turns command-line `key=value` items into
keyword overrides; the values are parsed as YAML (so `16` is an int, `1e-5` a float, `null` None,
`[0, 3]` a list). Parameter counts of the configs are `param_count.py`.
"""

import difflib
import importlib.resources
import re
import typing
from pathlib import Path

import yaml

from relaymoe_jax.models.config import KEYS, ModelConfig, check_mesh


def _config_dir() -> Path:
    """The shipped configs: `relaymoe_jax/configs/` in an installed wheel (the package data that
    pyproject maps from the checkout's `configs/`), else the checkout's (editable install, or
    run from the checkout)."""
    shipped = Path(str(importlib.resources.files("relaymoe_jax") / "configs"))
    return shipped if shipped.is_dir() else Path(__file__).resolve().parents[2] / "configs"


CONFIG_DIR = _config_dir()

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
    """An existing file path as given, else a shipped config by name (`tiny`, `tiny.yaml`:
    `configs/tiny.yaml`). FileNotFoundError saying what was looked for, and, for a path whose
    file name is a shipped config's (`configs/tiny.yaml` run from elsewhere), its name."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    name = str(path_or_name)
    if "/" not in name and "\\" not in name:
        file = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
        if (CONFIG_DIR / file).is_file():
            return CONFIG_DIR / file
        raise FileNotFoundError(
            f"no config file {name!r} here ({Path.cwd()}) and no shipped config "
            f"configs/{file}; available: {available_configs()}"
        )
    hint = ""
    if p.suffix in (".yaml", ".yml") and p.stem in available_configs():
        hint = f"; a shipped config has that name: pass {p.stem!r}"
    where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
    raise FileNotFoundError(f"no config file {name}{where}{hint}; available: {available_configs()}")


# ---------------------------------------------------------------------------------------------
# loading

_FIELDS = frozenset(KEYS)


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


# `offload_layer_inputs: true` in a file or override implies these where they are not given: the
# only settings it works with (each layer one checkpoint whose only residual is its input). A
# different value given is refused by `ModelConfig`'s check, naming it.
IMPLIED_BY_OFFLOAD = {"attention_remat": "full", "moe_remat": True}


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
    `offload_layer_inputs: true` implies `IMPLIED_BY_OFFLOAD` where those keys are not given.
    """
    path = resolve_config_path(path_or_name)
    data, lines = _read_yaml(path)
    merged = {**data, **overrides}
    if merged.get("offload_layer_inputs") is True:  # the whole-layer checkpoint it offloads
        merged = {**IMPLIED_BY_OFFLOAD, **merged}  # from: implied where not given (else checked)

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
        cfg = ModelConfig.from_dict(merged)
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
