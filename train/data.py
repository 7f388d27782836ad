"""Training data: local text, tokenized and packed into fixed-length sequences, in an order fixed
by (seed, step) alone, so a resumed run reads exactly the batches an uninterrupted one would have
read. The data position is simply the step: batch `s` (0-based) holds the global samples
`s*B .. s*B+B-1`; sample `i` is sequence `perm(seed, i // N)[i % N]` of epoch `i // N`, where `N`
is the number of packed sequences and `perm` a permutation drawn from numpy's PCG64 seeded with
(seed, epoch).

Tokenizers: by default a byte-level one (UTF-8 bytes, ids 0..255), which needs no download and no
extra package. `tokenizer=PATH` instead loads a local Hugging Face `tokenizer.json` (needs the
`tokenizers` package, imported only then). Each file is tokenized on its own (for the HF tokenizer
without the post-processor's special tokens, `add_special_tokens=False`) and followed by a
separator: the byte "\\n" for the byte-level tokenizer; for a HF tokenizer the id of the first of
`EOS_TOKENS` that its vocabulary holds, or nothing when it holds none of them. The concatenation
is cut into sequences; the tail that does not fill one is dropped.

`--synthetic` instead draws, per (seed, step), arithmetic progressions of token ids (random start
and stride), a learnable stream that needs no files.
"""

from pathlib import Path

import numpy as np

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "declaration.txt"

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


def tokenize_files(paths, tok=None) -> np.ndarray:
    """The int32 token ids of the files `paths`, each followed by the separator (see the module
    docstring); `tok` is a HF `tokenizers.Tokenizer`, or None for the byte-level tokenizer."""
    texts = [Path(p).read_text(encoding="utf-8") for p in paths]
    if tok is None:
        return np.concatenate([byte_tokenize(t + "\n") for t in texts])
    sep = eos_id(tok)
    parts = []
    for t in texts:
        parts.append(tok.encode(t, add_special_tokens=False).ids)
        parts.append([] if sep is None else [sep])
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


class TextData:
    """Fixed-length sequences packed from the tokens of `paths` (see the module docstring);
    `tokenizer` is the path of a HF tokenizer.json, or None for the byte-level tokenizer."""

    def __init__(
        self, paths, seq_len: int, batch_size: int, seed: int, vocab_size: int, tokenizer=None
    ):
        paths = [Path(p) for p in paths]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"data file not found: {p}")
        if tokenizer is None:
            tok = None
            if vocab_size < 256:
                raise ValueError(
                    f"the byte-level tokenizer needs vocab_size >= 256, got {vocab_size}"
                )
        else:
            tok = load_hf_tokenizer(tokenizer, vocab_size)
        tokens = tokenize_files(paths, tok)
        self.num_seqs = len(tokens) // seq_len
        if self.num_seqs < 1:
            raise ValueError(
                f"the data ({len(tokens)} tokens in {[str(p) for p in paths]}) "
                f"cannot fill one sequence of seq_len={seq_len}"
            )
        self.seqs = tokens[: self.num_seqs * seq_len].reshape(self.num_seqs, seq_len)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        """The permutation of the packed sequences for `epoch` (only the latest is cached)."""
        if epoch not in self._perm_cache:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm_cache = {epoch: rng.permutation(self.num_seqs)}
        return self._perm_cache[epoch]

    def batch(self, step: int) -> np.ndarray:
        """The [batch_size, seq_len] int32 batch of 0-based `step`."""
        idx = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        rows = [self._perm(int(i) // self.num_seqs)[int(i) % self.num_seqs] for i in idx]
        return self.seqs[rows]


class SyntheticData:
    """Arithmetic progressions mod vocab: row r of step s starts at a random token and adds a
    random stride in 1..7, both drawn from (seed, step)."""

    def __init__(self, seq_len: int, batch_size: int, seed: int, vocab_size: int):
        self.seq_len, self.batch_size, self.seed, self.vocab = seq_len, batch_size, seed, vocab_size

    def batch(self, step: int) -> np.ndarray:
        """The [batch_size, seq_len] int32 batch of 0-based `step`."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 1_000_003, step]))
        start = rng.integers(0, self.vocab, (self.batch_size, 1))
        stride = rng.integers(1, 8, (self.batch_size, 1))
        return ((start + stride * np.arange(self.seq_len)) % self.vocab).astype(np.int32)


def make_data(
    paths,
    *,
    synthetic: bool,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    tokenizer=None,
):
    """The trainer's data source: `SyntheticData` if `synthetic` (then `paths` and `tokenizer`
    are ignored), else `TextData` over `paths` (default: the shipped text) tokenized by
    `tokenizer` (a tokenizer.json path, or None for bytes)."""
    if synthetic:
        return SyntheticData(seq_len, batch_size, seed, vocab_size)
    return TextData(paths or [DEFAULT_TEXT], seq_len, batch_size, seed, vocab_size, tokenizer)
