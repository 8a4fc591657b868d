"""Read and write checkpoints in NVIDIA's published layout.

NVIDIA's ``nvidia_tacotron2pyt_fp32_*.pth`` and ``nvidia_waveglowpyt_fp32_*.pth`` files hold a dict
with a ``state_dict`` whose keys carry the ``module.`` prefix of a DistributedDataParallel wrapper
(and a ``config`` dict beside it). Loading strips the prefix, reads the sizes from the tensor
shapes and loads strictly, so a wrong or truncated file fails at load, naming the tensor, instead
of producing noise later. The small test checkpoints are written in the same layout, so the
handler has one loading path for both.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch
from tacotron2_model import Tacotron2, Tacotron2Config
from waveglow_model import WaveGlow, WaveGlowConfig

PREFIX = "module."


def read_state_dict(path: str | os.PathLike[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, prefix removed; a bare state dict is accepted too."""
    data: Any = torch.load(path, map_location=device, weights_only=True)
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"{path}: expected a checkpoint dict with a 'state_dict', found {type(data).__name__}"
        )
    return {k[len(PREFIX) :] if k.startswith(PREFIX) else k: v for k, v in data.items()}


def load_tacotron2(path: str | os.PathLike[str], device: torch.device) -> Tacotron2:
    """A Tacotron2 of the checkpoint's own sizes, weights loaded strictly, in eval mode."""
    state = read_state_dict(path, device)
    with torch.device("meta"):
        model = Tacotron2(Tacotron2Config.from_state_dict(state))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_waveglow(
    path: str | os.PathLike[str], device: torch.device, hop_length: int = 256
) -> WaveGlow:
    """A WaveGlow of the checkpoint's own sizes, loaded strictly and prepared for inference."""
    state = read_state_dict(path, device)
    with torch.device("meta"):
        model = WaveGlow(WaveGlowConfig.from_state_dict(state, hop_length))
    model.load_state_dict(state, strict=True, assign=True)
    return model.prepare_for_inference()


def save_nvidia_checkpoint(model: Tacotron2 | WaveGlow, path: str | os.PathLike[str]) -> None:
    """Write ``model`` as NVIDIA does: ``{"state_dict": {"module." + key: tensor}, "config"}``."""
    state = {PREFIX + k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = f"{path}.tmp"
    torch.save({"state_dict": state, "config": asdict(model.cfg)}, tmp)
    os.replace(tmp, path)
