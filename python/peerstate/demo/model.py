"""A small GPT (decoder-only transformer) and the text it learns, for the demo."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

WORDS = ("the model learns while ranks fail and recover from their buddies in seconds without a checkpoint "
         "every step is kept in memory and copied to another node so a spare can take its place the loss "
         "goes down as if nothing happened because the state is restored bit for bit").split()


def corpus(characters: int = 200_000, seed: int = 0) -> str:
    """Generated text (nothing is downloaded): sentences drawn from a small
    vocabulary with a bigram-ish bias, so there is structure to learn."""
    draw = random.Random(seed)
    words, previous, length = [], 0, 0
    while length < characters:
        index = (previous + draw.choice((1, 1, 2, 3, draw.randrange(len(WORDS))))) % len(WORDS)
        word = WORDS[index] + ("." if draw.random() < 0.08 else "")
        words.append(word)
        length += len(word) + 1
        previous = index
    return " ".join(words)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, width: int = 192, layers: int = 4, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        return self.head(self.norm(self.blocks(x)))


class Batches:
    """Batch ``step`` of rank ``rank``: a function of (seed, step, rank) only, so a
    replayed step sees exactly the same tokens."""

    def __init__(self, text: str, context: int, batch: int, seed: int) -> None:
        self.vocabulary = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocabulary)}
        self.data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.context, self.batch, self.seed = context, batch, seed

    def __call__(self, step: int, rank: int):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        starts = torch.randint(0, len(self.data) - self.context - 1, (self.batch,), generator=generator)
        x = torch.stack([self.data[s : s + self.context] for s in starts])
        y = torch.stack([self.data[s + 1 : s + 1 + self.context] for s in starts])
        return x, y


def build(vocabulary_size: int, width: int, layers: int, seed: int):
    """The demo's model, optimizer and learning-rate schedule, seeded: (model, optimizer, scheduler)."""
    torch.manual_seed(seed)
    model = TinyGPT(vocabulary_size, width=width, layers=layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return model, optimizer, scheduler


def train_step(ddp: nn.Module, optimizer, scheduler, batches: Batches, step: int, rank: int) -> float:
    """One step of rank ``rank`` on batch ``step``; returns its loss."""
    x, y = batches(step, rank)
    device = next(ddp.parameters()).device
    x, y = x.to(device), y.to(device)
    loss = F.cross_entropy(ddp(x).view(-1, len(batches.vocabulary)), y.view(-1))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return loss.item()
