"""Loads pretrained weights as torchvision's models do: ``torch.hub.load_state_dict_from_url``,
which finds them in torch.hub's cache (``<hub dir>/checkpoints/<file name of the URL>``) and
downloads only what is not there. The request body names the URL; the answer says where torch
looked and what it loaded."""

import json
import os


def handle(data, context):
    if data is None:
        return None
    import torch.hub

    body = data[0].get("body") or data[0].get("data")
    url = (json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body)["url"]
    weights = torch.hub.load_state_dict_from_url(url, map_location="cpu")
    loaded = {name: tensor.tolist() for name, tensor in weights.items()}
    return [json.dumps({"hub_dir": torch.hub.get_dir(), "weights": loaded,
                        "hf_hub_cache": os.environ.get("HF_HUB_CACHE")})]  # fmt: skip
