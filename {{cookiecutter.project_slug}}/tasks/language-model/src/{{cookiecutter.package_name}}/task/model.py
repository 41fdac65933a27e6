"""The model: a decoder-only transformer (GPT-2's shape) written out, and its named sizes.

GPT-2's architecture (model.bias adds its Linear biases, hf.py reads and writes its weights):
pre-norm blocks in an nn.ModuleList (FSDP shards each block: distributed.shard_model), causal
scaled_dot_product_attention (flash or memory-efficient kernels on GPU), learned positions, and
the output layer tied to the token embedding. Parallelism is applied in distributed.py, never here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..engine.errors import ConfigError
from .config import ModelConfig

# Named sizes: parameters without the embeddings are about 12 x n_layer x d_model**2.
PRESETS = {
    "nano": {"n_layer": 2, "n_head": 2, "d_model": 64},  # 0.1M: tests
    "micro": {"n_layer": 4, "n_head": 4, "d_model": 128},  # 0.8M
    "mini": {"n_layer": 6, "n_head": 6, "d_model": 192},  # 2.7M: the CPU demo
    "small": {"n_layer": 8, "n_head": 8, "d_model": 512},  # 25M
    "gpt2": {"n_layer": 12, "n_head": 12, "d_model": 768},  # 85M; 124M with GPT-2's 50257-token vocabulary
}


@dataclass
class GPTShape:
    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    bias: bool = False  # Linear biases, as GPT-2 has them
    positions: int = 0  # rows of the position table: the longest input (0: seq_len)

    def __post_init__(self):
        self.positions = self.positions or self.seq_len

    @classmethod
    def of(cls, cfg: ModelConfig, vocab_size: int, seq_len: int) -> GPTShape:
        """The preset, with any of model.n_layer, n_head, d_model set explicitly winning (model.init_from
        sets them all, config.validate)."""
        sizes = {key: getattr(cfg, key) or value for key, value in PRESETS[cfg.preset].items()}
        if sizes["d_model"] % sizes["n_head"]:
            raise ConfigError(f"model.d_model={sizes['d_model']} is not divisible by model.n_head={sizes['n_head']}")
        return cls(vocab_size, seq_len, dropout=cfg.dropout, bias=cfg.bias, positions=cfg.n_positions or 0, **sizes)


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.n_head, self.dropout = shape.n_head, shape.dropout
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model, bias=shape.bias)
        self.proj = nn.Linear(shape.d_model, shape.d_model, bias=shape.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (
            t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        self.norm1 = nn.LayerNorm(shape.d_model)
        self.attn = CausalSelfAttention(shape)
        self.norm2 = nn.LayerNorm(shape.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(shape.d_model, 4 * shape.d_model, bias=shape.bias),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * shape.d_model, shape.d_model, bias=shape.bias),
        )
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


# The modules GPT.init_module initialises: all that hold parameters.
INIT_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm)


class GPT(nn.Module):
    """Token ids [batch, time] (time up to seq_len) -> logits [batch, time, vocab]."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = nn.Embedding(shape.positions, shape.d_model)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.norm = nn.LayerNorm(shape.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), the projections into the residual stream scaled by
        1/sqrt(2 x n_layer) so that its variance does not grow with depth; biases zero."""
        for name, param in self.named_parameters():
            if param.dim() < 2:
                if name.endswith(".bias") and "norm" not in name:
                    nn.init.zeros_(param)  # LayerNorm: ones and zeros, as constructed
                continue
            std = (
                0.02 / math.sqrt(2 * self.shape.n_layer)
                if name.endswith(("attn.proj.weight", "mlp.2.weight"))
                else 0.02
            )
            nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.tok_emb.weight)  # tied: one matrix embeds and predicts


def init_module(name: str, module: nn.Module, generator: torch.Generator, n_layer: int) -> None:
    """GPT.reset_parameters' rule for one module, drawn from generator (meta_init.py builds the
    model on the meta device and initialises it module by module, sharded or whole)."""
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
        return
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn.proj", "mlp.2")) else 0.02
    nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> GPT:
    return GPT(GPTShape.of(cfg, vocab_size, seq_len))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy per token (float32), targets equal to IGNORE (-100) not counted."""
    if targets.dtype != torch.long or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must be token ids of shape {tuple(logits.shape[:-1])} and dtype long, "
            f"got shape {tuple(targets.shape)} and dtype {targets.dtype}"
        )
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
