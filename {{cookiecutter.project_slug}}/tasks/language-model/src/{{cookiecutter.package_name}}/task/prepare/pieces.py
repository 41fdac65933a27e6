"""Text in pieces of about PIECE bytes, each cut after a line end (else at a character boundary):
how a long file or document is read and encoded a few megabytes at a time, and where the tail
rule cuts a file."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ...engine.errors import DataError

PIECE = 1 << 20  # bytes of a long text file encoded at a time, cut after a line end


@dataclass
class Piece:
    """Text to encode: all of a document, or a part of a long one (start and end say which)."""

    split: str
    raw: bytes  # UTF-8, checked
    start: bool  # a document (or, for the tail rule, a split's part of it) begins here
    end: bool  # the document ends here: the end-of-document token follows
    chat: bool = False  # raw is a conversation in JSON (--chat: chat.conversation_of): rendered, masked, no end token


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
