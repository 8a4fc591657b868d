"""Hooks around the pytorch driver: check the request, then name the most likely class.

Written as kibernetika-serving hooks are: mserve finds these functions by name.
"""

import logging

import numpy as np

LOG = logging.getLogger(__name__)
LABELS = []


def init_hook(**params):
    # params: the driver options from model-config.yaml, plus model_path and model_dir
    LABELS[:] = params["labels"].split(",")
    LOG.info("classifier weights: %s", params["model_path"])


def preprocess(inputs, ctx):
    features = np.asarray(inputs["features"], dtype=np.float32)
    if features.ndim == 1:  # one sample: make it a batch of one
        features = features[None, :]
    ctx.samples = len(features)
    return {"features": features}


def postprocess(outputs, ctx, **kwargs):
    probabilities = outputs["output"]
    best = probabilities.argmax(axis=1)
    return {
        "labels": [LABELS[i] for i in best],
        "probabilities": probabilities.astype(np.float64).round(4),
        "samples": ctx.samples,
    }
