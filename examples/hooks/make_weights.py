"""Write the example's state dict (seed 0, no download): python make_weights.py OUT.pt"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from net import Classifier

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "weights.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(Classifier().state_dict(), out)
    print(f"wrote {out}")
