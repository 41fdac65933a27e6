"""Conversations tokenize to the chat template's exact text with every tokenizer style checkpoints
ship (byte-level BPE with and without a prefix space, SentencePiece-style Metaspace, the legacy Llama
normalizer, Gemma's), each built here with `tokenizers` and read back by `transformers`: no "▁" or
space before an answer or after an end of turn, the trained tokens spell the answers, and the first
answer (and the one --train-on last trains) follows its generation prompt's own ids."""

import json

import numpy as np
import pytest

from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task.chat import CHATML, ChatTemplate
from {{ cookiecutter.package_name }}.task.generate import Chat
from {{ cookiecutter.package_name }}.task.tokenizer import HFTokenizer

from hf_folders import CHATML_SPECIAL, CONVERSATION, STYLES, TEMPLATES, style_tokenizer

# Turns that trip tokenizers up: a space or a line end first, indented code, accents and an emoji (bytes
# under a SentencePiece vocabulary), several answers.
CONVERSATIONS = [
    CONVERSATION,
    [{"role": "user", "content": "Say hi in French."}, {"role": "assistant", "content": "Salut ! Ça va ? 👋"}],
    [
        {"role": "user", "content": "  a function, please"},
        {"role": "assistant", "content": "def one():\n    return 1\n"},
        {"role": "user", "content": "and a line first?"},
        {"role": "assistant", "content": "\nSure: one line."},
        {"role": "user", "content": "a space first?"},
        {"role": "assistant", "content": " Done."},
    ],
]
# Styles whose own tokenization of a rendered text spells it (no prefix after special tokens): there
# transformers' apply_chat_template gives the same prompt ids.
NATIVELY_EXACT = ("gpt2", "qwen2", "llama3", "metaspace-first", "gemma")
CASES = [*STYLES.items(), ("metaspace-first", "chatml"), ("gemma", "chatml")]


def template_of(name: str) -> tuple[str, dict]:
    return (CHATML, CHATML_SPECIAL) if name == "chatml" else TEMPLATES[name]


def corpus(template: ChatTemplate) -> list[str]:
    """What a style's tokenizer is trained on: the conversations rendered, some prose, paragraphs."""
    prose = "The quick brown fox jumps over the lazy dog; what is 12+30? It is 42.\n\n\n" * 20
    return [prose, *(template.render(messages) for messages in CONVERSATIONS * 10)]


def prepared(out, tokenizer_json, source, val, train_on="assistant") -> list[tuple[np.ndarray, np.ndarray]]:
    arguments = ["--chat", "--train-on", train_on, "--tokenizer", str(tokenizer_json), "--out", str(out)]
    assert prepare_main([*arguments, str(source), "--val-files", str(val)]) == 0
    tokens = np.fromfile(out / "train_000000.bin", dtype=np.uint16).astype(np.int64)
    mask = np.fromfile(out / "train_000000.mask", dtype=np.uint8).astype(bool)
    ends = np.fromfile(out / "train_ends.bin", dtype=np.int64)
    return [(tokens[a:b], mask[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def trained_spans(ids: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@pytest.mark.parametrize(("style", "template_name"), CASES)
def test_every_tokenizer_style_spells_the_templates_exact_text(style, template_name, tmp_path):
    """prepare --chat under each tokenizer style: transformers decodes each conversation's ids to exactly
    the text the template renders; the trained tokens spell each answer with its end of turn, nothing
    else; the ids before the first answer, and before the answer --train-on last trains, are its
    generation prompt tokenized alone (transformers' own ids where the style is natively exact), and
    generate --chat's prompt ids are those training starts with."""
    transformers = pytest.importorskip("transformers")
    source, special = template_of(template_name)
    template = ChatTemplate(source, special)
    tokenizer_json = style_tokenizer(style, tmp_path / "tok", corpus(template), source, special)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = HFTokenizer(tokenizer_json)
    records, val = tmp_path / "chat.jsonl", tmp_path / "val.jsonl"
    records.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    val.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")

    def alone(text: str) -> list[int]:
        return ours.encode_spans([[text]])[0][0]

    def spelled(ids: np.ndarray, start: int, end: int) -> str:
        """What ids[start:end] spell where they stand (a SentencePiece decoder strips a piece's leading space)."""
        before = theirs.decode(ids[:start].tolist(), skip_special_tokens=False)
        return theirs.decode(ids[:end].tolist(), skip_special_tokens=False).removeprefix(before)

    conversations = prepared(tmp_path / "assistant", tokenizer_json, records, val)
    lasts = prepared(tmp_path / "last", tokenizer_json, records, val, train_on="last")
    for messages, (ids, mask), (last_ids, last_mask) in zip(CONVERSATIONS, conversations, lasts, strict=True):
        assert theirs.decode(ids.tolist(), skip_special_tokens=False) == template.render(messages)
        answers = [s.text for s in template.segments(messages) if s.trained]
        spans = trained_spans(ids, mask)
        assert [spelled(ids, a, b) for a, b in spans] == answers

        turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        first = template.render(messages[: turns[0]], add_generation_prompt=True)
        assert ids[: spans[0][0]].tolist() == alone(first)
        if style in NATIVELY_EXACT:
            asked = messages[: turns[0]]
            assert alone(first) == theirs.apply_chat_template(asked, add_generation_prompt=True, return_dict=False)
        assert theirs.decode(last_ids.tolist(), skip_special_tokens=False) == template.render(messages)
        ((start, end),) = trained_spans(last_ids, last_mask)
        assert last_ids[:start].tolist() == alone(template.render(messages[: turns[-1]], add_generation_prompt=True))
        assert spelled(last_ids, start, end) == answers[-1]

        asked = []
        Chat(ours, lambda prompt, stop, asked=asked: asked.append(prompt) or []).answer(messages[: turns[-1]])
        assert asked[0] == ids[: len(asked[0])].tolist() and mask[len(asked[0])]


def test_a_tokenizer_that_changes_text_is_refused_in_one_line(tmp_path, capsys):
    """A tokenizer whose normalizer lowercases cannot give the template's text back: prepare --chat exits
    2 with one line naming the tokenizer, the conversation and the first characters that differ."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, normalizers

    template = ChatTemplate(CHATML, CHATML_SPECIAL)
    tokenizer_json = style_tokenizer("gpt2", tmp_path / "tok", corpus(template), CHATML, CHATML_SPECIAL)
    lowered = Tokenizer.from_file(str(tokenizer_json))
    lowered.normalizer = normalizers.Lowercase()
    lowered.save(str(tokenizer_json))
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    arguments = ["--chat", "--tokenizer", str(tokenizer_json), "--out", str(tmp_path / "out"), str(source)]
    assert prepare_main(arguments) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"chat.jsonl:1: the tokenizer {tokenizer_json} does not give the chat template's text back" in err[0]
    assert "the template wrote 'You add numbers.<|im', its tokens spell 'you add numbers.<|im'" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_json_in_the_older_metaspace_format_tokenizes_alike(tmp_path):
    """A tokenizer.json written before prepend_scheme existed (Metaspace with add_prefix_space, as many
    downloaded Llama-family folders have it) gives the same ids, the conversation's start prefix included,
    as the same tokenizer in today's format (prepend_scheme always, split)."""
    pytest.importorskip("transformers")
    template = ChatTemplate(CHATML, CHATML_SPECIAL)
    path = style_tokenizer("metaspace-always", tmp_path / "tok", corpus(template), CHATML, CHATML_SPECIAL)
    config = json.loads(path.read_text())
    metaspace = {"type": "Metaspace", "replacement": "▁"}
    assert config["pre_tokenizer"] == {**metaspace, "prepend_scheme": "always", "split": True}
    config["pre_tokenizer"] = {**metaspace, "add_prefix_space": True}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "tokenizer.json").write_text(json.dumps(config))
    texts = [[s.text for s in template.segments(m)] for m in CONVERSATIONS] + [["Salut ! ", "Ça va ?"]]
    today, older = HFTokenizer(path), HFTokenizer(tmp_path / "old" / "tokenizer.json")
    assert older.encode_spans(texts) == today.encode_spans(texts)
    first = today.encode_spans([["Salut"]])[0][0][0]
    assert today.tokenizer.id_to_token(first).startswith("▁")  # the text's start keeps SentencePiece's prefix
    assert older.spelled([[i for piece in pieces for i in piece] for pieces in older.encode_spans(texts)]) == [
        "".join(pieces) for pieces in texts
    ]
