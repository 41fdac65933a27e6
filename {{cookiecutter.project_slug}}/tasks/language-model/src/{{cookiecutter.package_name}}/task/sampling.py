"""Sampling from the language model: greedy or with a temperature and top-k, with the key/value cache
(the generate command and the benchmarks' generation tasks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .model.blocks import KVCache


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    seq_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    cache: bool = True,
    vocab: int | None = None,
    stop=None,
) -> list[int]:
    """Extend prompt by max_new_tokens ids, each predicted from the last seq_len ids.

    With cache (the default) the prompt runs once and each new token once, the keys and values of
    the earlier ones kept (blocks.KVCache); without, every step runs the whole window again. Both
    give the same tokens. Once the sequence is longer than seq_len, each step runs the last seq_len
    ids afresh, as the model was trained (positions from 0), so the cache serves the first seq_len.
    vocab: the tokenizer's ids, below the embedding's padded rows (None: every row), the only ones picked.
    stop(new ids) -> True ends the sample early (after the token that made it true)."""
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    kv = _new_cache(model, seq_len, ids) if cache else None
    logits = model(ids[:, -seq_len:], kv)[:, -1, :vocab].float()
    for step in range(max_new_tokens):
        next_id = _pick(logits, temperature, top_k, generator)
        ids = torch.cat([ids, next_id], dim=1)
        if step == max_new_tokens - 1 or (stop is not None and stop(ids[0, len(prompt) :].tolist())):
            break
        if kv is not None and ids.shape[1] <= seq_len:
            logits = model(next_id, kv)[:, -1, :vocab].float()
        else:
            logits = model(ids[:, -seq_len:])[:, -1, :vocab].float()
    return ids[0, len(prompt) :].tolist()


def _new_cache(model: nn.Module, seq_len: int, ids: torch.Tensor) -> KVCache:
    shape = model.shape
    like = next(model.parameters())
    return KVCache(shape.n_layer, ids.shape[0], shape.n_kv_head, shape.head_dim, seq_len, like.detach())


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> torch.Tensor:
    """The next id: the likeliest (temperature 0), or drawn from the top_k likeliest (0: all)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
