"""Write the tiny LM's weights, made locally from seed 0 (no download): untrained, so it
generates noise, but noise with the shapes, costs and KV cache of a real decoder.

    python examples/tiny_lm/make_weights.py out/tiny_lm.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def write(path: Path) -> Path:
    if str(HERE) not in sys.path:  # run as a script: model.py is next to it
        sys.path.insert(0, str(HERE))
    from model import TinyLM

    torch.manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(TinyLM().state_dict(), path)
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny_lm.pt")))
