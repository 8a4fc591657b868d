"""A stack of Linear layers (8 MiB of float32 weights): big enough that its pages are worth
keeping warm, small enough for a test."""

import torch
from torch import nn

WIDTH = 512
DEPTH = 8


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers(x))
