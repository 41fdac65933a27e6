"""Writing: prepare() itself, which runs the plan through the encoder into each split's shard writer
(SplitWriter) and writes meta.json, the output folder appearing complete or not at all."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import numpy as np

from ...engine.ckpt.files import writing
from ...engine.errors import ConfigError, DataError
from ..chat import ChatTemplate
from ..tokenizer import load_tokenizer
from .encode import Conversation, encoded
from .options import Options, _check
from .pieces import Piece
from .sources import find_sources
from .split import Plan

FORMAT = 2  # 1: one train.bin and one val.bin (still read by data.py)


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


def prepare(paths: list[str], out: Path, options: Options, val_paths: list[str] = ()) -> dict:
    """Write the token shards and meta.json into out; return the meta."""
    with writing(out):  # a full disk or a read-only folder: one line, exit 1
        return _prepare(paths, out, options, list(val_paths))


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
