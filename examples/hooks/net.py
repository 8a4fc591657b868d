"""The model class the pytorch driver creates (options.model_class in model-config.yaml)."""

import torch
from torch import nn


class Classifier(nn.Module):
    """Four measurements in, one probability per class out."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.out(torch.relu(self.hidden(features))), dim=-1)
