"""What the GPT-style porting pair shares: arguments, a token corpus, a small GPT and the batch draw.

``ddp_gpt.py`` (torchrun, DDP) and ``train_gpt.py`` (hgcli.runtime) are the shape of a widely used
GPT training script: no ``DataLoader``, each rank draws random windows of one token array with its
own generator. They differ only in the lines that distribute the training (docs/runtime.md,
"Scripts that draw their own batches"), so everything else lives here.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .recipe import torchrun_device as torchrun_device     # the torchrun twin's device


@dataclass(frozen=True)
class GPTConfig:
    """The example GPT's size: vocabulary, context length, blocks, heads and width."""

    vocab: int = 32
    block: int = 32         # context length
    layers: int = 2
    heads: int = 2
    width: int = 64


def parse_args(doc: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="windows per rank and step unless the plan sets one")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the corpus, the initial parameters, the draws")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    return parser.parse_args(argv)


def corpus(seed: int, length: int = 1 << 16, vocab: int = GPTConfig.vocab) -> torch.Tensor:
    """A token array from a fixed random Markov chain (each token has three likely successors), so a
    model can learn it: the loss falls from ln(vocab) towards the chain's entropy (about ln 3)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 3), generator=gen).tolist()
    tokens = [0]
    for pick in torch.randint(3, (length - 1,), generator=gen).tolist():
        tokens.append(successors[tokens[-1]][pick])
    return torch.tensor(tokens)


def get_batch(tokens: torch.Tensor, batch: int, gen: torch.Generator, device: torch.device,
              block: int = GPTConfig.block) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``block`` tokens and the same windows one token on (the targets)."""
    starts = torch.randint(len(tokens) - block - 1, (batch,), generator=gen)
    x = torch.stack([tokens[s:s + block] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + block] for s in starts.tolist()])
    return x.to(device), y.to(device)


class Block(nn.Module):
    """One decoder block: causal self-attention then an MLP, each behind a pre-norm residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer; ``forward(idx, targets)`` returns (logits, loss) as nanoGPT's does."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)            # every rank starts from the same parameters
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.block, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
