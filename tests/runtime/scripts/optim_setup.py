"""Model, optimizer and schedule of optim_train.py, shared with the tests' single-process references.

Imports only torch and hgcli (the tests load it by path, the script from its own directory)."""
import math

import torch

from hgcli.examples.data import CLASSES, FEATURES


def make_model(kind: str, hidden: int, seed: int = 0) -> torch.nn.Module:
    """``ln``: LayerNorm (per sample, no buffers: one process over the union batch is the reference);
    ``bn``: BatchNorm on the inputs first, so its running mean follows the data's mean."""
    torch.manual_seed(seed)
    if kind == "bn":
        return torch.nn.Sequential(torch.nn.BatchNorm1d(FEATURES, momentum=0.5),
                                   torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, CLASSES))
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.LayerNorm(hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))


def two_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The usual AdamW split: weight decay on matrices, none on norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(two_groups(model, 0.1), lr=lr, betas=(0.8, 0.99))


def warmup_cosine(opt: torch.optim.Optimizer, steps: int, warmup: int = 2) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
