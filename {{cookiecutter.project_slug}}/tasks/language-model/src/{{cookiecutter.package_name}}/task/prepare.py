"""Tokenize text files into the memory-mapped token files training reads (data.name=text).

    python -m PACKAGE.prepare --out data/corpus [--val-fraction 0.05] [--tokenizer bytes|tokenizer.json]
        [--glob '*.py'] PATH...

Each PATH is a text file or a directory read recursively (the files whose names match --glob,
default all; hidden files and folders skipped; files that are not UTF-8 text skipped and
counted). Every file is one document; a document goes to the validation split when a hash of its
path relative to its PATH falls below --val-fraction, so the split does not depend on the order
files are found in, or on which other files exist. Documents are separated by the tokenizer's
end-of-document token.

Writes into --out (a new or empty directory): train.bin and val.bin (token ids, uint16 when the
vocabulary fits, else uint32), meta.json (tokenizer, vocabulary size, dtype, and per split the
tokens, bytes of text and documents), and the tokenizer.json when one was given. Train with:

    python -m PACKAGE.train data.name=text data.root=data/corpus
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from ..engine import PACKAGE, cli
from ..engine.ckpt.files import writing
from ..engine.errors import ConfigError, DataError
from .tokenizer import load_tokenizer

FORMAT = 1


def find_documents(paths: list[str], pattern: str = "*") -> list[tuple[Path, str]]:
    """(file, its name relative to the PATH it was found under), sorted; hidden entries skipped."""
    found = []
    for given in paths:
        root = Path(given)
        if root.is_file():
            found.append((root, root.name))
        elif root.is_dir():
            for path in sorted(root.rglob(pattern)):
                relative = path.relative_to(root)
                if path.is_file() and not any(part.startswith(".") for part in relative.parts):
                    found.append((path, relative.as_posix()))
        else:
            raise ConfigError(f"{given}: no such file or directory")
    if not found:
        raise DataError(f"no files matching {pattern!r} under {', '.join(paths)}")
    return found


def goes_to_val(name: str, fraction: float) -> bool:
    """Deterministic: the same name lands in the same split on every machine."""
    digest = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return digest / 2**64 < fraction


def prepare(paths: list[str], out: Path, val_fraction: float, tokenizer_spec: str, pattern: str = "*") -> dict:
    """Write train.bin, val.bin and meta.json into out; return the meta."""
    with writing(out):  # a full disk or a read-only folder: one line, exit 1
        return _prepare(paths, out, val_fraction, tokenizer_spec, pattern)


def _prepare(paths: list[str], out: Path, val_fraction: float, tokenizer_spec: str, pattern: str) -> dict:
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty directory; name a new one (nothing was changed)")
    tokenizer = load_tokenizer(tokenizer_spec)
    documents = find_documents(paths, pattern)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    splits = {name: {"tokens": 0, "bytes": 0, "documents": 0} for name in ("train", "val")}
    val_names = {name for _, name in documents if goes_to_val(name, val_fraction)}
    if not val_names or len(val_names) == len(documents):  # too few files for the fraction: one goes to val
        if len(documents) < 2:
            raise DataError("prepare needs at least two documents (files): one for each split")
        val_names = {min((name for _, name in documents), key=lambda n: hashlib.sha256(n.encode()).digest())}
    skipped = 0
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        files = {name: stack.enter_context(open(staging / f"{name}.bin", "wb")) for name in splits}
        for path, name in documents:
            try:
                raw = path.read_bytes()
            except OSError as err:
                raise DataError(f"cannot read {path} ({err.strerror or err})") from None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped += 1
                continue
            ids = tokenizer.encode(text)
            if tokenizer.eot is not None:
                ids.append(tokenizer.eot)
            split = "val" if name in val_names else "train"
            files[split].write(np.asarray(ids, dtype=dtype).tobytes())
            stats = splits[split]
            stats["tokens"] += len(ids)
            stats["bytes"] += len(raw)
            stats["documents"] += 1
    for name, stats in splits.items():
        if stats["tokens"] < 2:
            shutil.rmtree(staging)
            raise DataError(f"the {name} split has no text (every file of it was empty or not UTF-8)")
    meta = {
        "format": FORMAT,
        "tokenizer": "bytes" if tokenizer_spec == "bytes" else "tokenizer.json",
        "vocab_size": tokenizer.vocab_size,
        "eot": tokenizer.eot,
        "dtype": np.dtype(dtype).name,
        "train": splits["train"],
        "val": splits["val"],
        "skipped_files": skipped,
        "val_fraction": val_fraction,
    }
    if tokenizer_spec != "bytes":
        shutil.copyfile(tokenizer_spec, staging / "tokenizer.json")
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        out.rmdir()  # empty, checked above
    staging.rename(out)  # the directory appears complete or not at all
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="text files, or directories read recursively")
    parser.add_argument("--out", required=True, type=Path, help="a new directory for the token files")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of documents for validation")
    parser.add_argument("--tokenizer", default="bytes", help="bytes (default) or the path of a tokenizer.json")
    parser.add_argument("--glob", default="*", help="in directories, read only files matching this (e.g. '*.py')")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return cli.run(lambda: _prepare_and_say(args))


def _prepare_and_say(args: argparse.Namespace) -> int:
    meta = prepare(args.paths, args.out, args.val_fraction, args.tokenizer, args.glob)
    train, val = meta["train"], meta["val"]
    print(
        f"wrote {args.out}: train {train['tokens']} tokens ({train['documents']} documents), "
        f"val {val['tokens']} tokens ({val['documents']} documents), vocabulary {meta['vocab_size']} "
        f"({meta['tokenizer']}); {meta['skipped_files']} files skipped (not UTF-8)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
