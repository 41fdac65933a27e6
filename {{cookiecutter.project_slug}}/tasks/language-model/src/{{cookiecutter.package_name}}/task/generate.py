"""Sample text from a trained language model.

    python -m PACKAGE.generate run.output_dir=runs/demo --prompt "def " --max-new-tokens 200
    python -m PACKAGE.generate --checkpoint runs/demo/checkpoints/step_00000600.pt --temperature 0.8 --top-k 40
    python -m PACKAGE.generate run.output_dir=runs/sft --chat --prompt "what is 17+25?" --temperature 0
    python -m PACKAGE.generate run.output_dir=runs/sft --chat [--system TEXT]   # turns from stdin, one a line
    python -m PACKAGE.generate run.output_dir=runs/sft --chat --tools tools.json --prompt "weather in Oslo?"

The model is rebuilt from the checkpoint as for evaluate (restore.py): the checkpoint gives the
model's and the data's shape only. The tokenizer is the one the run saved in its directory
(tokenizer/); no prepared data is needed. (A run trained before runs kept their tokenizer reads it
from data.root, the directory prepare wrote: pass data.root=DIR when it is not ./data.) Sampling: --temperature 0 is
greedy; --top-k K keeps the K likeliest tokens (0: all); --seed makes a sample repeatable; --no-cache
recomputes the whole window for every token (the same tokens, slower: for comparison). Prints
the prompt followed by the generated text. Errors are one `error: ...` line: exit 2 for bad input.

--chat: the prompt is a user's turn (after --system's, if given), rendered with the run's chat
template (its tokenizer's, or ChatML: task/chat.py) and the generation prompt, tokenized as training
tokenized conversations; the answer stops at the template's end of turn (or after
--max-new-tokens) and is printed alone. Without --prompt, each line read from stdin is a user's
turn, answered in turn, the conversation kept. --tools FILE offers the functions of a JSON file (a
list of function schemas, as a record's `tools` in prepare --chat) to the template; the answer is
printed as the model writes it, tool calls included (ChatML: <tool_call> lines); reading turns from
stdin, a line that starts with "tool:" is then the result of the call just made. Every line is
answered in turn, so the results of several calls in one answer go in one at a time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..engine import PACKAGE, cli
from ..engine.ckpt.restore import beside, load_model_weights, restore_trained
from ..engine.errors import ConfigError
from .chat import ChatTemplate, tool_name
from .config import SPEC
from .sampling import sample
from .task import Task


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.generate", add_help=False)
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--system", default=None)
    parser.add_argument("--tools", default=None, metavar="FILE")
    options, rest = parser.parse_known_args(argv)
    if options.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={options.max_new_tokens} must be at least 1")
    if options.temperature < 0 or options.top_k < 0:
        raise ConfigError("--temperature and --top-k must be 0 or more (0: greedy, 0: no top-k)")
    if options.tools is not None:
        if not options.chat:
            raise ConfigError("--tools offers functions to a conversation: use it with --chat")
        options.tools = read_tools(options.tools)
    return options, rest


def read_tools(path: str) -> list[dict]:
    """--tools FILE: a JSON list of function schemas."""
    try:
        with open(path, encoding="utf-8") as file:
            tools = json.load(file)
    except OSError as err:
        raise ConfigError(f"--tools {path}: cannot read it ({err.strerror})") from None
    except ValueError as err:
        raise ConfigError(f"--tools {path}: not JSON ({err})") from None
    if not isinstance(tools, list) or not tools or not all(isinstance(t, dict) and tool_name(t) for t in tools):
        raise ConfigError(f"--tools {path}: must hold a list of function schemas, each with a name")
    return tools


class Chat:
    """Answers to a conversation with the run's chat template: ids as training cut them, sampling until the
    template's end of turn."""

    def __init__(self, tokenizer, sampler, tools: list | None = None):
        self.tokenizer, self.sampler, self.tools = tokenizer, sampler, tools
        self.template = ChatTemplate.of(tokenizer)
        self.end = self.template.end_of_turn()
        marker = tokenizer.encode(self.end) if self.end else []
        self.end_id = marker[0] if len(marker) == 1 else None  # a special token: stop on its id

    def ended(self, ids: list[int]) -> bool:
        if self.end_id is not None:
            return ids[-1] == self.end_id
        return bool(self.end) and self.end in self.tokenizer.decode(ids)

    def answer(self, messages: list[dict]) -> str:
        segments = self.template.prompt(messages, self.tools)
        (pieces,) = self.tokenizer.encode_spans([[segment.text for segment in segments]])
        prompt = [i for piece in pieces for i in piece]
        new = self.sampler(prompt, self.ended)
        if self.end_id is not None and new and new[-1] == self.end_id:
            new = new[:-1]
        text = self.tokenizer.decode(new)
        return text.split(self.end, 1)[0] if self.end else text


def generate(options: argparse.Namespace, rest: list[str]) -> tuple[str, str]:
    """The prompt and the generated text for parse()'s options and the checkpoint the rest names (--chat:
    the answer alone after an empty prompt)."""
    tokenizer, sampler = _sampler(rest, options)
    if options.chat:
        system = [{"role": "system", "content": options.system}] if options.system else []
        asked = [*system, {"role": "user", "content": options.prompt}]
        return "", Chat(tokenizer, sampler, options.tools).answer(asked)
    prompt = tokenizer.encode(options.prompt)
    if not prompt:  # start a new document, or from a token drawn with the seed
        start = tokenizer.eot
        if start is None:
            seeded = torch.Generator().manual_seed(options.seed)
            start = int(torch.randint(tokenizer.vocab_size, (1,), generator=seeded))
        prompt = [start]
    return options.prompt, tokenizer.decode(sampler(prompt, None))


def _sampler(rest: list[str], options: argparse.Namespace):
    """The run's tokenizer, and sample(prompt ids, stop) with the checkpoint's model and the options."""
    cfg, path, state = restore_trained(SPEC, rest, f"{PACKAGE}.generate")
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.run.device != "cpu" else "cpu")
    task = Task(cfg, device)
    if not task.use_model_files(beside(path)):  # the run's own tokenizer; a run from before it kept one: the data's
        task.datasets()
    tokenizer = task.data.tokenizer
    model = task.build_model()
    load_model_weights(model, state, path, task.frozen_weights())
    model.to(device)
    generator = torch.Generator(device).manual_seed(options.seed)

    def sampler(prompt: list[int], stop) -> list[int]:
        return sample(
            model,
            prompt,
            options.max_new_tokens,
            cfg.data.seq_len,
            options.temperature,
            options.top_k,
            generator,
            cache=not options.no_cache,
            vocab=task.data.vocab_size,
            stop=stop,
        )

    return tokenizer, sampler


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(lambda: _generate(argv))


def _generate(argv: list[str]) -> int:
    options, rest = parse(argv)
    if options.chat and not options.prompt:
        return _converse(rest, options)
    prompt, text = generate(options, rest)
    print(prompt + text)
    return 0


TOOL_RESULT = "tool:"  # with --tools, a stdin line that starts so is the result of the call just made


def _converse(rest: list[str], options: argparse.Namespace) -> int:
    """--chat without --prompt: each line of stdin is a user's turn (with --tools, a line that starts with
    TOOL_RESULT is a tool's result); each answer is printed on its own."""
    chat = Chat(*_sampler(rest, options), options.tools)
    messages = [{"role": "system", "content": options.system}] if options.system else []
    ask = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 are replaced, not a traceback
        sys.stdin.reconfigure(errors="replace")
    while True:
        if ask:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.rstrip("\n")
        if options.tools and line.startswith(TOOL_RESULT):
            messages.append({"role": "tool", "content": line.removeprefix(TOOL_RESULT).removeprefix(" ")})
        else:
            messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": chat.answer(messages)})
        print(messages[-1]["content"], flush=True)


if __name__ == "__main__":
    sys.exit(main())
