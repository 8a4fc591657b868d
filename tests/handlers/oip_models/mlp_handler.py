"""A torch MLP (256 -> 64 -> 10) served over the Open Inference Protocol and TorchServe's path.

With ``kserveEnvelope: true`` in the model config (``mlp_config.yaml``), a v2 request's
``data[i]["body"]`` is ``{"input__0": numpy array}``; a ``/predictions`` request's body is the
JSON ``{"data": [[...256 floats...], ...]}`` as always. The weights (``mlp.pt``, a state dict)
are written by the test with a fixed seed.
"""

import os

import torch


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )

    def forward(self, x):
        return self.layers(x)


_model = None


def handle(data, context):
    global _model
    if _model is None:
        torch.set_num_threads(1)
        _model = MLP()
        path = os.path.join(context.system_properties["model_dir"], "mlp.pt")
        _model.load_state_dict(torch.load(path, weights_only=True))
        _model.eval()
    if data is None:
        return None
    out = []
    with torch.inference_mode():
        for row in data:
            if context.protocol == "v2":  # decoded tensors: answer a torch tensor
                out.append(_model(torch.from_numpy(row["body"]["input__0"])))
            else:
                x = torch.tensor(row["body"]["data"], dtype=torch.float32)
                out.append(_model(x).tolist())
    return out
