"""The command line: python -m PACKAGE.prepare (its text is the package's docstring)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...engine import PACKAGE, cli
from ..chat import TRAIN_ON
from .options import SHARD_TOKENS, TOO_LONG, Options
from .shards import prepare


def main(argv: list[str] | None = None) -> int:
    usage = sys.modules[__package__].__doc__  # the command's text: the package's docstring
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.prepare", description=usage.split("\n\n")[0])
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
