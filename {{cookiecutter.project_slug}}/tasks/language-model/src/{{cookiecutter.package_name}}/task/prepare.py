"""Tokenize text into the memory-mapped token files training reads (data.name=text).

    python -m PACKAGE.prepare --out data/corpus [--tokenizer bytes|tokenizer.json] [--val-fraction 0.05]
        [--val-files PATH...] [--doc-sep STRING] [--text-key text] [--glob '*.py'] [--workers N]
        [--shard-tokens N] [--chat [--train-on assistant|all|last] [--max-tokens N [--too-long truncate]]] PATH...

Each PATH is a file, a Hugging Face `datasets` folder (written by save_to_disk; read offline), or a
directory read recursively (the files whose names match --glob, default all; hidden files and
folders skipped). What a file holds follows its name:

    *.jsonl, *.jsonl.gz  one document per line, a JSON object whose --text-key (default text) is a string
    *.parquet            one document per row, its --text-key column
    anything else        UTF-8 text: one document, or several cut by --doc-sep (e.g. '\\n\\n', a blank
                         line, or '<|endoftext|>'); files that are not UTF-8 are skipped and counted

Empty documents are left out; every other document ends with the tokenizer's end-of-document token.

--chat: each JSON line, Parquet or datasets row is a conversation for supervised fine-tuning
(`messages`, or `prompt` and `response`, or `instruction`, `input` and `output`; tool calls and
`tools` as transformers' templates take them), rendered with the tokenizer's chat template (ChatML
without one) and written with a mask of the tokens trained: --train-on assistant (default: every
assistant turn with its end-of-turn marker), last, or all (see chat.py for the rule). A
conversation longer than --max-tokens N is dropped (--too-long drop, the default) or truncated after
its last answer that ends within N tokens (--too-long truncate: its first turns as the template
renders them, through that answer's end-of-turn marker, without the line end some templates write
after it; dropped when not even its first answer fits). With --train-on last or all, the one place
to cut is after the last answer (all: the end of the text), so truncation can only take off the
untrained text after it; meta.json counts both.

Splitting, written into meta.json as split.rule:
    files  --val-files names the validation inputs; everything else trains.
    tail   one text file and no --doc-sep (one document, e.g. a book): the last --val-fraction of its
           bytes is validation, cut after a line end (nanoGPT's and run_clm's rule).
    hash   several documents: a document is validation when a hash of its identity falls below
           --val-fraction, so the split does not depend on the order inputs are found in, on which
           other inputs exist, or on --workers. The identity is the file's name relative to its
           PATH, with '#i' for the i-th piece --doc-sep cut (from 0), ':LINE' for a JSON line (from
           1) and ':ROW' for a Parquet or datasets row (from 0). When the fraction leaves a split
           empty and there are two documents or more, the one with the smallest hash is validation
           and the others train (split.val_document names it).

Prepare streams: it holds a few megabytes of text at a time, however large the corpus, and
`--workers N` tokenizes with a tokenizer.json in N processes of one thread each, writing the same
bytes as one process (which spreads each batch over the `tokenizers` package's threads); the
bytes tokenizer, a copy, always runs in one process. Writes into --out (a new
or empty directory; it appears complete or not at all): the token ids (uint16 when the vocabulary
fits, else uint32) in shards of --shard-tokens tokens, train_000000.bin, ... and val_000000.bin,
... (training reads each split's shards as one stream), meta.json (the tokenizer, vocabulary,
dtype, the split rule, and per split its files and its tokens, bytes of text and documents), and
the tokenizer.json when one was given (with the tokenizer_config.json, special_tokens_map.json and
chat_template.jinja found beside it). Train with:

    python -m PACKAGE.train data.name=text data.root=data/corpus
"""

from __future__ import annotations

import argparse
import codecs
import collections
import concurrent.futures
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine import PACKAGE, cli
from ..engine.ckpt.files import writing
from ..engine.errors import ConfigError, DataError
from .chat import TRAIN_ON, ChatTemplate, conversation_of
from .tokenizer import ByteTokenizer, load_tokenizer

FORMAT = 2  # 1: one train.bin and one val.bin (still read by data.py)
SHARD_TOKENS = 100_000_000  # about 200 MB of uint16 per shard
PIECE = 1 << 20  # bytes of a long text file encoded at a time, cut after a line end
JOB = 4 << 20  # bytes of text per tokenizing job: a worker's share of the work at a time
DATASET_FILES = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its .arrow files


@dataclass(frozen=True)
class Source:
    """One input: a file or a datasets folder, named relative to the PATH it was found under."""

    path: Path
    name: str
    kind: str  # text, jsonl, parquet or datasets
    val: bool | None = None  # --val-files decides (True / False) or the document's hash does (None)


@dataclass
class Piece:
    """Text to encode: all of a document, or a part of a long one (start and end say which)."""

    split: str
    raw: bytes  # UTF-8, checked
    start: bool  # a document (or, for the tail rule, a split's part of it) begins here
    end: bool  # the document ends here: the end-of-document token follows
    chat: bool = False  # raw is a conversation in JSON (--chat: chat.conversation_of): rendered, masked, no end token


def kind_of(path: Path) -> str:
    if path.is_dir():
        return "datasets"
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def is_dataset(folder: Path) -> bool:
    return all((folder / name).is_file() for name in DATASET_FILES)


def find_sources(paths: list[str], pattern: str = "*", val: bool | None = None) -> list[Source]:
    """The inputs under paths, in the order given and sorted within a directory; hidden entries skipped."""
    found = []
    for given in paths:
        root = Path(given)
        if root.is_file() or (root.is_dir() and is_dataset(root)):
            found.append(Source(root, root.name, kind_of(root), val))
        elif root.is_dir() and (root / "dataset_dict.json").is_file():
            raise ConfigError(dataset_dict_advice(root))
        elif root.is_dir():
            found.extend(_walk(root, pattern, val))
        else:
            raise ConfigError(f"{given}: no such file or directory")
    if not found:
        raise DataError(f"no files matching {pattern!r} under {', '.join(paths)}")
    return found


def _walk(root: Path, pattern: str, val: bool | None) -> list[Source]:
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in list(dirs):
            if is_dataset(here / name):  # one input, not a folder of .arrow files
                dirs.remove(name)
                found.append(Source(here / name, (here / name).relative_to(root).as_posix(), "datasets", val))
        for name in sorted(f for f in files if not f.startswith(".")):
            path = here / name
            if path.match(pattern) or Path(name).match(pattern):
                found.append(Source(path, path.relative_to(root).as_posix(), kind_of(path), val))
    return sorted(found, key=lambda source: source.name)


def dataset_dict_advice(folder: Path) -> str:
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = []
    named = ", ".join(splits) or "its splits"
    return (
        f"{folder} holds several datasets ({named}): name them, e.g. {folder / 'train'} --val-files "
        f"{folder / (splits[-1] if len(splits) > 1 else 'validation')}"
    )


def goes_to_val(name: str, fraction: float) -> bool:
    """Deterministic: the same identity lands in the same split on every machine."""
    return _hash(name) / 2**64 < fraction


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


# Reading documents: each reader yields (identity, raw UTF-8 bytes) per document, a few MB at a time.


def _text_key(value, where: str, key: str) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} is {type(value).__name__}, not text; name the text field with --text-key")
    return value.encode("utf-8")


def _conversation(record: object, where: str, columns: bool = False) -> bytes:
    """A --chat record as its conversation and where it was read, in JSON (what a worker renders and tokenizes)."""
    conversation = conversation_of(record, where, columns)
    return json.dumps({**conversation, "where": where}, ensure_ascii=False).encode("utf-8")


def read_jsonl(source: Source, key: str | None) -> Iterator[tuple[str, bytes]]:
    """(identity, text) per JSON line: its key's text, or (key None, --chat) its conversation."""
    opener = gzip.open if source.path.name.lower().endswith(".gz") else open
    try:
        with opener(source.path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{source.path}:{number}"
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(f"{where}: not a JSON line ({err})") from None
                if key is None:  # --chat: the record is a conversation
                    yield f"{source.name}:{number}", _conversation(record, where)
                    continue
                if not isinstance(record, dict) or key not in record:
                    fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{where}: no {key!r} field (it has {fields}); name the text field with --text-key")
                yield f"{source.name}:{number}", _text_key(record[key], where, key)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"cannot read {source.path} ({getattr(err, 'strerror', None) or err})") from None


def unescape(separator: str) -> str:
    """--doc-sep as typed: '\\n' and '\\t' stand for a line end and a tab (so '\\n\\n' is a blank line)."""
    return separator.replace("\\n", "\n").replace("\\t", "\t")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (the submodule is imported for its side effect)
    except ImportError:
        raise ConfigError("Parquet and datasets inputs need pyarrow: pip install -e '.[data]'") from None
    return pyarrow


def _column_texts(source: Source, key: str | None, batches, schema) -> Iterator[bytes]:
    if key is None:  # --chat: each row is a conversation
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield _conversation(record, f"{source.path}: row {row}", columns=True)
                row += 1
        return
    if key not in schema.names:
        raise DataError(
            f"{source.path}: no {key!r} column (it has {', '.join(schema.names)}); name the text column with --text-key"
        )
    if str(schema.field(key).type) not in ("string", "large_string", "string_view"):
        raise DataError(
            f"{source.path}: column {key!r} is {schema.field(key).type}, not text; name one with --text-key"
        )
    for batch in batches:
        for value in batch.column(key).to_pylist():
            yield _text_key(value, source.path, key)


def read_parquet(source: Source, key: str | None) -> Iterator[tuple[str, bytes]]:
    pa = _pyarrow()
    try:
        table = pa.parquet.ParquetFile(source.path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{source.path}: not a Parquet file ({err})") from None
    schema = table.schema_arrow
    columns = [key] if key in schema.names else None
    texts = _column_texts(source, key, table.iter_batches(batch_size=1024, columns=columns), schema)
    yield from ((f"{source.name}:{row}", raw) for row, raw in enumerate(texts))


def read_dataset(source: Source, key: str | None) -> Iterator[tuple[str, bytes]]:
    """A datasets folder written by save_to_disk: its .arrow files (Arrow streams) in state.json's order."""
    pa = _pyarrow()
    try:
        state = json.loads((source.path / "state.json").read_text(encoding="utf-8"))
        files = [source.path / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{source.path}/state.json: not written by datasets' save_to_disk ({err})") from None

    def texts() -> Iterator[bytes]:
        for path in files:
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            except (OSError, pa.ArrowException) as err:
                raise DataError(f"{path}: not an Arrow stream ({err})") from None
            yield from _column_texts(source, key, reader, reader.schema)

    yield from ((f"{source.name}:{row}", raw) for row, raw in enumerate(texts()))


def read_text(source: Source, separator: bytes) -> Iterator[tuple[str, bytes]]:
    """The documents separator cuts a text file into (each whole in memory; a file without a
    separator streams through line_pieces instead)."""
    rest, index = b"", 0
    for block in _blocks(source.path):
        parts = (rest + block).split(separator)
        for part in parts[:-1]:
            yield f"{source.name}#{index}", part
            index += 1
        rest = parts[-1]
    yield f"{source.name}#{index}", rest


def _blocks(path: Path) -> Iterator[bytes]:
    try:
        with open(path, "rb") as file:
            while block := file.read(PIECE):
                yield block
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror or err})") from None


def line_pieces(path: Path, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of path[start:stop] in pieces of about PIECE bytes, each cut after a line end
    (else at a character boundary), so that no piece splits a character."""
    carry, offset = b"", start
    try:
        with open(path, "rb") as file:
            file.seek(start)
            left = None if stop is None else stop - start
            while True:
                block = file.read(PIECE if left is None else min(PIECE, left))
                if left is not None:
                    left -= len(block)
                data = carry + block
                if not block:
                    break
                cut = _piece_end(data)
                if cut:
                    yield offset, data[:cut]
                    offset += cut
                carry = data[cut:]
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror or err})") from None
    if data:
        yield offset, data


def _piece_end(data: bytes) -> int:
    """Where a piece of data ends: after its last line end, else before its last character (0: data is
    one character, or part of one)."""
    return data.rfind(b"\n") + 1 or _char_boundary(data)


def _char_boundary(data: bytes) -> int:
    """The last position in data where a UTF-8 character starts (0 for none)."""
    for back in range(1, min(4, len(data)) + 1):
        if data[-back] & 0xC0 != 0x80:
            return len(data) - back
    return 0


def tail_cut(path: Path, fraction: float) -> int:
    """The byte offset where the last `fraction` of path begins: just after the first line end at or past
    (1 - fraction) x its size; else after the last line end before it; else at a character start."""
    size = path.stat().st_size
    target = int(size * (1 - fraction))
    with open(path, "rb") as file:
        file.seek(target)
        while block := file.read(PIECE):
            found = block.find(b"\n")
            if found >= 0:
                cut = target + found + 1
                return cut if cut < size else _cut_before(file, target)
            target += len(block)
        return _cut_before(file, int(size * (1 - fraction)))


def _cut_before(file, target: int) -> int:
    """After the last line end before target, else the start of the character holding byte target."""
    start = max(0, target - PIECE)
    file.seek(start)
    head = file.read(target - start + 1)
    found = head.rfind(b"\n", 0, target - start)
    if found >= 0:
        return start + found + 1
    position = target
    while position > start and head[position - start] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        position -= 1
    return position


# Encoding: the same in the main process and in --workers processes.

_TOKENIZER, _CHAT = None, None


def _load_worker(spec: str, train_on: str | None) -> None:
    global _TOKENIZER, _CHAT
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: N workers use N cores
    _TOKENIZER = load_tokenizer(spec)
    _CHAT = None if train_on is None else (ChatTemplate.of(_TOKENIZER), train_on)


def _encode_texts(texts: list[bytes], tokenizer) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(raw, dtype=np.uint8) for raw in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch([raw.decode() for raw in texts])]


@dataclass
class Conversation:
    """A --chat piece encoded: its ids, which of them are trained targets, and its rendered text's bytes."""

    ids: np.ndarray
    trained: np.ndarray  # uint8, 1 where the token is a trained target
    size: int
    answers: list[tuple[int, int]]  # (tokens, bytes) where each trained span ends: where it may be cut

    def cut(self, max_tokens: int) -> Conversation | None:
        """The conversation up to the end of its last answer that ends within max_tokens (None: none does):
        its turns from the start, as the template renders them, the answer's end of turn included."""
        fits = [(tokens, size) for tokens, size in self.answers if tokens <= max_tokens]
        if not fits:
            return None
        tokens, size = fits[-1]
        return Conversation(self.ids[:tokens], self.trained[:tokens], size, self.answers[: len(fits)])


def _segments(template: ChatTemplate, conversation: dict, train_on: str) -> list:
    try:
        return template.segments(conversation["messages"], train_on, conversation.get("tools"))
    except DataError as err:
        raise DataError(f"{conversation['where']}: {err}") from None


def encode_conversations(pieces: list[Piece], dtype: str, tokenizer, chat: tuple[ChatTemplate, str]) -> list:
    """Each conversation rendered with the chat template, cut where training starts and stops, each piece
    tokenized on its own (tokenizer.encode_spans: no prefix space but at the text's start); refused when
    the ids do not spell the rendered text exactly."""
    template, train_on = chat
    records = [json.loads(piece.raw) for piece in pieces]
    spans = [_segments(template, record, train_on) for record in records]
    encoded = tokenizer.encode_spans([[segment.text for segment in segments] for segments in spans])
    spelled = tokenizer.spelled([[i for part in parts for i in part] for parts in encoded])
    out = []
    for record, segments, parts, back in zip(records, spans, encoded, spelled, strict=True):
        text = "".join(segment.text for segment in segments)
        if back != text:
            raise DataError(f"{record['where']}: {unspelled(tokenizer, text, back)}")
        ids = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]).astype(dtype)
        pairs = zip(parts, segments, strict=True)
        trained = np.concatenate([np.full(len(part), segment.trained, dtype=np.uint8) for part, segment in pairs])
        sizes = np.cumsum([len(segment.text.encode("utf-8")) for segment in segments])
        tokens = np.cumsum([len(part) for part in parts])
        answers = [(int(t), int(b)) for t, b, segment in zip(tokens, sizes, segments, strict=True) if segment.trained]
        out.append(Conversation(ids, trained, int(sizes[-1]), answers))
    return out


def unspelled(tokenizer, text: str, spelled: str) -> str:
    """Why a tokenizer cannot train on a rendered text: where its ids spell something else."""
    at = next((i for i, (a, b) in enumerate(zip(text, spelled, strict=False)) if a != b), min(len(text), len(spelled)))
    return (
        f"the tokenizer {getattr(tokenizer, 'path', tokenizer.name)} does not give the chat template's text back "
        "(a normalizer or pre-tokenizer that changes text, or characters it cannot encode): at character "
        f"{at} the template wrote {text[at : at + 20]!r}, its tokens spell {spelled[at : at + 20]!r}"
    )


def encode_pieces(pieces: list[Piece], dtype: str, tokenizer=None, chat=None) -> list:
    """The token ids of each piece, the end-of-document token after each that ends one; for --chat pieces
    (all of a job or none), a Conversation each."""
    tokenizer, chat = tokenizer or _TOKENIZER, chat or _CHAT
    if pieces and pieces[0].chat:
        return encode_conversations(pieces, dtype, tokenizer, chat)
    encoded = _encode_texts([piece.raw for piece in pieces], tokenizer)
    out = []
    for ids, piece in zip(encoded, pieces, strict=True):
        ends = piece.end and tokenizer.eot is not None
        array = np.empty(len(ids) + ends, dtype=dtype)
        array[: len(ids)] = ids
        if ends:
            array[-1] = tokenizer.eot
        out.append(array)
    return out


class SplitWriter:
    """One split's token ids into shards of at most shard_tokens tokens: SPLIT_000000.bin, ...; for --chat
    also the trained-target mask beside each (SPLIT_000000.mask, one byte per token) and where each
    conversation ends (SPLIT_ends.bin, int64 token offsets: training packs conversations whole)."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int, chat: bool = False):
        self.folder, self.split, self.dtype, self.shard_tokens, self.chat = folder, split, dtype, shard_tokens, chat
        self.files: list[str] = []
        self.file = self.mask = None
        self.room = 0
        self.stats = {"tokens": 0, "bytes": 0, "documents": 0}
        if chat:
            self.stats["trained_tokens"] = 0
            self.ends: list[int] = []

    def write(self, piece: Piece, ids) -> None:
        trained = None
        if isinstance(ids, Conversation):
            ids, trained, size = ids.ids, ids.trained, ids.size
            self.stats["trained_tokens"] += int(trained.sum())
            self.ends.append(self.stats["tokens"] + len(ids))
        else:
            size = len(piece.raw)
        self.stats["tokens"] += len(ids)
        self.stats["bytes"] += size
        self.stats["documents"] += piece.start
        while len(ids):
            if not self.room:
                self._next_shard()
            taken = min(self.room, len(ids))
            self.file.write(ids[:taken].tobytes())
            if trained is not None:
                self.mask.write(trained[:taken].tobytes())
                trained = trained[taken:]
            self.room -= taken
            ids = ids[taken:]

    def _next_shard(self) -> None:
        self.close()
        self.files.append(f"{self.split}_{len(self.files):06d}.bin")
        self.file = open(self.folder / self.files[-1], "wb")  # noqa: SIM115  (closed in close())
        if self.chat:
            self.mask = open(self.folder / self.files[-1].replace(".bin", ".mask"), "wb")  # noqa: SIM115
        self.room = self.shard_tokens

    def close(self) -> None:
        for file in (self.file, self.mask):
            if file is not None:
                file.close()
        self.file = self.mask = None

    def finish(self) -> dict:
        """The split's entry of meta.json (and, for --chat, its ends file written)."""
        self.close()
        entry = {**self.stats, "files": self.files}
        if self.chat:
            np.asarray(self.ends, dtype=np.int64).tofile(self.folder / f"{self.split}_ends.bin")
            masks = [name.replace(".bin", ".mask") for name in self.files]
            entry |= {"mask_files": masks, "ends": f"{self.split}_ends.bin"}
        return entry


@dataclass
class Options:
    val_fraction: float = 0.05
    tokenizer: str = "bytes"
    pattern: str = "*"
    doc_sep: str | None = None
    text_key: str = "text"
    workers: int = 1
    shard_tokens: int = SHARD_TOKENS
    chat: bool = False
    train_on: str = "assistant"
    max_tokens: int | None = None
    too_long: str = "drop"


TOO_LONG = ("drop", "truncate")


class Plan:
    """Which split each document goes to, and the pieces to encode, in order."""

    def __init__(self, sources: list[Source], options: Options):
        self.sources, self.options = sources, options
        self.separator = None if options.doc_sep is None else unescape(options.doc_sep).encode("utf-8")
        self.skipped: set[Path] = set()  # a set: the look-ahead for the fallback meets some files twice
        explicit = any(source.val is not None for source in sources)
        whole_files = self.separator is None and all(source.kind == "text" for source in sources)
        if explicit:
            self.rule = "files"
        elif whole_files and len(sources) == 1:
            self.rule = "tail"
        else:
            self.rule = "hash"
        self.fallback = self._smallest_hash() if self.rule == "hash" else None
        self.cut: int | None = None

    def _smallest_hash(self) -> str | None:
        """The document that alone is validation when the fraction leaves a split empty: the one with the
        smallest hash, if there are two or more. Decided before any is written, so that it does not depend
        on --workers; the look-ahead stops once both splits have a document, after a few documents unless
        the corpus is too small for the fraction."""
        splits, smallest, count = set(), None, 0
        for identity in self._identities():
            splits.add(goes_to_val(identity, self.options.val_fraction))
            if len(splits) == 2:
                return None
            count += 1
            if smallest is None or _hash(identity) < _hash(smallest):
                smallest = identity
        return smallest if count > 1 else None

    def _identities(self) -> Iterator[str]:
        """The identities of the documents pieces() will hold, in its order."""
        for source in self.sources:
            if source.kind == "text" and self.separator is None:
                if _is_document(source.path):
                    yield source.name
                continue
            yield from (identity for identity, raw in self._documents(source) if raw)

    def split_of(self, source: Source, identity: str) -> str:
        if source.val is not None:
            return "val" if source.val else "train"
        if self.fallback is not None:
            return "val" if identity == self.fallback else "train"
        return "val" if goes_to_val(identity, self.options.val_fraction) else "train"

    def pieces(self) -> Iterator[Piece]:
        for source in self.sources:
            if source.kind == "text" and self.separator is None:
                yield from self._file_pieces(source)
                continue
            for identity, raw in self._documents(source):
                if self.options.chat:  # a conversation is never cut
                    yield Piece(self.split_of(source, identity), raw, True, True, chat=True)
                elif raw:
                    yield from _long_pieces(self.split_of(source, identity), raw)

    def _documents(self, source: Source) -> Iterator[tuple[str, bytes]]:
        key = None if self.options.chat else self.options.text_key
        if source.kind == "jsonl":
            return read_jsonl(source, key)
        if source.kind == "parquet":
            return read_parquet(source, key)
        if source.kind == "datasets":
            return read_dataset(source, key)
        return self._checked(read_text(source, self.separator), source)

    def _checked(self, documents: Iterator[tuple[str, bytes]], source: Source) -> Iterator[tuple[str, bytes]]:
        """Text documents, the file skipped (and counted) when its first one is not UTF-8."""
        for index, (identity, raw) in enumerate(documents):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                if index == 0:
                    self.skipped.add(source.path)
                    return
                raise DataError(f"{source.path}: not UTF-8 in document {identity} ({err.reason})") from None
            yield identity, raw

    def _file_pieces(self, source: Source) -> Iterator[Piece]:
        """A whole text file as one document, streamed in pieces; for the tail rule, its last part is val."""
        size = source.path.stat().st_size
        if self.rule == "tail":
            self.cut = tail_cut(source.path, self.options.val_fraction)
            parts = (("train", 0, self.cut), ("val", self.cut, size))
        else:
            parts = ((self.split_of(source, source.name), 0, size),)
        decoder = codecs.getincrementaldecoder("utf-8")()
        for split, start, stop in parts:
            first, previous = True, None
            for offset, raw in line_pieces(source.path, start, stop):
                try:
                    decoder.decode(raw)
                except UnicodeDecodeError as err:
                    if offset == 0:
                        self.skipped.add(source.path)
                        return
                    raise DataError(
                        f"{source.path}: not UTF-8 at byte {offset + err.start} (after {offset} bytes that were); "
                        "remove it, or leave it out with --glob"
                    ) from None
                if previous is not None:
                    yield previous
                previous, first = Piece(split, raw, first, False), False
            if previous is not None:
                previous.end = stop == size
                yield previous


def _is_document(path: Path) -> bool:
    """Whether a whole text file holds a document: it is not empty, and not skipped for its first piece
    not being UTF-8."""
    raw = next(line_pieces(path), (0, b""))[1]
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw)
    except UnicodeDecodeError:
        return False
    return bool(raw)


def _long_pieces(split: str, raw: bytes) -> Iterator[Piece]:
    """A document in memory as pieces of about PIECE bytes cut after line ends (one piece when short)."""
    if len(raw) <= PIECE:
        yield Piece(split, raw, True, True)
        return
    start = 0
    while start < len(raw):
        stop = min(len(raw), start + PIECE)
        if stop < len(raw):
            stop = start + (_piece_end(raw[start:stop]) or PIECE)
        yield Piece(split, raw[start:stop], start == 0, stop == len(raw))
        start = stop


def jobs(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped into jobs of about JOB bytes, in order."""
    job, size = [], 0
    for piece in pieces:
        job.append(piece)
        size += len(piece.raw)
        if size >= JOB:
            yield job
            job, size = [], 0
    if job:
        yield job


def encoded(plan: Plan, tokenizer, dtype: str, workers: int, chat=None) -> Iterator[tuple[Piece, np.ndarray]]:
    """(piece, its ids) in the plan's order; with workers > 1 encoded by that many processes, a bounded
    number of jobs ahead, so memory does not grow with the corpus. The bytes tokenizer is a copy, faster
    in this process than the hand-over to another (--workers changes nothing for it)."""
    if workers == 1 or isinstance(tokenizer, ByteTokenizer):
        for job in jobs(plan.pieces()):
            yield from zip(job, encode_pieces(job, dtype, tokenizer, chat), strict=True)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_load_worker,
        initargs=(plan.options.tokenizer, plan.options.train_on if plan.options.chat else None),
    ) as pool:
        pending = collections.deque()
        for job in jobs(plan.pieces()):
            pending.append((job, pool.submit(encode_pieces, job, dtype)))
            if len(pending) > 2 * workers:
                done, future = pending.popleft()
                yield from zip(done, future.result(), strict=True)
        while pending:
            done, future = pending.popleft()
            yield from zip(done, future.result(), strict=True)


def prepare(paths: list[str], out: Path, options: Options, val_paths: list[str] = ()) -> dict:
    """Write the token shards and meta.json into out; return the meta."""
    with writing(out):  # a full disk or a read-only folder: one line, exit 1
        return _prepare(paths, out, options, list(val_paths))


def _check(paths: list[str], out: Path, options: Options, val_paths: list[str]) -> None:
    if not 0.0 < options.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction={options.val_fraction} must be between 0 and 1 (exclusive)")
    if options.workers < 1:
        raise ConfigError(f"--workers={options.workers} must be at least 1")
    if options.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens={options.shard_tokens} must be at least 1")
    if options.doc_sep == "":
        raise ConfigError("--doc-sep must not be empty (leave it out: each file is one document)")
    if options.chat and options.train_on not in TRAIN_ON:
        raise ConfigError(f"--train-on={options.train_on!r}: choose {', '.join(TRAIN_ON)}")
    if options.max_tokens is not None and options.max_tokens < 2:
        raise ConfigError(f"--max-tokens={options.max_tokens} must be at least 2")
    if options.too_long not in TOO_LONG:
        raise ConfigError(f"--too-long={options.too_long!r}: choose {', '.join(TOO_LONG)}")
    if not options.chat and (options.max_tokens is not None or options.too_long != "drop"):
        raise ConfigError("--max-tokens and --too-long are for conversations: use them with --chat")
    if options.too_long == "truncate" and options.max_tokens is None:
        raise ConfigError("--too-long truncate cuts conversations longer than --max-tokens N: name N")
    both = {os.path.abspath(p) for p in paths} & {os.path.abspath(p) for p in val_paths}
    if both:
        raise ConfigError(f"{sorted(both)[0]} is named both as an input and in --val-files")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty directory; name a new one (nothing was changed)")


def _prepare(paths: list[str], out: Path, options: Options, val_paths: list[str]) -> dict:
    _check(paths, out, options, val_paths)
    tokenizer = load_tokenizer(options.tokenizer)
    if val_paths:
        sources = find_sources(paths, options.pattern, val=False) + find_sources(val_paths, options.pattern, val=True)
    else:
        sources = find_sources(paths, options.pattern)
    text = [source.path for source in sources if source.kind == "text"]
    if options.chat and text:
        raise ConfigError(f"--chat reads records (.jsonl, .parquet, datasets folders); {text[0]} is text")
    chat = (ChatTemplate.of(tokenizer), options.train_on) if options.chat else None
    plan = Plan(sources, options)
    dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writers = {name: SplitWriter(staging, name, dtype, options.shard_tokens, options.chat) for name in ("train", "val")}
    dropped = dict.fromkeys(writers, 0)  # conversations longer than --max-tokens, left out
    truncated = dict.fromkeys(writers, 0)  # and cut after an answer (--too-long truncate)
    try:
        for piece, ids in encoded(plan, tokenizer, dtype, options.workers, chat):
            if options.max_tokens is not None and len(ids.ids) > options.max_tokens:  # --chat: Conversations
                ids = ids.cut(options.max_tokens) if options.too_long == "truncate" else None
                if ids is None:
                    dropped[piece.split] += 1
                    continue
                truncated[piece.split] += 1
            writers[piece.split].write(piece, ids)
        splits = {name: writer.finish() for name, writer in writers.items()}
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for writer in writers.values():
            writer.close()
    documents = sum(writer.stats["documents"] for writer in writers.values())
    for name, writer in writers.items():
        if writer.stats["tokens"] < 2:
            shutil.rmtree(staging)
            raise DataError(_empty_split(name, plan, documents, dropped[name]))
    meta = {
        "format": FORMAT,
        "tokenizer": "bytes" if options.tokenizer == "bytes" else "tokenizer.json",
        "vocab_size": tokenizer.vocab_size,
        "eot": tokenizer.eot,
        "dtype": dtype,
        "split": _split_meta(plan),
        **splits,
        "skipped_files": len(plan.skipped),
        "val_fraction": options.val_fraction,
        "shard_tokens": options.shard_tokens,
        "inputs": dict(collections.Counter(source.kind for source in sources)),
    }
    if chat:
        template = chat[0]
        meta["chat"] = {
            "template": template.origin,
            "train_on": options.train_on,
            "end_of_turn": template.end_of_turn(),
            "max_tokens": options.max_tokens,
            "too_long": {"drop": "dropped", "truncate": "truncated"}[options.too_long],
            "dropped": dropped,
            "truncated": truncated,
        }
    if options.tokenizer != "bytes":
        shutil.copyfile(options.tokenizer, staging / "tokenizer.json")
        for name, content in tokenizer.companions.items():  # special tokens, chat template: they travel too
            (staging / name).write_bytes(content)
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        out.rmdir()  # empty, checked above
    staging.rename(out)  # the directory appears complete or not at all
    return meta


def _split_meta(plan: Plan) -> dict:
    if plan.rule == "files":
        return {"rule": "files", "val_inputs": [s.name for s in plan.sources if s.val]}
    if plan.rule == "tail":
        return {"rule": "tail", "val_fraction": plan.options.val_fraction, "cut_at_byte": plan.cut}
    split = {"rule": "hash", "val_fraction": plan.options.val_fraction}
    if plan.fallback is not None:
        split |= {"fallback": "smallest_hash", "val_document": plan.fallback}
    return split


def _empty_split(name: str, plan: Plan, documents: int, dropped: int) -> str:
    if dropped:
        too_long = f"--max-tokens={plan.options.max_tokens}"
        if plan.options.too_long == "truncate":
            too_long += " (even cut after their first answer)"
        return f"the {name} split is empty: every conversation of it ({dropped}) is longer than {too_long}"
    if plan.rule == "hash" and documents == 1:  # the smallest-hash fallback needs two
        return (
            f"no document went to the {name} split with --val-fraction {plan.options.val_fraction}: one document "
            "is too few to split by hash; name the validation inputs with --val-files"
        )
    return f"the {name} split has no text (every input of it was empty or not UTF-8)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="text, .jsonl(.gz) or .parquet files, datasets "
                        "folders (save_to_disk), or directories read recursively")  # fmt: skip
    parser.add_argument("--out", required=True, type=Path, help="a new directory for the token files")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of documents (or of one file's "
                        "text) for validation")  # fmt: skip
    parser.add_argument("--val-files", nargs="+", default=[], metavar="PATH", help="validation inputs (then "
                        "every PATH trains)")  # fmt: skip
    parser.add_argument("--tokenizer", default="bytes", help="bytes (default) or the path of a tokenizer.json")
    parser.add_argument("--glob", default="*", help="in directories, read only files matching this (e.g. '*.py')")
    parser.add_argument("--doc-sep", help="cut text files into documents at this string (e.g. '<|endoftext|>')")
    parser.add_argument("--text-key", default="text", help="the text field of JSON lines, Parquet and datasets")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing with a tokenizer.json "
                        "(the output is the same)")  # fmt: skip
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per output file")
    parser.add_argument("--chat", action="store_true", help="records are conversations (messages, prompt/response "
                        "or instruction/input/output): rendered with the chat template, with a loss mask")  # fmt: skip
    parser.add_argument("--train-on", default="assistant", choices=TRAIN_ON, help="--chat: which tokens are trained "
                        "(every assistant turn, the last one, or all)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, help="--chat: conversations longer than this are dropped "
                        "or truncated (--too-long), and counted")  # fmt: skip
    parser.add_argument("--too-long", default="drop", choices=TOO_LONG, help="--chat: a conversation longer than "
                        "--max-tokens is dropped, or truncated after its last answer that fits")  # fmt: skip
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    options = Options(
        args.val_fraction,
        args.tokenizer,
        args.glob,
        args.doc_sep,
        args.text_key,
        args.workers,
        args.shard_tokens,
        args.chat,
        args.train_on,
        args.max_tokens,
        args.too_long,
    )
    return cli.run(lambda: _prepare_and_say(args, options))


def _prepare_and_say(args: argparse.Namespace, options: Options) -> int:
    meta = prepare(args.paths, args.out, options, args.val_files)
    train, val = meta["train"], meta["val"]
    print(
        f"wrote {args.out}: train {train['tokens']} tokens ({train['documents']} documents, "
        f"{len(train['files'])} files), val {val['tokens']} tokens ({val['documents']} documents), vocabulary "
        f"{meta['vocab_size']} ({meta['tokenizer']}), split by {meta['split']['rule']}; "
        f"{meta['skipped_files']} files skipped (not UTF-8)"
    )
    if "chat" in meta:
        chat = meta["chat"]
        too_long = ""
        if chat["max_tokens"] is not None:
            too_long = (
                f"; longer than --max-tokens: {sum(chat['dropped'].values())} dropped, "
                f"{sum(chat['truncated'].values())} truncated"
            )
        print(
            f"conversations: trained tokens {train['trained_tokens']} of {train['tokens']} (--train-on "
            f"{chat['train_on']}, {chat['template']} template, end of turn {chat['end_of_turn']!r}){too_long}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
