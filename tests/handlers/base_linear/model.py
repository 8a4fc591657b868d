"""A linear model, 4 features -> 3 scores: its gradients are its weights, easy to check."""

import torch
from torch import nn


class Linear4(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)
