"""GPT-2's family: learned positions, LayerNorm, a GELU MLP, fused q/k/v, the output tied to the
token embedding (model.bias adds GPT-2's Linear biases; hf.py reads and writes its weights).

Pre-norm blocks in an nn.ModuleList (FSDP shards each block: distributed.shard_model), causal
attention through SDPA (blocks.attend). Parallelism is applied in distributed.py, never here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .blocks import KVCache, attend, packed, reset_parameters


class CausalSelfAttention(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.n_head, self.dropout = shape.n_head, shape.dropout
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model, bias=shape.bias)
        self.proj = nn.Linear(shape.d_model, shape.d_model, bias=shape.bias)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, mask=None) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (
            t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = attend(q, k, v, self.dropout if self.training else 0.0, cache, layer, mask)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape):
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

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, mask=None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cache, layer, mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Token ids [batch, time] (time up to the position table's rows) -> logits [batch, time, vocab];
    with documents [batch, time], packed sequences as in llama.Llama."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = nn.Embedding(shape.positions, shape.d_model)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.norm = nn.LayerNorm(shape.d_model)
        reset_parameters(self, shape.n_layer)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, documents=None) -> torch.Tensor:
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        mask = None
        if documents is not None:
            positions, mask = packed(documents)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, mask)
        if cache is not None:
            cache.advance(tokens.shape[1])
        return F.linear(self.norm(x), self.tok_emb.weight)  # tied: one matrix embeds and predicts
