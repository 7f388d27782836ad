"""The trainer's tokenizers: the byte-level one and a local Hugging Face tokenizer.json, and the
end-of-document token between documents (`train.prepare`)."""

from pathlib import Path

import numpy as np

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
