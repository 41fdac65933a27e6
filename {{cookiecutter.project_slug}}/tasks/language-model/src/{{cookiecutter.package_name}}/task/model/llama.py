"""The Llama family (Llama 2 and 3, SmolLM2, TinyLlama, Qwen2, Mistral): RMSNorm, rotary positions,
a SwiGLU MLP, grouped-query attention, optional q/k/v biases (Qwen2's: model.bias), the output
tied to the token embedding or its own matrix (model.tie_embeddings).

Modules carry Hugging Face's names (embed_tokens, layers.N.self_attn.q_proj, ..., norm, lm_head),
so that hf.py reads and writes a LlamaForCausalLM folder by adding or removing "model.", and the
rotary embedding is in Hugging Face's rotate_half layout (blocks.py): no weight is permuted.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .blocks import KVCache, Rope, apply_rope, attend, packed, reset_parameters, rope_cos_sin, rope_frequencies


class Attention(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        self.dropout = shape.dropout
        self.q_proj = nn.Linear(shape.d_model, shape.n_head * shape.head_dim, bias=shape.bias)
        self.k_proj = nn.Linear(shape.d_model, shape.n_kv_head * shape.head_dim, bias=shape.bias)
        self.v_proj = nn.Linear(shape.d_model, shape.n_kv_head * shape.head_dim, bias=shape.bias)
        self.o_proj = nn.Linear(shape.n_head * shape.head_dim, shape.d_model, bias=False)

    def forward(self, x, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None, layer: int, mask=None):
        batch, time, _ = x.shape
        q = self.q_proj(x).view(batch, time, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, time, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, time, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q, k, v, self.dropout if self.training else 0.0, cache, layer, mask)
        return self.o_proj(y.transpose(1, 2).reshape(batch, time, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, shape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.d_model, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.d_model, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        self.mlp = MLP(shape)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0, mask=None) -> torch.Tensor:
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Llama(nn.Module):
    """Token ids [batch, time] -> logits [batch, time, vocab]; with documents [batch, time] (packed
    sequences: each position's document number), positions restart at each document and no
    position attends to another document (blocks.packed)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.rope = Rope(shape.rope_theta, *shape.rope_scaling)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.d_model)
        self.drop = nn.Dropout(shape.dropout)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.n_layer))
        self.norm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        if not shape.tie_embeddings:
            self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        reset_parameters(self, shape.n_layer)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, documents=None) -> torch.Tensor:
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        mask = None
        if documents is not None:
            positions, mask = packed(documents)
        # Angles in float32 from the positions, each forward (no buffer: nothing to initialise,
        # shard or checkpoint, and exact at any length).
        cos, sin = rope_cos_sin(rope_frequencies(self.shape.head_dim, self.rope, tokens.device), positions)
        x = self.drop(self.embed_tokens(tokens))
        for layer, block in enumerate(self.layers):
            x = block(x, cos, sin, cache, layer, mask)
        if cache is not None:
            cache.advance(tokens.shape[1])
        head = self.embed_tokens.weight if self.shape.tie_embeddings else self.lm_head.weight
        return F.linear(self.norm(x), head)
