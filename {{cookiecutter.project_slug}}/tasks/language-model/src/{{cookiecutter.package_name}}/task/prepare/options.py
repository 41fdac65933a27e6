"""The command's options (Options, one field per flag) and the checks made before anything is read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...engine.errors import ConfigError
from ..chat import TRAIN_ON

SHARD_TOKENS = 100_000_000  # about 200 MB of uint16 per shard


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
