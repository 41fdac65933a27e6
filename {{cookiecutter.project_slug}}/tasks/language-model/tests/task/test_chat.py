"""Supervised fine-tuning on conversations: what is trained (masks by position, the end of turn
included), tokens as transformers' apply_chat_template gives them, packing without attention across
documents, and a step's loss normalised by its trained tokens over micro-batches and processes."""

import io
import json
import re
import sys

import numpy as np
import pytest

from {{ cookiecutter.package_name }}.engine.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task import generate as generate_module
from {{ cookiecutter.package_name }}.task.chat import CHATML, ChatTemplate, conversation_of, jinja
from {{ cookiecutter.package_name }}.task.generate import Chat, parse, read_tools
from {{ cookiecutter.package_name }}.task.generate import main as generate_main
from {{ cookiecutter.package_name }}.task.prepare import encode as prepare_encode
from {{ cookiecutter.package_name }}.task.tokenizer import ByteTokenizer, HFTokenizer

from hf_folders import CONVERSATION, arithmetic, bpe_tokenizer, style_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A conversation that calls a tool, as datasets often store one: tools and arguments as JSON strings.
TOOL_RECORD = {
    "tools": json.dumps([WEATHER]),
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "name": "get_weather", "content": '{"celsius": -3}'},
        {"role": "assistant", "content": "-3 C in Oslo."},
    ],
}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
TIME_RECORD = {  # a flat call ({name, arguments}) and a flat schema, objects rather than strings
    "tools": [CLOCK],
    "messages": [
        {"role": "user", "content": "time in UTC?"},
        {"role": "assistant", "content": "Asking.", "tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "Noon."},
    ],
}


def output_bytes(out) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def trained_text(template: ChatTemplate, messages: list[dict], train_on: str = "assistant", tools=None) -> list[str]:
    return [segment.text for segment in template.segments(messages, train_on, tools) if segment.trained]


def test_assistant_turns_and_their_end_of_turn_are_trained_and_nothing_else():
    """ChatML (the default): the system and user turns and each generation prompt are masked; each
    answer is trained with its <|im_end|>, not the line end after it; `last` and `all` as named; the
    pieces put together are the rendered conversation, and each prompt is a prefix of it."""
    template = ChatTemplate(CHATML)
    assert trained_text(template, CONVERSATION) == ["42<|im_end|>", "4<|im_end|>"]
    assert trained_text(template, CONVERSATION, "last") == ["4<|im_end|>"]
    text = template.render(CONVERSATION)
    assert trained_text(template, CONVERSATION, "all") == [text]
    assert "".join(s.text for s in template.segments(CONVERSATION)) == text
    prompt = template.render(CONVERSATION[:2], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt + "42<|im_end|>")
    assert template.end_of_turn() == "<|im_end|>"
    assert text == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nwhat is 17+25?<|im_end|>\n"
        "<|im_start|>assistant\n42<|im_end|>\n<|im_start|>user\nand 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )  # ChatML as documented (chat.py), what a run on a tokenizer without a template keeps in its tokenizer/


def test_tool_calls_are_trained_and_tool_results_masked_as_transformers_renders_them(tmp_path, capsys):
    """A record that offers a tool, calls it and reads its result: arguments and tools given as JSON strings
    reach the template as objects; the call (with its end of turn) and the final answer are trained, the
    tool's result is not; the ids equal transformers' apply_chat_template with tools=, and the prompt that
    asks for the call is a token prefix. A template without tool support is refused, not trained on a
    conversation with its calls missing."""
    transformers = pytest.importorskip("transformers")
    conversation = conversation_of(TOOL_RECORD, "chat.jsonl:1")
    messages, tools = conversation["messages"], conversation["tools"]
    assert tools == [WEATHER] and "content" not in messages[2]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    template = ChatTemplate(CHATML)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    assert trained_text(template, messages, tools=tools) == [call, "-3 C in Oslo.<|im_end|>"]
    text = template.render(messages, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and json.dumps(WEATHER) in text
    assert '<|im_start|>tool\n{"celsius": -3}<|im_end|>' in text

    folder = tmp_path / "tok"
    bpe_tokenizer(folder, tmp_path / "corpus.txt", chat_template=CHATML)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = HFTokenizer(folder / "tokenizer.json")
    ids = [i for segment in template.segments(messages, tools=tools) for i in ours.encode(segment.text)]
    assert ids == list(theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))
    asking = theirs.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=True, return_dict=False)
    assert ids[: len(asking)] == list(asking)

    plain = ChatTemplate(jinja("<% for m in messages %><< m['role'] >>: << m['content'] >>\n<% endfor %>"))
    with pytest.raises(DataError, match="does not write the tool 'get_weather': it has no tool support"):
        plain.segments(messages, tools=tools)
    # Writing the tools (which name the function too) does not stand in for writing the call, nor the reverse.
    calls = re.search(r"\{. for call in .*?endfor .\}", CHATML)[0]
    for kind, dropped in [("tool call", CHATML.replace(calls, "")), ("tool", re.sub(r"<tools>.*</tools>", "", CHATML))]:
        assert dropped != CHATML
        with pytest.raises(DataError, match=f"does not write the {kind} 'get_weather'"):
            ChatTemplate(dropped).segments(messages, tools=tools)
    source = tmp_path / "tools.jsonl"
    source.write_text(json.dumps(TOOL_RECORD) + "\n")
    (folder / "chat_template.jinja").write_text(plain.source)
    tokenizer = ["--tokenizer", str(folder / "tokenizer.json")]
    assert prepare_main(["--chat", *tokenizer, "--out", str(tmp_path / "out"), str(source)]) == 2
    assert f"error: {source}:1: the chat template (chat_template.jinja) does not write" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tool_records_are_put_in_the_shape_templates_read():
    """A flat call becomes {"type": "function", "function": {name, arguments}}; empty arguments are {}; a list
    of tools written as JSON strings is read; ChatML writes no empty system text before the tools."""
    conversation = conversation_of(TIME_RECORD, "x")
    assert conversation["messages"][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
    ]
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": ""}}]}
    record = {"tools": [json.dumps(CLOCK)], "messages": [{"role": "system", "content": ""}, call]}
    conversation = conversation_of(record, "x")
    assert conversation["messages"][1]["tool_calls"][0]["function"]["arguments"] == {}
    assert conversation["tools"] == [CLOCK]
    text = ChatTemplate(CHATML).render(conversation["messages"], tools=conversation["tools"])
    assert text.startswith("<|im_start|>system\nYou may call one or more functions.")


def test_prepare_chat_writes_masks_by_position_for_every_record_format(tmp_path):
    """messages, prompt/response and Alpaca records, with the bytes tokenizer: the mask marks exactly the
    answers' bytes and their end-of-turn marker; meta.json names the rule."""
    records = [
        {"messages": CONVERSATION},
        {"prompt": "what is 1+1?", "response": "2"},
        {"instruction": "Add.", "input": "3+4", "output": "7"},
        {"instruction": "Say hi.", "output": "hi"},
    ] * 5
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "out"
    assert prepare_main(["--chat", "--out", str(out), str(source)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["chat"] == {
        "template": "chatml", "train_on": "assistant", "end_of_turn": "<|im_end|>", "max_tokens": None,
        "too_long": "dropped", "dropped": {"train": 0, "val": 0}, "truncated": {"train": 0, "val": 0},
    }  # fmt: skip
    tokens = np.fromfile(out / "train_000000.bin", dtype=np.uint16)
    mask = np.fromfile(out / "train_000000.mask", dtype=np.uint8)
    ends = np.fromfile(out / "train_ends.bin", dtype=np.int64)
    assert len(ends) == meta["train"]["documents"] and ends[-1] == len(tokens) == len(mask)
    answers = []
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        doc, trained = tokens[start:end], mask[start:end].astype(bool)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], trained, [0]])))
        spans = zip(edges[::2], edges[1::2], strict=True)
        answers.append(tuple(bytes(doc[a:b].astype(np.uint8)).decode() for a, b in spans))
    expected = {("42<|im_end|>", "4<|im_end|>"), ("2<|im_end|>",), ("7<|im_end|>",), ("hi<|im_end|>",)}
    assert set(answers) == expected
    assert meta["train"]["trained_tokens"] == int(mask.sum())


def test_too_long_conversations_are_dropped_or_truncated_after_an_answer_that_fits(tmp_path, capsys):
    """--max-tokens N: a longer conversation is dropped (the default) or, --too-long truncate, cut after
    its last answer that ends within N tokens: the tokens, mask and bytes of its first turns as rendered,
    the answer's end of turn included; one whose first answer does not fit is dropped. meta.json and the
    summary line count both. Without --chat, --max-tokens is refused, and truncate without --max-tokens."""
    template = ChatTemplate(CHATML)
    first = template.render(CONVERSATION[:3]).rstrip()  # through the first answer's <|im_end|>
    full = template.render(CONVERSATION)
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    late = [{"role": "user", "content": "x" * 99}, *CONVERSATION[2:]]  # its first answer ends too late
    source, val = tmp_path / "chat.jsonl", tmp_path / "val.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (CONVERSATION, short, late)))
    val.write_text(json.dumps({"messages": short}) + "\n")
    limit = len(first) + 5  # the bytes tokenizer: a token a byte
    assert len(first) < limit < len(full) and len(template.render(late[:2], add_generation_prompt=True)) > limit
    for rule in ("drop", "truncate"):
        out = tmp_path / rule
        common = ["--max-tokens", str(limit), "--too-long", rule, "--val-files", str(val)]
        assert prepare_main(["--chat", *common, "--out", str(out), str(source)]) == 0
        meta = json.loads((out / "meta.json").read_text())
        chat, train = meta["chat"], meta["train"]
        text = np.fromfile(out / "train_000000.bin", dtype=np.uint16).astype(np.uint8).tobytes().decode()
        mask = np.fromfile(out / "train_000000.mask", dtype=np.uint8)
        assert chat["too_long"] == {"drop": "dropped", "truncate": "truncated"}[rule]
        if rule == "drop":
            assert (chat["dropped"]["train"], chat["truncated"]["train"]) == (2, 0)
            assert text == template.render(short)
        else:
            assert (chat["dropped"]["train"], chat["truncated"]["train"]) == (1, 1)
            assert text == first + template.render(short)  # in file order
            assert train["bytes"] == len(text) and np.fromfile(out / "train_ends.bin", dtype=np.int64)[0] == len(first)
            assert int(mask.sum()) == len("42<|im_end|>") + len("hello<|im_end|>")
    assert "longer than --max-tokens: 1 dropped, 1 truncated" in capsys.readouterr().out
    assert prepare_main(["--max-tokens", "9", "--out", str(tmp_path / "text"), str(source)]) == 2
    assert "use them with --chat" in capsys.readouterr().err
    assert prepare_main(["--chat", "--too-long", "truncate", "--out", str(tmp_path / "no_n"), str(source)]) == 2
    assert "--too-long truncate cuts conversations longer than --max-tokens N: name N" in capsys.readouterr().err


def test_jsonl_parquet_and_datasets_conversations_give_the_same_tokens_and_masks(tmp_path):
    """The same conversations as JSON lines, a Parquet file (messages a list of structs: every message has
    every field, null where it had none) and a datasets folder (validation ones named by --val-files),
    two of them calling tools (Arrow fills their arguments' and schemas' missing fields with null), write the
    same tokens, masks and conversation ends."""
    pa, pq, datasets = (pytest.importorskip(name) for name in ("pyarrow", "pyarrow.parquet", "datasets"))
    datasets.disable_progress_bars()
    # Two tool conversations whose arguments and tools differ in their fields: Arrow merges the structs and
    # fills each one's missing fields with null. First: pyarrow takes a table's columns from its first row.
    calls = [conversation_of(TOOL_RECORD, "x"), conversation_of(TIME_RECORD, "x")]
    splits = {"train": [*calls, {"messages": CONVERSATION}, *arithmetic(30, 4)], "val": arithmetic(6, 5)}
    for split, records in splits.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{split}.parquet", row_group_size=7)
        datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / f"{split}_dataset"))
    written = {}
    for kind in (".jsonl", ".parquet", "_dataset"):
        out = tmp_path / f"out{kind}"
        inputs = [str(tmp_path / f"train{kind}"), "--val-files", str(tmp_path / f"val{kind}")]
        assert prepare_main(["--chat", "--out", str(out), *inputs]) == 0
        written[kind] = {name: data for name, data in output_bytes(out).items() if name != "meta.json"}
    assert written[".parquet"] == written[".jsonl"] == written["_dataset"]
    assert {"train_000000.mask", "val_000000.mask", "train_ends.bin"} <= set(written[".jsonl"])


def test_ids_equal_transformers_apply_chat_template_and_bos_is_not_doubled(tmp_path, monkeypatch):
    """With a BPE tokenizer.json whose tokenizer_config.json holds a chat template, prepare --chat writes
    a multi-turn conversation's ids (each span tokenized on its own) as transformers' apply_chat_template
    gives them, with 1 worker or 2 (in jobs of ~1 kB: they take turns) byte for byte; a template that
    writes bos_token under a tokenizer that would add one too gives one BOS."""
    transformers = pytest.importorskip("transformers")
    from tokenizers.processors import TemplateProcessing

    folder = tmp_path / "tok"
    bpe_tokenizer(folder, tmp_path / "corpus.txt", chat_template=CHATML)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = HFTokenizer(folder / "tokenizer.json")
    template = ChatTemplate.of(ours)
    assert template.origin in ("chat_template.jinja", "tokenizer_config.json")
    ids = [i for segment in template.segments(CONVERSATION) for i in ours.encode(segment.text)]
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ids == list(expected)

    monkeypatch.setattr(prepare_encode, "JOB", 1000)
    source, val = tmp_path / "chat.jsonl", tmp_path / "val.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [{"messages": CONVERSATION}, *arithmetic(60, 1)]))
    val.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(10, 2)))
    common = ["--chat", "--tokenizer", str(folder / "tokenizer.json"), str(source), "--val-files", str(val)]
    for workers in ("1", "2"):
        assert prepare_main(["--workers", workers, "--out", str(tmp_path / workers), *common]) == 0
    assert output_bytes(tmp_path / "1") == output_bytes(tmp_path / "2")
    written = np.fromfile(tmp_path / "1" / "train_000000.bin", dtype=np.uint16)
    assert written[: len(ids)].tolist() == ids
    prompt = theirs.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[: len(prompt)] == list(prompt)  # the prompt is a token prefix of the conversation

    # A BOS that the template writes and the tokenizer's post-processor would add again.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    bos = ours.tokenizer.token_to_id("<|endoftext|>")
    adds_bos = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    ours.tokenizer.post_processor = adds_bos
    marker = "{" + "{ bos_token }" + "}"
    with_bos = ChatTemplate(marker + CHATML, {"bos_token": "<|endoftext|>"})
    ids = [i for segment in with_bos.segments(CONVERSATION) for i in ours.encode(segment.text)]
    assert ids[0] == bos and ids.count(bos) == 1


# ChatML that marks each answer for transformers' return_assistant_tokens_mask, and writes an assistant's
# reasoning (as Qwen3's template does) in <think> before its content.
MARKED = jinja(
    "<% for m in messages %><<'<|im_start|>' + m['role'] + '\\n'>><% if m['role'] == 'assistant' %><% generation %>"
    "<% if m['reasoning_content'] %><<'<think>' + m['reasoning_content'] + '</think>'>><% endif %>"
    "<<m['content'] + '<|im_end|>'>><% endgeneration %><<'\\n'>><% else %><<m['content'] + '<|im_end|>\\n'>>"
    "<% endif %><% endfor %><% if add_generation_prompt %><<'<|im_start|>assistant\\n'>><% endif %>"
)


@pytest.mark.parametrize("style", ["bpe", "metaspace-first", "gemma"])
def test_generation_blocks_render_and_the_mask_equals_transformers_assistant_mask(style, tmp_path):
    """A template with generation blocks (which the Jinja of transformers knows) renders, and the mask made
    by position equals transformers' return_assistant_tokens_mask, token for token, under a byte-level BPE
    and the SentencePiece styles whose own tokenization spells the text (Metaspace first, Gemma's); an
    assistant's reasoning given as `reasoning` reaches the template as reasoning_content and is trained."""
    transformers = pytest.importorskip("transformers")
    record = {"messages": [*CONVERSATION[:4], {"role": "assistant", "content": "4", "reasoning": "2 and 2"}]}
    messages = conversation_of(record, "x")["messages"]
    template = ChatTemplate(MARKED)
    assert trained_text(template, messages) == ["42<|im_end|>", "<think>2 and 2</think>4<|im_end|>"]
    folder = tmp_path / "tok"
    if style == "bpe":
        bpe_tokenizer(folder, tmp_path / "corpus.txt", chat_template=MARKED)
    else:
        corpus = [template.render(m) for m in [messages, *(r["messages"] for r in arithmetic(40, 0))]]
        style_tokenizer(style, folder, corpus, MARKED, {"eos_token": "<|im_end|>"})
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = HFTokenizer(folder / "tokenizer.json")
    segments = template.segments(messages)
    encoded = zip(ours.encode_spans([[segment.text for segment in segments]])[0], segments, strict=True)
    encoded = [(ids, segment.trained) for ids, segment in encoded]
    expected = theirs.apply_chat_template(record["messages"], return_assistant_tokens_mask=True, return_dict=True)
    assert [i for ids, _ in encoded for i in ids] == expected["input_ids"]
    assert [int(trained) for ids, trained in encoded for _ in ids] == expected["assistant_masks"]


def test_a_template_that_drops_earlier_reasoning_trains_the_last_turn_only_on_request():
    """A template that writes an assistant's reasoning in its last turn only (as Qwen3's does) renders an
    earlier answer differently once a later turn follows: --train-on assistant is refused in one line that
    names --train-on last, which trains the last answer with its reasoning."""
    forgets = MARKED.replace("m['reasoning_content'] %", "m['reasoning_content'] and loop.last %")
    assert forgets != MARKED
    messages = [dict(m, reasoning="think") if m["role"] == "assistant" else m for m in CONVERSATION]
    messages = conversation_of({"messages": messages}, "x")["messages"]
    template = ChatTemplate(forgets)
    with pytest.raises(DataError, match="does not render turn 2 as a continuation") as raised:
        template.segments(messages)
    assert "use --train-on last (or all)" in str(raised.value) and "\n" not in str(raised.value)
    assert trained_text(template, messages, "last") == ["<think>think</think>4<|im_end|>"]


def calling(call: dict) -> dict:
    return {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "hi"}, "no conversation (it has 'text')"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "role 'bot'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
        ({"prompt": "x", "response": 3}, "must be text"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}]}, "on an assistant message"),
        (calling({"arguments": {}}), "call 0 has no function name"),
        (calling({"name": " ", "arguments": {}}), "call 0 has no function name"),
        (calling({"name": "f", "arguments": "{oops"}), "arguments is a string that is not JSON"),
        (calling({"name": "f", "arguments": "[1]"}), "arguments are list, not an object"),
        (calling({"name": "f", "arguments": '"{}"'}), "arguments are str, not an object"),  # JSON written twice
        (calling({"name": "f", "arguments": {"x": float("nan")}}), "a value JSON cannot write"),
        ({"tools": 0, "messages": CONVERSATION}, "'tools' must be a list of function schemas, not int"),
        ({"tools": {"name": "f"}, "messages": CONVERSATION}, "'tools' must be a list of function schemas"),
        ({"messages": [{"role": "assistant", "content": {"a": 1}}]}, "content is dict, not text"),
    ],
)
def test_bad_records_are_one_line_errors(record, message):
    with pytest.raises(DataError) as raised:
        conversation_of(record, "chat.jsonl:1")
    assert str(raised.value).startswith("chat.jsonl:1: ") and message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_chat_prompts_as_training_cut_them_and_answers_stop_at_the_end_of_turn():
    """generate --chat's prompt ids are those the conversation's training ids start with (the generation
    prompt included), and the answer ends at the end-of-turn marker, without it."""
    prompts = []

    def sampler(prompt, stop):
        prompts.append(prompt)
        out = []
        for byte in b"4<|im_end|>\nand on":
            out.append(byte)
            if stop(out):
                break
        return out

    chat = Chat(ByteTokenizer(), sampler)
    assert chat.answer(CONVERSATION[:4]) == "4"
    segments = ChatTemplate(CHATML).segments(CONVERSATION)
    training = [i for segment in segments for i in ByteTokenizer().encode(segment.text)]
    assert training[: len(prompts[0])] == prompts[0]
    assert bytes(training[len(prompts[0]) :]).decode() == "4<|im_end|>\n"


def test_generate_tools_offers_the_functions_as_training_rendered_them(tmp_path, monkeypatch, capsys):
    """generate --chat --tools FILE, turns from stdin: the prompt ids are those the tool conversation's
    training ids start with (the tools in the system turn); the call is printed as the model writes it; a
    "tool: " line is the tool's result, and the prompt that asks for the final answer is the training ids'
    prefix too. A --tools file that is not a list of named functions, or --tools without --chat, is a
    one-line error."""
    prompts = []
    messages, tools = (conversation_of(TOOL_RECORD, "x")[key] for key in ("messages", "tools"))
    segments = ChatTemplate(CHATML).segments(messages, tools=tools)
    training = [i for segment in segments for i in ByteTokenizer().encode(segment.text)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    answers = iter([call, "-3 C in Oslo."])

    def sampler(prompt, stop):
        prompts.append(prompt)
        out = []
        for byte in (next(answers) + "<|im_end|>\nand on").encode():
            out.append(byte)
            if stop(out):
                break
        return out

    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER]))
    monkeypatch.setattr(generate_module, "_sampler", lambda rest, options: (ByteTokenizer(), sampler))
    monkeypatch.setattr(sys, "stdin", io.StringIO('weather in Oslo?\ntool: {"celsius": -3}\n'))
    assert generate_main(["--chat", "--system", "Be brief.", "--tools", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [*call.splitlines(), "-3 C in Oslo."]
    for prompt in prompts:
        assert training[: len(prompt)] == prompt
    asked_for = [bytes(training[len(prompt) :]).decode() for prompt in prompts]
    assert asked_for[0].startswith(call + "<|im_end|>") and asked_for[1] == "-3 C in Oslo.<|im_end|>\n"

    for content, message in [("{", "not JSON"), ('{"name": "f"}', "a list of function schemas")]:
        path.write_text(content)
        with pytest.raises(ConfigError, match=message):
            read_tools(str(path))
    with pytest.raises(ConfigError, match="use it with --chat"):
        parse(["--tools", str(path)])
