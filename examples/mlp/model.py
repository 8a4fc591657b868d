"""A small multi-layer perceptron: 256 inputs, two hidden layers of 1024, 10 outputs.

It is the example model the demo archives and the model the benchmarks serve.
"""

import torch
from torch import nn

IN_FEATURES = 256
HIDDEN = 1024
OUT_FEATURES = 10


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, OUT_FEATURES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
