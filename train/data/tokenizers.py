"""The tokenizers: the byte-level one (UTF-8 bytes, ids 0..255, "\\n" between documents) and a
local Hugging Face tokenizer.json (the `tokenizers` package, imported only then; encoded without
the post-processor's special tokens), each with the end-of-document token `prepare` appends to
every document (`Tokenizer`)."""

from pathlib import Path

import numpy as np

from .format import TokenizerInfo, sha256_file

BYTE_EOD = 10  # "\n", the byte-level tokenizer's document separator

# End-of-document tokens looked up (in this order) in a HF tokenizer's vocabulary: GPT-2/Qwen,
# Llama/Mistral/T5, Llama 3, ChatML, Gemma.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")


def byte_tokenize(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids 0..255."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def load_hf_tokenizer(path, vocab_size: int):
    """The `tokenizers.Tokenizer` stored in the tokenizer.json at `path`. Raises
    FileNotFoundError if the file is missing, ValueError if it is not a valid tokenizer.json or
    its vocabulary (added tokens included) is larger than the model's `vocab_size`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception
        raise ValueError(f"not a valid tokenizer.json: {path} ({e})") from e
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(
            f"the tokenizer {path} has {n} tokens, more than the model's vocab_size={vocab_size}"
        )
    return tok


def eos_id(tok) -> int | None:
    """The id of the first of `EOS_TOKENS` in the HF tokenizer `tok`'s vocabulary, else None."""
    for name in EOS_TOKENS:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


class Tokenizer:
    """The byte-level tokenizer (path None) or a HF tokenizer.json, with its end-of-document id
    `eod` (for a HF tokenizer the first of `EOS_TOKENS` in its vocabulary, None if none)."""

    def __init__(self, path):
        self.path = path
        if path is None:
            self.hf, self.vocab_size, self.eod = None, 256, BYTE_EOD
            return
        self.hf = load_hf_tokenizer(path, vocab_size=2**31 - 1)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.eod = eos_id(self.hf)

    def ids(self, text: str) -> np.ndarray:
        """The token ids of one document, the end-of-document id last (if any)."""
        if self.hf is None:
            body = byte_tokenize(text)
        else:
            body = np.asarray(self.hf.encode(text, add_special_tokens=False).ids, np.int32)
        return body if self.eod is None else np.append(body, np.int32(self.eod))

    def describe(self) -> TokenizerInfo:
        """What the manifest records of it."""
        if self.path is None:
            return TokenizerInfo("bytes", None, None)
        return TokenizerInfo("hf", str(self.path), sha256_file(self.path))
