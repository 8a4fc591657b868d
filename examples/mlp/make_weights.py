"""Write the example MLP's weights (a state dict) with a fixed seed: same seed, same tensors.

Usage: python examples/mlp/make_weights.py OUT.pt
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import MLP


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: make_weights.py OUT.pt")
    torch.manual_seed(0)
    model = MLP()
    torch.save(model.state_dict(), sys.argv[1])
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {sys.argv[1]}: {n:,} parameters, seed 0")


if __name__ == "__main__":
    main()
