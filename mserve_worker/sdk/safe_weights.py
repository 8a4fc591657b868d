"""Weights loaded without running the code a pickle names (docs/weights-safety.md).

``BaseHandler`` loads a state dict with ``torch.load(weights_only=True)``: torch's own
unpickler, which rebuilds tensors, containers and numbers and refuses any other global. A model
whose checkpoint pickles more (an ``argparse.Namespace`` of its training options, its own
classes) opts out in its model config with ``weightsOnly: false``, and is then unpickled as
TorchServe before torch 2.6 did: whatever the file names runs.

A ``.safetensors`` serialized file is not a pickle at all: a JSON header and the tensors' bytes,
read by the ``safetensors`` library. The library is the model environment's: without it the
load fails with a message naming the package to add (there is no pickle fallback for it).
TorchServe's BaseHandler has no safetensors path (it sends any file that is not ``.onnx`` or
an eager model's state dict to ``torch.jit.load``), so there is no behaviour of its to match.

Runs inside a worker, in the model's environment: standard library at import time; torch and
safetensors are imported by the functions that use them.
"""

from __future__ import annotations

import os
from typing import Any

OPT_OUT = "weightsOnly"  # the model config's key; false: unpickle the whole checkpoint
SAFETENSORS = ".safetensors"


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).lower().endswith(SAFETENSORS)


def weights_only(model_config: dict[str, Any] | None) -> bool:
    """Whether ``torch.load`` gets ``weights_only=True`` (the default) for this model."""
    value = (model_config or {}).get(OPT_OUT, True)
    if not isinstance(value, bool):
        raise ValueError(f"model config {OPT_OUT} must be true or false, found {value!r}")
    return value


def load_safetensors(path: str | os.PathLike[str], device: Any) -> dict[str, Any]:
    """The tensors of a ``.safetensors`` file, on ``device``; nothing is unpickled."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ImportError(
            f"{os.path.basename(os.fspath(path))} is a safetensors file, which loads with the "
            f"safetensors library, and this model's environment cannot import it ({exc}): add "
            f"safetensors to the archive's requirements file, or pip install it next to the "
            f"server"
        ) from exc
    return load_file(os.fspath(path), device=str(device))
