"""Write the tiny LM's weights, made locally from seed 0 (no download): untrained, so it
generates noise, but noise with the shapes, costs and KV cache of a real decoder. The handler
reads the model's width and depth from the weights, so a bigger one serves unchanged (a
per-token cost closer to a real LLM's, for benchmarks).

    python examples/tiny_lm/make_weights.py out/tiny_lm.pt [--dim 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def write(path: Path, dim: int | None = None, layers: int | None = None) -> Path:
    """Seed-0 weights at ``path``: the example's size unless ``dim``/``layers`` say."""
    if str(HERE) not in sys.path:  # run as a script: model.py is next to it
        sys.path.insert(0, str(HERE))
    from model import DIM, LAYERS, TinyLM

    torch.manual_seed(0)
    model = TinyLM(dim or DIM, layers or LAYERS)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", default="tiny_lm.pt")
    parser.add_argument("--dim", type=int, help="the model's width (a multiple of 16; 64)")
    parser.add_argument("--layers", type=int, help="the number of blocks (2)")
    args = parser.parse_args()
    print(write(Path(args.path), args.dim, args.layers))
