"""The pieces both model families share: causal attention through SDPA (grouped-query, with a
key/value cache for generation) and rotary position embeddings in Hugging Face's layout.

Rotary embeddings rotate the two halves of each head (`rotate_half`), as Hugging Face's Llama,
Qwen2 and Mistral store their q/k projections, so their weights load as they are, with no
permutation. The frequencies are computed in float32 exactly as transformers computes them
(rope_frequencies), including Llama 3's `llama3` scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class Rope:
    """Rotary position embeddings: the base period, and Llama 3's frequency scaling (factor 0: none)."""

    theta: float = 10_000.0
    factor: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


def rope_frequencies(head_dim: int, rope: Rope, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32: theta ** (-2i / head_dim), and with rope.factor
    Llama 3's scaling (long wavelengths divided by the factor, short ones kept, a smooth blend between)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if not rope.factor:
        return inv_freq
    low_wavelen = rope.original_context / rope.low_freq_factor
    high_wavelen = rope.original_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, the half-frequencies repeated (rotate_half's layout):
    [time, head_dim] for positions [time], [batch, 1, time, head_dim] for positions [batch, time]
    (packed sequences, whose positions restart at each document)."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    if positions.dim() == 2:
        angles = angles[:, None]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, time, head_dim] rotated by each position's angles."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # float32 angles, applied in the activations' precision
    return x * cos + rotate_half(x) * sin


class KVCache:
    """The keys and values of the tokens seen so far, per block, preallocated for `capacity` tokens
    ([batch, n_kv_head, capacity, head_dim] each): generation runs the prompt once, then one token
    per step, instead of the whole sequence again for every new token."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, head_dim: int, capacity: int, like: torch.Tensor):
        shape = (batch, n_kv_head, capacity, head_dim)
        self.keys = [like.new_empty(shape) for _ in range(n_layer)]
        self.values = [like.new_empty(shape) for _ in range(n_layer)]
        self.length = 0  # tokens held (the position of the next token)
        self.capacity = capacity

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this block's new keys and values after the held ones; return all of them."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens; {end} were given")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, tokens: int) -> None:
        """The model ran `tokens` more positions through every block."""
        self.length += tokens


def packed(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences packed from several documents (documents [batch, time]: each position's document
    number, the same number never twice apart), each position's place in its document [batch, time]
    and the attention mask [batch, 1, time, time]: a query sees the keys of its own document up to
    itself, never another document's."""
    index = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values  # where each position's document starts
    same = documents[:, :, None] == documents[:, None, :]
    return index - first, (same & (index[None, :] <= index[:, None]))[:, None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float = 0.0,
    cache: KVCache | None = None,
    layer: int = 0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention, q [batch, n_head, time, head_dim] over k, v [batch, n_kv_head, time, head_dim]
    (n_kv_head divides n_head: each key/value head serves n_head / n_kv_head query heads, in SDPA).

    With a cache, k and v are appended to the held ones and each new query attends to every held
    position and to the new ones up to its own. With a mask (packed documents: `packed`), a query
    attends where the mask is True."""
    gqa = k.shape[1] != q.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    held = 0
    if cache is not None:
        held = cache.length
        k, v = cache.update(layer, k, v)
    time = q.shape[2]
    if held == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
    if time == 1:  # one new token sees everything held
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, enable_gqa=gqa)
    keys = torch.arange(k.shape[2], device=q.device)
    mask = keys[None, :] <= torch.arange(held, held + time, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)


# The layers that write into the residual stream, one per branch (GPT-2's names, then Llama's).
RESIDUAL_OUTPUTS = ("attn.proj", "mlp.2", "self_attn.o_proj", "mlp.down_proj")


def init_module(name: str, module: torch.nn.Module, generator: torch.Generator | None, n_layer: int) -> None:
    """GPT-2's initialisation, for both families: weights N(0, 0.02), the layers that write into the
    residual stream scaled by 1/sqrt(2 x n_layer) so that its variance does not grow with depth;
    biases zero; norms one (and LayerNorm's bias zero). One module at a time: meta_init.py draws
    each module's values from its own generator, whole or sharded (generator None: the global one)."""
    if isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm):
        torch.nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)
        return
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(RESIDUAL_OUTPUTS) else 0.02
    torch.nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
    if getattr(module, "bias", None) is not None:
        torch.nn.init.zeros_(module.bias)


def reset_parameters(model: torch.nn.Module, n_layer: int) -> None:
    """init_module for every module that holds parameters, from the global generator."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                init_module(name, module, None, n_layer)
