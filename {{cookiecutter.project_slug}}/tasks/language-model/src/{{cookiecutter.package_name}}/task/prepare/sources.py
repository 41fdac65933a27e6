"""The inputs: finding them under the PATHs given, and reading documents out of each of the five
formats: text files (whole, or cut by --doc-sep), JSON lines (.jsonl, .jsonl.gz), Parquet, and
datasets folders (save_to_disk)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ...engine.errors import ConfigError, DataError
from ..chat import conversation_of
from .pieces import _blocks

DATASET_FILES = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its .arrow files


@dataclass(frozen=True)
class Source:
    """One input: a file or a datasets folder, named relative to the PATH it was found under."""

    path: Path
    name: str
    kind: str  # text, jsonl, parquet or datasets
    val: bool | None = None  # --val-files decides (True / False) or the document's hash does (None)


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
