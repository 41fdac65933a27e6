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

What lives where:

    sources     finding the inputs, and reading documents out of each format (text, --doc-sep, .jsonl(.gz),
                .parquet, datasets folders)
    pieces      long texts in pieces of about PIECE bytes cut after line ends; where the tail rule cuts
    split       the split rules (files, tail, hash) and the Plan: each document's split, the pieces in order
    encode      pieces to token ids (conversations with their trained mask), in --workers processes
    shards      prepare(): the shard writer (SplitWriter) and meta.json
    options     Options, one field per flag, and their checks
    cli         the command line (main)
"""

from .cli import main
from .options import Options
from .shards import prepare
from .split import goes_to_val

__all__ = ["Options", "goes_to_val", "main", "prepare"]
