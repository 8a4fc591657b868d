"""Write the example's weights (a state dict, seed 0) and a test image; no download needed.

python examples/image_classifier/make_weights.py out
"""

import sys
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import TinyCNN


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(TinyCNN().state_dict(), out / "tiny_cnn.pt")
    Image.new("RGB", (320, 240), (200, 40, 40)).save(out / "red.png")
    print(f"wrote {out / 'tiny_cnn.pt'} and {out / 'red.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out"))
