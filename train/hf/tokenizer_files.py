"""The files an export carries beside the weights (`train.hf.export`): the tokenizer and
generation files (`COPIED`) of the Hugging Face checkpoint a run started from (`--init-from-hf
DIR`, recorded in its checkpoints' `init`), so `AutoTokenizer.from_pretrained` and `generate` read
the export as they read DIR."""

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


def source_files(meta: dict, log) -> tuple[Path | None, list[str]]:
    """(the run's --init-from-hf directory, the `COPIED` files it holds) from the checkpoint's
    `init`; (None, []) for a run without one. A directory that is gone, or whose tokenizer.json
    is not the one the run's data was tokenized with, copies nothing (`log`: one warning line)."""
    init = meta.get("init")
    if not isinstance(init, dict) or not init.get("path"):
        return None, []
    src = Path(init["path"])
    if not src.is_dir():
        log(
            f"warning: the run's --init-from-hf {src} is gone: the export has no tokenizer; "
            f"copy its {', '.join(COPIED[:2])} (and the like) into --out"
        )
        return src, []
    names = [n for n in COPIED if (src / n).is_file()]
    tok = (meta.get("data") or {}).get("tokenizer")
    if "tokenizer.json" in names and isinstance(tok, dict) and tok.get("sha256"):
        from ..data.format import sha256_file

        if sha256_file(src / "tokenizer.json") != tok["sha256"]:
            log(
                f"warning: {src / 'tokenizer.json'} is not the tokenizer the run's data was "
                f"tokenized with (another sha256; the data's: {tok.get('path')}): no tokenizer "
                "file copied"
            )
            return src, []
    return src, names
