"""A tiny CNN for 224 x 224 RGB images and 10 classes (eager model file for the archive)."""

import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=5, stride=4)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))
