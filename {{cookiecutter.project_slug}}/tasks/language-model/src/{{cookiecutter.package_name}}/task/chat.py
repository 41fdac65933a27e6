"""Conversations for supervised fine-tuning: records to messages, messages to text through the
tokenizer's chat template, and which tokens of that text are trained.

A record is a conversation, `messages` (a list of {role, content}, roles system, user and
assistant, any number of turns), or one exchange: `prompt` and `response`, or Alpaca's
`instruction`, `input` (optional) and `output`.

The chat template is the tokenizer's (chat_template.jinja, or tokenizer_config.json's
chat_template), rendered as transformers renders it (a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, its tojson, raise_exception and strftime_now, and the special tokens
as variables); a tokenizer without one gets ChatML (CHATML below, Qwen2's and SmolLM2's format):

    <|im_start|>user
    What is 2+3?<|im_end|>
    <|im_start|>assistant
    5<|im_end|>

Which text is trained (--train-on): `assistant` (the default) trains every assistant turn, `last`
the last one, `all` every token. An assistant turn's trained text runs from the end of the prompt
that asks for it (the conversation before it, rendered with the generation prompt) to the end of
the conversation rendered up to and including it, without trailing whitespace: its content and the
end-of-turn marker the template writes after it (ChatML's <|im_end|>, Llama 3's <|eot_id|>), never
the next turn's header. The mask is made by position in the text, never by token id (SmolLM2's
padding id is its end-of-turn id).

Each span is tokenized on its own and the ids joined: the prompt that asks for an answer is always a
token prefix of the conversation, as at generation time, where the prompt is tokenized alone. A
BPE could merge across a span's edge when the whole text is tokenized at once; templates put a line
end or a special token there, where the usual pre-tokenizers cut anyway, and the tests check that
the ids equal transformers' apply_chat_template for such a template. Special tokens are added by the
template alone (bos_token where it writes one), never by the tokenizer as well: no doubled BOS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime

from ..engine.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "all", "last")

# ChatML, for tokenizers without a chat template. Jinja's delimiters are spelled <% %> and << >> here
# and put back below (this file is itself the output of a template engine that reads the real ones).
_CHATML = (
    "<% for message in messages %><<'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'>>"
    "<% endfor %><% if add_generation_prompt %><<'<|im_start|>assistant\\n'>><% endif %>"
)
_DELIMITERS = {"<%": "{" + "%", "%>": "%" + "}", "<<": "{" + "{", ">>": "}" + "}"}
CHATML = re.sub("<%|%>|<<|>>", lambda found: _DELIMITERS[found[0]], _CHATML)


def messages_of(record: object, where: str) -> list[dict]:
    """The conversation a record holds, as [{"role", "content"}, ...] ending with an assistant turn."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of objects with role and content")
        out = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise DataError(f"{where}: message {index} is not an object with role and content")
            role, content = message["role"], message["content"]
            if role not in ROLES:
                raise DataError(f"{where}: message {index} has role {role!r}; roles are {', '.join(ROLES)}")
            if not isinstance(content, str):
                raise DataError(f"{where}: message {index}'s content is {type(content).__name__}, not text")
            out.append({"role": role, "content": content})
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
    if not all(isinstance(m["content"], str) for m in out):
        raise DataError(f"{where}: prompt and response must be text")
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant turn, nothing to train")
    return out


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
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need jinja2: pip install jinja2") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except self._error as err:
            raise DataError(f"the chat template ({self.origin}) refused a conversation: {err}") from None

    def segments(self, messages: list[dict], train_on: str = "assistant") -> list[Segment]:
        """The conversation's text in order, cut where training starts and stops (empty pieces left out)."""
        text = self.render(messages)
        if train_on == "all":
            return [Segment(text, True)]
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if train_on == "last":
            answers = answers[-1:]
        segments, done = [], 0
        for index in answers:
            prompt = self.render(messages[:index], add_generation_prompt=True)
            through = self.render(messages[: index + 1]).rstrip()
            if not (text.startswith(prompt) and text.startswith(through) and len(prompt) <= len(through)):
                raise DataError(
                    f"the chat template ({self.origin}) does not render turn {index} as a continuation of the turns "
                    "before it, so its answer cannot be told apart from its prompt; use --train-on all"
                )
            segments += [Segment(text[done : len(prompt)], False), Segment(text[len(prompt) : len(through)], True)]
            done = len(through)
        segments.append(Segment(text[done:], False))
        return [segment for segment in segments if segment.text]

    def prompt(self, messages: list[dict]) -> list[Segment]:
        """A conversation that ends with a user turn, with the generation prompt after it, cut as segments()
        cuts it in training (the text since the last answer and the generation prompt are one span)."""
        segments = self.segments(messages) if any(m["role"] == "assistant" for m in messages) else []
        done = sum(len(segment.text) for segment in segments)
        asking = self.render(messages, add_generation_prompt=True)
        if not asking.startswith(self.render(messages)[:done]):
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
