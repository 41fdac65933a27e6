"""Tokenizers: bytes (the default: any text, no files), the synthetic source's alphabet, and a local
Hugging Face tokenizer.json through the `tokenizers` package.

Each has encode(text) -> list of ids, decode(ids) -> text, vocab_size, and eot: the id that ends a
document in the token files (None when the tokenizer has none). Those that tokenize conversations
(bytes, tokenizer.json) also have encode_spans(texts), each text given as the pieces training cuts it
into, and spelled(ids): the text ids stand for, special tokens included.

A run carries its tokenizer: training writes it into the run directory (tokenizer/, through
Task.model_files) and export into export/tokenizer/, as `tokenizer/meta.json` (which tokenizer,
its vocabulary, end-of-document id and, for a tokenizer.json, its SHA-256) beside the
tokenizer.json itself and the files a Hugging Face model folder keeps beside it
(tokenizer_config.json: special tokens and chat template; special_tokens_map.json;
chat_template.jinja). generate and export read it from there, so they need no prepared data, and
a run refuses data prepared with another tokenizer (`identity`).
"""

from __future__ import annotations

import functools
import hashlib
import json
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

    def encode_spans(self, texts: list[list[str]]) -> list[list[list[int]]]:
        return [[self.encode(piece) for piece in pieces] for pieces in texts]

    def spelled(self, ids: list[list[int]]) -> list[str]:
        return [self.decode(each) for each in ids]


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


# What a Hugging Face model folder keeps beside its tokenizer.json: travels with it, unread but for
# the end-of-sequence token.
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class HFTokenizer:
    """A local Hugging Face tokenizer.json (BPE, WordPiece, ...) through the `tokenizers` package, with
    the companion files found beside it (COMPANIONS)."""

    name = "tokenizer.json"
    END_MARKERS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("a tokenizer.json needs the tokenizers package: pip install -e '.[tokenizers]'") from None
        self.path = Path(path)
        try:
            self.json = Path(path).read_bytes()  # kept: a run and its export carry the file itself
            self.tokenizer = Tokenizer.from_str(self.json.decode("utf-8"))
        except Exception as err:  # the Rust side raises its own exception type
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({err})") from None
        beside = Path(path).parent
        self.companions = {name: (beside / name).read_bytes() for name in COMPANIONS if (beside / name).is_file()}
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        markers = (self._configured_end(path), *self.END_MARKERS)
        self.eot = next((i for m in markers if m and (i := self.tokenizer.token_to_id(m)) is not None), None)

    def _configured_end(self, path: str | Path) -> str | None:
        """tokenizer_config.json's eos_token (a string, or a dict with its content), if given."""
        if "tokenizer_config.json" not in self.companions:
            return None
        try:
            end = json.loads(self.companions["tokenizer_config.json"]).get("eos_token")
        except (ValueError, AttributeError) as err:
            raise DataError(f"{Path(path).parent / 'tokenizer_config.json'}: unreadable ({err})") from None
        return end.get("content") if isinstance(end, dict) else end if isinstance(end, str) else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode of each text, the batch spread over the `tokenizers` package's threads."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_spans(self, texts: list[list[str]]) -> list[list[list[int]]]:
        """The ids of each text given as pieces (a conversation cut where training starts and stops), each
        piece tokenized on its own, with no prefix put before it: the tokenizer's prefix (SentencePiece's "▁",
        a byte-level prefix space) goes only at a text's start, and there only when its decoder takes it away
        again and no special token comes first, as a text tokenized alone gets it. So a text's ids spell
        exactly its pieces joined (checked by the caller with spelled()), where encode() would put a "▁" or a
        space before every piece (prepend_scheme first: each piece is a first section) or after every
        special token (prepend_scheme always, the legacy Llama normalizer, add_prefix_space)."""
        cut, start = self._pieces
        flat = [piece for pieces in texts for piece in pieces]
        first = 0
        for pieces in texts:  # a text's start, where no special token opens it, gets the start prefix
            if pieces and start and not pieces[0].startswith(self._added):
                flat[first] = start + pieces[0]
            first += len(pieces)
        encoded = iter(encoding.ids for encoding in cut.encode_batch(flat, add_special_tokens=False))
        return [[next(encoded) for _ in pieces] for pieces in texts]

    def spelled(self, ids: list[list[int]]) -> list[str]:
        """The text each list of ids stands for, special tokens written out (as a chat template writes them)."""
        return self.tokenizer.decode_batch(ids, skip_special_tokens=False)

    @functools.cached_property
    def _pieces(self):
        """(this tokenizer without the prefix it puts before each piece of text, the prefix a text's start
        gets: the one taken out, where the decoder takes it away again; "" where it does not)."""
        from tokenizers import Tokenizer

        config, taken = json.loads(self.json), []
        for key in ("normalizer", "pre_tokenizer"):
            config[key] = _without_prefix(config.get(key), taken)
        cut = Tokenizer.from_str(json.dumps(config))

        def spells(text: str, probe: str) -> bool:
            return self.spelled([cut.encode(text, add_special_tokens=False).ids]) == [probe]

        probe = next((probe for probe in ("a", "e", "1", "x") if spells(probe, probe)), None)  # one it can encode
        removed = [prefix for prefix in taken if probe and spells(prefix + probe, probe)]
        return cut, (removed or [""])[0]

    @functools.cached_property
    def _added(self) -> tuple[str, ...]:
        return tuple(token.content for token in self.tokenizer.get_added_tokens_decoder().values())


def _without_prefix(node: object, taken: list[str]) -> object:
    """A tokenizer.json normalizer or pre-tokenizer without the prefix it puts before each piece of text: a
    Prepend normalizer left out, Metaspace's prepend_scheme "never", ByteLevel's add_prefix_space false; each
    prefix taken out is added to taken."""
    if isinstance(node, list):
        return [kept for kept in (_without_prefix(item, taken) for item in node) if kept is not None]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Prepend":
        taken.append(node.get("prepend", ""))
        return None
    node = {key: _without_prefix(value, taken) for key, value in node.items()}
    if kind == "Metaspace":
        scheme = node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never")
        if scheme != "never":
            taken.append(node.get("replacement", "\u2581"))
        node |= {"prepend_scheme": "never"} | ({"add_prefix_space": False} if "add_prefix_space" in node else {})
    if kind == "ByteLevel" and node.get("add_prefix_space"):
        taken.append(" ")
        node["add_prefix_space"] = False
    return node


def load_tokenizer(spec: str):
    """ "bytes" or the path of a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ConfigError(f"--tokenizer {spec!r}: no such file; use bytes or the path of a tokenizer.json")
    return HFTokenizer(spec)


FOLDER = "tokenizer"  # in a run directory and in export/


def identity(tokenizer) -> dict:
    """What tells tokenizers apart: its kind, vocabulary, end-of-document id and, for a tokenizer.json,
    the SHA-256 of the file (two runs agree on a tokenizer when these agree)."""
    sha = hashlib.sha256(tokenizer.json).hexdigest() if isinstance(tokenizer, HFTokenizer) else None
    return {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot": tokenizer.eot, "sha256": sha}


def describe(meta: dict) -> str:
    """A tokenizer's identity in words, e.g. "bytes (vocabulary 257)" or "tokenizer.json 3f2a9c1b0d4e
    (vocabulary 50257)"."""
    sha = f" {meta['sha256'][:12]}" if meta.get("sha256") else ""
    return f"{meta.get('tokenizer')}{sha} (vocabulary {meta.get('vocab_size')})"


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files that carry a tokenizer, by path relative to a run directory or export folder."""
    files = {f"{FOLDER}/meta.json": (json.dumps(identity(tokenizer), indent=2) + "\n").encode()}
    if isinstance(tokenizer, HFTokenizer):
        files[f"{FOLDER}/tokenizer.json"] = tokenizer.json
        files |= {f"{FOLDER}/{name}": content for name, content in tokenizer.companions.items()}
    return files


def read_identity(folder: Path) -> dict | None:
    """The tokenizer identity stored under folder (a run directory or export folder); None when it has
    none (a run trained before runs carried their tokenizer)."""
    path = Path(folder) / FOLDER / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err})") from None
    if not isinstance(meta, dict) or not {"tokenizer", "vocab_size"} <= meta.keys():
        raise DataError(f"{path}: not a tokenizer description (needs tokenizer and vocab_size)")
    return meta


def read_tokenizer(folder: Path):
    """The tokenizer stored under folder, or None when it has none."""
    meta = read_identity(folder)
    if meta is None:
        return None
    kind = meta["tokenizer"]
    if kind == ByteTokenizer.name:
        return ByteTokenizer()
    if kind == AlphabetTokenizer.name:
        return AlphabetTokenizer(int(meta["vocab_size"]))
    if kind == HFTokenizer.name:
        tokenizer = HFTokenizer(Path(folder) / FOLDER / "tokenizer.json")
        if identity(tokenizer) != meta:
            raise DataError(f"{Path(folder) / FOLDER}: tokenizer.json does not match its meta.json (edited by hand?)")
        return tokenizer
    raise DataError(f"{Path(folder) / FOLDER / 'meta.json'}: unknown tokenizer {kind!r}")
