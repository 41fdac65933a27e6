"""The split rules (files, tail, hash; written into meta.json as split.rule) and the Plan: which
split each document goes to, and the pieces to encode, in order."""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator
from pathlib import Path

from ...engine.errors import DataError
from .options import Options
from .pieces import Piece, _long_pieces, line_pieces, tail_cut
from .sources import Source, read_dataset, read_jsonl, read_parquet, read_text, unescape


def goes_to_val(name: str, fraction: float) -> bool:
    """Deterministic: the same identity lands in the same split on every machine."""
    return _hash(name) / 2**64 < fraction


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


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
