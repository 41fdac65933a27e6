"""The model: a decoder-only transformer of one of two families, and its named sizes.

- `llama` (llama.py): RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention, in Hugging
  Face's layout (Llama, Qwen2, Mistral folders load and export by renaming).
- `gpt2` (gpt2.py): GPT-2's learned positions, LayerNorm, GELU MLP and full multi-head attention.

Both are pre-norm blocks in an nn.ModuleList (FSDP shards each block) over causal SDPA, with the
pieces they share in blocks.py. ModelShape is the one description both are built from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ...engine.errors import ConfigError
from .gpt2 import GPT
from .llama import Llama

if TYPE_CHECKING:
    from ..config import ModelConfig  # config.py checks a shape with this module: annotations only here

ARCHS = ("llama", "gpt2")
DEFAULT_ARCH = "llama"  # for a new model of a size preset (bench/arch.py: 29% lower loss than gpt2 in the same time)

# Named sizes. Size presets (no "arch") fit either family; llama reads their n_kv_head, and sizes
# its SwiGLU MLP by swiglu_width (about 8/3 x d_model in 3 matrices: as many parameters as GPT-2's
# 4 x d_model in 2). Model presets are published shapes, vocabulary aside (it is the tokenizer's:
# prepare with the model's tokenizer.json); their parameter counts are with their own vocabulary.
PRESETS = {
    "nano": {"n_layer": 2, "n_head": 2, "d_model": 64, "n_kv_head": 1},  # 0.1M: tests
    "micro": {"n_layer": 4, "n_head": 4, "d_model": 128, "n_kv_head": 2},  # 0.8M
    "mini": {"n_layer": 6, "n_head": 6, "d_model": 192, "n_kv_head": 3},  # 2.7M: the CPU demo
    "small": {"n_layer": 8, "n_head": 8, "d_model": 512, "n_kv_head": 4},  # 25M
    "gpt2": {"arch": "gpt2", "n_layer": 12, "n_head": 12, "d_model": 768},  # 124M (50,257 tokens)
    "smollm2-135m": {  # 134,515,008 (49,152 tokens)
        "arch": "llama", "n_layer": 30, "n_head": 9, "d_model": 576, "n_kv_head": 3, "intermediate_size": 1536,
        "rope_theta": 100_000.0,
    },
    "smollm2-360m": {  # 361,821,120 (49,152 tokens)
        "arch": "llama", "n_layer": 32, "n_head": 15, "d_model": 960, "n_kv_head": 5, "intermediate_size": 2560,
        "rope_theta": 100_000.0,
    },
    "qwen2.5-0.5b": {  # 494,032,768 (151,936 tokens)
        "arch": "llama", "n_layer": 24, "n_head": 14, "d_model": 896, "n_kv_head": 2, "intermediate_size": 4864,
        "rope_theta": 1_000_000.0, "bias": True, "norm_eps": 1e-6,
    },
    "llama3.2-1b": {  # 1,235,814,400 (128,256 tokens)
        "arch": "llama", "n_layer": 16, "n_head": 32, "d_model": 2048, "n_kv_head": 8, "intermediate_size": 8192,
        "rope_theta": 500_000.0, "rope_scaling": "llama3", "rope_factor": 32.0,
    },
}  # fmt: skip
# What a key is when neither the configuration nor the preset sets it.
FAMILY_DEFAULTS = {
    "gpt2": {"bias": False, "tie_embeddings": True},
    "llama": {
        "bias": False,
        "tie_embeddings": True,
        "n_kv_head": 0,  # n_head
        "head_dim": 0,  # d_model / n_head
        "intermediate_size": 0,  # swiglu_width(d_model)
        "rope_theta": 10_000.0,
        "rope_scaling": None,
        "rope_factor": 8.0,  # Llama 3.1's
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_context": 8192,
        "norm_eps": 1e-5,
    },
}
SHARED_KEYS = ("n_layer", "n_head", "d_model")
LLAMA_ONLY = tuple(key for key in FAMILY_DEFAULTS["llama"] if key not in FAMILY_DEFAULTS["gpt2"])
ROPE_SCALING = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")


def swiglu_width(d_model: int) -> int:
    """8/3 x d_model rounded up to a multiple of 32 (Llama's rule, with a smaller multiple)."""
    return -(-8 * d_model // 96) * 32


def arch_of(cfg: ModelConfig) -> str:
    """model.arch, or the preset's family, or the default for a new model."""
    return cfg.arch or PRESETS[cfg.preset].get("arch", DEFAULT_ARCH)


@dataclass
class ModelShape:
    """Everything that decides the model's tensors and its arithmetic."""

    arch: str
    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    bias: bool = False  # gpt2: every Linear's bias; llama: q/k/v's (Qwen2)
    positions: int = 0  # the longest input; gpt2: rows of the position table (0: seq_len)
    tie_embeddings: bool = True
    n_kv_head: int = 0  # llama from here: key/value heads (0: n_head)
    head_dim: int = 0  # width of a head (0: d_model / n_head)
    intermediate_size: int = 0  # the SwiGLU MLP's width (0: swiglu_width(d_model))
    rope_theta: float = 10_000.0
    rope_scaling: tuple = ()  # llama3: (factor, low_freq_factor, high_freq_factor, original context)
    norm_eps: float = 1e-5

    def __post_init__(self):
        if not self.head_dim and self.d_model % self.n_head:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        self.positions = self.positions or self.seq_len
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.d_model // self.n_head
        self.intermediate_size = self.intermediate_size or swiglu_width(self.d_model)

    @classmethod
    def of(cls, cfg: ModelConfig, vocab_size: int, seq_len: int) -> ModelShape:
        """Each key from the configuration when set, else the preset's, else the family's
        (model.init_from sets them all from the folder's config.json)."""
        arch = arch_of(cfg)
        known = {**FAMILY_DEFAULTS[arch], **PRESETS[cfg.preset]}
        keys = (*SHARED_KEYS, *FAMILY_DEFAULTS[arch])
        value = {key: getattr(cfg, key) if getattr(cfg, key) is not None else known[key] for key in keys}
        heads, kv_heads = value["n_head"], value.get("n_kv_head")
        if arch == "llama" and cfg.n_kv_head is None and kv_heads and heads % kv_heads:
            raise ConfigError(
                f"model.n_head={heads} is not a multiple of the preset's model.n_kv_head={kv_heads}: "
                "set model.n_kv_head to a divisor of it"
            )
        scaling = value.pop("rope_scaling", None)
        scaling_values = tuple(value.pop(key, None) for key in ROPE_SCALING)
        if scaling == "llama3":
            value["rope_scaling"] = scaling_values
        shape = cls(arch, vocab_size, seq_len, dropout=cfg.dropout, positions=cfg.n_positions or 0, **value)
        shape.check()
        return shape

    def check(self) -> None:
        """Sizes that do not fit together, named by their keys."""
        if self.arch == "gpt2" and not self.tie_embeddings:
            raise ConfigError("model.tie_embeddings=false: GPT-2's output layer is its token embedding")
        if self.arch == "llama":
            if self.n_head % self.n_kv_head:
                raise ConfigError(f"model.n_kv_head={self.n_kv_head} does not divide model.n_head={self.n_head}")
            if self.head_dim % 2:
                raise ConfigError(f"model.head_dim={self.head_dim} must be even (rotary embeddings turn pairs)")


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> nn.Module:
    return architecture(ModelShape.of(cfg, vocab_size, seq_len))


def architecture(shape: ModelShape) -> nn.Module:
    """The module of shape.arch, initialised from the global generator."""
    return Llama(shape) if shape.arch == "llama" else GPT(shape)


# The modules init_module initialises: all that hold parameters.
INIT_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy per token (float32), targets equal to IGNORE (-100) not counted."""
    if targets.dtype != torch.long or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must be token ids of shape {tuple(logits.shape[:-1])} and dtype long, "
            f"got shape {tuple(targets.shape)} and dtype {targets.dtype}"
        )
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
