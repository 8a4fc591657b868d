"""TorchServe/MMS module-function handler for the example MLP.

Request body: ``{"data": [256 floats]}``; answer: 10 floats. The first call (with no data)
initialises, as MMS and TorchServe do for module-function handlers.
"""

import json
import os

import torch
from model import IN_FEATURES, MLP

_model = None


def _initialize(context):
    global _model
    properties = context.system_properties
    model_dir = properties.get("model_dir")
    weights = os.path.join(model_dir, context.manifest["model"]["serializedFile"])
    threads = (
        (getattr(context, "model_yaml_config", None) or {}).get("handler", {}).get("threads", 1)
    )
    torch.set_num_threads(int(threads))
    gpu = properties.get("gpu_id")
    device = torch.device(f"cuda:{gpu}" if gpu is not None and torch.cuda.is_available() else "cpu")
    model = MLP()
    model.load_state_dict(torch.load(weights, map_location=device, weights_only=True))
    _model = model.to(device).eval()


def _rows(data):
    rows = []
    for item in data:
        body = item.get("body") if isinstance(item, dict) else item
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        values = body["data"] if isinstance(body, dict) else body
        if len(values) != IN_FEATURES:
            raise ValueError(f"expected {IN_FEATURES} numbers in 'data', got {len(values)}")
        rows.append(values)
    return rows


def handle(data, context):
    if _model is None:
        _initialize(context)
    if not data:
        return None
    device = next(_model.parameters()).device
    with torch.inference_mode():
        batch = torch.tensor(_rows(data), dtype=torch.float32, device=device)
        return _model(batch).tolist()
