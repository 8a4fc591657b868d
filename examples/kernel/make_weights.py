"""Write the example's weights (seed 0, no download): python make_weights.py out/linear.pt"""

import sys
from pathlib import Path

import torch
from torch import nn


def main(path: str) -> None:
    torch.manual_seed(0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(nn.Linear(4, 3).state_dict(), path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/linear.pt")
