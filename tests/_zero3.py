"""The model of the ZeRO-3 tests: ``Net`` (root parameters around three wrapped ``Block``s, odd
sizes so the flat buffers need padding), its batches (``batch``: [micro, rank, rows, features])
and optimizers (``make_opt``), and ``full_params`` (a Zero3 model's gathered parameters)."""

from __future__ import annotations

import torch
from _training import global_batch
from torch import nn

from fastpar.optim import FusedAdamW
from fastpar.zero import Zero3

STEPS = 4
D_IN, D_H, D_OUT = 7, 13, 5


class Block(nn.Module):
    """A residual MLP block (odd sizes: the flat buffers need padding)."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.tanh(self.fc1(x))))


class Net(nn.Module):
    """Root parameters (inp, head) around three wrapped blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D_H)
        self.blocks = nn.ModuleList(Block(D_H, 11) for _ in range(3))
        self.head = nn.Linear(D_H, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch(step: int, micro: int, world: int):
    """Step ``step``'s inputs and targets, [micro, rank, rows, features]."""
    return global_batch(step, micro, world, D_IN, D_OUT)


def make_opt(name: str, params, reference: bool = False):
    """SGD with momentum, or AdamW: fastpar's fused one, or (``reference``) torch's
    single-tensor one, the oracle."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if reference:
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, foreach=False)
    return FusedAdamW(params, lr=0.01, weight_decay=0.01)


def full_params(model: Zero3) -> list[torch.Tensor]:
    """Copies of the model's whole parameters (gathered from the shards)."""
    with model.summon_full_params():
        return [p.detach().clone() for p in model.module.parameters()]
