"""Tokenizers: bytes (the default: any text, no files), the synthetic source's alphabet, and a local
Hugging Face tokenizer.json through the `tokenizers` package.

Each has encode(text) -> list of ids, decode(ids) -> text, vocab_size, and eot: the id that ends a
document in the token files (None when the tokenizer has none).
"""

from __future__ import annotations

import string
from pathlib import Path

from ..engine.errors import ConfigError, DataError

ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits  # the synthetic source's symbols


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 for the end of a document: one token is one byte of text."""

    name = "bytes"
    vocab_size = 257
    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class AlphabetTokenizer:
    """The synthetic source's symbols: id i is ALPHABET[i], so a token is one byte of text."""

    name = "alphabet"
    eot = None

    def __init__(self, vocab_size: int):
        self.symbols = ALPHABET[:vocab_size]
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self.symbols))
        if unknown:
            raise ConfigError(
                f"the synthetic source's text uses only {self.symbols!r}; {''.join(unknown)!r} cannot be encoded"
            )
        return [self.symbols.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.symbols[i] for i in ids)


class HFTokenizer:
    """A local Hugging Face tokenizer.json (BPE, WordPiece, ...) through the `tokenizers` package."""

    name = "tokenizer.json"
    END_MARKERS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("a tokenizer.json needs the tokenizers package: pip install -e '.[tokenizers]'") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises its own exception type
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({err})") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot = next((i for m in self.END_MARKERS if (i := self.tokenizer.token_to_id(m)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(spec: str):
    """ "bytes" or the path of a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ConfigError(f"--tokenizer {spec!r}: no such file; use bytes or the path of a tokenizer.json")
    return HFTokenizer(spec)
