"""Benchmarks: lm-evaluation-harness tasks on the model in memory, offline, on 1 or N processes.

    python -m PACKAGE.evaluate run.output_dir=runs/sft --tasks hellaswag --task-data hellaswag=data/hellaswag
    python -m PACKAGE.evaluate run.output_dir=runs/sft --tasks my_task --include my_tasks/ --limit 100
    torchrun --nproc_per_node=4 -m PACKAGE.evaluate run.output_dir=runs/sft --tasks arc_easy,piqa --num-fewshot 5

HarnessModel is the harness's model (its TemplateLM interface) over this project's model and
tokenizer, treating them as the harness's own HFLM treats a `transformers` model: the same
tokenization (special tokens added as the tokenizer's post-processor adds them, the prefix token
before an empty context), the same log-likelihoods (context + continuation in one forward pass, in
the run's precision, log-softmax in float32), greedy generation with the key/value cache until a
stop string. So the scores equal the harness's on `export --format hf`, item for item. One
difference: an input longer than the model's context is refused in one line, where HFLM cuts it
silently, since a score over cut inputs is not the benchmark's.

On N processes the harness gives each process every N-th item and gathers the per-item results on
the first, so the scores do not depend on the process count. Each process holds the whole model
(evaluate builds it whole, for FSDP runs too).

The tasks and their data (local copies, the user's own task YAMLs): harness_tasks.py. During training
(trainer.eval_tasks), Task.benchmarks runs them at validation: under FSDP every forward is a
collective, so each process's forwards go in step with the others' (HarnessModel.lockstep), and the
random generators the harness seeds are put back (preserved_rng).

This module imports the harness: import it only when --tasks or trainer.eval_tasks is given (task.py
does), after config.require_harness.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
from collections.abc import Iterator
from unittest import mock

import lm_eval
import numpy as np
import torch
import torch.distributed as dist
from lm_eval import evaluator
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from torch.nn import functional as F

from ..engine.errors import ConfigError, DataError
from ..engine.parallel.distributed import is_dtensor
from ..engine.step import autocast
from .chat import ChatTemplate, special_tokens
from .harness_tasks import Request, load_tasks
from .sampling import sample

log = logging.getLogger(__name__)

MAX_GEN_TOKS = 256  # what a generation task may write when it does not say (HFLM's default)


class HarnessModel(TemplateLM):
    """This project's model and tokenizer as an lm-evaluation-harness model (TemplateLM).

    batch_size items are scored per forward pass, longest first (padding on the right, which a causal
    model never attends to). rank and world_size: this process among those evaluating together
    (torch.distributed), whose results the harness gathers."""

    def __init__(
        self, model: nn.Module, tokenizer, device: torch.device, precision: str, batch_size: int, chat: bool = False
    ):
        super().__init__()
        if tokenizer.eot is None:
            raise ConfigError(
                "--tasks: this tokenizer has no end of text (the synthetic source's); benchmarks need text"
            )
        self.model, self.text, self._device = model.eval(), tokenizer, device
        self.precision, self.batch_size = precision, batch_size
        self.template = ChatTemplate.of(tokenizer) if chat else None
        self.special = special_tokens(getattr(tokenizer, "companions", {}))
        self.context = model.shape.positions  # what HFLM reads from the export's config.json
        self.vocab = tokenizer.vocab_size
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        # A sharded model's forward is a collective: every process then runs its forwards in step (_forward, _drain).
        self.lockstep = self._world_size > 1 and any(is_dtensor(p) for p in model.parameters())
        self.tasks: list[str] = []  # the task of each log-likelihood request, for error messages
        self.generator = torch.Generator(device).manual_seed(1234)  # sampled generation only (the harness's seed)

    # --- the tokenizer, as HFLM uses a transformers tokenizer ---
    @property
    def eot_token_id(self) -> int:
        return self.text.eot

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context: the tokenizer's beginning of sequence, else its end of text."""
        return self._bos if self._bos is not None else self.text.eot

    @property
    def _bos(self) -> int | None:
        """The beginning-of-sequence token the tokenizer's files name (tokenizer_config.json), if any."""
        bos, encoder = self.special.get("bos_token"), getattr(self.text, "tokenizer", None)
        return encoder.token_to_id(bos) if bos and encoder is not None else None

    @property
    def max_length(self) -> int:
        return self.context

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The ids of string; with add_special_tokens None (the harness's default) the special tokens the
        tokenizer's post-processor adds (a Llama tokenizer's beginning of sequence) are added, as
        transformers adds them, unless the string already starts with the prefix token."""
        encoder = getattr(self.text, "tokenizer", None)
        if encoder is None:  # bytes: no special tokens
            return self.text.encode(string)
        if add_special_tokens is None:
            prefix = encoder.id_to_token(self.prefix_token_id) or ""
            add_special_tokens = not (prefix and string.startswith(prefix))
        return encoder.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    # --- the three kinds of request ---
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.tasks = [request.task_name for request in requests]  # for _too_long's message
        results = super().loglikelihood(requests, disable_tqdm=True)  # (its bar is for tokenizing, which is quick)
        self._drain()
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding would write it) of each
        (strings, context ids, continuation ids)."""
        items = [(context + continuation, len(continuation)) for _, context, continuation in requests]
        for i, ((strings, _, _), (ids, _)) in enumerate(zip(requests, items, strict=True)):
            if len(ids) - 1 > self.context:
                raise self._too_long(len(ids) - 1, strings, self.tasks[i] if len(self.tasks) == len(items) else "?")
        results: list[tuple[float, bool] | None] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # similar lengths batch together
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            logprobs = self._logprobs([items[i][0][:-1] for i in batch])
            for row, i in enumerate(batch):
                ids, length = items[i]
                inputs = len(ids) - 1
                scores = logprobs[row, inputs - length : inputs]
                targets = torch.tensor(ids[-length:], device=scores.device)
                picked = scores.gather(-1, targets[:, None]).squeeze(-1)
                results[i] = (float(picked.sum()), bool((scores.argmax(-1) == targets).all()))
        return results

    def _logprobs(self, inputs: list[list[int]]) -> torch.Tensor:
        """log_softmax of the model's logits for inputs padded on the right: [batch, longest, vocabulary rows]."""
        longest = max(len(ids) for ids in inputs)
        batch = torch.zeros(len(inputs), longest, dtype=torch.long)
        for row, ids in enumerate(inputs):
            batch[row, : len(ids)] = torch.tensor(ids)
        with torch.no_grad(), autocast(self._device, self.precision):
            logits = self._forward(batch.to(self._device))
        return F.log_softmax(logits.float(), dim=-1)

    def _forward(self, *args) -> torch.Tensor:
        """The model's forward; in lockstep, first telling the other processes that this one has a forward to run."""
        if self.lockstep:
            self._anyone(True)
        return self.model(*args)

    def _anyone(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _drain(self) -> None:
        """In lockstep, once this process ran its last forward of a kind of request: a one-token forward for
        each forward another process still runs, until none has any left."""
        if not self.lockstep:
            return
        idle = torch.zeros(1, 1, dtype=torch.long, device=self._device)
        with torch.no_grad(), autocast(self._device, self.precision):
            while self._anyone(False):
                self.model(idle)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string (perplexity tasks), in windows of the model's context
        that each predict new tokens only, the first after the prefix token (as HFLM cuts them)."""
        results = []
        for request in requests:
            (string,) = request.args
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.context,
                    context_len=1,
                )
            ]
            scored = self._loglikelihood_tokens([((string, ""), context, target) for context, target in windows])
            results.append(sum(logprob for logprob, _ in scored))
        self._drain()
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued greedily (or sampled, where the task asks for a temperature) until one of
        its stop strings or the end of text, at most max_gen_toks tokens; the text before the first stop."""
        answers = [self._generate(*request.args, request.task_name) for request in requests]
        self._drain()
        return answers

    def _generate(self, context: str, settings: dict, task: str) -> str:
        settings = dict(settings)
        until = settings.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        most = int(settings.pop("max_gen_toks", MAX_GEN_TOKS))
        sampled = settings.get("do_sample", False) or float(settings.get("temperature") or 0) > 0
        temperature = float(settings.get("temperature") or 1.0) if sampled else 0.0
        prompt = self.tok_encode(context)
        if len(prompt) > self.context:
            raise self._too_long(len(prompt), (context, ""), task)
        eot = self.text.eot

        def stop(new: list[int]) -> bool:
            return new[-1] == eot or any(term in self.text.decode(new) for term in until)

        with autocast(self._device, self.precision):
            new = sample(
                Stepped(self), prompt, most, self.context, temperature, 0, self.generator, vocab=self.vocab, stop=stop
            )
        text = self.text.decode([i for i in new if i != eot])
        for term in until:
            text = text.split(term)[0]
        return text

    def _too_long(self, tokens: int, strings: tuple, task: str) -> DataError:
        start = (strings[0] or "")[:40].replace("\n", " ")
        return DataError(
            f"--tasks {task}: an item takes {tokens} tokens, more than the model's context of "
            f"{self.context} (it starts {start!r}); try fewer --num-fewshot examples or a model with a longer context"
        )

    # --- chat templates (--apply-chat-template) ---
    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(chat_history, add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return hashlib.sha256((self.template.source if self.template else "").encode()).hexdigest()[:16]

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template.source if chat_template and self.template else None

    # --- processes evaluating together ---
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        parts = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, parts, dst=dst)
        return parts

    def barrier(self) -> None:
        dist.barrier()


class Stepped:
    """The model as sampling.sample calls it, each forward through HarnessModel._forward (lockstep)."""

    def __init__(self, harness: HarnessModel):
        self.harness, self.shape = harness, harness.model.shape

    def __call__(self, *args) -> torch.Tensor:
        return self.harness._forward(*args)

    def eval(self) -> Stepped:
        return self

    def parameters(self):  # what the key/value cache is made like: this process's tensors, not DTensors
        return (p.to_local() if is_dtensor(p) else p for p in self.harness.model.parameters())


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """The random generators (Python's, numpy's, torch's) as they were before, whatever ran inside (the harness
    seeds them all): training after a benchmark draws what it would have drawn without one."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    random.setstate(python)
    np.random.set_state(numpy_state)


def run_tasks(lm: HarnessModel, request: Request) -> tuple[dict, dict[str, dict]]:
    """The request's scores: flat metrics {eval/TASK/METRIC: value} (stderrs as eval/TASK/METRIC_stderr), and
    a report per task {TASK: {...}} with its scores, its item count, the harness's version and a hash of the
    task's configuration; the same on every process (the first one's, broadcast)."""
    built, manager = load_tasks(request)
    harness = logging.getLogger("lm_eval")
    level, harness.level = harness.level, max(harness.level, logging.WARNING)
    try:  # (the harness asks git for a commit hash, whose "not a git repository" would be printed)
        with mock.patch.object(evaluator, "get_git_commit_hash", lambda: None):
            results = evaluator.simple_evaluate(
                model=lm,
                tasks=built,
                num_fewshot=request.num_fewshot,
                limit=request.limit,
                task_manager=manager,
                apply_chat_template=request.chat,
                log_samples=False,
                bootstrap_iters=1000,
            )
    finally:
        harness.level = level
    if lm.world_size > 1:  # every process gets the first one's results: they all log the same scores
        shared = [results]
        dist.broadcast_object_list(shared, src=0)
        results = shared[0]
    version = lm_eval.__version__
    metrics, reports = {}, {}
    for task, scores in results["results"].items():
        kept = {}
        for key, value in scores.items():
            metric, comma, kind = key.partition(",")  # "acc,none", "acc_stderr,none", "exact_match,strict-match"
            if comma and isinstance(value, (int, float)):
                name = metric if kind == "none" else f"{metric}_{kind}"
                kept[name] = metrics[f"eval/{task}/{name}"] = value
        config = json.dumps(results["configs"].get(task, {}), sort_keys=True, default=str)
        reports[task] = {
            "task": task,
            "scores": kept,
            "items": results.get("n-samples", {}).get(task, {}).get("effective"),
            "num_fewshot": results.get("n-shot", {}).get(task),
            "limit": request.limit,
            "chat_template": request.chat,
            "harness_version": version,
            "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        }
    return metrics, reports
