"""Conversations for supervised fine-tuning: records to messages, messages to text through the
tokenizer's chat template, and which tokens of that text are trained.

A record is a conversation, `messages` (a list of {role, content}, roles system, user, assistant
and tool, any number of turns), or one exchange: `prompt` and `response`, or Alpaca's
`instruction`, `input` (optional) and `output`. A conversation may call tools as transformers'
chat templates expect it: an assistant message's `tool_calls` (a list of {"type": "function",
"function": {"name", "arguments"}}; flat {"name", "arguments"} calls are put in that shape; its
content may then be empty), the results as `tool` messages, and the functions on offer as the
record's `tools` (JSON schemas). A message's other fields (name, tool_call_id, ...) reach the
template as given; null fields are left out (from Parquet and datasets rows, whose structs hold
every field of their column, at every depth), and `arguments` or `tools` written as JSON strings
are read as the JSON they hold: arguments must be an object (the templates write it with tojson; a
string would be written quoted). The template must write every call and every tool it is given:
one that leaves them out (one without tool support) is refused, never trained on a conversation
with its calls missing. An assistant's reasoning, under any of reasoning_content, thinking or
reasoning, reaches the template under the first two as well (as transformers passes it); it is part
of the answer and trained.

The chat template is the tokenizer's (chat_template.jinja, or tokenizer_config.json's
chat_template), rendered as transformers renders it (a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, its tojson, raise_exception and strftime_now, generation blocks,
and the special tokens as variables); a tokenizer without one gets ChatML (CHATML below, Qwen2's
and SmolLM2's format):

    <|im_start|>user
    What is 2+3?<|im_end|>
    <|im_start|>assistant
    5<|im_end|>

with tools in the Hermes format Qwen2.5 uses: the functions in the system turn, one JSON schema a
line between <tools> and </tools>; each call in the assistant's turn, after its content, as
<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> on lines of its own; a result as a
turn of role tool (Qwen2.5 writes results in a user turn, in <tool_response> tags).

Which text is trained (--train-on): `assistant` (the default) trains every assistant turn, `last`
the last one, `all` every token. An assistant turn's trained text runs from the end of the prompt
that asks for it (the conversation before it, rendered with the generation prompt) to the end of
the conversation rendered up to and including it, without trailing whitespace: its content and the
end-of-turn marker the template writes after it (ChatML's <|im_end|>, Llama 3's <|eot_id|>), never
the next turn's header. The mask is made by position in the text, never by token id (SmolLM2's
padding id is its end-of-turn id).

Each piece of the text cut this way (the text before an answer, the answer with its end of turn, ...)
is tokenized on its own and the ids joined (tokenizer.encode_spans), with no prefix put before a
piece: SentencePiece-style tokenizers (Metaspace, the legacy Llama normalizer) put a "▁" before each
text they are given, some byte-level ones a space; only the conversation's start gets it, as a text
tokenized alone does, where no special token comes first and the decoder takes it away again. So:

- the ids spell exactly the rendered text (prepare checks each conversation and refuses, in one line,
  a tokenizer that changes text), for byte-level BPE with or without a prefix space, Metaspace with
  prepend_scheme first or always, the legacy Llama normalizer and Gemma's;
- no token straddles an answer's edges: the trained tokens spell each answer and its end of turn,
  nothing else;
- the ids before the first answer are its generation prompt tokenized alone (as generate --chat and
  an inference server tokenize it), always, and so are the ids before the one trained answer under
  --train-on last; a later answer follows its own prompt's ids unless a token of that prompt, tokenized
  whole, would cross an earlier answer's edge (an answer that starts with a line end, after a
  template's line end, under a tokenizer that merges the two).

Tokenizing the whole text at once instead would give transformers' apply_chat_template ids (where the
tokenizer puts no prefix after special tokens) but lose the third point wherever a token crosses an
answer's start, e.g. Llama 3's "\n\n" before each answer under a GPT-2-style pre-tokenizer, which splits
it from the answer as two "\n" tokens. Both ways are measured, tokenizer style by template, in
bench/chat_tokens.py. Special tokens are added by the template alone (bos_token where it writes one),
never by the tokenizer as well: no doubled BOS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime

from ..engine.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "all", "last")
REASONING = ("reasoning_content", "thinking", "reasoning")  # an assistant's reasoning, by the names datasets use

# ChatML, for tokenizers without a chat template. Jinja's delimiters are spelled <% %> and << >> here
# and put back below (this file is itself the output of a template engine that reads the real ones).
_CHATML = (
    "<% if tools %><<'<|im_start|>system\\n'>><% if messages[0]['role'] == 'system' and messages[0]['content'] %>"
    "<<messages[0]['content'] + '\\n\\n'>><% endif %><<'You may call one or more functions. Each call is a JSON "
    "object with the name and arguments, inside <tool_call></tool_call> tags. The functions:\\n<tools>'>>"
    "<% for tool in tools %><<'\\n' + tool | tojson>><% endfor %><<'\\n</tools><|im_end|>\\n'>><% endif %>"
    "<% for message in messages %><% if not (tools and loop.first and message['role'] == 'system') %>"
    "<<'<|im_start|>' + message['role'] + '\\n'>><% if message['content'] %><<message['content']>><% endif %>"
    "<% for call in message['tool_calls'] or [] %><% set function = call['function'] if call['function'] is defined "
    "else call %><% if message['content'] or not loop.first %><<'\\n'>><% endif %><<'<tool_call>\\n' + "
    "{'name': function['name'], 'arguments': function['arguments']} | tojson + '\\n</tool_call>'>><% endfor %>"
    "<<'<|im_end|>\\n'>><% endif %><% endfor %><% if add_generation_prompt %><<'<|im_start|>assistant\\n'>><% endif %>"
)
_DELIMITERS = {"<%": "{" + "%", "%>": "%" + "}", "<<": "{" + "{", ">>": "}" + "}"}


def jinja(spelled: str) -> str:
    """Jinja source from its spelling with <% %> and << >>."""
    return re.sub("<%|%>|<<|>>", lambda found: _DELIMITERS[found[0]], spelled)


CHATML = jinja(_CHATML)


def conversation_of(record: object, where: str, columns: bool = False) -> dict:
    """The conversation a record holds: {"messages": [{"role", "content", ...}, ...]} with an assistant turn,
    and "tools" when it offers any. columns: a Parquet or datasets row, whose structs hold every field of
    their column (null where a record had none): nulls are left out at every depth."""
    if columns:
        record = _without_nulls(record)
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of objects with role and content")
        out = [_message(message, index, where) for index, message in enumerate(messages)]
    elif {"prompt", "response"} <= record.keys():
        out = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    elif {"instruction", "output"} <= record.keys():
        extra = record.get("input") or ""
        prompt = f"{record['instruction']}\n\n{extra}" if extra else record["instruction"]
        out = [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    else:
        fields = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where}: no conversation (it has {fields}); --chat reads 'messages', 'prompt' and 'response', "
            "or 'instruction', 'input' and 'output'"
        )
    if not all(isinstance(m.get("content", ""), str) for m in out):
        raise DataError(f"{where}: prompt and response must be text")
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant turn, nothing to train")
    conversation = {"messages": out}
    tools = _tools(record.get("tools"), where)
    if tools:
        conversation["tools"] = tools
    try:
        json.dumps(conversation, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise DataError(f"{where}: the conversation holds a value JSON cannot write ({err})") from None
    return conversation


def _without_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _message(message: object, index: int, where: str) -> dict:
    """One message as the template gets it: its fields as given, null ones left out, calls' arguments as JSON."""
    if not isinstance(message, dict):
        raise DataError(f"{where}: message {index} is not an object with role and content")
    message = {key: value for key, value in message.items() if value is not None}
    role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
    if role not in ROLES:
        raise DataError(f"{where}: message {index} has role {role!r}; roles are {', '.join(ROLES)}")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not calls:
            raise DataError(f"{where}: message {index}'s tool_calls must be a non-empty list on an assistant message")
        message["tool_calls"] = [_call(call, f"{where}: message {index}'s call {n}") for n, call in enumerate(calls)]
    elif "content" not in message:
        raise DataError(f"{where}: message {index} is not an object with role and content")
    if content is not None and not isinstance(content, str):
        raise DataError(f"{where}: message {index}'s content is {type(content).__name__}, not text")
    reasoning = next((message[key] for key in REASONING if key in message), None)
    if reasoning is not None:  # under each name templates read it by, as transformers passes it
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _call(call: object, where: str) -> dict:
    """A tool call as {"type": "function", "function": {"name", "arguments": {...}}, ...} (a flat {name,
    arguments} call is put in that shape, which every template that supports tools reads)."""
    call = {key: value for key, value in call.items() if value is not None} if isinstance(call, dict) else {}
    function = call.get("function", call)
    if not isinstance(function, dict) or not _named(function.get("name")):
        raise DataError(f"{where} has no function name (a call is a name and arguments, or those inside 'function')")
    arguments = _json_of(function.get("arguments", ""), f"{where}'s arguments")
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, dict):
        raise DataError(f"{where}'s arguments are {type(arguments).__name__}, not an object of named values")
    if "function" in call:
        return {**call, "function": {**function, "arguments": arguments}}
    rest = {key: value for key, value in call.items() if key not in ("name", "arguments", "type")}
    return {"type": "function", **rest, "function": {"name": function["name"], "arguments": arguments}}


def _tools(value: object, where: str) -> list[dict]:
    """A record's tools: a list of function schemas (each may be a JSON string), or a JSON string of one."""
    tools = _json_of(value, f"{where}: 'tools'")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of function schemas, not {type(tools).__name__}")
    tools = [_json_of(tool, f"{where}: tool {n}") for n, tool in enumerate(tools)]
    if not all(isinstance(tool, dict) and tool_name(tool) for tool in tools):
        raise DataError(f"{where}: 'tools' must be a list of function schemas, each with a name")
    return tools


def _json_of(value: object, where: str) -> object:
    """A value, or the JSON a string holds (Parquet and many datasets keep arguments and tools as strings);
    an empty string is None."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else None
    except ValueError:
        raise DataError(f"{where} is a string that is not JSON") from None


def _named(name: object) -> bool:
    return isinstance(name, str) and bool(name.strip())


def tool_name(tool: dict) -> str | None:
    """A tool's name: {"type": "function", "function": {"name": ...}} or {"name": ...}."""
    name = (tool.get("function") if isinstance(tool.get("function"), dict) else tool).get("name")
    return name if _named(name) else None


def template_of(companions: dict[str, bytes]) -> tuple[str, str]:
    """(the chat template, where it came from) of a tokenizer's companion files; ChatML without one."""
    if "chat_template.jinja" in companions:
        return companions["chat_template.jinja"].decode("utf-8"), "chat_template.jinja"
    config = _config(companions)
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, "tokenizer_config.json"
    return CHATML, "chatml"


def _config(companions: dict[str, bytes]) -> dict:
    try:
        config = json.loads(companions.get("tokenizer_config.json", b"{}"))
    except ValueError as err:
        raise DataError(f"tokenizer_config.json: unreadable ({err})") from None
    return config if isinstance(config, dict) else {}


def special_tokens(companions: dict[str, bytes]) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (tokenizer_config.json, then special_tokens_map.json)."""
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            values = json.loads(companions[name]) if name in companions else {}
        except ValueError as err:
            raise DataError(f"{name}: unreadable ({err})") from None
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            value = values.get(key) if isinstance(values, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return found


def _environment():
    """Jinja as transformers sets it up for chat templates."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
    except ImportError:
        raise ConfigError("chat templates need jinja2: pip install jinja2") from None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """Templates may mark an assistant's text with generation ... endgeneration blocks (for transformers'
        return_assistant_tokens_mask): the block renders its body; the mask here is made by position."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2.TemplateError


@dataclass
class Segment:
    text: str
    trained: bool


class ChatTemplate:
    """A chat template, compiled: render(messages) and the trained spans of a conversation."""

    def __init__(self, source: str, special: dict[str, str] | None = None, origin: str = "chatml"):
        env, self._error = _environment()
        self.source, self.special, self.origin = source, dict(special or {}), origin
        try:
            self.template = env.from_string(source)
        except self._error as err:
            raise DataError(f"the chat template ({origin}) is not valid Jinja: {err}") from None

    @classmethod
    def of(cls, tokenizer) -> ChatTemplate:
        """The tokenizer's template (ChatML when it has none)."""
        companions = getattr(tokenizer, "companions", {})
        source, origin = template_of(companions)
        return cls(source, special_tokens(companions), origin)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        try:
            return self.template.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except self._error as err:
            raise DataError(f"the chat template ({self.origin}) refused a conversation: {err}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as err:  # a template's own bug
            raise DataError(f"the chat template ({self.origin}) failed on a conversation ({err!r})") from None

    def segments(self, messages: list[dict], train_on: str = "assistant", tools: list | None = None) -> list[Segment]:
        """The conversation's text in order, cut where training starts and stops (empty pieces left out)."""
        text = self.render(messages, tools=tools)
        self._writes_tools(text, messages, tools)
        if train_on == "all":
            return [Segment(text, True)]
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if train_on == "last":
            answers = answers[-1:]
        segments, done = [], 0
        for index in answers:
            prompt = self.render(messages[:index], add_generation_prompt=True, tools=tools)
            through = self.render(messages[: index + 1], tools=tools).rstrip()
            if not (text.startswith(prompt) and text.startswith(through) and len(prompt) <= len(through)):
                raise DataError(
                    f"the chat template ({self.origin}) does not render turn {index} as a continuation of the turns "
                    "before it (does it drop earlier turns' reasoning?), so its answer cannot be told apart from its "
                    "prompt; use --train-on last (or all)"
                )
            segments += [Segment(text[done : len(prompt)], False), Segment(text[len(prompt) : len(through)], True)]
            done = len(through)
        segments.append(Segment(text[done:], False))
        return [segment for segment in segments if segment.text]

    def _writes_tools(self, text: str, messages: list[dict], tools: list | None) -> None:
        """Refuse a template that leaves out the tools on offer or an assistant's tool calls (one without tool
        support): the text rendered with them holds each name more often than the text rendered without."""
        checks = []
        if tools:
            checks.append(("tool", [tool_name(tool) for tool in tools], messages, None))
        for index, message in enumerate(messages):
            if "tool_calls" in message:
                bare = {key: value for key, value in message.items() if key != "tool_calls"}
                bare["content"] = message.get("content") or ""
                names = [call["function"]["name"] for call in message["tool_calls"]]
                checks.append(("tool call", names, [*messages[:index], bare, *messages[index + 1 :]], tools))
        for kind, names, without, offered in checks:
            try:
                plain = self.render(without, tools=offered)
            except DataError:  # the template needs what was taken away: it reads it
                continue
            for name in set(names):
                if text.count(name) - plain.count(name) < names.count(name):
                    raise DataError(
                        f"the chat template ({self.origin}) does not write the {kind} {name!r}: it has no tool "
                        "support; use a tokenizer whose template has it, or one without a template (ChatML writes "
                        "tools and calls)"
                    )

    def prompt(self, messages: list[dict], tools: list | None = None) -> list[Segment]:
        """A conversation that ends with a user (or tool) turn, with the generation prompt after it, cut as
        segments() cuts it in training (the text since the last answer and the generation prompt are one span)."""
        answered = any(m["role"] == "assistant" for m in messages)
        segments = self.segments(messages, tools=tools) if answered else []
        done = sum(len(segment.text) for segment in segments)
        asking = self.render(messages, add_generation_prompt=True, tools=tools)
        if not answered:  # segments() has checked the tools otherwise
            self._writes_tools(asking, messages, tools)
        if not asking.startswith(self.render(messages, tools=tools)[:done]):
            raise DataError(f"the chat template ({self.origin}) does not continue the conversation it rendered")
        if segments and not segments[-1].trained:
            done -= len(segments.pop().text)
        return [*segments, Segment(asking[done:], False)]

    def end_of_turn(self) -> str:
        """What the template writes after an assistant's content (e.g. <|im_end|>): generation stops there."""
        marker = "\x00answer\x00"
        turn = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}])
        if marker not in turn:
            raise DataError(f"the chat template ({self.origin}) does not write an assistant's content")
        return turn.split(marker, 1)[1].strip()
