"""Write small Tacotron2 and WaveGlow checkpoints, seed 0, in NVIDIA's published layout.

No weights can be downloaded where this project is tested, so tests, the demo and the benchmark
use these: the same architecture at a small width, randomly initialised. They speak noise, not
English; the real checkpoints (see README.md) speak English and load through the same code.

Usage: python examples/waveglow/make_checkpoints.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvidia_checkpoints import save_nvidia_checkpoint
from tacotron2_model import Tacotron2, Tacotron2Config
from waveglow_model import WaveGlow, WaveGlowConfig

TACOTRON2_FILE = "nvidia_tacotron2pyt_fp32_small.pth"
WAVEGLOW_FILE = "nvidia_waveglowpyt_fp32_small.pth"

# 32 mel bands instead of 80 keeps WaveGlow's upsampling layer (bands^2 * 1024 weights) at 4 MB.
SMALL_TACOTRON2 = Tacotron2Config(
    n_mel_channels=32,
    symbols_embedding_dim=32,
    encoder_embedding_dim=32,
    prenet_dim=32,
    attention_rnn_dim=64,
    decoder_rnn_dim=64,
    attention_dim=32,
    attention_location_n_filters=8,
    postnet_embedding_dim=32,
)
SMALL_WAVEGLOW = WaveGlowConfig(n_mel_channels=32, n_flows=8, n_layers=2, n_channels=32)


def make_tacotron2(seed: int = 0) -> Tacotron2:
    torch.manual_seed(seed)
    model = Tacotron2(SMALL_TACOTRON2)
    with torch.no_grad():
        # Random weights never learned when to stop. A firmly closed gate makes every text run to
        # its own step bound, so durations are reproducible instead of a coin toss.
        model.decoder.gate_layer.linear_layer.bias.fill_(-10.0)
    return model.eval()


def make_waveglow(seed: int = 0) -> WaveGlow:
    torch.manual_seed(seed)
    model = WaveGlow(SMALL_WAVEGLOW)
    with torch.no_grad():
        # The recipe zeroes each coupling's last layer (an identity flow at the start of
        # training). Small random values instead make the output depend on the mel.
        for block in model.WN:
            block.end.weight.normal_(0.0, 0.02)
            block.end.bias.zero_()
    return model.eval()


def write(out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write both checkpoints into ``out_dir`` and return their paths (Tacotron2, WaveGlow)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tacotron2, waveglow = out_dir / TACOTRON2_FILE, out_dir / WAVEGLOW_FILE
    save_nvidia_checkpoint(make_tacotron2(seed), tacotron2)
    save_nvidia_checkpoint(make_waveglow(seed), waveglow)
    return tacotron2, waveglow


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: make_checkpoints.py OUT_DIR")
    for path in write(Path(sys.argv[1])):
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, seed 0)")


if __name__ == "__main__":
    main()
