"""The files an export carries beside the weights (`train.hf.export`): the tokenizer and
generation files (`COPIED`) of the Hugging Face checkpoint a run started from (`--init-from-hf
DIR`, recorded in its checkpoints' `init`), so `AutoTokenizer.from_pretrained` and `generate` read
the export as they read DIR; or, for a run from a config, the `--tokenizer FILE` its data was
tokenized with (recorded in its checkpoints' `data`), as tokenizer.json."""

from pathlib import Path

# copied from the run's --init-from-hf directory where it has them: what transformers'
# tokenizers and `generate` read beside the weights
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def source_files(meta: dict, log) -> tuple[Path | None, list[tuple[str, Path]]]:
    """(where the export's tokenizer comes from, the files to copy as (name in the export, file)).

    A run started with --init-from-hf DIR (the checkpoint's `init`): DIR and the `COPIED` files
    it holds. A run without one whose data was tokenized with `--tokenizer FILE` (the
    checkpoint's `data.tokenizer`): FILE, copied as tokenizer.json (what the `tokenizers` library
    and transformers' fast tokenizers read). Neither: (None, []). A source that is gone, or a
    tokenizer.json that is not the one the run's data was tokenized with, copies nothing (`log`:
    one warning line)."""
    init = meta.get("init")
    tok = (meta.get("data") or {}).get("tokenizer")
    if not isinstance(init, dict) or not init.get("path"):
        return _data_tokenizer(tok, log)
    src = Path(init["path"])
    if not src.is_dir():
        log(
            f"warning: the run's --init-from-hf {src} is gone: the export has no tokenizer; "
            f"copy its {', '.join(COPIED[:2])} (and the like) into --out"
        )
        return src, []
    names = [n for n in COPIED if (src / n).is_file()]
    if "tokenizer.json" in names and isinstance(tok, dict) and tok.get("sha256"):
        if _sha256(src / "tokenizer.json") != tok["sha256"]:
            log(
                f"warning: {src / 'tokenizer.json'} is not the tokenizer the run's data was "
                f"tokenized with (another sha256; the data's: {tok.get('path')}): no tokenizer "
                "file copied"
            )
            return src, []
    return src, [(n, src / n) for n in names]


def _data_tokenizer(tok, log) -> tuple[Path | None, list[tuple[str, Path]]]:
    """The run's --tokenizer FILE (`source_files`), checked against the sha256 the data recorded."""
    if not isinstance(tok, dict) or not tok.get("path"):
        return None, []  # the byte-level tokenizer (None): no file
    path = Path(tok["path"])
    if not path.is_file():
        log(
            f"warning: the run's --tokenizer {path} is gone: the export has no tokenizer; copy "
            "that file into --out as tokenizer.json"
        )
        return path, []
    if tok.get("sha256") and _sha256(path) != tok["sha256"]:
        log(
            f"warning: {path} changed since the run's data was tokenized with it (another "
            "sha256): no tokenizer file copied"
        )
        return path, []
    return path, [("tokenizer.json", path)]


def _sha256(path: Path) -> str:
    from ..data.format import sha256_file

    return sha256_file(path)
