"""Tiny torch models for the pytorch driver tests (weights are made by the tests, seed 0)."""

import torch
from torch import nn


class TinyNet(nn.Module):
    """One input, one tensor out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))


class TwoInputs(nn.Module):
    """Two named inputs (an int index among them), a tuple out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, index):
        return self.fc(x), x[:, index].sum(dim=1)
