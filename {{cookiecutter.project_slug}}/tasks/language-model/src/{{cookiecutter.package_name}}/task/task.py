"""The task: what this project trains, a decoder-only language model. The engine calls it through the
interface engine/seam.py declares (seam.Task).

The training set takes the (epoch, index) keys of loaders.ResumableSampler, so the windows it cuts
are the same for any number of processes and after a resume. config.py (its SPEC), tokenizer.py,
data.py, model/ and validation.py are this task's own building blocks; prepare/ and generate.py
its own commands (__init__.py lists what lives where).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..engine import PACKAGE, seam
from ..engine.config import Config
from ..engine.errors import ConfigError, DataError
from ..engine.parallel import meta_init
from .chat import CHATML, ChatTemplate
from .config import require_harness
from .data import IGNORE, DeviceWindows, Packs, TokenData, build_datasets
from .model import INIT_TYPES, ModelShape, architecture, hf, init_module, lm_loss, lora
from .tokenizer import FOLDER, HFTokenizer, describe, identity, read_identity, read_tokenizer, tokenizer_files
from .validation import evaluate_model

log = logging.getLogger(__name__)

SOURCE_CONFIG = "init_from/config.json"  # in a run directory and export/: the starting folder's config.json


class Task(seam.Task):
    """Next-token prediction: windows of token ids, cross-entropy per token, perplexity and bits per byte."""

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        self.data: TokenData | None = None
        self.source_config: bytes | None = None  # config.json of the folder a fine-tune started from
        self.frozen: dict | None = None  # with adapters: what the frozen base is (frozen_weights)
        self.benchmark_tasks = None  # trainer.eval_tasks as a harness_tasks.Request (datasets() checks them)

    def datasets(self) -> tuple[Dataset, Dataset]:
        """The training windows (by (epoch, index) keys) and the validation windows."""
        data = self.cfg.data
        if data.name == "text" and not (Path(data.root) / "meta.json").is_file():  # checked here, not in
            # config.validate: generate and export of a trained run need no data
            raise ConfigError(
                f"data.root={data.root!r} has no meta.json; data.name=text reads the token files that "
                f"`python -m {PACKAGE}.prepare --out {data.root} FILES...` writes"
            )
        train_set, val_set, self.data = build_datasets(self.cfg.data, seed=self.cfg.run.seed)
        if self.cfg.trainer.eval_tasks and self.benchmark_tasks is None:  # checked before training starts
            require_harness()
            from .harness_tasks import Request, load_tasks

            self.benchmark_tasks = Request.of_trainer(self.cfg.trainer)
            load_tasks(self.benchmark_tasks)  # names and data: a one-line error now, not at step val_every
        if isinstance(train_set, Packs):
            log.info(
                "conversations packed into %d training and %d validation sequences of %d positions; "
                "%d and %d left out (longer than data.seq_len + 1 tokens)",
                len(train_set), len(val_set), self.cfg.data.seq_len, train_set.left_out, val_set.left_out,
            )  # fmt: skip
        return train_set, val_set

    def model_files(self) -> dict[str, bytes]:
        """The tokenizer (tokenizer/meta.json, and tokenizer/tokenizer.json for a BPE): generate and export
        read it from the run directory, and a resume checks the data against it. A fine-tune also keeps
        the config.json of the folder it started from (init_from/config.json): `export --format hf`
        writes the model as the class that folder held (Mistral stays Mistral), with its settings."""
        files = tokenizer_files(self.data.tokenizer)
        tokenizer = self.data.tokenizer
        if self.data.chat and isinstance(tokenizer, HFTokenizer) and ChatTemplate.of(tokenizer).origin == "chatml":
            # trained on ChatML (the tokenizer has no template): the export's tokenizer renders it too
            files[f"{FOLDER}/chat_template.jinja"] = CHATML.encode("utf-8")
        if self.source_config is None and self.cfg.model.init_from:
            self.source_config = (Path(self.cfg.model.init_from) / "config.json").read_bytes()
        if self.source_config is not None:
            files[SOURCE_CONFIG] = self.source_config
        return files

    def check_model_files(self, folder: Path) -> None:
        """Refuse data prepared with another tokenizer than the run in folder was trained with."""
        stored = read_identity(folder)
        now = identity(self.data.tokenizer)
        if stored is not None and stored != now:
            data = self.cfg.data
            source = f"data.root={data.root!r} was prepared" if data.name == "text" else f"data.name={data.name} is"
            again = Path(folder) / FOLDER / "tokenizer.json" if stored["tokenizer"] == "tokenizer.json" else "bytes"
            raise DataError(
                f"{folder} was trained with the tokenizer {describe(stored)}, but {source} with {describe(now)}; "
                f"prepare the text again with --tokenizer {again}, or train a new run"
            )

    def use_model_files(self, folder: Path) -> bool:
        """The vocabulary and the tokenizer from the run directory (or export folder) instead of the data."""
        source = Path(folder) / SOURCE_CONFIG
        self.source_config = source.read_bytes() if source.is_file() else None
        tokenizer = read_tokenizer(folder)
        if tokenizer is None:
            return False
        self.data = TokenData(tokenizer.vocab_size, 1.0, None, tokenizer)
        return True

    def device_bytes(self, train_set: Dataset, val_set: Dataset) -> tuple[int, str | None]:
        """Bytes both splits take on the device (int32 tokens), and what speaks against data.loader=auto
        choosing the device (None: nothing)."""
        if isinstance(train_set, Packs):
            return 0, "packed conversations are assembled by DataLoader workers"
        return 4 * (len(train_set.tokens) + len(val_set.tokens)), None

    def device_sets(self, train_set: Dataset, val_set: Dataset) -> tuple:
        """Both splits on the training device (data.loader=device): the same windows, gathered there."""
        if isinstance(train_set, Packs):
            raise ConfigError("data.loader=device: packed conversations (prepare --chat) load with data.loader=workers")
        return DeviceWindows(train_set, self.device), DeviceWindows(val_set, self.device)

    def build_model(self, device: torch.device | None = None, shard: Callable | None = None) -> nn.Module:
        """The transformer for the data's vocabulary on `device` (default CPU), initialised from
        run.seed, or from model.init_from's weights; shard(model) (FSDP) is applied on the meta
        device, before any weight exists (meta_init.py), so no process ever holds the whole model
        (with model.init_from, each process copies in its shards of the folder's tensors)."""
        shape = ModelShape.of(self.cfg.model, self._vocabulary(), self.cfg.data.seq_len)
        weights = self._pretrained() if self.cfg.model.init_from else None  # read (and checked) first
        adapters = self.cfg.model.lora
        if self.cfg.model.quantize != "none" and shard is not None:
            raise ConfigError(
                f"model.quantize={self.cfg.model.quantize} with distributed.strategy=fsdp: the NF4 weights are made "
                "whole, after loading, and are not sharded; train on one process or with distributed.strategy=ddp"
            )
        if adapters.r:  # the base is frozen and not checkpointed: what rebuilds it, and its hash
            self.frozen = {
                "config": {"model.init_from": self.cfg.model.init_from},
                "sha256": lora.weights_hash(weights),
            }

        def build() -> nn.Module:
            model = architecture(shape)
            if adapters.r:
                lora.add_adapters(model, shape.arch, adapters)  # before sharding: each block with its adapters
            return model

        model, _ = meta_init.build(
            build,
            partial(lora.init_module if adapters.r else init_module, n_layer=shape.n_layer),
            INIT_TYPES,
            device or torch.device("cpu"),
            self.cfg.run.seed,
            shard,
        )
        if weights is not None:
            hf.load_into(model, weights, self.cfg.model.init_from)
        if adapters.r:
            lora.set_magnitudes(model, weights)  # DoRA: from the base's row norms
            if self.cfg.model.quantize == "nf4":
                before, after = lora.quantize_base(model, shape.arch)
                log.info("model.quantize=nf4: the blocks' linear weights take %.2f MiB instead of %.2f MiB",
                         after / 2**20, before / 2**20)  # fmt: skip
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            log.info(
                "LoRA r=%d on %s: %d trainable parameters of %d (%.2f%%)%s", adapters.r,
                ", ".join(adapters.targets or lora.TARGETS[shape.arch]), trainable, total, 100 * trainable / total,
                " with DoRA" if adapters.dora else "",
            )  # fmt: skip
        return model

    def frozen_weights(self) -> dict | None:
        """With adapters (model.lora.r > 0): model.init_from and the SHA-256 of its weights."""
        return self.frozen

    def _vocabulary(self) -> int:
        """Rows of the embedding: model.vocab_size (model.init_from's), else the tokenizer's."""
        rows = self.cfg.model.vocab_size or self.data.vocab_size
        if rows < self.data.vocab_size:
            raise DataError(
                f"model.vocab_size={rows} is below the tokenizer's vocabulary of {self.data.vocab_size} tokens"
            )
        return rows

    def _pretrained(self) -> dict[str, torch.Tensor]:
        """model.init_from's weights, once its tokenizer is known to be the data's: the same
        tokenizer.json (and end-of-text token) when the folder has one, else the same vocabulary."""
        folder = Path(self.cfg.model.init_from)
        again = f"prepare the text with the model's tokenizer (--tokenizer {folder / 'tokenizer.json'})"
        if (folder / "tokenizer.json").is_file():
            theirs, ours = identity(HFTokenizer(folder / "tokenizer.json")), identity(self.data.tokenizer)
            if theirs != ours:
                raise DataError(
                    f"model.init_from={str(folder)!r} comes with the tokenizer {describe(theirs)}, but the data was "
                    f"prepared with {describe(ours)}: {again}"
                )
        elif (vocab := hf.read_config(folder)["vocab_size"]) != self.data.vocab_size:
            raise DataError(
                f"model.init_from={str(folder)!r} has a vocabulary of {vocab} tokens, "
                f"the data's tokenizer {self.data.vocab_size}: {again}"
            )
        return hf.read_weights(folder)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy per token of one micro-batch of windows, and its number of sequences; for
        packed conversations [batch, 3, seq_len], per trained target."""
        if batch.dim() == 3:
            packs = batch.to(self.device, non_blocking=True)
            targets = packs[:, 1]
            loss = lm_loss(model(packs[:, 0], documents=packs[:, 2]), targets, reduction="sum")
            return loss / (targets != IGNORE).sum().clamp(min=1), len(packs)
        windows = batch.to(self.device, non_blocking=True)
        inputs, targets = windows[:, :-1], windows[:, 1:]
        return lm_loss(model(inputs), targets), len(windows)

    def loss_weight(self, batch: torch.Tensor) -> int | None:
        """Packed conversations: the trained targets, so that a step's loss is their sum over the step's
        trained targets (every micro-batch and process), as one large batch's; windows: None (all equal)."""
        return int((batch[:, 1] != IGNORE).sum()) if batch.dim() == 3 else None

    def validate(self, model: nn.Module, loader: DataLoader) -> dict:
        """val/loss, val/ppl, val/bpb and val/tokens over the whole validation split (and, for the
        synthetic source, val/loss_floor: its entropy rate, the lowest val/loss any model can reach)."""
        metrics = evaluate_model(model, loader, self.device, self.cfg.trainer.precision, self.data.bytes_per_token)
        if self.data.loss_floor is not None:
            metrics["val/loss_floor"] = self.data.loss_floor
        return metrics

    def evaluate(self, model: nn.Module, loader: DataLoader, options: dict[str, str | None]) -> tuple[dict, dict]:
        """The evaluate command: validate's metrics and, with --tasks, lm-evaluation-harness scores
        (eval/TASK/METRIC) with a report per task (TASK.json): benchmarks.py."""
        metrics = self.validate(model, loader)
        if "--tasks" not in options:
            if unused := sorted(set(options) - {"--tasks"}):
                raise ConfigError(f"{', '.join(unused)} go with --tasks")
            return metrics, {}
        require_harness()
        from .benchmarks import HarnessModel, Request, run_tasks

        request = Request.of(options)
        precision, batch = self.cfg.trainer.precision, self.cfg.data.batch_size
        harness = HarnessModel(model, self.data.tokenizer, self.device, precision, batch, chat=request.chat)
        scores, reports = run_tasks(harness, request)
        writers = {f"{task}.json": partial(_write_json, report) for task, report in reports.items()}
        return {**metrics, **scores}, writers

    def benchmarks(self, model: nn.Module, trainer) -> dict:
        """trainer.eval_tasks' scores (eval/TASK/METRIC) on the model as it is (its shards under FSDP, every
        process in step), the random generators left as they were: benchmarks.py."""
        from .benchmarks import HarnessModel, preserved_rng, run_tasks

        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper would compile every new shape
        precision, batch = self.cfg.trainer.precision, self.cfg.data.batch_size
        harness = HarnessModel(model, self.data.tokenizer, self.device, precision, batch)
        with preserved_rng(self.device):
            scores, _ = run_tasks(harness, self.benchmark_tasks)
        return scores

    def summary(self, metrics: dict) -> str:
        floor = f" (floor {metrics['val/loss_floor']:.4f})" if "val/loss_floor" in metrics else ""
        scores = "".join(
            f" {key} {value:.4f}" for key, value in metrics.items() if key.startswith("eval/") and "_stderr" not in key
        )
        return (
            f"val/loss {metrics['val/loss']:.4f}{floor} val/ppl {metrics['val/ppl']:.3f} "
            f"val/bpb {metrics['val/bpb']:.4f} ({metrics['val/tokens']} tokens){scores}"
        )

    def throughput(self, samples_per_s: float) -> dict:
        """perf/tokens_per_s: every sequence trains data.seq_len tokens."""
        return {"perf/tokens_per_s": samples_per_s * self.cfg.data.seq_len}

    EXPORT_FORMATS = {
        "hf": "a Hugging Face folder, GPT-2, Llama or Qwen2 (export/hf: transformers' from_pretrained loads it; "
        "with adapters, the merged model)",
        "peft": "a PEFT adapter (export/peft: PeftModel.from_pretrained loads it over model.init_from)",
    }

    def export_as(self, fmt: str, model: nn.Module, folder: Path) -> Path:
        """export --format hf: config.json, model.safetensors and, for a tokenizer.json run, the
        tokenizer's files, in folder/hf (adapters merged into their layers); --format peft: the
        adapters as peft writes them, in folder/peft."""
        out = Path(folder) / fmt
        if fmt == "peft":
            hf.write_peft(model, out, self.cfg.model.lora, str(self.cfg.model.init_from))
            return out
        hf.write_folder(model, out, self.data.tokenizer, self.data.tokenizer.eot, self.source_config)
        return out

    def export_example(self) -> tuple[tuple, tuple]:
        """Token ids [2, seq_len] with dynamic batch (1 to 4096) and time (1 to data.seq_len).

        torch.export specialises a dimension of size 0 or 1 to that constant, so the example has
        two of each."""
        seq_len = self.cfg.data.seq_len
        tokens = torch.zeros(2, max(seq_len, 2), dtype=torch.long)
        dims = {0: torch.export.Dim("batch", min=1, max=4096), 1: torch.export.Dim("time", min=1, max=seq_len)}
        return (tokens,), (dims,)


def _write_json(value: dict, path: Path) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
