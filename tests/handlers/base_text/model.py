"""A tiny EmbeddingBag text classifier: model(token_ids, offsets) -> scores for 3 classes."""

import torch
from torch import nn


class TinyTextNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(16, 8, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, text: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(text, offsets))
