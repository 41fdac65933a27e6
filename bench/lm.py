"""The language-model contender's parts, written out without the generated project's code.

The generated language-model project's defaults (data.*, model.preset=micro, optim.*): the synthetic
Markov source (the same tokens: the same generator calls as the project's data.MarkovSource),
training windows of seq_len + 1 tokens through a shuffled DataLoader, a GPT-2-shaped decoder with
the same parameters (pre-norm blocks, causal scaled_dot_product_attention, learned positions, the
output layer tied to the token embedding), AdamW without weight decay on biases and norm weights,
warmup-cosine, clipping at 1.0, cross-entropy per token. contenders.py imports this in the timed
process only, after the step hook, so nothing here is imported at its module level.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

SEQ_LEN, BATCH = 128, 32  # data.seq_len, data.batch_size
VOCAB, ORDER, CONCENTRATION, CONTEXT_CONCENTRATION = 32, 2, 0.2, 0.5  # data.* (synthetic)
N_LAYER, N_HEAD, D_MODEL = 4, 4, 128  # model.preset=micro
LR, WEIGHT_DECAY, WARMUP, MIN_LR_RATIO = 0.003, 0.1, 30, 0.01  # optim.*
BETAS = (0.9, 0.95)  # optim.betas, the language model's default
CLIP = 1.0  # trainer.grad_clip
DATA_SEED, STREAMS = 0, 64  # the project's synthetic source and its training split's streams


def train_tokens_for(total_steps: int) -> int:
    """data.train_tokens for an epoch of total_steps + 1 batches (the runs are short)."""
    return SEQ_LEN * (BATCH * (total_steps + 1) + 2) + 1


def markov_tokens(tokens: int) -> np.ndarray:
    """The training split of the project's synthetic source: an order-2 Markov chain over 32
    symbols, sampled as 64 independent streams, one after the other (uint8)."""
    rng = np.random.default_rng(DATA_SEED)
    contexts = VOCAB**ORDER
    by_last = rng.dirichlet(np.full(VOCAB, CONCENTRATION), size=VOCAB)
    around = CONTEXT_CONCENTRATION * VOCAB * by_last[np.arange(contexts) % VOCAB] + 1e-3
    next_probs = np.stack([rng.dirichlet(alpha) for alpha in around])
    # The chain's stationary distribution over contexts (where each stream starts).
    successors = ((np.arange(contexts)[:, None] * VOCAB) % contexts + np.arange(VOCAB)).ravel()
    pi = np.full(contexts, 1.0 / contexts)
    for _ in range(10_000):
        flow = (pi[:, None] * next_probs).ravel()
        new = np.bincount(successors, weights=flow, minlength=contexts)
        done, pi = np.abs(new - pi).sum() < 1e-13, new
        if done:
            break
    rng = np.random.default_rng(DATA_SEED + 1)
    length = math.ceil(tokens / STREAMS)
    cumulative = next_probs.cumsum(axis=1)
    context = rng.choice(contexts, size=STREAMS, p=pi)
    out = np.empty((STREAMS, length), dtype=np.uint8)
    for t in range(length):
        draws = rng.random(STREAMS)
        symbols = (draws[:, None] > cumulative[context]).sum(axis=1).clip(max=VOCAB - 1)
        out[:, t] = symbols
        context = (context * VOCAB) % contexts + symbols
    return out.reshape(-1)[:tokens]


def fingerprint(tokens: np.ndarray) -> int:
    """A checksum of the training tokens: every contender must train on the same ones."""
    return zlib.crc32(np.ascontiguousarray(tokens, dtype=np.uint8).tobytes())


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of SEQ_LEN + 1 tokens (int64)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens
        self.count = (len(tokens) - 1) // SEQ_LEN - 1

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        start = index * SEQ_LEN
        return torch.from_numpy(self.tokens[start : start + SEQ_LEN + 1].astype(np.int64))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL, bias=False),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * D_MODEL, D_MODEL, bias=False),
        )

    def forward(self, x):
        batch, time, width = x.shape
        q, k, v = (
            t.view(batch, time, N_HEAD, width // N_HEAD).transpose(1, 2)
            for t in self.qkv(self.norm1(x)).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.Sequential(*(Block() for _ in range(N_LAYER)))
        self.norm = nn.LayerNorm(D_MODEL)
        for name, param in self.named_parameters():  # GPT-2's initialisation
            if param.dim() > 1:
                scaled = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * N_LAYER) if scaled else 0.02)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.tok_emb(tokens) + self.pos_emb(positions))
        return F.linear(self.norm(x), self.tok_emb.weight)  # tied to the embedding


def parts(total_steps: int):
    """Model, loader, optimizer, schedule and the data's fingerprint, as a script builds them."""
    tokens = markov_tokens(train_tokens_for(total_steps))
    loader = torch.utils.data.DataLoader(
        Windows(tokens), batch_size=BATCH, shuffle=True, drop_last=True
    )
    model = GPT()
    groups = [
        {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)

    def schedule(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = min(1.0, (step - WARMUP) / max(1, total_steps - WARMUP))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return model, loader, optimizer, scheduler, fingerprint(tokens)


def run_raw(total_steps: int, log_every: int) -> int:
    """The minimal loop: zero_grad, forward, loss, backward, clip, step; returns the data's
    fingerprint."""
    model, loader, optimizer, scheduler, data = parts(total_steps)
    model.train()
    for step, windows in enumerate(loader):
        if step == total_steps:
            break
        optimizer.zero_grad(set_to_none=True)
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        if (step + 1) % log_every == 0:
            loss.item()
    return data


def generated_overrides(total_steps: int, log_every: int) -> list[str]:
    """The generated project's command-line overrides for the same run (its defaults spelled out
    where they set the work per step)."""
    return [
        "model.preset=micro",
        "model.arch=gpt2",  # the raw loop's GPT (the project's default family is llama)
        f"data.seq_len={SEQ_LEN}",
        f"data.batch_size={BATCH}",
        "data.loader=workers",  # a DataLoader, as the raw loop's: the loops are compared
        "data.num_workers=0",
        f"data.train_tokens={train_tokens_for(total_steps)}",
        "data.val_tokens=4096",  # validation follows the timed steps; keep it short
        f"trainer.max_steps={total_steps}",
        f"trainer.log_every={log_every}",
    ]
