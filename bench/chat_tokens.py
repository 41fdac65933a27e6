"""Conversations as token ids, three ways, for each tokenizer style checkpoints ship and each
family's chat template: what the ids spell, and what each answer is trained after.

    python bench/chat_tokens.py [--project DIR --package NAME] [--conversations 60]

The tokenizers are made here with `tokenizers` (BPE of 600 tokens trained on other conversations
and some prose; hf_folders.STYLES of the baked project's tests: byte-level with and without a
prefix space, GPT-2's, Qwen2's and Llama 3's pre-tokenizers, Metaspace with prepend_scheme first
and always, the legacy Llama normalizer, Gemma's) and read back by `transformers`. The
conversations: 1 to 3 answers each, some with a system turn, turns that start with a space or a
line end, code, accents, an emoji.
The ways:

- pieces (before): each piece of the cut text (prompt, answer, ...) through the tokenizer's own
  encode, as prepare --chat did before: every piece gets the prefix a text's start gets;
- whole text: the rendered text tokenized at once, with no prefix but at its start;
- pieces: each piece on its own with no prefix but at the text's start (prepare --chat today).

Figures per style x template x way: conversations whose ids spell the rendered text exactly (decoded
by transformers, special tokens kept); conversations whose ids equal transformers'
apply_chat_template(tokenize=True); answers whose preceding ids equal their generation prompt
tokenized alone, the same way (as generate --chat does), and as transformers' apply_chat_template
(add_generation_prompt=True) tokenizes it. Prints a table; writes bench/results/chat_tokens.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "answer",
    "sum",
    "total",
    "café",
    "naïve",
    "why",
    "how",
]
WAYS = ("pieces (before)", "whole text", "pieces")


def sentence(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))).capitalize()
    end = rng.choice([".", "?", " 🙂", ":\n\n    x = 1", ""])
    return rng.choice(["", "Sure! ", " ", "\n"]) + words + end


def conversations(count: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            asked = rng.choice([f"what is {a}+{b}?", sentence(rng)])
            messages.append({"role": "user", "content": asked})
            messages.append(
                {"role": "assistant", "content": rng.choice([str(a + b), sentence(rng)])}
            )
        out.append(messages)
    return out


def measure(package: str, helpers, style: str, template_name: str, measured: list, folder: Path):
    import transformers

    chat = importlib.import_module(f"{package}.task.chat")
    tokenizer_module = importlib.import_module(f"{package}.task.tokenizer")
    if template_name == "chatml":
        source, special = chat.CHATML, helpers.CHATML_SPECIAL
    else:
        source, special = helpers.TEMPLATES[template_name]
    template = chat.ChatTemplate(source, special)
    prose = "The quick brown fox jumps over the lazy dog; what is 12+30? It is 42.\n\n\n" * 20
    corpus = [prose, *(template.render(messages) for messages in conversations(200, 7))]
    path = helpers.style_tokenizer(style, folder, corpus, source, special)
    ours = tokenizer_module.HFTokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))

    def ids_of(way: str, pieces: list[str]) -> list[int]:
        if way == "pieces (before)":
            return [i for piece in pieces for i in ours.encode(piece)]
        joined = ["".join(pieces)] if way == "whole text" else pieces
        return [i for ids in ours.encode_spans([joined])[0] for i in ids]

    counted = ("exact", "transformers", "after_prompt", "after_their_prompt")
    figures = {way: dict.fromkeys(counted, 0) for way in WAYS}
    answers = 0
    for messages in measured:
        pieces = [segment.text for segment in template.segments(messages)]
        text = "".join(pieces)
        their_ids = list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False))
        turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        answers += len(turns)
        for way in WAYS:
            ids = ids_of(way, pieces)
            counts = figures[way]
            counts["exact"] += theirs.decode(ids, skip_special_tokens=False) == text
            counts["transformers"] += ids == their_ids
            for turn in turns:
                prompt = template.render(messages[:turn], add_generation_prompt=True)
                alone = ids_of(way, [prompt])
                their_prompt = theirs.apply_chat_template(
                    messages[:turn], add_generation_prompt=True, return_dict=False
                )
                counts["after_prompt"] += ids[: len(alone)] == alone
                counts["after_their_prompt"] += ids[: len(their_prompt)] == list(their_prompt)
    return {"conversations": len(measured), "answers": answers, "ways": figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=60)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "chat_tokens.json")
    sys.path.insert(0, str(HERE))
    from run import add_project_options, command_line, lm_project

    add_project_options(parser)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        project, package = lm_project(args, Path(tmp))
        sys.path[:0] = [str(project / "src"), str(project / "tests" / "task")]
        helpers = importlib.import_module("hf_folders")
        measured = conversations(args.conversations, 1)
        templates = ["chatml", *helpers.TEMPLATES]
        for style in helpers.STYLES:
            for template_name in templates:
                folder = Path(tmp) / f"{style}-{template_name}"
                row = {"style": style, "template": template_name}
                row |= measure(package, helpers, style, template_name, measured, folder)
                rows.append(row)
                print(line(row), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": command_line("chat_tokens.py", args), "rows": rows}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def line(row: dict) -> str:
    """A row of the table: per way, exact conversations, answers after their prompt."""
    cells = []
    for way, counts in row["ways"].items():
        cells.append(
            f"{way}: exact {counts['exact']}/{row['conversations']}, "
            f"= transformers {counts['transformers']}, "
            f"after own prompt {counts['after_prompt']}/{row['answers']} "
            f"(transformers' {counts['after_their_prompt']})"
        )
    return f"{row['style']:17} {row['template']:7} " + " | ".join(cells)


if __name__ == "__main__":
    sys.exit(main())
