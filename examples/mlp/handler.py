"""TorchServe/MMS module-function handler for the example MLP.

Request body: ``{"data": [256 floats]}``; answer: 10 floats. The first call (with no data)
initialises, as MMS and TorchServe do for module-function handlers. A request the handler cannot
use (not JSON, no ``data``, not 256 numbers) is the client's mistake: it is answered 400 with the
reason (``context.error_response``, TorchServe's BadInput body) and the rest of its batch is
served, instead of the whole batch failing with a 500.
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


def _values(item):
    """The request's numbers, or why it has none (a string)."""
    body = item.get("body", item.get("data")) if isinstance(item, dict) else item
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body)
        except ValueError:
            return f'expected a JSON body {{"data": [{IN_FEATURES} numbers]}}'
    values = body.get("data") if isinstance(body, dict) else body
    if not isinstance(values, list):
        return f'expected {{"data": [{IN_FEATURES} numbers]}}, found no list under "data"'
    if len(values) != IN_FEATURES:
        return f"expected {IN_FEATURES} numbers in 'data', got {len(values)}"
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return f"expected {IN_FEATURES} numbers in 'data', found something else among them"
    return values


def handle(data, context):
    if _model is None:
        _initialize(context)
    if not data:
        return None
    answers, rows, good = [None] * len(data), [], []
    for i, item in enumerate(data):
        values = _values(item)
        if isinstance(values, str):  # the client's mistake: 400, the others still served
            answers[i] = context.error_response(i, 400, "BadInput", values)
        else:
            rows.append(values)
            good.append(i)
    if rows:
        device = next(_model.parameters()).device
        with torch.inference_mode():
            out = _model(torch.tensor(rows, dtype=torch.float32, device=device)).tolist()
        for k, i in enumerate(good):
            answers[i] = out[k]
    return answers
